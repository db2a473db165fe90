"""The optimizer and memory ledger of a recipe: `build_optimizer`, `memory_ledger`,
`bytes_per_param`, public as `precision.optim.*`.

Each takes a Recipe, a preset name or a Plan, binds it once (`precision.bind`) and reads
the decisions the Plan records: the optimizer chain is built by `precision.optim`'s
`_build.chain`, the ledger is the Plan's. They live above the Plan (which derives its
decisions from the optimizer's package), so `precision/__init__.py` attaches them to
`precision.optim` rather than that package importing them.
"""

from __future__ import annotations

import optax

from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision.optim import _build


def build_optimizer(recipe: Recipe | str | Plan, inner: optax.GradientTransformation,
                    *, seed: int = 0, axis_name: str | None = None
                    ) -> optax.GradientTransformation:
  """The optimizer of `recipe` wrapped around `inner` (any optax optimizer).

  From the inside out:
    1. moments stored in ``recipe.mu_dtype`` / ``recipe.nu_dtype`` (`moment_dtypes`; only
       when one is not f32), the update computed in f32;
    2. how updates reach the params: a master copy (`master_weights`, nearest or
       stochastic rounding) when ``recipe.master_dtype`` is set; else for 16-bit params
       `stochastic_updates`, `kahan_updates`, or f32 updates rounded to nearest
       (`f32_update`); f32 params take `inner`'s updates as they are;
    3. the guard: `loss_scaling` with the recipe's loss scale, or `skip_nonfinite` for
       unscaled recipes; it keeps the counters and the f32 grad norm;
    4. when ``recipe.spike_guard`` is set, `spike_guard` around all of it (its grad norm
       is the guard's; ``update`` then needs ``value=loss``, which `precision.train_step`
       passes).
  On the fp32 recipe the result is bit-identical to `inner` on finite grads. A recipe
  with ``fused=True`` takes ``inner=fused_adamw(...)``, which replaces steps 1 and 2 (its
  moments are f32; it keeps an f32 master when the recipe has one) and gets `seed` and
  `axis_name` from here; the guard wraps it as any other.

  Args:
    recipe: a Recipe, a preset name or a Plan (`precision.bind`; `plan.optimizer(inner)`
      is the same call).
    inner: e.g. ``optax.adamw(3e-4)``; for a fused recipe
      ``precision.optim.fused_adamw(3e-4)``.
    seed: seed of stochastic rounding: an int in [0, 2**32) (Python or NumPy; a bool, a
      float or an int outside that range is refused, whether or not the recipe rounds
      stochastically), an integer scalar array, or a `jax.random` key.
    axis_name: set when `update` runs inside shard_map/pmap on shards of the grads
      (ZeRO): the all-finite check and grad norm are reduced over this axis, and
      stochastic rounding counts elements by their GLOBAL flat index. That assumes
      precision.parallel's layout: every leaf (params, grads, optimizer state alike) is
      flattened row-major, zero-padded to a multiple of the axis size n, and device r =
      ``axis_index(axis_name)`` holds the contiguous flat elements [r*k, (r+1)*k), k the
      local shard's size; its rounding uses ``index_offset = r * k``. A sharded update
      then rounds every element exactly as the unsharded one (same seed) does, whatever
      n is. Another layout (strided, uneven, or any non-elementwise split) needs its own
      offsets. Leave it None for whole leaves (stage 0, single device): offset 0.

  Returns:
    An optax.GradientTransformation; apply its updates with
    `precision.optim.apply_updates` (exact rounding into 16-bit params).

  Examples:
    >>> tx = build_optimizer("bf16_master", optax.adamw(3e-4))
    >>> opt_state = tx.init(params)
  """
  return _build.chain(as_plan(recipe).optimizer_decisions, inner, seed=seed,
                      axis_name=axis_name)


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


__all__ = ["build_optimizer", "bytes_per_param", "memory_ledger"]
