"""Structure figures of precision/, read from the source with `ast` (nothing is imported,
JAX neither): modules and lines; function-level imports of precision modules (each with
file:line); Recipe-field reads outside `precision.bind` (_plan.py) and the Recipe
(_recipe.py), by file (experiments/_source_reads.py, the reader tests/test_recipe_readers.py
asserts with); import cycles between the packages of precision/ (a package: a top-level
module or subpackage of precision/), through module-level imports and through all.

  python -m experiments.structure_figures [path/to/precision]
"""

from __future__ import annotations

import pathlib
import sys

try:  # run as a module (python -m experiments.structure_figures) or as a file
  from experiments import _import_graph, _source_reads
except ImportError:  # pragma: no cover
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  from experiments import _import_graph, _source_reads


def main(argv: list[str]) -> None:
  root = pathlib.Path(argv[0]).resolve() if argv else _source_reads.ROOT
  mods = _import_graph.modules(root)
  lines = sum(len(p.read_text().splitlines()) for p in mods.values())
  print(f"precision/: {len(mods)} modules, {lines} lines")

  edges = _import_graph.edges(root)
  local = [(m, t, line) for m, es in edges.items() for t, top, line in es if not top]
  print(f"function-level imports of precision modules: {len(local)}")
  for m, t, line in sorted(local, key=lambda e: (str(mods[e[0]]), e[2])):
    print(f"  {mods[m].relative_to(root.parent).as_posix()}:{line} -> {t}")

  reads = _source_reads.recipe_reads(root)
  total = sum(len(r) for r in reads.values())
  print(f"Recipe-field reads outside _plan.py/_recipe.py: {total} in {len(reads)} files")
  for rel, found in sorted(reads.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    print(f"  precision/{rel}: {len(found)}")

  graph = _import_graph.package_edges(edges)
  for what, module_level_only in (("module level", True), ("module and function level", False)):
    found = _import_graph.cycles(graph, module_level_only)
    print(f"package-level import cycles ({what}): {len(found)}")
    for comp in found:
      print("  " + " <-> ".join(sorted(c.removeprefix("precision.") for c in comp)))


if __name__ == "__main__":
  main(sys.argv[1:])
