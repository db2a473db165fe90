"""`data_parallel`: a jitted, donated ZeRO-0/1/2/3 train step over a Mesh, on shard_map.

Size: one step builder for ZeRO stages 0-3 and its init/placement; the stages share every
line but their reduce and gather, so they stay together.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from precision import optim
from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision._state import TrainState
from precision.numerics import _telemetry
from precision.parallel import _full_state
from precision.parallel import _report
from precision.parallel._collectives import all_gather_flat
from precision.parallel._fsdp import GATHER_MODES
from precision.parallel._layout import ParamLayout, unflatten
from precision.parallel._step import (
    ZERO_STAGES, OptimizerHooks, StepConfig, local_init, local_step, plain_optax_hooks,
    with_standard_promotion)


def recipe_hooks(plan: Plan, inner: optax.GradientTransformation, *, seed: int,
                 axis_name: str | None) -> tuple[optax.GradientTransformation, OptimizerHooks]:
  """The optimizer a plan builds around `inner` (precision.optim) and its step hooks."""
  tx = plan.optimizer(inner, seed=seed, axis_name=axis_name)
  return tx, OptimizerHooks(optim.loss_scale_of, optim.apply_updates,
                            optim.optimizer_metrics)


def step_config(loss_fn, tx, *, zero_stage: int, plan: Plan | None, axis_name: str,
                devices: int, seed: int, gather: str = "step",
                fp8_state: bool = False) -> StepConfig:
  """Validates the arguments shared by `data_parallel` and `data_parallel_pmap`."""
  # An int: True == 1 and 1.0 == 1 are not stages (a flag or a float passed by mistake).
  if (isinstance(zero_stage, (bool, np.bool_)) or not isinstance(zero_stage, (int, np.integer))
      or zero_stage not in ZERO_STAGES):
    raise ValueError(f"zero_stage={zero_stage!r}; accepted: the int 0, 1, 2 or 3")
  if not callable(loss_fn):
    raise ValueError(f"loss_fn={loss_fn!r}; accepted: a callable loss_fn(params, batch)")
  if not isinstance(fp8_state, bool):
    raise ValueError(f"fp8_state={fp8_state!r}; accepted: True or False")
  if plan is None and (isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 32):
    # With a recipe, build_optimizer checks the seed (it also takes jax.random keys).
    raise ValueError(f"seed={seed!r}; accepted: an int in [0, 2**32)")
  if gather not in GATHER_MODES:
    raise ValueError(f"gather={gather!r}; accepted: {', '.join(map(repr, GATHER_MODES))}")
  if gather == "layer" and fp8_state:
    raise ValueError("gather='layer' with fp8_state=True; a layer's fp8 scaling state would "
                     "be updated inside its re-gathered custom VJP and lost; accepted: "
                     "gather='step' for fp8 models")
  if gather == "layer" and zero_stage != 3:
    raise ValueError(f"gather='layer' with zero_stage={zero_stage}; layer-by-layer "
                     "gathering shards params, accepted only with zero_stage=3")
  if not isinstance(tx, optax.GradientTransformation):
    raise ValueError(f"tx={tx!r}; accepted: an optax.GradientTransformation")
  spec = None
  if plan is None:
    tx = with_standard_promotion(tx)
    hooks, compute_dtype, reduce_dtype = plain_optax_hooks(), None, None
  else:
    # The plan's spec: policy, overrides, fp32 ops (an fp8 recipe's GEMM state lives in
    # the model's layers). A model marked with the same plan or recipe runs its GEMMs as
    # in its own calls; one marked with another is refused when loss_fn calls it.
    spec = plan.autocast_spec
    # Stage 0 updates full, already reduced grads: every rank sees the same values, so no
    # cross-rank reduction in the optimizer. Stages 1-3 update shards: the finite check
    # and grad norm must be reduced over the axis so every rank decides alike.
    tx, hooks = recipe_hooks(plan, tx, seed=seed, axis_name=axis_name if zero_stage else None)
    compute_dtype, reduce_dtype = plan.compute_dtype, plan.reduce_dtype
  return StepConfig(loss_fn=loss_fn, tx=tx, hooks=hooks, zero_stage=zero_stage,
                    axis_name=axis_name, devices=devices, compute_dtype=compute_dtype,
                    reduce_dtype=reduce_dtype, gather=gather, fp8_state=fp8_state,
                    autocast=spec)


def opt_state_specs(cfg: StepConfig, layout: ParamLayout):
  """PartitionSpec of each optimizer-state leaf: sharded where the leaf is built from the
  param shards (its shape follows the shard size), replicated otherwise (counters, loss
  scale). Found by tracing `tx.init` on shards of k and k+1 elements."""
  if cfg.zero_stage == 0:
    params = layout.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype))
    return jax.tree.map(lambda _: P(), jax.eval_shape(cfg.tx.init, params))
  n, axis = cfg.devices, cfg.axis_name

  def state_shapes(extra):
    shards = layout.map(lambda lay: jax.ShapeDtypeStruct((n, lay.shard_size + extra), lay.dtype))
    return jax.eval_shape(jax.vmap(cfg.tx.init, axis_name=axis, axis_size=n), shards)

  def spec(a, b):
    differ = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
    if not differ:
      return P()
    if len(differ) != 1:
      raise ValueError(f"Optimizer-state leaf of shape {a.shape[1:]} follows the shard size "
                       "in more than one dimension; accepted: one")
    return P(*([None] * (differ[0] - 1)), axis)

  return jax.tree.map(spec, state_shapes(0), state_shapes(1))


class DataParallel:
  """A data-parallel (ZeRO stage 0-3) trainer on a Mesh; build it with `data_parallel`.

  Its state is a `precision.TrainState` (the type `precision.checkpoint` saves) whose
  `layout` is set: params full and replicated (stages 0-2) or flat padded shards (stage
  3); optimizer state full (stage 0) or built on flat shards (stages 1-3); `model_state`
  the fp8 scaling state (with ``fp8_state=True``) or None; `rng` carried untouched.

  Attributes:
    init: `init(params, fp8_state=None) -> TrainState`, params a pytree of full floating
      arrays (numpy or jax, identical on every process); cast to the recipe's param dtype
      and placed. `fp8_state`: the model's fp8 scaling state, with `fp8_state=True` only.
    step: `step(state, batch) -> (state, metrics)`, jitted, `state` donated. `batch` is
      the GLOBAL batch, its leading axis split over the data axis: in one process, host
      arrays (numpy, or jax arrays on one device) are split here; in a multi-process job
      each process passes global arrays built from its own slice by `shard_batch`.
      metrics: f32 "loss" (mean over all devices) plus
      `precision.optim.optimizer_metrics` when a recipe is given; replicated scalars.
    state_for_checkpoint / state_from_checkpoint: to and from the full form a checkpoint
      holds (full-shape params; see their docstrings), which any device count resumes.
    telemetry: `telemetry(state, batch) -> precision.numerics.TelemetryRecord`, the
      numerics of one device's share of the step (see its docstring).

  Examples:
    >>> state = dp.init(params)
    >>> state, metrics = dp.step(state, {"x": x, "y": y})         # numpy, global batch
    >>> ckpt.save(100, dp.state_for_checkpoint(state), recipe=recipe)
    >>> r = ckpt.restore(dp4.state_for_checkpoint(dp4.init(params)))  # 4 devices, say
    >>> state4 = dp4.state_from_checkpoint(r.state)
  """

  def __init__(self, cfg: StepConfig, mesh: Mesh, *, param_dtype, donate: bool):
    self.cfg, self.mesh, self._param_dtype = cfg, mesh, param_dtype
    self.zero_stage, self.axis_name = cfg.zero_stage, cfg.axis_name
    self._step = jax.jit(self._local_step, donate_argnums=(0,) if donate else ())
    self._gather = jax.jit(self._full_params)
    self._telemetry = None   # jitted on first use

  # ---- state -----------------------------------------------------------------------
  def _specs(self, layout: ParamLayout):
    return (P(self.axis_name) if self.zero_stage == 3 else P(),
            opt_state_specs(self.cfg, layout))

  def init(self, params, fp8_state=None) -> TrainState:
    """`TrainState` from full params (and, with fp8_state=True, the fp8 scaling state)."""
    if self.cfg.fp8_state != (fp8_state is not None):
      raise ValueError(
          f"init(fp8_state={'None' if fp8_state is None else '...'}) for a step built with "
          f"fp8_state={self.cfg.fp8_state}; accepted: the model's "
          "nnx.state(model, precision.fp8.Fp8State) exactly when fp8_state=True")
    replicated = NamedSharding(self.mesh, P())

    def place(x):
      if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
          return x
        # A copy on the mesh, never through numpy: PRNG keys (an nnx.Rngs or Dropout in
        # the model's state) and other extended dtypes have no numpy form. Copied first:
        # the step donates its state, which must not delete the caller's arrays, and
        # device_put(may_alias=False) from one device to all still aliases device 0's.
        return jax.device_put(jnp.array(x, copy=True), replicated)
      return jax.device_put(np.asarray(x), replicated)

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
      raise ValueError(f"params={params!r} holds no arrays; accepted: a pytree of floating "
                       "arrays (numpy or jax)")
    for path, x in leaves:
      if not isinstance(x, (jax.Array, np.ndarray, np.generic, float)):
        raise ValueError(f"params leaf {jax.tree_util.keystr(path)} is a "
                         f"{type(x).__name__}; accepted: floating arrays (numpy or jax)")
    params = jax.tree.map(place, params)
    fp8_state = jax.tree.map(place, fp8_state)
    # Checked before the cast to the param dtype, which would make integer or bool leaves
    # floats and train them.
    ParamLayout.of(params, self.cfg.devices)
    cast = lambda tree: jax.tree.map(
        lambda x: x.astype(self._param_dtype or x.dtype), tree)
    layout = ParamLayout.of(jax.eval_shape(cast, params), self.cfg.devices)
    p_spec, o_spec = self._specs(layout)
    body = lambda p: local_init(self.cfg, layout, cast(p))
    fn = jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=(p_spec, o_spec),
                       check_vma=False)
    p, o = jax.jit(fn)(params)
    return TrainState(p, o, fp8_state, None, layout)

  def step(self, state: TrainState, batch):
    """One training step on the global `batch`; see the class docstring."""
    state, batch = self._check_state(state), self._global_batch(batch)
    try:
      return self._step(state, batch)
    except ValueError as e:
      # Raised while tracing (nothing donated yet): say so if the state is another stage's.
      problem = self._stage_problem(state)
      if problem is None:
        raise
      raise ValueError(problem) from e

  def _stage_problem(self, state: TrainState) -> str | None:
    """Why `state` does not fit this DataParallel when it was made by one of another ZeRO
    stage (read from which of its arrays are sharded), else None."""
    def sharded(tree):
      return any(isinstance(getattr(x, "sharding", None), NamedSharding)
                 and any(a is not None for a in x.sharding.spec) for x in jax.tree.leaves(tree))
    made = 3 if sharded(state.params) else 1 if sharded(state.opt_state) else 0
    mine = min(self.zero_stage, 1) if self.zero_stage < 3 else 3
    if made == mine:
      return None
    words = {0: ("ZeRO stage 0", "nothing sharded"),
             1: ("ZeRO stage 1 or 2", "optimizer state sharded"),
             3: ("ZeRO stage 3", "params and optimizer state sharded")}
    hint = (" (or move it through the checkpoint form, which stages 1, 2 and 3 share: "
            "state_from_checkpoint(other.state_for_checkpoint(state)))"
            if made and mine else "")
    return (f"state was made by a {words[made][0]} data_parallel ({words[made][1]}) and "
            f"given to one of zero_stage={self.zero_stage} ({words[mine][1]}); accepted: "
            f"a state of a data_parallel of zero_stage={self.zero_stage}{hint}")

  def _check_state(self, state) -> TrainState:
    if not isinstance(state, TrainState) or state.layout is None:
      raise ValueError(
          f"state is a {type(state).__name__}"
          f"{' in full form (layout None)' if isinstance(state, TrainState) else ''}; "
          "accepted: a state of this DataParallel (init, step, or state_from_checkpoint "
          "of a restored checkpoint)")
    return state

  def _local_step(self, state: TrainState, batch):
    layout = state.layout
    p_spec, o_spec = self._specs(layout)
    body = lambda p, o, f, b: local_step(self.cfg, layout, p, o, b, f)
    # check_vma=False: replicated outputs are replicated by construction (psum / pmean /
    # pmax / all-gather results, or identical updates of identical replicated inputs).
    fn = jax.shard_map(body, mesh=self.mesh,
                       in_specs=(p_spec, o_spec, P(), P(self.axis_name)),
                       out_specs=(p_spec, o_spec, P(), P()), check_vma=False)
    params, opt_state, fp8_state, metrics = fn(state.params, state.opt_state,
                                               state.model_state, batch)
    return TrainState(params, opt_state, fp8_state, state.rng, layout), metrics

  def _full_params(self, state: TrainState):
    if self.zero_stage != 3:
      return state.params
    layout = state.layout
    red = lambda lay: self.cfg.reduction(lay)._replace(compute_dtype=lay.dtype)
    body = lambda shards: layout.map(
        lambda lay, s: unflatten(all_gather_flat(s, red(lay)), lay), shards)
    return jax.shard_map(body, mesh=self.mesh, in_specs=P(self.axis_name), out_specs=P(),
                         check_vma=False)(state.params)

  def params(self, state: TrainState):
    """Full params (original shapes, param dtype), replicated on the mesh."""
    return self._gather(self._check_state(state))

  def _global_batch(self, batch):
    """`batch` as global arrays split over the data axis, as `step` takes them.

    Leaves already split that way, and global arrays of a multi-process job, pass as they
    are. In one process, host arrays (numpy, or jax arrays on one device or otherwise
    laid out) are the whole global batch: they are split here. In a multi-process job a
    host array is refused: which process's rows would it be? Use `shard_batch`.

    Raises:
      ValueError: a leaf without a leading axis divisible by the data axis size, or a
        host array in a multi-process job.
    """
    sharding = NamedSharding(self.mesh, P(self.axis_name))
    n = self.cfg.devices
    check_batch_rows(batch)

    def one(path, x):
      if isinstance(x, jax.core.Tracer):
        return x
      if isinstance(x, jax.Array):
        if not x.is_fully_addressable or x.sharding.is_equivalent_to(sharding, x.ndim):
          return x
      if jax.process_count() > 1:
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path)} is a host array in a job of "
            f"{jax.process_count()} processes; accepted: global arrays from "
            "dp.shard_batch(this process's slice)")
      shape = np.shape(x)
      if not shape or shape[0] % n:
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path)} has shape {shape}; accepted: a "
            f"leading (batch) axis divisible by the {n} devices of axis "
            f"{self.axis_name!r}")
      return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(one, batch)

  def shard_batch(self, local_batch):
    """Multi-process jobs: this process's slice of the global batch -> global arrays
    split over the data axis (`jax.make_array_from_process_local_data`); each process
    passes its own rows, in process order. In one process the slice is the whole global
    batch; `step` then also takes the host arrays directly."""
    sharding = NamedSharding(self.mesh, P(self.axis_name))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch)

  # ---- numerics ---------------------------------------------------------------------
  def telemetry(self, state: TrainState, batch, *, whatif: bool = True):
    """The numerics of one device's share of the step `step(state, batch)` would take:
    `precision.numerics.gemm_telemetry` of the loss (times the optimizer's loss scale, as
    the step scales it) and its gradient on the first device's slice of the global batch,
    with the full params, under the recipe's spec: every GEMM operand, cotangent and
    result of that forward and backward pass and the logit monitors. Its own compiled
    program (`state` is not donated or changed): call it every N steps beside `step`.
    The rows are one shard's; the other devices' slices are alike in distribution, not
    in value. Needs a recipe. With fp8_state=True the fp8 GEMMs are measured on their
    scaled operands, from the state's scaling (its new value is discarded).

    Returns:
      A `precision.numerics.TelemetryRecord`.
    """
    if self.cfg.autocast is None:
      raise ValueError("telemetry: this DataParallel has no recipe; accepted: one built "
                       "with data_parallel(..., recipe=...)")
    if not isinstance(whatif, bool):
      raise ValueError(f"telemetry: whatif={whatif!r}; accepted: True or False")
    if self._telemetry is None:
      self._telemetry = jax.jit(self._local_telemetry, static_argnums=(2,))
    state = self._check_state(state)
    return self._telemetry(state, self._global_batch(batch), whatif)

  def _local_telemetry(self, state: TrainState, batch, whatif: bool):
    params = self._full_params(state)
    n = self.cfg.devices
    shard = jax.tree.map(lambda x: x[: x.shape[0] // n], batch)
    scale = optim.loss_scale_of(state.opt_state).astype(jnp.float32)
    loss_fn = self.cfg.loss_fn

    if self.cfg.fp8_state:
      def grads(p, s, b):
        # As the step differentiates: w.r.t. the params and the fp8 state (the gradient
        # operand's state comes back as a cotangent; here it is discarded).
        def f(q, t):
          loss, new = loss_fn(q, t, b)
          return loss.astype(jnp.float32) * scale, new
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True, allow_int=True)(p, s)

      return _telemetry.gemm_telemetry(grads, self.cfg.autocast, params, state.model_state,
                                       shard, whatif=whatif)

    def grads(p, b):
      return jax.value_and_grad(lambda q: loss_fn(q, b).astype(jnp.float32) * scale)(p)

    return _telemetry.gemm_telemetry(grads, self.cfg.autocast, params, shard, whatif=whatif)

  # ---- checkpoints -----------------------------------------------------------------
  def state_for_checkpoint(self, state: TrainState, *, rng: Any = None) -> TrainState:
    """`state` in the full form `precision.checkpoint` saves, replicated on the mesh.

    Full-shape params in the param dtype (stage 3's shards gathered); at stages 1-3 each
    optimizer-state leaf built on flat shards gathered into one flat vector of the
    parameter's size, padding dropped (the state the same optimizer builds on one
    device); counters, loss scale and fp8 state as they are; `model_state` {} without
    fp8; `layout` None. It does not depend on the device count: a DataParallel on any
    number of devices, at any of stages 1-3 (stage 0: stage 0), resumes it with
    `state_from_checkpoint`, bit for bit.

    Args:
      state: a state of this DataParallel.
      rng: PRNG key data to save with it (replaces `state.rng` when given).

    Examples:
      >>> ckpt.save(step, dp.state_for_checkpoint(state), recipe=recipe)
    """
    return _full_state.to_full(self.cfg, self.mesh, self._specs, self._check_state(state),
                               rng)

  def state_from_checkpoint(self, state: TrainState) -> TrainState:
    """The full form (e.g. ``Checkpointer.restore(...).state``) -> a state of this
    DataParallel, sharded over its devices (the padding for this device count added).

    Raises:
      ValueError naming the first leaf that is not what this DataParallel builds (other
      recipe, optimizer, model or ZeRO stage 0 vs 1-3), or fp8 state given to a step
      built without it (or the reverse).

    Examples:
      >>> r = ckpt.restore(dp.state_for_checkpoint(dp.init(params)))
      >>> state = dp.state_from_checkpoint(r.state)
    """
    return _full_state.from_full(self.cfg, self.mesh, self._specs, self._param_dtype, state)

  # ---- reports ---------------------------------------------------------------------
  def compile(self, state: TrainState, batch):
    """The compiled step executable for these argument shapes."""
    state = self._check_state(state)
    try:
      return self._step.lower(state, self._global_batch(batch)).compile()
    except ValueError as e:
      problem = self._stage_problem(state)
      if problem is None:
        raise
      raise ValueError(problem) from e

  def memory_report(self, state: TrainState, batch) -> _report.MemoryReport:
    """Per-device memory of one step (see `precision.parallel.MemoryReport`)."""
    return _report.memory_report(self.compile(state, batch), state, batch,
                                 zero_stage=self.zero_stage, devices=self.cfg.devices,
                                 reduce_dtype=self.cfg.reduce_dtype)

  def collective_report(self, state: TrainState, batch, *,
                        compiled: bool = True) -> _report.CollectiveReport:
    """Collectives of the step and the bytes each device sends per step.

    compiled=True: the executable this backend runs. XLA's CPU backend widens bf16/f16
    collectives to f32 (it converts around them), so on CPU they move f32.
    compiled=False: the program as lowered, before backend passes: the dtypes the step
    asks for, which backends with native 16-bit collectives (NCCL on GPU) move.
    """
    lowered = self._step.lower(self._check_state(state), self._global_batch(batch))
    text = lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")
    return _report.collective_report(text, self.cfg.devices)


def data_parallel(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                  mesh: Mesh, *, zero_stage: int = 0,
                  recipe: Plan | Recipe | str | None = None,
                  overrides: Mapping[Any, Any] | None = None,
                  axis_name: str = "data", seed: int = 0, donate: bool = True,
                  gather: str = "step", fp8_state: bool = False) -> DataParallel:
  """Data-parallel training with ZeRO stage 0-3 on `mesh`'s `axis_name` axis (shard_map).

  - stage 0: grads all-reduced (mean); full optimizer state on every device.
  - stage 1: optimizer state (master, moments) sharded; grads reduce-scattered after the
    backward pass; each device updates its shard; new params all-gathered.
  - stage 2: as 1, but each leaf's grad is reduce-scattered inside the backward pass, so
    no full-size gradient outlives its reduction. Bit-identical to stage 1.
  - stage 3 (FSDP): params sharded too; gathered in the compute dtype (a bf16 recipe
    moves bf16), their cotangents reduce-scattered. `gather="step"`: every leaf once per
    step, before loss_fn reads it, the gathered copy kept for backward (2 Psi of traffic,
    full params alive through the step; works with any loss_fn). `gather="layer"`:
    loss_fn gets `ShardedParam` leaves and marks its layers with
    `precision.parallel.gathered_layer` / `call_layer`; each layer's params are gathered
    when it runs and re-gathered in backward (3 Psi, one layer's params alive at a time).
  Leaves are flattened and zero-padded to a multiple of the device count (never refused).
  The same code runs in one process or many (`jax.distributed`): pass a mesh over
  `jax.devices()`; in one process `step` takes the global batch as host arrays, in many
  each process builds global arrays from its own slice with `DataParallel.shard_batch`.

  Args:
    loss_fn: `loss_fn(params, local_batch) -> scalar` mean loss over the device's slice of
      the batch, written with no dtype in mind: with a recipe it runs under
      `precision.autocast(loss_fn, plan)` (every GEMM compute x compute -> f32, forward
      and backward, outside the plan's overrides; the recipe's fp32 ops in f32) and
      receives params in the recipe's PARAM dtype (stage 3: gathered in the compute
      dtype), so gradients come back in the param dtype at its accuracy. The result is
      cast to f32. An NNX model loss_fn merges and calls keeps the mark of
      `precision.flax.apply_recipe`: its module paths are scopes that overrides match,
      its own overrides apply when the plan here has none, and a model marked with
      another recipe, policy or overrides is refused (ValueError naming both).
    tx: the inner optax optimizer. With a recipe it is wrapped by
      `precision.optim.build_optimizer` (master weights, loss scaling, skipping, moment
      dtypes). Without one it runs as given and must be elementwise for stages 1-3 (adam,
      adamw, sgd): a global-norm transform would see only a shard.
    mesh: a Mesh with an axis named `axis_name`; other axes replicate.
    zero_stage: 0, 1, 2 or 3.
    recipe: a Plan (`precision.bind`), a Recipe or a preset name; sets the param dtype
      (init casts), the compute dtype, the overrides, and `reduce_dtype`, the dtype grads
      are summed in across devices. None: f32-style training in each leaf's own dtype.
    overrides: {path pattern or module type: policy} bound with `recipe` (not with a
      Plan, which has its own; not without a recipe).
    axis_name: the data axis.
    seed: the optimizer's stochastic-rounding seed (identical on every rank).
    donate: donate the state to the step.
    gather: stage 3 only: "step" or "layer" (see above).
    fp8_state: the model has fp8 GEMMs (`precision.fp8.apply_fp8`): `loss_fn` is then
      ``loss_fn(params, fp8_state, local_batch) -> (loss, new_fp8_state)``, with
      ``new_fp8_state = nnx.state(model, precision.fp8.Fp8State)`` read after the forward
      pass, and `init(params, fp8_state)` takes the initial state. Each step takes the
      gradient operand's new state from its cotangent (`precision.fp8.merge_grad_state`)
      and makes the state agree across ranks (`precision.fp8.sync_fp8_state`: amax
      histories max-reduced, so every rank derives the same delayed scale). The state
      may also hold the model's RNG state (an nnx.Rngs or Dropout: ``rest`` of
      ``nnx.split(model, nnx.Param, ...)``, typed keys included): it is replicated, not
      reduced; every rank draws from the same key and count and advances them alike (so
      each rank's slice sees the same dropout mask pattern).

  Returns:
    A `DataParallel` with `init`, `step`, `params`, `shard_batch`,
    `state_for_checkpoint`, `state_from_checkpoint`, `memory_report`,
    `collective_report`.

  Examples:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> dp = data_parallel(loss_fn, optax.adamw(1e-3), mesh, zero_stage=1, recipe="bf16_master")
    >>> state = dp.init(params)
    >>> state, metrics = dp.step(state, batch)     # global batch, numpy arrays
    >>> checkpoint.save(path, 1, dp.state_for_checkpoint(state), recipe=recipe)
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh={mesh!r}; accepted: a jax.sharding.Mesh, e.g. "
                     "jax.make_mesh((8,), ('data',))")
  if not isinstance(donate, bool):
    raise ValueError(f"donate={donate!r}; accepted: True or False")
  if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh; accepted: "
                     f"{', '.join(map(str, mesh.axis_names))}")
  plan = plan_of(recipe, overrides)
  cfg = step_config(loss_fn, tx, zero_stage=zero_stage, plan=plan, axis_name=axis_name,
                    devices=int(mesh.shape[axis_name]), seed=seed, gather=gather,
                    fp8_state=fp8_state)
  param_dtype = None if plan is None else plan.param_dtype
  return DataParallel(cfg, mesh, param_dtype=param_dtype, donate=donate)


