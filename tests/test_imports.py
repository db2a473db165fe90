"""The import graph of precision/, read from the source (nothing is imported).

Module-level imports (run when a module is imported: the module body, class bodies,
top-level if/try blocks) must form no cycle. An import inside a function runs when the
function is called; one that closes a circle hides it from the import system but not
from the reader, so every circle closed that way is listed in KNOWN_CYCLES with the
reason it stays, and a new one fails here.
"""

from __future__ import annotations

import pathlib

import precision
from experiments import _import_graph

ROOT = pathlib.Path(precision.__file__).parent

# Each strongly connected set of modules of the whole graph (function-level imports
# included) that is allowed, and why it stays.
KNOWN_CYCLES = {
    frozenset({"precision.study._task", "precision.study._bisect_cell",
               "precision.study._cells", "precision.study._digest",
               "precision.study._models"}):
        "inside the study: Task.bisect_replay (how numerics.bisect, below the study, "
        "replays a cell without importing it) builds the replay from the study's "
        "programs, which take a Task",
}


def _edges():
  return _import_graph.edges(ROOT)


def _cycles(edges, module_level_only: bool) -> list[frozenset[str]]:
  return _import_graph.cycles(edges, module_level_only)


def _describe(edges, component: frozenset[str]) -> str:
  """The imports inside one strongly connected set, with where each one is."""
  lines = [f"cycle among {', '.join(sorted(component))}:"]
  for m in sorted(component):
    for target, top, line in edges[m]:
      if target in component:
        lines.append(f"  {m} line {line} imports {target} "
                     f"({'module level' if top else 'in a function'})")
  return "\n".join(lines)


def test_the_graph_sees_the_package():
  edges = _edges()
  assert len(edges) > 50 and "precision._optimizer" in edges
  targets = {t for t, _, _ in edges["precision._optimizer"]}
  assert {"precision._plan", "precision.optim._build"} <= targets


def test_no_import_cycle_at_module_level():
  edges = _edges()
  cycles = _cycles(edges, module_level_only=True)
  assert not cycles, "\n".join(_describe(edges, c) for c in cycles)


def test_function_level_import_cycles_are_the_known_ones():
  edges = _edges()
  cycles = set(_cycles(edges, module_level_only=False))
  new = [c for c in cycles if c not in KNOWN_CYCLES]
  assert not new, "new import cycles:\n" + "\n".join(_describe(edges, c) for c in new)
  gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
  assert not gone, f"cycles no longer there (remove them from KNOWN_CYCLES): {gone}"


# The layers of precision/, lowest first: a package (a subpackage, or a top-level module)
# imports only packages of lower layers, at module or function level. The recipe core is
# ordered too: the optimizer's transforms, the fp8 GEMMs, the Plan (which decides what
# each of them does), then what applies a Plan (the autocast interpreter; the optimizer
# and fp8 entry points that take a recipe, which precision/__init__.py attaches to
# precision.optim and precision.fp8). Nothing imports the root package, which re-exports
# the public surface. docs/architecture.md draws this table.
LAYERS = (
    ("_dtypes", "_keypath", "_deprecation"),   # shared helpers: dtype, key path, deprecation
    ("_compat", "_fp32_ops", "_policy", "_state", "_version", "_intercept", "_trace_state"),
    ("_numerics", "_gemm", "formats", "_recipe", "_overrides"),
    ("rounding", "ops", "_autocast_spec"),
    ("optim",),                                 # the recipe core, from here
    ("fp8",),
    ("_plan",),
    ("_autocast", "_optimizer"),
    ("audit", "checkpoint", "flax", "_step_core", "_grad"),
    ("numerics", "_deprecated_grads"),
    ("_train", "parallel"),
    ("_jit_step",),
    ("study",),
)


def _package(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def test_packages_import_only_lower_layers():
  rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
  edges = _edges()
  packages = {_package(m) for m in edges} - {""}
  assert packages == set(rank), (
      f"packages not in LAYERS: {sorted(packages - set(rank))}; "
      f"in LAYERS but gone: {sorted(set(rank) - packages)}")
  wrong = []
  for module, imports in edges.items():
    src = _package(module)
    for target, top, line in imports:
      dst = _package(target)
      if src == dst:
        continue
      if dst == "" or (src != "" and rank[dst] >= rank[src]):
        wrong.append(f"{module} line {line} imports {target} "
                     f"({'module level' if top else 'in a function'}): layer "
                     f"{rank.get(src, 'root')} -> {rank.get(dst, 'root')}")
  assert not wrong, "\n".join(wrong)


def test_numerics_imports_nothing_from_the_study():
  edges = _edges()
  found = [(m, t, line) for m, imports in edges.items() if _package(m) == "numerics"
           for t, _, line in imports if _package(t) == "study"]
  assert not found, found


def test_no_package_level_cycle():
  # Between packages no circle at all, inside functions included (inside the study,
  # KNOWN_CYCLES lists the modules that still close one through a function).
  cycles = _cycles(_import_graph.package_edges(_edges()), module_level_only=False)
  assert not cycles, [sorted(c) for c in cycles]
