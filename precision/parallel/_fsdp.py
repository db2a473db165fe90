"""ZeRO stage 3 layer by layer: params gathered where a layer runs, re-gathered in backward.

With `data_parallel(..., zero_stage=3, gather="layer")`, `loss_fn` receives its params as a
pytree of `ShardedParam` (this device's flat shard of each leaf plus its static layout)
instead of full arrays. The model says where a layer begins and ends:

  * `gathered_layer(fn)(params, *args)` runs ``fn(full_params, *args)`` with the layer's
    leaves all-gathered (moved in the compute dtype, handed over in the param dtype) just
    before it runs. Nothing gathered is kept
    for backward: the residuals are the shards and `args`; backward gathers the leaves
    again, computes the layer's VJP and reduce-scatters each leaf's gradient at once. So
    at most one layer's full params and full grads are alive at a time (ZeRO-3 as in
    Rajbhandari et al. 2020: 3 Psi of traffic per step, two all-gathers and a
    reduce-scatter, against 2 Psi when every leaf is gathered once per step).
  * `call_layer(module, *args)` does the same for a Flax NNX module.
  * `gather(tree)` gathers what a model reads outside any layer (kept for backward, like
    `gather="step"`).

Every call is a no-op wrapper when its params hold no `ShardedParam` (one device, stages
0-2, `gather="step"`), so the same model code runs everywhere.

Ordering. XLA may run a collective as early as its operands are ready, which would gather
every layer up front and defeat the purpose (the CPU backend does exactly that, and it
drops optimization barriers before scheduling). So each layer's forward gather is made to
depend on the layer's input, and its backward re-gather on the output's cotangent (see
`_gather_now`). The price: no prefetch of the next layer's params while this one computes
(the overlap a GPU latency-hiding scheduler would add).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from precision import _trace_state
from precision._autocast import _api
from precision.parallel import _collectives as coll
from precision.parallel._layout import LeafLayout, flatten_pad, unflatten

GATHER_MODES = ("step", "layer")


@jax.tree_util.register_pytree_node_class
class ShardedParam:
  """One parameter leaf as `loss_fn` sees it under ZeRO-3 `gather="layer"`.

  Attributes:
    shard: this device's `layout.shard_size` elements of the flat, zero-padded leaf, in
      the dtype gradients are handed to the optimizer in (f32 for a bf16-compute recipe).
    layout: the leaf's shape, param dtype and shard size (static).
    reduction: dtypes of the gather and of the gradient reduction (static).
    index: the leaf's position in the params pytree (static; for error messages).

  `shape`, `ndim`, `size` and `dtype` describe the FULL leaf as `gather` returns it (dtype:
  the param dtype; it travels in the compute dtype). It is not an array: pass it through
  `gather`, `gathered_layer` or `call_layer` before computing with it.
  """

  def __init__(self, shard: jax.Array, layout: LeafLayout, reduction: coll.Reduction,
               index: int):
    self.shard, self.layout, self.reduction, self.index = shard, layout, reduction, index

  def tree_flatten(self):
    return (self.shard,), (self.layout, self.reduction, self.index)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.layout.shape

  @property
  def ndim(self) -> int:
    return len(self.layout.shape)

  @property
  def size(self) -> int:
    return self.layout.size

  @property
  def dtype(self) -> np.dtype:
    return self.reduction.param_dtype

  def gather(self) -> jax.Array:
    """The full leaf in the param dtype, moved in the compute dtype (all-gather; its
    cotangent reduce-scattered)."""
    _record(self.index)
    return unflatten(coll.gather_view(self.shard, self.reduction), self.layout)

  def __jax_array__(self):
    raise TypeError(
        f"Parameter leaf {self.index} (shape {self.shape}) is a ZeRO-3 shard "
        "(data_parallel gather='layer'); read it through precision.parallel.gather, "
        "gathered_layer or call_layer")

  def __repr__(self) -> str:
    return (f"ShardedParam(index={self.index}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name}, shard={self.layout.shard_size})")


def is_sharded(x: Any) -> bool:
  return isinstance(x, ShardedParam)


def has_sharded(tree: Any) -> bool:
  """Whether any leaf of `tree` is a `ShardedParam`."""
  return any(map(is_sharded, jax.tree.leaves(tree, is_leaf=is_sharded)))


# ---- which leaves a loss_fn gathered (checked once per trace by the step) -------------
_GATHERED = _trace_state.FSDP_GATHERED  # the trace state lives in precision._trace_state


def _record(index: int) -> None:
  seen = _GATHERED.get()
  if seen is not None:
    seen.add(index)


@contextlib.contextmanager
def recording():
  """Collects the indices of the leaves gathered while tracing inside the block."""
  seen: set[int] = set()
  token = _GATHERED.set(seen)
  try:
    yield seen
  finally:
    _GATHERED.reset(token)


# ---- public gathers --------------------------------------------------------------------
def gather(tree: Any) -> Any:
  """`tree` with every `ShardedParam` replaced by its full leaf (param dtype).

  Other leaves pass through, so a model calls it unconditionally. The gathered leaves are
  kept for backward (use `gathered_layer` / `call_layer` to re-gather there instead).
  """
  return jax.tree.map(lambda x: x.gather() if is_sharded(x) else x, tree, is_leaf=is_sharded)


def _first_array(tree: Any) -> jax.Array | None:
  leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and x.size]
  return leaves[0] if leaves else None


def _gather_now(params: Any, after: jax.Array | None) -> Any:
  """Full leaves from shards with no VJP of their own (the layer's VJP reduces).

  `after`: the gather is made to wait for this array. XLA may start a collective whose
  operands are ready as early as it likes (the CPU backend drops optimization barriers
  before scheduling and hoists every gather to the top of the step), which would hold
  every layer's params at once. So one element of `after` rides along in each gathered
  buffer: ``all_gather(concat(shard, after[0]))``, then the extra column is sliced off.
  A real data dependency, honoured by every backend, exact (the element is moved, never
  combined with data, so an inf or NaN in it cannot leak) and n elements of extra traffic.
  It also keeps the forward gather and the backward re-gather distinct for CSE.
  """
  tag = None if after is None else after.reshape(-1)[:1]

  def one(x):
    if not is_sharded(x):
      return x
    _record(x.index)
    red = x.reduction
    shard = x.shard.astype(red.compute_dtype)
    if tag is None:
      return unflatten(coll.all_gather_flat(shard, red).astype(red.param_dtype), x.layout)
    rows = jnp.concatenate([shard, tag.astype(red.compute_dtype)])[None, :]
    rows = jax.lax.all_gather(rows, red.axis_name, axis=0, tiled=True)
    # Moved in the compute dtype, handed to the layer in the param dtype (exact).
    return unflatten(rows[:, :-1].reshape(-1).astype(red.param_dtype), x.layout)

  return jax.tree.map(one, params, is_leaf=is_sharded)


def _reduce_grads(params: Any, full_grads: Any) -> Any:
  """Cotangents of the full leaves -> this device's reduced shard of each (others as is)."""

  def one(p, g):
    if not is_sharded(p):
      return g
    flat = flatten_pad(g, p.layout)  # param dtype, as the layer's f32 accumulators left it
    return ShardedParam(coll.reduce_scatter_mean(flat, p.reduction), p.layout, p.reduction,
                        p.index)

  return jax.tree.map(one, params, full_grads, is_leaf=is_sharded)


def _layer_vjp(fn: Callable[..., Any]):
  """``run(params, args)``: fn(gather(params), *args) with residuals (shards, args) only.

  Inside a `precision.autocast` trace (data_parallel with a recipe) the layer runs under
  the same policy in its forward and in its backward re-computation: autocast leaves
  custom-VJP bodies as written, so the policy is applied here.
  """
  spec = _api.active_spec()
  if spec is not None:
    plain = fn
    fn = lambda p, *a: _api.run(spec, plain, (p, *a), {}, check_overrides=False).outputs

  def primal(params, args):
    # Gathered once this layer's inputs exist (not every layer at the start of the step).
    return fn(_gather_now(params, _first_array(args)), *args)

  run = jax.custom_vjp(primal)

  def fwd(params, args):
    # The residuals are the shards and the inputs, never the gathered params.
    return primal(params, args), (params, args)

  def bwd(res, ct):
    params, args = res
    # Re-gathered once the output's cotangent exists (not at the start of backward).
    full = _gather_now(params, _first_array(ct))
    _, vjp = jax.vjp(lambda p, a: fn(p, *a), full, args)
    g_full, g_args = vjp(ct)
    return _reduce_grads(params, g_full), g_args

  run.defvjp(fwd, bwd)
  return run


def gathered_layer(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Wraps ``fn(params, *args) -> out`` into one ZeRO-3 layer (see the module docstring).

  `params` is the layer's pytree of params (`ShardedParam` leaves under `gather="layer"`,
  arrays otherwise); `args` are arrays (activations, token ids). `fn` must be pure: what
  it computes besides its output is dropped. Without `ShardedParam` leaves this is `fn`.

  Examples:
    >>> def mlp(p, x):
    ...   return jnp.tanh(x @ p["w1"]) @ p["w2"]
    >>> def loss_fn(params, batch):   # params: {"layers": [{"w1": .., "w2": ..}, ...]}
    ...   x = batch["x"]
    ...   for p in params["layers"]:
    ...     x = x + gathered_layer(mlp)(p, x)
    ...   return jnp.mean(jnp.square(x - batch["y"]))
  """

  @functools.wraps(fn)
  def wrapped(params, *args):
    if not has_sharded(params):
      return fn(params, *args)
    return _layer_vjp(fn)(params, args)

  return wrapped


def call_layer(module: Any, *args: Any) -> Any:
  """``module(*args)`` for a Flax NNX module as one ZeRO-3 layer (`gathered_layer`).

  Under `gather="layer"` the module's `nnx.Param` values are `ShardedParam`s (the loss_fn
  merged them into the model with `nnx.merge`); they are gathered for this call only and
  re-gathered in backward. Other state (RNG counters, fp8 scaling) is read, not updated:
  run stateful layers outside. Without `ShardedParam` values this is ``module(*args)``.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top  (optional dependency)

  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  if not has_sharded(params):
    return module(*args)

  def run(p, *a):
    return nnx.merge(graphdef, p, rest)(*a)

  return _layer_vjp(run)(params, args)