def check_batch_rows(batch) -> None:
  """Every batch leaf has the same number of rows, at least one: a zero-row batch has
  a NaN mean loss (0 / 0) that the step would count as a finite step, and leaves of
  different lengths would pair the rows of one example with another's."""
  rows = []
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = getattr(x, "shape", None)
    if shape is None:
      if not isinstance(x, (np.ndarray, np.generic, numbers.Number)):
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}; accepted: "
            "arrays (numpy or jax) with a leading batch axis")
      shape = np.shape(x)
    if shape and shape[0] == 0:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}: no rows; "
          "accepted: a batch of at least one row per device")
    if shape:
      rows.append((jax.tree_util.keystr(path), int(shape[0])))
  if len({r for _, r in rows}) > 1:
    shown = ", ".join(f"{p}: {r}" for p, r in rows)
    raise ValueError(f"batch leaves have different leading (batch) sizes ({shown}); "
                     "accepted: every leaf with the same number of rows")
  if not jax.tree_util.tree_leaves(batch):
    raise ValueError(f"batch={batch!r} holds no arrays; accepted: a pytree of arrays "
                     "with a leading batch axis")


def plan_of(recipe: Plan | Recipe | str | None,
            overrides: Mapping[Any, Any] | None) -> Plan | None:
  """The step's plan (None without a recipe), bound here once."""
  if recipe is None:
    if overrides is not None:
      raise ValueError(f"overrides={overrides!r} without a recipe; accepted: a recipe (or "
                       "a Plan from precision.bind) to bind them with")
    return None
  return as_plan(recipe, overrides)
