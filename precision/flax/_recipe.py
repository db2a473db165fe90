"""apply_recipe: a Recipe's module Policy, then its fp8 GEMMs when it has an fp8 config."""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from precision import _plan
from precision._recipe import Recipe
from precision.flax import _nnx


def apply_recipe(module: nnx.Module, recipe: Any,
                 overrides: Mapping[Any, Any] | None = None) -> nnx.Module:
  """Applies a recipe to an NNX model in place and returns it.

  The recipe's policy, with `overrides` and the recipe's fp32_ops, governs each call
  (`apply_policy`); then, when the recipe has an fp8 config,
  `precision.fp8.apply_fp8(module, recipe.fp8, recipe.policy)`: the model's nnx.Linear /
  LinearGeneral / Einsum layers outside `recipe.fp8.keep_high_precision` get fp8 GEMMs
  with their scaling state; every other GEMM follows the policy. The model is marked with
  the plan's autocast spec: trained by `precision.parallel.data_parallel` with the same
  plan (or the same recipe: the model's overrides are then applied), its GEMMs run in the
  dtypes of its own calls; with another recipe the step is refused.

  Args:
    module: the NNX model (modified in place).
    recipe: a Recipe, a preset name or a Plan (`precision.bind`, overrides included).
    overrides: {path pattern or module type: policy} (not with a Plan: it has its own).
  Returns:
    `module`.
  Raises:
    ValueError: an unknown preset, a bad override, a pattern that matches no module path,
      or overrides given with a Plan.

  Examples:
    >>> model = apply_recipe(GPT(cfg, rngs=nnx.Rngs(0)), "bf16_mixed")
    >>> plan = precision.bind("bf16_mixed", overrides={"*lm_head*": "f32"})
    >>> model = apply_recipe(GPT(cfg, rngs=nnx.Rngs(0)), plan)
  """
  if not isinstance(recipe, (_plan.Plan, Recipe, str)):
    raise ValueError(f"apply_recipe expects a Recipe, a preset name or a Plan, got "
                     f"{recipe!r}")
  if not isinstance(module, nnx.Module):
    raise ValueError(f"apply_recipe expects an nnx.Module, got {type(module).__name__}")
  plan = _plan.as_plan(recipe, overrides)
  _nnx.mark(module, plan.autocast_spec)
  if plan.fp8 is not None:
    # Imported lazily: the fp8 package is optional for every non-fp8 recipe.
    from precision.fp8 import apply_fp8  # pylint: disable=g-import-not-at-top
    apply_fp8(module, plan.fp8, plan.policy)
  return module
