"""apply_recipe: a Recipe's module Policy, then its fp8 GEMMs when it has an fp8 config."""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from precision._recipe import Recipe, get_recipe
from precision.flax._nnx import apply_policy


def apply_recipe(module: nnx.Module, recipe: Recipe | str,
                 overrides: Mapping[Any, Any] | None = None) -> nnx.Module:
  """Applies `recipe.policy` (with `overrides`) to an NNX model in place, then, when
  `recipe.fp8` is set, `precision.fp8.apply_fp8(module, recipe.fp8, recipe.policy)`,
  which replaces the policy GEMMs of eligible layers by fp8 GEMMs. Returns `module`.

  Examples:
    >>> model = apply_recipe(GPT(cfg, rngs=nnx.Rngs(0)), "bf16_mixed")
  """
  if isinstance(recipe, str):
    recipe = get_recipe(recipe)
  if not isinstance(recipe, Recipe):
    raise ValueError(f"apply_recipe expects a Recipe or a preset name, got {recipe!r}")
  apply_policy(module, recipe.policy, overrides)
  if recipe.fp8 is not None:
    # Imported lazily: the fp8 package is optional for every non-fp8 recipe.
    from precision.fp8 import apply_fp8
    apply_fp8(module, recipe.fp8, recipe.policy)
  return module
