"""apply_recipe: a Recipe's module Policy, then its fp8 GEMMs when it has an fp8 config."""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from precision import _plan
from precision._recipe import Recipe
from precision.flax import _nnx
from precision.fp8 import apply_fp8
from precision.fp8 import fp8_modules


def apply_recipe(module: nnx.Module, recipe: Any,
                 overrides: Mapping[Any, Any] | None = None, *,
                 replace: bool = False) -> nnx.Module:
  """Applies a recipe to an NNX model in place and returns it.

  The recipe's policy, with `overrides` and the recipe's fp32_ops, governs each call
  (`apply_policy`); then, when the recipe has an fp8 config,
  `precision.fp8.apply_fp8(module, recipe.fp8, recipe.policy)`: the model's nnx.Linear /
  LinearGeneral / Einsum layers outside `recipe.fp8.keep_high_precision` get fp8 GEMMs
  with their scaling state; grouped GEMMs (`lax.ragged_dot` experts on plain params) run
  fp8 under the mark, one scale per expert group from each step's amaxes (no state;
  microscaled blocks within groups under mxfp8; compute dtype under nvfp4), by the fp8
  config's keep_high_precision and overrides; every other GEMM follows the policy. The
  model is marked with
  the plan's autocast spec: trained by `precision.parallel.data_parallel` with the same
  plan (or the same recipe: the model's overrides are then applied), its GEMMs run in the
  dtypes of its own calls; with another recipe the step is refused.

  A model already marked (by `apply_recipe` or `apply_policy`) with the same recipe,
  overrides and fp32 ops is left as it is: applying twice changes nothing. A model marked
  with anything else is refused unless ``replace=True``: its params were cast to the
  earlier param dtype, and a second recipe silently layered on the first is neither.
  With ``replace=True`` the new mark replaces the old one and the params are cast to the
  new param dtype; values an earlier, narrower param dtype rounded stay rounded (cast up
  exactly, not restored: build the model again for the f32 initialisation). A model with
  fp8 GEMMs from an earlier fp8 recipe cannot be given another recipe (its fp8 layers
  stay): build it again.

  Args:
    module: the NNX model (modified in place).
    recipe: a Recipe, a preset name or a Plan (`precision.bind`, overrides included).
    overrides: {path pattern or module type: policy} (not with a Plan: it has its own).
    replace: replace the mark of a model already marked with another recipe, policy,
      overrides or fp32 ops (see above).
  Returns:
    `module`.
  Raises:
    ValueError: an unknown preset, a bad override, a module type key that matches no module,
      overrides given with a Plan, or a model marked with another recipe (without
      ``replace=True``, or with fp8 GEMMs of an earlier recipe).
  Warns:
    UnmatchedOverrideWarning: a path pattern that matches no module path (see
      `apply_policy`: the first call raises if it matches no named scope either).

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
  if not isinstance(replace, bool):
    raise ValueError(f"apply_recipe replace={replace!r}; accepted: True or False")
  plan = _plan.as_plan(recipe, overrides)
  _check_mark(module, plan, replace)
  _nnx.mark(module, plan.autocast_spec)
  if plan.fp8 is not None:
    # Imported lazily: the fp8 package is optional for every non-fp8 recipe.
    apply_fp8(module, plan.fp8, plan.policy)
  return module


def _check_mark(module: nnx.Module, plan: _plan.Plan, replace: bool) -> None:
  """Raises when `module` is marked with a spec other than `plan`'s (see apply_recipe)."""
  old = _nnx.spec_of(module)
  if old is None or old == plan.autocast_spec:
    return
  if not replace:
    raise ValueError(
        f"apply_recipe: the model is already marked with {old.describe()}, not "
        f"{plan.autocast_spec.describe()}: its params were cast to "
        f"{old.policy.param_dtype.name} by that mark; accepted: the same recipe again (a "
        "no-op), replace=True (the new mark, params cast again; rounded values stay "
        "rounded) or a model built again")
  if fp8_modules(module) and (old.recipe is None or _plan.as_plan(old.recipe).fp8 != plan.fp8):
    raise ValueError(
        f"apply_recipe(replace=True): the model has fp8 GEMMs from {old.describe()}, which "
        f"{plan.autocast_spec.describe()} does not have; fp8 layers are not undone; "
        "accepted: a model built again")
