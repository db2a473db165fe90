"""`chain`: the whole optimizer a recipe's decisions describe, around any optax optimizer
(`precision.optim.build_optimizer` binds the recipe and calls it)."""

from __future__ import annotations

from typing import Any

import optax

from precision.optim import _direct
from precision.optim import _fused
from precision.optim import _guard
from precision.optim import _kahan
from precision.optim import _loss_scale
from precision.optim import _master
from precision.optim import _moments
from precision.optim import _seed
from precision.optim import _spike
from precision.optim._decisions import OptimizerDecisions


def chain(opt: OptimizerDecisions, inner: optax.GradientTransformation, *, seed: Any = 0,
          axis_name: str | None = None) -> optax.GradientTransformation:
  """The optimizer `opt` decides (a Plan's `optimizer_decisions`) around `inner`: what
  `precision.optim.build_optimizer` returns (its docstring says what each step does and
  what `seed` and `axis_name` take)."""
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
