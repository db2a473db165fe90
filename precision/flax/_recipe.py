"""apply_recipe: a Recipe's module Policy, then its fp8 GEMMs when it has an fp8 config."""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from precision._recipe import Recipe, get_recipe
from precision._autocast import _api
from precision.flax import _nnx


def apply_recipe(module: nnx.Module, recipe: Recipe | str,
                 overrides: Mapping[Any, Any] | None = None) -> nnx.Module:
  """Applies `recipe.policy` (with `overrides` and `recipe.fp32_ops`) to an NNX model in
  place (`apply_policy`), then, when `recipe.fp8` is set,
  `precision.fp8.apply_fp8(module, recipe.fp8, recipe.policy)`: the model's nnx.Linear /
  LinearGeneral / Einsum layers outside `recipe.fp8.keep_high_precision` get fp8 GEMMs
  with their scaling state; every other GEMM follows the policy. Returns `module`.

  Examples:
    >>> model = apply_recipe(GPT(cfg, rngs=nnx.Rngs(0)), "bf16_mixed")
  """
  if isinstance(recipe, str):
    recipe = get_recipe(recipe)
  if not isinstance(recipe, Recipe):
    raise ValueError(f"apply_recipe expects a Recipe or a preset name, got {recipe!r}")
  spec = _api.AutocastSpec.make(recipe.policy, overrides, recipe.fp32_ops,
                                module_base=nnx.Module)
  _nnx.mark(module, spec)
  if recipe.fp8 is not None:
    # Imported lazily: the fp8 package is optional for every non-fp8 recipe.
    from precision.fp8 import apply_fp8
    apply_fp8(module, recipe.fp8, recipe.policy)
  return module
