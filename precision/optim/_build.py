"""`build_optimizer`: the whole optimizer a Recipe describes, around any optax optimizer."""

from __future__ import annotations

from typing import Any

import numpy as np
import optax

from precision._plan import OptimizerDecisions, Plan, as_plan
from precision._recipe import Recipe
from precision.optim import _direct
from precision.optim import _fused
from precision.optim import _guard
from precision.optim import _kahan
from precision.optim import _loss_scale
from precision.optim import _master
from precision.optim import _moments
from precision.optim import _seed
from precision.optim import _spike

_F32 = np.dtype(np.float32)


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
  opt = as_plan(recipe).optimizer_decisions
  _check_arguments(inner, seed, axis_name)
  if opt.fused != _fused.is_fused_adamw(inner):
    if opt.fused:
      raise ValueError(
          f"recipe {opt.recipe_name!r} has fused=True: its update is the fused AdamW "
          f"kernel, whose hyperparameters come from inner; got inner={inner!r}; accepted: "
          "inner=precision.optim.fused_adamw(learning_rate, ...)")
    raise ValueError(
        f"inner=fused_adamw(...) with recipe {opt.recipe_name!r} (fused=False): the fused "
        "kernel does its own rounding; accepted: a recipe with fused=True (e.g. "
        "get_recipe('bf16_sr').replace(name=..., fused=True)), or an optax optimizer "
        "such as optax.adamw for this recipe")
  if opt.fused:
    tx = _fused.bind_to_recipe(inner, opt.recipe_name, opt.master_dtype is not None, seed,
                               axis_name)
    return _guarded(opt, tx, axis_name)
  tx = inner
  if opt.moment_dtypes is not None:
    tx = _moments.moment_dtypes(tx, *opt.moment_dtypes)
  if opt.updates == "master":
    tx = _master.master_weights(tx, opt.master_dtype, opt.rounding, seed,
                                axis_name=axis_name)
  elif opt.updates == "stochastic":
    tx = _direct.stochastic_updates(tx, seed, axis_name=axis_name)
  elif opt.updates == "kahan":
    tx = _kahan.kahan_updates(tx)
  elif opt.updates == "f32_update":
    tx = _direct.f32_update(tx)
  return _guarded(opt, tx, axis_name)


def _check_arguments(inner: Any, seed: Any, axis_name: Any) -> None:
  """ValueError naming `inner`, `seed` or `axis_name` when it is not what build_optimizer
  takes. The seed is checked here, at build time, for every recipe: stochastic rounding
  would refuse it only at the first update, and a recipe without it would ignore it."""
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner={inner!r}; accepted: an optax.GradientTransformation, e.g. "
                     "optax.adamw(3e-4) (called, not the function optax.adamw)")
  _seed.check_seed(seed)
  if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
    raise ValueError(f"axis_name={axis_name!r}; accepted: None or the name (a non-empty "
                     "str) of the shard_map/pmap axis the update runs over")


def _guarded(opt: OptimizerDecisions, tx: optax.GradientTransformation,
             axis_name: str | None) -> optax.GradientTransformation:
  """Steps 3 and 4 of `build_optimizer`: the recipe's loss scaling or non-finite
  skipping, then its spike guard."""
  if opt.loss_scale is None:
    tx = _guard.skip_nonfinite(tx, axis_name)
  else:
    tx = _guard.loss_scaling(tx, _loss_scale.from_config(opt.loss_scale), axis_name)
  sg = opt.spike_guard
  if sg is None:
    return tx
  return _spike.spike_guard(tx, window=sg.window, threshold=sg.threshold,
                            max_consecutive=sg.max_consecutive, min_history=sg.min_history,
                            axis_name=axis_name)
