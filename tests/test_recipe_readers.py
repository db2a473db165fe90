"""Recipe fields are read by `precision.bind` (precision/_plan.py) and the Recipe itself
(precision/_recipe.py) only; every other module reads the Plan's decisions. Read from the
source (nothing is imported) by experiments/_source_reads.py (its docstring says what
counts as a read), shared with experiments/structure_figures.py, as tests/test_imports.py
reads the import graph (experiments/_import_graph.py).
"""

from __future__ import annotations

import pathlib

import precision
from experiments._source_reads import READERS, reads_of, recipe_reads  # noqa: F401

ROOT = pathlib.Path(precision.__file__).parent

# The reads left outside the readers, each a message: (module, expression) -> why.
ALLOWED = {
    ("_autocast_spec.py", "self.recipe.fp32_ops"):
        "AutocastSpec.describe: a message names fp32 ops that differ from the recipe's",
    ("study/_report.py", "r.fp8"): "the study report's notes: a line about fp8 recipes",
    ("study/_report.py", "r.loss_scale"):
        "the study report's notes: a line naming the dynamically scaled recipes",
}



def _reads() -> dict[str, list[tuple[int, str]]]:
  return recipe_reads(ROOT)


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
