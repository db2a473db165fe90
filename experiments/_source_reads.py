"""Facts about precision/ read from its source with `ast` (nothing is imported): the
reads of Recipe fields outside `precision.bind` and the Recipe (tests/test_recipe_readers.py
asserts on them; experiments/structure_figures.py prints them).

What counts as a read: an attribute of a Recipe field (`policy`, `master_dtype`, ...,
`spike_guard`, and the `swamping_risk` / `description` properties; not `name`, which
identifies the recipe) or a `getattr` on an expression that names a recipe: a name
`recipe` (or `rec`, `rcp`), a `.recipe` attribute (`plan.recipe.fp8`), a call of
`get_recipe` / `recipe_of` / a function whose name ends in `_recipe`, a parameter
annotated with a Recipe type, a name assigned from one of those in the same function,
and the loop variable of a loop or comprehension over an iterable named `*recipe*`.
"""

from __future__ import annotations

import ast
import pathlib

# precision/, found beside this folder (no import of the package, hence none of JAX).
ROOT = pathlib.Path(__file__).resolve().parent.parent / "precision"
READERS = {"_plan.py", "_recipe.py"}
FIELDS = frozenset({
    "policy", "master_dtype", "mu_dtype", "nu_dtype", "rounding", "loss_scale",
    "reduce_dtype", "fp8", "fp32_ops", "allow_f16_without_loss_scale", "fused",
    "spike_guard", "swamping_risk", "description"})


def _name(func: ast.expr) -> str:
  return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


class _Reads(ast.NodeVisitor):
  """(line, expression) of each read of a Recipe field in one module."""

  def __init__(self):
    self.names: list[set[str]] = [{"recipe", "rec", "rcp"}]
    self.found: list[tuple[int, str]] = []

  def _names_a_recipe(self, node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
      return any(node.id in scope for scope in self.names)
    if isinstance(node, ast.Attribute):
      return node.attr == "recipe"
    if isinstance(node, ast.Call):
      name = _name(node.func)
      return name in ("get_recipe", "recipe_of") or name.endswith("_recipe")
    return False

  def _scope(self, node: ast.AST, names: set[str]) -> None:
    self.names.append(names)
    self.generic_visit(node)
    self.names.pop()

  def visit_FunctionDef(self, node):
    args = node.args
    names = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
             if a.annotation is not None and "Recipe" in ast.unparse(a.annotation)}
    for sub in ast.walk(node):
      if (isinstance(sub, ast.Assign) and len(sub.targets) == 1
          and isinstance(sub.targets[0], ast.Name) and self._names_a_recipe(sub.value)):
        names.add(sub.targets[0].id)
    self._scope(node, names)

  visit_AsyncFunctionDef = visit_FunctionDef

  def _loop(self, node, generators):
    self._scope(node, {g.target.id for g in generators if isinstance(g.target, ast.Name)
                       and "recipe" in ast.unparse(g.iter).lower()})

  def visit_ListComp(self, node):
    self._loop(node, node.generators)

  visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

  def visit_For(self, node):
    self._loop(node, [node])

  def visit_Attribute(self, node):
    if node.attr in FIELDS and self._names_a_recipe(node.value):
      self.found.append((node.lineno, ast.unparse(node)))
    self.generic_visit(node)

  def visit_Call(self, node):
    if (isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args
        and self._names_a_recipe(node.args[0])):
      self.found.append((node.lineno, ast.unparse(node)))
    self.generic_visit(node)


def reads_of(source: str) -> list[tuple[int, str]]:
  visitor = _Reads()
  visitor.visit(ast.parse(source))
  return sorted(visitor.found)


def recipe_reads(root: pathlib.Path = ROOT) -> dict[str, list[tuple[int, str]]]:
  """{module path relative to `root`: [(line, expression)]} of the Recipe-field reads
  outside the readers (`READERS`)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel not in READERS:
      found = reads_of(path.read_text())
      if found:
        out[rel] = found
  return out
