"""The import graph of precision/, read from the source (nothing is imported).

Module-level imports (run when a module is imported: the module body, class bodies,
top-level if/try blocks) must form no cycle. An import inside a function runs when the
function is called; one that closes a circle hides it from the import system but not
from the reader, so every circle closed that way is listed in KNOWN_CYCLES with the
reason it stays, and a new one fails here.
"""

from __future__ import annotations

import ast
import pathlib

import precision

ROOT = pathlib.Path(precision.__file__).parent

# Each strongly connected set of modules of the whole graph (function-level imports
# included) that is allowed, and why it stays.
KNOWN_CYCLES = {
    frozenset({"precision._plan", "precision._autocast._api", "precision.optim._build"}):
        "a Plan holds an AutocastSpec and offers plan.optimizer, while AutocastSpec.make "
        "and build_optimizer each accept a Plan: plan.optimizer and AutocastSpec.make "
        "import the other side in the function",
    frozenset({"precision.study._task", "precision.study._bisect_cell",
               "precision.study._cells", "precision.study._digest",
               "precision.study._models"}):
        "inside the study: Task.bisect_replay (how numerics.bisect, below the study, "
        "replays a cell without importing it) builds the replay from the study's "
        "programs, which take a Task",
}


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for path in ROOT.rglob("*.py"):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path
  return mods


class _Imports(ast.NodeVisitor):
  """(target module, module-level?, line) of each import of a precision module."""

  def __init__(self, name: str, is_package: bool, mods: dict[str, pathlib.Path]):
    self.package = name if is_package else name.rpartition(".")[0]
    self.mods = mods
    self.depth = 0
    self.found: list[tuple[str, bool, int]] = []

  def _function(self, node):
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

  def visit_If(self, node):
    test = node.test
    if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
      for child in node.orelse:  # the TYPE_CHECKING branch never runs
        self.visit(child)
      return
    self.generic_visit(node)

  def _add(self, target: str, line: int):
    if target == "precision" or target.startswith("precision."):
      while target not in self.mods:  # a name inside a module: the module
        target = target.rpartition(".")[0]
      self.found.append((target, self.depth == 0, line))

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
      sub = f"{module}.{alias.name}"  # `from package import submodule`
      self._add(sub if sub in self.mods else module, node.lineno)


def _edges() -> dict[str, list[tuple[str, bool, int]]]:
  mods = _modules()
  edges = {}
  for name, path in mods.items():
    visitor = _Imports(name, path.name == "__init__.py", mods)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    edges[name] = [e for e in visitor.found if e[0] != name]
  return edges


def _cycles(edges, module_level_only: bool) -> list[frozenset[str]]:
  """The strongly connected sets of more than one module (Tarjan)."""
  graph = {m: sorted({t for t, top, _ in es if top or not module_level_only})
           for m, es in edges.items()}
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, []):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(frozenset(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


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
  assert len(edges) > 50 and "precision.optim._build" in edges
  targets = {t for t, _, _ in edges["precision.optim._build"]}
  assert {"precision._plan", "precision.optim._guard"} <= targets


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
# imports only packages of lower layers, at module or function level. Inside the recipe
# core the four packages still import each other (KNOWN_CYCLES); nothing imports the root
# package, which re-exports the public surface. docs/architecture.md draws this table.
LAYERS = (
    ("_dtypes", "_keypath", "_deprecation"),   # shared helpers: dtype, key path, deprecation
    ("_compat", "_fp32_ops", "_policy", "_state", "_version", "_intercept", "_trace_state"),
    ("_numerics", "_gemm", "formats", "_recipe"),
    ("rounding", "ops"),
    ("_autocast", "_plan", "fp8", "optim"),     # the recipe core
    ("audit", "checkpoint", "flax", "_step_core", "_grad"),
    ("numerics", "_deprecated_grads"),
    ("_train", "parallel"),
    ("_jit_step",),
    ("study",),
)
_CORE = frozenset(LAYERS[4])


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
      if dst == "" or (src != "" and rank[dst] >= rank[src]
                       and not (src in _CORE and dst in _CORE)):
        wrong.append(f"{module} line {line} imports {target} "
                     f"({'module level' if top else 'in a function'}): layer "
                     f"{rank.get(src, 'root')} -> {rank.get(dst, 'root')}")
  assert not wrong, "\n".join(wrong)


def test_numerics_imports_nothing_from_the_study():
  edges = _edges()
  found = [(m, t, line) for m, imports in edges.items() if _package(m) == "numerics"
           for t, _, line in imports if _package(t) == "study"]
  assert not found, found


def test_no_package_level_cycle_at_module_level():
  # Inside the recipe core the packages may still import each other inside functions
  # (KNOWN_CYCLES); their module-level imports form no circle between packages.
  package_edges = {}
  for module, imports in _edges().items():
    src = f"precision.{_package(module)}" if _package(module) else "precision"
    for target, top, line in imports:
      dst = f"precision.{_package(target)}" if _package(target) else "precision"
      if src != dst and src != "precision":
        package_edges.setdefault(src, []).append((dst, top, line))
  cycles = _cycles(package_edges, module_level_only=True)
  assert not cycles, [sorted(c) for c in cycles]
