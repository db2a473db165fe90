"""A DataParallel state to and from its full form: what a checkpoint holds.

The full form of a state does not depend on the device count:

* params: every leaf in its own shape and the param dtype (stage 3's flat shards
  gathered, padding dropped);
* opt_state: at stage 0 as it is (built on full-shape params). At stages 1-3 the
  optimizer state is built on flat padded shards; every leaf that follows the shard size
  (master copy, moments, compensation) is gathered into ONE flat vector of the
  parameter's `size` elements, padding dropped: exactly the state the same optimizer
  builds on one device (n = 1, no padding). Leaves that do not follow it (counters, the
  loss scale) are kept as they are;
* model_state: the fp8 scaling state and any RNG state (typed keys, counters; replicated,
  identical on every device), or {};
* layout: None.

Both directions only move bytes (slices, reshapes, zero padding; the padding is zero in
every sharded leaf, see `_layout`), so sharded -> full -> sharded on the same device count
is the identity bit for bit, and a state saved on n devices resumes on m devices at any
of stages 1-3 (stage 0 keeps full-shape optimizer leaves: it resumes at stage 0).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from precision._state import TrainState
from precision.parallel._layout import ParamLayout, flatten_pad, own_shard, unflatten


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def _sharded_dims(specs: Any) -> list[int | None]:
  """Per optimizer-state leaf (flatten order): the dimension split over the data axis
  (the last entry of its PartitionSpec), or None for a replicated leaf."""
  return [len(s) - 1 if len(s) else None
          for s in jax.tree.leaves(specs, is_leaf=_is_spec)]


def full_opt_shapes(cfg, layout: ParamLayout) -> Any:
  """ShapeDtypeStructs of the full-form optimizer state (see module docstring)."""
  if cfg.zero_stage == 0:
    params = layout.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype))
    return jax.eval_shape(cfg.tx.init, params)
  # The optimizer on one device: one "shard" per leaf of all its `size` elements.
  flat = layout.map(lambda lay: jax.ShapeDtypeStruct((1, lay.size), lay.dtype))
  one = jax.eval_shape(jax.vmap(cfg.tx.init, axis_name=cfg.axis_name, axis_size=1), flat)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), one)


def _fresh(tree: Any) -> Any:
  """Copies of the jax arrays of `tree` in their own buffers: the step donates its state,
  which must not delete the arrays of a full form the caller keeps (or the reverse)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                      tree)


def _describe(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _check_tree(what: str, got: Any, want: Any) -> None:
  """ValueError naming the first leaf of `got` whose path, shape or dtype is not `want`'s."""
  g = jax.tree_util.tree_flatten_with_path(got)
  w = jax.tree_util.tree_flatten_with_path(want)
  if g[1] != w[1]:
    gp = [_describe(p) for p, _ in g[0]]
    wp = [_describe(p) for p, _ in w[0]]
    extra = sorted(set(gp) - set(wp))[:3]
    missing = sorted(set(wp) - set(gp))[:3]
    raise ValueError(
        f"{what} has another structure than this DataParallel builds (extra leaves "
        f"{extra}, missing {missing}); accepted: the full form of a state of the same "
        "model, recipe and inner optimizer (DataParallel.state_for_checkpoint)")
  for (path, x), (_, s) in zip(g[0], w[0]):
    if tuple(np.shape(x)) != tuple(s.shape) or np.dtype(x.dtype) != np.dtype(s.dtype):
      raise ValueError(
          f"{what} leaf {_describe(path)} is {np.dtype(x.dtype).name}{list(np.shape(x))}; "
          f"this DataParallel expects {np.dtype(s.dtype).name}{list(s.shape)} (the full "
          "form: full-shape params, flat unpadded optimizer leaves at stages 1-3)")


def to_full(cfg, mesh, specs, state: TrainState, rng: Any = None) -> TrainState:
  """`state` (sharded, layout set) -> its full form, replicated on `mesh`.

  `specs(layout) -> (param spec, optimizer-state specs)`: the state's PartitionSpecs.
  `rng` replaces the state's rng when given.
  """
  layout = state.layout
  p_spec, o_spec = specs(layout)
  dims = _sharded_dims(o_spec)
  shapes = jax.tree.leaves(full_opt_shapes(cfg, layout))
  leaves, treedef = jax.tree.flatten(state.opt_state)
  if len(leaves) != len(dims) or len(leaves) != len(shapes):
    raise ValueError("state.opt_state does not have the structure of this DataParallel's "
                     "optimizer state; accepted: a state this DataParallel made")

  axis = cfg.axis_name

  def body(params, opt):
    # Per device: gather the shards (bytes only), then drop the padding. The sharded
    # dimension of a leaf is the concatenation of its shards in device order.
    if cfg.zero_stage == 3:
      params = layout.map(
          lambda lay, x: unflatten(jax.lax.all_gather(x, axis, tiled=True), lay), params)
    opt = [x if d is None else jax.lax.slice_in_dim(
        jax.lax.all_gather(x, axis, axis=d, tiled=True), 0, s.shape[d], axis=d)
           for x, d, s in zip(opt, dims, shapes)]
    return params, opt

  o_specs = jax.tree.leaves(o_spec, is_leaf=_is_spec)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(p_spec, o_specs), out_specs=P(),
                     check_vma=False)
  params, opt = jax.jit(fn)(state.params, leaves)
  model_state = {} if state.model_state is None else _fresh(state.model_state)
  return TrainState(params, jax.tree.unflatten(treedef, opt), model_state,
                    _fresh(state.rng) if rng is None else rng)


