"""Structure figures of precision/, read from the source with `ast` (nothing is imported,
JAX neither): modules and lines; function-level imports of precision modules (each with
file:line); Recipe-field reads outside `precision.bind` (_plan.py) and the Recipe
(_recipe.py), by file (experiments/_source_reads.py, the reader tests/test_recipe_readers.py
asserts with); import cycles between the packages of precision/ (a package: a top-level
module or subpackage of precision/), through module-level imports and through all.

  python -m experiments.structure_figures [path/to/precision]
"""

from __future__ import annotations

import ast
import pathlib
import sys

try:  # run as a module (python -m experiments.structure_figures) or as a file
  from experiments import _source_reads
except ImportError:  # pragma: no cover
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  from experiments import _source_reads


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """{dotted module name: path} of every .py file under `root` (a package `precision`)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


class _Imports(ast.NodeVisitor):
  """(target module, in a function?, line) of each import of a precision module; the
  TYPE_CHECKING branch (never run) is skipped."""

  def __init__(self, name: str, is_package: bool, mods):
    self.package = name if is_package else name.rpartition(".")[0]
    self.mods, self.depth, self.found = mods, 0, []

  def _function(self, node):
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def visit_If(self, node):
    if ast.unparse(node.test).endswith("TYPE_CHECKING"):
      for child in node.orelse:
        self.visit(child)
      return
    self.generic_visit(node)

  def _add(self, target: str, line: int):
    if target == "precision" or target.startswith("precision."):
      while target not in self.mods:
        target = target.rpartition(".")[0]
      self.found.append((target, self.depth > 0, line))

  def visit_Import(self, node):
    for alias in node.names:
      self._add(alias.name, node.lineno)

  def visit_ImportFrom(self, node):
    if node.level:
      base = self.package.split(".")
      base = base[:len(base) - node.level + 1]
      module = ".".join(base + ([node.module] if node.module else []))
    else:
      module = node.module or ""
    for alias in node.names:
      sub = f"{module}.{alias.name}"
      self._add(sub if sub in self.mods else module, node.lineno)


def imports(root: pathlib.Path) -> dict[str, list[tuple[str, bool, int]]]:
  mods = modules(root)
  out = {}
  for name, path in mods.items():
    v = _Imports(name, path.name == "__init__.py", mods)
    v.visit(ast.parse(path.read_text(), str(path)))
    out[name] = [e for e in v.found if e[0] != name]
  return out


def package_of(module: str) -> str:
  parts = module.split(".")
  return ".".join(parts[:2])   # precision.X: a top-level module or subpackage


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected sets of more than one node (Tarjan), sorted."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(out)


def main(argv: list[str]) -> None:
  root = pathlib.Path(argv[0]).resolve() if argv else _source_reads.ROOT
  mods = modules(root)
  lines = sum(len(p.read_text().splitlines()) for p in mods.values())
  print(f"precision/: {len(mods)} modules, {lines} lines")

  edges = imports(root)
  local = [(m, t, line) for m, es in edges.items() for t, in_fn, line in es if in_fn]
  print(f"function-level imports of precision modules: {len(local)}")
  for m, t, line in sorted(local, key=lambda e: (str(mods[e[0]]), e[2])):
    print(f"  {mods[m].relative_to(root.parent).as_posix()}:{line} -> {t}")

  reads = _source_reads.recipe_reads(root)
  total = sum(len(r) for r in reads.values())
  print(f"Recipe-field reads outside _plan.py/_recipe.py: {total} in {len(reads)} files")
  for rel, found in sorted(reads.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    print(f"  precision/{rel}: {len(found)}")

  for what, fn_too in (("module level", False), ("module and function level", True)):
    graph: dict[str, set[str]] = {}
    for m, es in edges.items():
      for t, in_fn, _ in es:
        a, b = package_of(m), package_of(t)
        if a != b and (fn_too or not in_fn):
          graph.setdefault(a, set()).add(b)
    found = cycles(graph)
    print(f"package-level import cycles ({what}): {len(found)}")
    for comp in found:
      print("  " + " <-> ".join(c.removeprefix("precision.") for c in comp))


if __name__ == "__main__":
  main(sys.argv[1:])
