"""The per-device bodies of init and train step for ZeRO stages 0-3.

Written once against a named axis, so the same code runs under `jax.shard_map` (one or
many processes) and under `jax.pmap`. Values are per-device: params full (stages 0-2) or
one flat shard per leaf (stage 3); optimizer state full (stage 0) or built on flat shards
(stages 1-3); the batch is this device's slice of the global batch.

Precision (see _collectives): loss_fn sees params in the compute dtype; the loss is
multiplied by the loss scale in f32; grads are summed in the reduce dtype and divided by
n in the wider of (param, reduce) dtype; the optimizer (with `axis_name` when it runs on
shards) unscales, checks finiteness over the whole model and decides to skip alike on
every rank; the loss metric is the f32 mean over devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision.parallel import _collectives as coll
from precision.parallel import _fsdp
from precision.parallel._layout import ParamLayout, flatten_pad, own_shard, unflatten

ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class OptimizerHooks:
  """The three calls of the train-step protocol (precision.optim's, or plain optax's)."""

  loss_scale_of: Callable[[Any], jax.Array]
  apply_updates: Callable[[Any, Any], Any]
  metrics: Callable[[Any], dict]


def with_standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` with init/update run under standard dtype promotion.

  Plain optax cannot run under strict promotion (adam's bias correction raises a Python
  float to an int32 count); this scope covers only the optimizer call, never the model.
  """

  def init(params):
    with jax.numpy_dtype_promotion("standard"):
      return tx.init(params)

  def update(updates, state, params=None):
    with jax.numpy_dtype_promotion("standard"):
      return tx.update(updates, state, params)

  return optax.GradientTransformation(init, update)


def plain_optax_hooks() -> OptimizerHooks:
  return OptimizerHooks(
      loss_scale_of=lambda _: jnp.ones((), jnp.float32),
      apply_updates=optax.apply_updates,
      metrics=lambda _: {},
  )


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Everything the per-device bodies need besides the arrays (static)."""

  loss_fn: Callable[[Any, Any], jax.Array]
  tx: optax.GradientTransformation
  hooks: OptimizerHooks
  zero_stage: int
  axis_name: str
  devices: int
  compute_dtype: np.dtype | None   # None: each leaf computes in its own dtype
  reduce_dtype: np.dtype | None    # None: each leaf is reduced in its own dtype
  gather: str = "step"             # stage 3: "step" (once per step) or "layer" (_fsdp)

  def reduction(self, leaf) -> coll.Reduction:
    reduce_dtype = self.reduce_dtype or leaf.dtype
    return coll.Reduction(
        axis_name=self.axis_name,
        devices=self.devices,
        reduce_dtype=np.dtype(reduce_dtype),
        grad_dtype=coll.wider_dtype(leaf.dtype, reduce_dtype),
        compute_dtype=np.dtype(self.compute_dtype or leaf.dtype),
    )


def _shards(cfg: StepConfig, layout: ParamLayout, params):
  return layout.map(lambda lay, p: own_shard(flatten_pad(p, lay), lay, cfg.axis_name), params)


def local_init(cfg: StepConfig, layout: ParamLayout, params):
  """Per device: full params (in the param dtype) -> (params or shards, opt_state)."""
  if cfg.zero_stage == 0:
    return params, cfg.tx.init(params)
  shards = _shards(cfg, layout, params)
  return (shards if cfg.zero_stage == 3 else params), cfg.tx.init(shards)


def _scaled_loss(cfg: StepConfig, scale: jax.Array, batch):
  def f(compute_params):
    return cfg.loss_fn(compute_params, batch).astype(jnp.float32) * scale
  return f


def _sharded_params(cfg: StepConfig, layout: ParamLayout, wide):
  """The params pytree of `_fsdp.ShardedParam`s loss_fn gets under gather="layer"."""
  leaves = layout.treedef.flatten_up_to(wide)
  return layout.treedef.unflatten(
      [_fsdp.ShardedParam(w, lay, cfg.reduction(lay), i)
       for i, (lay, w) in enumerate(zip(layout.leaves, leaves))])


def _check_all_gathered(layout: ParamLayout, gathered: set) -> None:
  """A leaf loss_fn never gathered would silently get a zero gradient: refuse it."""
  paths = [jax.tree_util.keystr(path) for path, _ in
           jax.tree_util.tree_flatten_with_path(layout.treedef.unflatten(
               range(len(layout.leaves))))[0]]
  missing = [paths[i] for i in range(len(paths)) if i not in gathered]
  if missing:
    raise ValueError(
        f"gather='layer': loss_fn never gathered the params {missing}; read every leaf "
        "through precision.parallel.gather, gathered_layer or call_layer")


def local_step(cfg: StepConfig, layout: ParamLayout, params, opt_state, batch):
  """Per device: one training step. Returns (params, opt_state, metrics)."""
  stage, red = cfg.zero_stage, cfg.reduction
  scale = cfg.hooks.loss_scale_of(opt_state).astype(jnp.float32)
  loss_of = _scaled_loss(cfg, scale, batch)
  to_compute = lambda lay, p: p.astype(red(lay).compute_dtype)

  if stage in (0, 1):
    scaled_loss, grads = jax.value_and_grad(loss_of)(layout.map(to_compute, params))
    if stage == 0:
      grads = layout.map(lambda lay, g: coll.all_reduce_mean(g, red(lay)), grads)
      shards = params
    else:
      grads = layout.map(
          lambda lay, g: coll.reduce_scatter_mean(flatten_pad(g, lay), red(lay)), grads)
      shards = _shards(cfg, layout, params)
  else:
    shards = params if stage == 3 else _shards(cfg, layout, params)
    # Differentiate w.r.t. the shards upcast to the gradient dtype: the custom VJPs hand
    # back the reduced mean in that dtype (an f32 reduction is not rounded to bf16).
    wide = layout.map(lambda lay, s: s.astype(red(lay).grad_dtype), shards)
    if stage == 2:
      full_flat = layout.map(lambda lay, p: flatten_pad(to_compute(lay, p), lay), params)
      view = lambda lay, w, f: unflatten(coll.replicated_view(w, f, red(lay)), lay)
      loss_of_shards = lambda w: loss_of(layout.map(view, w, full_flat))
    elif cfg.gather == "step":
      # Each leaf is gathered once per step, where loss_fn first reads it; the gathered
      # copy is a residual of the backward pass (no re-gather: 2 Psi of traffic, not the
      # ZeRO paper's 3 Psi). gather="layer" re-gathers layer by layer instead.
      view = lambda lay, w: unflatten(coll.gather_view(w, red(lay)), lay)
      loss_of_shards = lambda w: loss_of(layout.map(view, w))
    else:
      loss_of_shards = lambda w: loss_of(_sharded_params(cfg, layout, w))
    with _fsdp.recording() as gathered:
      scaled_loss, grads = jax.value_and_grad(loss_of_shards)(wide)
    if stage == 3 and cfg.gather == "layer":
      _check_all_gathered(layout, gathered)

  updates, opt_state = cfg.tx.update(grads, opt_state, shards)
  shards = cfg.hooks.apply_updates(shards, updates)
  if stage in (1, 2):
    params = layout.map(
        lambda lay, s: unflatten(coll.all_gather_flat(s, red(lay)), lay), shards)
  else:
    params = shards
  loss = jax.lax.pmean(scaled_loss / scale, cfg.axis_name)
  metrics = {"loss": loss, **cfg.hooks.metrics(opt_state)}
  return params, opt_state, metrics