def from_full(cfg, mesh, specs, param_dtype, full: TrainState) -> TrainState:
  """The full form (from `to_full` or a checkpoint) -> a sharded state on `mesh`.

  `param_dtype`: the recipe's (None: each leaf's own); a leaf in another dtype raises.
  """
  if not isinstance(full, TrainState):
    raise ValueError(f"state_from_checkpoint got {type(full).__name__}; accepted: a "
                     "precision.TrainState in full form (a restored checkpoint's state)")
  if full.layout is not None:
    raise ValueError("state_from_checkpoint got a DataParallel state (layout set); "
                     "accepted: its full form, DataParallel.state_for_checkpoint(state)")
  for path, x in jax.tree_util.tree_flatten_with_path(full.params)[0]:
    want = param_dtype or x.dtype
    if np.dtype(x.dtype) != np.dtype(want):
      raise ValueError(
          f"state.params leaf {_describe(path)} is {np.dtype(x.dtype).name}; this "
          f"DataParallel's recipe keeps params in {np.dtype(want).name} (restore the "
          "checkpoint with precision.checkpoint's recipe conversion first)")
  layout = ParamLayout.of(full.params, cfg.devices)
  want_opt = full_opt_shapes(cfg, layout)
  _check_tree("state.opt_state", full.opt_state, want_opt)
  has_model_state = bool(jax.tree.leaves(full.model_state))
  if cfg.fp8_state != has_model_state:
    raise ValueError(
        f"state.model_state {'holds' if has_model_state else 'holds no'} arrays for a "
        f"DataParallel built with fp8_state={cfg.fp8_state}; accepted: the fp8 scaling "
        "state exactly when fp8_state=True ({} or None otherwise)")

  replicated = NamedSharding(mesh, P())
  # Fresh copies on this mesh (the full form may live on another mesh or the host): the
  # step donates its state, which must not delete the caller's arrays. Copied before
  # device_put: from one device to all, may_alias=False still aliases device 0's buffer.
  # Never through numpy: PRNG keys (an nnx.Rngs in the model state) have no numpy form.
  put = lambda tree: jax.tree.map(
      lambda x: jax.device_put(jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                               replicated), tree)
  p_spec, o_spec = specs(layout)
  dims = _sharded_dims(o_spec)
  shapes = jax.tree.leaves(want_opt)
  leaves, treedef = jax.tree.flatten(full.opt_state)

  def own(x, d, s):
    # This device's part of a sharded leaf: pad the flat dimension with zeros to n * k
    # elements (k = ceil(size / n)) and take elements [r*k, (r+1)*k), as `_layout` does.
    if d is None:
      return x
    size = s.shape[d]
    k = -(-size // cfg.devices)
    if k * cfg.devices != size:
      zeros = jnp.zeros(x.shape[:d] + (k * cfg.devices - size,) + x.shape[d + 1:], x.dtype)
      x = jnp.concatenate([x, zeros], axis=d)
    start = jax.lax.axis_index(cfg.axis_name) * k
    return jax.lax.dynamic_slice_in_dim(x, start, k, axis=d)

  def body(params, opt):
    if cfg.zero_stage == 3:
      params = layout.map(lambda lay, x: own_shard(flatten_pad(x, lay), lay, cfg.axis_name),
                          params)
    return params, [own(x, d, s) for x, d, s in zip(opt, dims, shapes)]

  o_specs = jax.tree.leaves(o_spec, is_leaf=_is_spec)
  fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(p_spec, o_specs),
                     check_vma=False)
  params, opt = jax.jit(fn)(put(full.params), put(leaves))
  model_state = put(full.model_state) if cfg.fp8_state else None
  # The rng rides through the jitted step with the rest: on this mesh, replicated.
  return TrainState(params, jax.tree.unflatten(treedef, opt), model_state, put(full.rng),
                    layout)
