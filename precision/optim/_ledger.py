"""`bytes_per_param`: the analytic memory ledger of a recipe (ZeRO paper's accounting)."""

from __future__ import annotations

import numpy as np

from precision._plan import Plan
from precision._recipe import Recipe
from precision._plan import recipe_of

# Moments each inner optimizer keeps per param: which of mu / nu.
INNER_MOMENTS = {
    "adamw": ("mu", "nu"), "adam": ("mu", "nu"), "lamb": ("mu", "nu"),
    "lion": ("mu",), "momentum": ("mu",), "sgd": (),
}


def memory_ledger(recipe: Recipe | str | Plan, inner: str = "adamw") -> dict[str, float]:
  """Bytes per parameter of each persistent tensor of a training step with `recipe`.

  Keys: params, grads (in the param dtype, as jax.grad returns them), master (0 without),
  compensation (Kahan buffer, param dtype), mu, nu (their recipe dtypes; 0 when `inner`
  keeps none). Per-tensor scalars (counts, loss scale) are O(1) and left out.
  """
  recipe = recipe_of(recipe)
  if inner not in INNER_MOMENTS:
    raise ValueError(f"inner={inner!r}; accepted: {', '.join(INNER_MOMENTS)}")
  p = np.dtype(recipe.policy.param_dtype).itemsize
  moments = INNER_MOMENTS[inner]
  master_wide = recipe.master_dtype is not None
  return {
      "params": float(p),
      "grads": float(p),
      "master": float(np.dtype(recipe.master_dtype).itemsize) if master_wide else 0.0,
      "compensation": float(p) if recipe.rounding == "kahan" and not master_wide else 0.0,
      "mu": float(np.dtype(recipe.mu_dtype).itemsize) if "mu" in moments else 0.0,
      "nu": float(np.dtype(recipe.nu_dtype).itemsize) if "nu" in moments else 0.0,
  }


def bytes_per_param(recipe: Recipe | str | Plan, inner: str = "adamw") -> float:
  """Persistent bytes per parameter: params + grads + master + Kahan buffer + moments.

  bf16 params and grads + f32 master + two f32 Adam moments = 2 + 2 + 4 + 8 = 16 (the ZeRO
  paper's mixed-precision Adam figure); fp32 Adam is 16 as well; pure_bf16 is 8.

  Examples:
    >>> bytes_per_param("bf16_master")
    16.0
  """
  return float(sum(memory_ledger(recipe, inner).values()))
