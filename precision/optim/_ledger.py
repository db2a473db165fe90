"""`bytes_per_param`: the analytic memory ledger of a recipe (ZeRO paper's accounting),
read from the optimizer decisions `precision.bind` records (`Plan.ledger`)."""

from __future__ import annotations

from precision._plan import INNER_MOMENTS, Plan, as_plan
from precision._recipe import Recipe


def memory_ledger(recipe: Recipe | str | Plan, inner: str = "adamw") -> dict[str, float]:
  """Bytes per parameter of each persistent tensor of a training step with `recipe`.

  Keys: params, grads (in the param dtype, as jax.grad returns them), master (0 without),
  compensation (Kahan buffer, param dtype), mu, nu (their recipe dtypes; 0 when `inner`
  keeps none). Per-tensor scalars (counts, loss scale) are O(1) and left out.
  """
  return as_plan(recipe).ledger.for_inner(inner)


def bytes_per_param(recipe: Recipe | str | Plan, inner: str = "adamw") -> float:
  """Persistent bytes per parameter: params + grads + master + Kahan buffer + moments.

  bf16 params and grads + f32 master + two f32 Adam moments = 2 + 2 + 4 + 8 = 16 (the ZeRO
  paper's mixed-precision Adam figure); fp32 Adam is 16 as well; pure_bf16 is 8.

  Examples:
    >>> bytes_per_param("bf16_master")
    16.0
  """
  return float(sum(memory_ledger(recipe, inner).values()))
