"""The per-device bodies of init and train step for ZeRO stages 0-3.

Written once against a named axis, so the same code runs under `jax.shard_map` (one or
many processes) and under `jax.pmap`. Values are per-device: params full (stages 0-2) or
one flat shard per leaf (stage 3); optimizer state full (stage 0) or built on flat shards
(stages 1-3); the batch is this device's slice of the global batch.

Precision (see _collectives): with a recipe, loss_fn runs under `precision.autocast` with
the recipe's policy (every GEMM compute x compute -> f32 forward and backward, the fp32 ops
in f32) and is differentiated with respect to the params in their param dtype (stages
0-2), so each rank's gradients leave the f32 accumulators in the param dtype, as in
single-device training; stage 3 gathers params in the compute dtype (half the traffic of
f32), so its gradients are those of the compute-dtype params. With `fp8_state` loss_fn also
gets the replicated fp8 scaling state, synchronised after every step. The loss is
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

from precision import _step_core
from precision._autocast import _api
from precision.parallel import _collectives as coll
from precision.parallel import _fsdp
from precision.parallel._layout import ParamLayout, flatten_pad, own_shard, unflatten
from precision import fp8

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
  fp8_state: bool = False          # loss_fn(params, fp8_state, batch) -> (loss, state)
  autocast: Any = None             # the recipe's precision._autocast.AutocastSpec, or None

  def reduction(self, leaf) -> coll.Reduction:
    reduce_dtype = self.reduce_dtype or leaf.dtype
    return coll.Reduction(
        axis_name=self.axis_name,
        devices=self.devices,
        reduce_dtype=np.dtype(reduce_dtype),
        grad_dtype=coll.wider_dtype(leaf.dtype, reduce_dtype),
        compute_dtype=np.dtype(self.compute_dtype or leaf.dtype),
        param_dtype=np.dtype(leaf.dtype),
    )


def _shards(cfg: StepConfig, layout: ParamLayout, params):
  return layout.map(lambda lay, p: own_shard(flatten_pad(p, lay), lay, cfg.axis_name), params)


def local_init(cfg: StepConfig, layout: ParamLayout, params):
  """Per device: full params (in the param dtype) -> (params or shards, opt_state)."""
  if cfg.zero_stage == 0:
    return params, cfg.tx.init(params)
  shards = _shards(cfg, layout, params)
  return (shards if cfg.zero_stage == 3 else params), cfg.tx.init(shards)


def _policy_loss_fn(cfg: StepConfig):
  """cfg.loss_fn, under the recipe's policy when there is one (outputs in their traced
  dtypes: the loss as loss_fn computes it, fp8 state in its own dtype)."""
  if cfg.autocast is None:
    return cfg.loss_fn
  # An override that matches no scope raises, as under autocast; except with layers
  # gathered one by one, whose GEMMs the custom VJPs of _fsdp trace apart.
  check = cfg.gather != "layer"
  return lambda *args: _api.run(cfg.autocast, cfg.loss_fn, args, {},
                                check_overrides=check).outputs_in_traced_dtypes()


def _scaled_loss(cfg: StepConfig, scale: jax.Array, batch):
  """``f(params, fp8_state) -> (loss * scale in f32, new fp8 state or None)``."""
  loss_fn = _policy_loss_fn(cfg)

  def f(params, fp8_state):
    if cfg.fp8_state:
      loss, new_state = loss_fn(params, fp8_state, batch)
    else:
      loss, new_state = loss_fn(params, batch), None
    return loss.astype(jnp.float32) * scale, new_state

  return f


def _value_and_grad(f, x, fp8_state):
  """Differentiates `f` w.r.t. the params AND the fp8 state: the cotangent of an fp8
  gradient-operand state carries its new value (precision.fp8's custom VJP). allow_int:
  the state may also hold integer and PRNG-key leaves (an nnx.Rngs count and key, e.g.
  of a Dropout); their cotangents (float0) are never read. The params are floating
  (`ParamLayout.of` checks), so their gradients are unaffected."""
  (loss, new_state), (grads, state_ct) = jax.value_and_grad(
      f, argnums=(0, 1), has_aux=True, allow_int=True)(x, fp8_state)
  return loss, grads, (new_state, state_ct)


def _next_fp8_state(cfg: StepConfig, new_state, state_ct):
  """This step's fp8 scaling state, identical on every rank: the forward operands' state
  as loss_fn returned it, the gradient operand's from its cotangent, then amax histories
  and scales max-reduced over the axis (the largest amax any rank saw: no rank's data
  saturates where another's would not) and the saturation counters summed."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  state = fp8.merge_grad_state(new_state, state_ct)
  if not isinstance(state, nnx.State):
    return fp8.sync_fp8_state(state, cfg.axis_name)
  # RNG state (nnx.Rngs keys and counts, e.g. a Dropout's) passes as loss_fn returned it:
  # every rank got the same replicated key and count and advanced them alike, so it is
  # still replicated; only the fp8 leaves are reduced.
  rng_state, fp8_part = nnx.split_state(state, nnx.RngState, ...)
  return nnx.merge_state(rng_state, fp8.sync_fp8_state(fp8_part, cfg.axis_name))


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


def local_step(cfg: StepConfig, layout: ParamLayout, params, opt_state, batch,
               fp8_state=None):
  """Per device: one training step. Returns (params, opt_state, fp8_state, metrics)."""
  stage, red = cfg.zero_stage, cfg.reduction
  scale = cfg.hooks.loss_scale_of(opt_state).astype(jnp.float32)
  loss_of = _scaled_loss(cfg, scale, batch)
  if stage in (0, 1):
    # Differentiated w.r.t. the params in their own dtype: the policy GEMMs cast to the
    # compute dtype inside their custom VJPs, so f32 params get f32 gradients.
    scaled_loss, grads, fp8_out = _value_and_grad(loss_of, params, fp8_state)
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
      full_flat = layout.map(lambda lay, p: flatten_pad(p, lay), params)
      view = lambda lay, w, f: unflatten(coll.replicated_view(w, f, red(lay)), lay)
      loss_of_shards = lambda w, st: loss_of(layout.map(view, w, full_flat), st)
    elif cfg.gather == "step":
      # Each leaf is gathered once per step, where loss_fn first reads it; the gathered
      # copy is a residual of the backward pass (no re-gather: 2 Psi of traffic, not the
      # ZeRO paper's 3 Psi). gather="layer" re-gathers layer by layer instead.
      view = lambda lay, w: unflatten(coll.gather_view(w, red(lay)), lay)
      loss_of_shards = lambda w, st: loss_of(layout.map(view, w), st)
    else:
      loss_of_shards = lambda w, st: loss_of(_sharded_params(cfg, layout, w), st)
    with _fsdp.recording() as gathered:
      scaled_loss, grads, fp8_out = _value_and_grad(loss_of_shards, wide, fp8_state)
    if stage == 3 and cfg.gather == "layer":
      _check_all_gathered(layout, gathered)

  # The loss a spike guard sees as `value` is the unscaled global mean, the same on every
  # rank, so every rank decides alike.
  loss = jax.lax.pmean(scaled_loss / scale, cfg.axis_name)
  # The step core (precision._step_core): update, the hook's apply_updates on the shards,
  # the narrow state leaves ordered after them (in place), and the fp8 state of a step
  # the optimizer skipped rolled back (every rank skips alike: the guard reads reduced
  # grads and the global loss).
  result = _step_core.apply_gradients(
      cfg.tx, grads, opt_state, shards, loss=loss, apply_updates=cfg.hooks.apply_updates,
      fp8_before=fp8_state if cfg.fp8_state else None,
      fp8_after=_next_fp8_state(cfg, *fp8_out) if cfg.fp8_state else None)
  shards, opt_state = result.params, result.opt_state
  if stage in (1, 2):
    params = layout.map(
        lambda lay, s: unflatten(coll.all_gather_flat(s, red(lay)), lay), shards)
  else:
    params = shards
  if cfg.fp8_state:
    fp8_state = result.fp8_state
  metrics = {"loss": loss, **cfg.hooks.metrics(opt_state)}
  return params, opt_state, fp8_state, metrics
