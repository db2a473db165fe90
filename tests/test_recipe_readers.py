"""Recipe fields are read by `precision.bind` (precision/_plan.py) and the Recipe itself
(precision/_recipe.py) only; every other module reads the Plan's decisions. Read from the
source (nothing is imported), as tests/test_imports.py reads the import graph.

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

import precision

ROOT = pathlib.Path(precision.__file__).parent
READERS = {"_plan.py", "_recipe.py"}
FIELDS = frozenset({
    "policy", "master_dtype", "mu_dtype", "nu_dtype", "rounding", "loss_scale",
    "reduce_dtype", "fp8", "fp32_ops", "allow_f16_without_loss_scale", "fused",
    "spike_guard", "swamping_risk", "description"})
# The reads left outside the readers, each a message: (module, expression) -> why.
ALLOWED = {
    ("_autocast/_api.py", "self.recipe.fp32_ops"):
        "AutocastSpec.describe: a message names fp32 ops that differ from the recipe's",
    ("study/_report.py", "r.fp8"): "the study report's notes: a line about fp8 recipes",
    ("study/_report.py", "r.loss_scale"):
        "the study report's notes: a line naming the dynamically scaled recipes",
}


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


def _reads() -> dict[str, list[tuple[int, str]]]:
  out = {}
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT).as_posix()
    if rel not in READERS:
      found = reads_of(path.read_text())
      if found:
        out[rel] = found
  return out


def test_the_check_sees_reads():
  src = '''
def build(recipe, inner):
  return recipe.master_dtype, plan.recipe.fp8, get_recipe("x").rounding

def f(r: Recipe | None, cfg):
  x = plan.recipe
  return r.fused, x.loss_scale, [q.spike_guard for q in cfg.recipes], getattr(recipe, "mu_dtype")

def g(plan, rule, r):
  return plan.fp8, plan.policy, rule.policy, r.policy, recipe.name
'''
  assert sorted(e for _, e in reads_of(src)) == sorted([
      "recipe.master_dtype", "plan.recipe.fp8", "get_recipe('x').rounding", "r.fused",
      "x.loss_scale", "q.spike_guard", "getattr(recipe, 'mu_dtype')"])


def test_recipe_fields_are_read_only_by_bind_and_the_recipe():
  assert len(list(ROOT.rglob("*.py"))) > 50  # the walk sees the package
  found = _reads()
  extra = [f"precision/{m} line {line}: {expr}" for m, reads in found.items()
           for line, expr in reads if (m, expr) not in ALLOWED]
  assert not extra, ("Recipe fields read outside precision/_plan.py and _recipe.py (read "
                     "the Plan's decisions, precision.bind, instead):\n" + "\n".join(extra))
  gone = [k for k in ALLOWED if not any(e == k[1] for _, e in found.get(k[0], []))]
  assert not gone, f"allowed reads no longer there (remove them from ALLOWED): {gone}"
  assert len({m for m, _ in ALLOWED}) <= 4
  assert sum(len(r) for r in found.values()) <= 12
