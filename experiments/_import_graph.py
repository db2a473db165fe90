"""The import graph of precision/, read from its source with `ast` (nothing is imported):
tests/test_imports.py asserts the layers and cycles on it, experiments/structure_figures.py
prints its figures.

An edge is (target module, module level?, line): module level means it runs when the
module is imported (the module body, class bodies, top-level if/try blocks); an import
inside a function or lambda runs when it is called. The TYPE_CHECKING branch, which never
runs, is skipped. A name imported from a module counts as an import of that module.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterable, Mapping

from experiments._source_reads import ROOT   # precision/ beside experiments/

Edge = tuple[str, bool, int]


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """{dotted module name: path} of every .py file under `root` (the package `precision`)."""
  mods = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = path
  return mods


class _Imports(ast.NodeVisitor):
  """(target module, module level?, line) of each import of a precision module."""

  def __init__(self, name: str, is_package: bool, mods: Mapping[str, pathlib.Path]):
    self.package = name if is_package else name.rpartition(".")[0]
    self.mods = mods
    self.depth = 0
    self.found: list[Edge] = []

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


def edges(root: pathlib.Path = ROOT) -> dict[str, list[Edge]]:
  """{module: its imports of other precision modules}."""
  mods = modules(root)
  out = {}
  for name, path in mods.items():
    visitor = _Imports(name, path.name == "__init__.py", mods)
    visitor.visit(ast.parse(path.read_text(), str(path)))
    out[name] = [e for e in visitor.found if e[0] != name]
  return out


def package_of(module: str) -> str:
  """The package of `module`: "precision.X" for a top-level module or subpackage X, and
  "precision" for the root package."""
  return ".".join(module.split(".")[:2])


def package_edges(module_edges: Mapping[str, Iterable[Edge]]) -> dict[str, list[Edge]]:
  """The graph between packages (the root package left out: nothing imports it)."""
  out: dict[str, list[Edge]] = {}
  for module, imports in module_edges.items():
    src = package_of(module)
    for target, top, line in imports:
      dst = package_of(target)
      if src != dst and src != "precision":
        out.setdefault(src, []).append((dst, top, line))
  return out


def cycles(graph: Mapping[str, Iterable[Edge]], module_level_only: bool
           ) -> list[frozenset[str]]:
  """The strongly connected sets of more than one node (Tarjan), in a stable order."""
  adj = {m: sorted({t for t, top, _ in es if top or not module_level_only})
         for m, es in graph.items()}
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in adj.get(v, []):
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

  for v in sorted(adj):
    if v not in index:
      visit(v)
  return sorted(out, key=sorted)


__all__ = ["ROOT", "Edge", "cycles", "edges", "modules", "package_edges", "package_of"]
