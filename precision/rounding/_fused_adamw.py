"""Fused AdamW + stochastic rounding: one pass reads grad, param, m, v (or the f32 master)
and writes the new param, m, v (and master), each exactly once.

The arithmetic is optax.adamw's, operation for operation, so the fused update is bit for bit
the unfused one (`precision.optim.stochastic_updates` / `master_weights(...,
rounding="stochastic")` around ``optax.adamw``), for f32 moments:

  mu  = (1 - b1) * g + b1 * mu                    optax.tree.update_moment, order 1
  nu  = (1 - b2) * (g * g) + b2 * nu              update_moment_per_elem_norm, order 2
  u   = (mu / bc1) / (sqrt(nu / bc2 + eps_root) + eps)
        bc = 1 - b ** (count + 1), computed as optax does, in f32
  u   = u + wd * w                                add_decayed_weights, where the mask says
  u   = (-lr) * u                                 scale_by_learning_rate
  w'  = w + u                                     w: the f32 master, or f32(param) without
  param' = stochastic_round(w', param dtype, key=leaf_seed(seed, i), step=count,
                            index_offset=offset_i)
        offset_i = 0, or with `axis_name` (the update runs on ZeRO shards)
        ``axis_index(axis_name) * shard size``: the shard's first global flat index

g is upcast to f32 (exact for bf16/f16). Everything is f32: Adam's moments and epsilon
need the range (1e-8 is 0 in f16) and the update must be exact before the one rounding.
Weight decay applies, as in llm.c, to matrices and embeddings only (leaves with ndim >= 2)
unless a mask says otherwise.

`adamw_sr_elementwise` is the one definition of the per-element arithmetic: the XLA
reference applies it to whole leaves, the Pallas kernel to blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from precision import formats
from precision.rounding import _hash
from precision.rounding import _pallas
from precision.rounding import _reference

_F32 = np.dtype(np.float32)
IMPLS = ("auto", "xla", "pallas")


class FusedAdamWState(NamedTuple):
  """count: int32 steps taken (Adam's count, and the stochastic-rounding step before the
  increment); mu, nu: f32 moments shaped like the params; master: f32 params or None."""

  count: jax.Array
  mu: Any
  nu: Any
  master: Any


class Hyper(NamedTuple):
  """Static per-leaf constants of the element arithmetic."""

  b1: float
  b2: float
  eps: float
  eps_root: float
  decay: bool  # whether weight decay applies to this leaf


def llmc_decay_mask(params: Any) -> Any:
  """llm.c's weight-decay rule: True for matrices and embeddings (ndim >= 2), False for
  vectors and scalars (biases, norm gains)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def adamw_sr_elementwise(g, w, mu, nu, rbits, scalars, hp: Hyper, fi: formats.FormatInfo):
  """One AdamW step on f32 master values `w` and the stochastic rounding of the result.

  Args:
    g: grads (f32, bf16 or f16); w, mu, nu: f32; rbits: uint32 random bits.
    scalars: (bc1, bc2, step_size, wd, apply) f32 scalars; step_size = -learning_rate;
      apply: 1.0 takes the step, 0.0 skips it (a guard's non-finite or spike skip).
    hp: Python-float constants. fi: the param format.

  Returns:
    (param bit patterns (uint16/uint8), new mu, new nu, new w), same shape as `g`. On a
    skipped step mu, nu and w come back bit for bit, and the param bits are those of the
    unchanged w rounded again (meaningless: a skip's caller discards them).
  """
  bc1, bc2, step_size, wd, apply = scalars
  ok = apply != np.float32(0)
  g = g.astype(jnp.float32)
  # Same expressions, same order as optax (Python floats become f32 constants there too).
  # Each new value is selected against the old one where it is computed, and everything
  # after reads the selected value: on a taken step that IS the new value, and a skipped
  # step's param is discarded. So every old buffer is read only by the computation that
  # overwrites it, which XLA then does in place (no copy kept for a later select).
  mu = jnp.where(ok, np.float32(1 - hp.b1) * g + np.float32(hp.b1) * mu, mu)
  nu = jnp.where(ok, np.float32(1 - hp.b2) * (g * g) + np.float32(hp.b2) * nu, nu)
  u = (mu / bc1) / (jnp.sqrt(nu / bc2 + np.float32(hp.eps_root)) + np.float32(hp.eps))
  if hp.decay:
    u = u + wd * w
  u = step_size * u
  w = jnp.where(ok, w + u, w)
  return _reference.encode(w, rbits, fi), mu, nu, w


SCALARS_SIZE = 8  # step_scalars' length


def step_scalars(count: jax.Array, learning_rate, b1: float, b2: float,
                 weight_decay: float, apply: jax.Array | None = None) -> jax.Array:
  """f32[8] (bc1, bc2, -lr, wd, apply, 0, 0, 0) for the step taken at `count` (steps
  before this one); apply is 1.0, or 0.0 where the bool `apply` is False (the step is
  skipped). Padded to 8: a Pallas block on Triton has a power-of-two size."""
  count_inc = jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)  # safe_increment
  # optax computes ``1 - b ** count`` with a Python float b and an int32 count (f32 result)
  # and casts it to the moment dtype; spelled the same way for identical bits. Mixing a
  # Python float with an int32 array needs standard promotion (as optax itself does).
  with jax.numpy_dtype_promotion("standard"):
    bc1 = (1 - b1 ** count_inc).astype(jnp.float32)
    bc2 = (1 - b2 ** count_inc).astype(jnp.float32)
  if callable(learning_rate):
    # scale_by_schedule: ``jnp.array(-1 * lr(count), dtype=g.dtype)`` with count before +1.
    # optax schedules mix Python floats with the int32 count: standard promotion, as optax.
    with jax.numpy_dtype_promotion("standard"):
      step_size = jnp.array(-1 * learning_rate(count), dtype=jnp.float32)
  else:
    step_size = jnp.asarray(np.float32(-1 * learning_rate))
  taken = (jnp.ones((), jnp.float32) if apply is None
           else jnp.where(apply, jnp.float32(1), jnp.float32(0)))
  pad = jnp.zeros((), jnp.float32)
  return jnp.stack([bc1, bc2, step_size, jnp.asarray(np.float32(weight_decay)), taken,
                    pad, pad, pad])


def _leaf_reference(g, p, mu, nu, master, keys, scalars, hp, fi):
  """keys: `_pallas.kernel_keys` (k1, k2, index_offset, 0), as the kernel reads them."""
  n = g.size
  index = jax.lax.iota(jnp.uint32, n).reshape(g.shape) + keys[2]
  rbits = _hash.bits_at(index, keys[0], keys[1])
  w = master if master is not None else p.astype(jnp.float32)
  bits, mu, nu, w = adamw_sr_elementwise(
      g, w, mu, nu, rbits, tuple(scalars[k] for k in range(5)), hp, fi)
  return _reference.decode(bits, fi), mu, nu, (w if master is not None else None)


def _adamw_kernel(keys_ref, s_ref, g_ref, w_ref, mu_ref, nu_ref, *out_refs, n, block_size,
                  hp, fi, has_master):
  pbits_ref, mu_out, nu_out = out_refs[:3]
  position, ok = _pallas.block_indices(block_size, n)
  g = plgpu.load(g_ref, mask=ok, other=0)
  w = plgpu.load(w_ref, mask=ok, other=0)
  if not has_master:  # w_ref holds the param's bit pattern: widen it to f32 (exact)
    w = jax.lax.bitcast_convert_type(w, fi.dtype).astype(jnp.float32)
  mu = plgpu.load(mu_ref, mask=ok, other=0)
  nu = plgpu.load(nu_ref, mask=ok, other=0)
  rbits = _pallas.bits_from_keys(position, keys_ref)
  scalars = tuple(s_ref[k] for k in range(5))
  bits, mu, nu, w = adamw_sr_elementwise(g, w, mu, nu, rbits, scalars, hp, fi)
  plgpu.store(pbits_ref, bits, mask=ok)
  plgpu.store(mu_out, mu, mask=ok)
  plgpu.store(nu_out, nu, mask=ok)
  if has_master:
    plgpu.store(out_refs[3], w, mask=ok)


def _leaf_pallas(g, p, mu, nu, master, keys, scalars, hp, fi, *, block_size, interpret):
  n = g.size
  _pallas.check_size(n)
  has_master = master is not None
  bits_dt = _reference.bits_dtype(fi)
  # Without a master the param is read (as its bit pattern) and its buffer reused for the
  # new one; with a master only the master is read, the param is written.
  w = master if has_master else jax.lax.bitcast_convert_type(p, bits_dt)
  flat = [a.reshape(-1) for a in (g, w, mu, nu)]
  block = pl.BlockSpec((block_size,), lambda i: (i,))
  out_shape = [jax.ShapeDtypeStruct((n,), bits_dt), jax.ShapeDtypeStruct((n,), _F32),
               jax.ShapeDtypeStruct((n,), _F32)]
  # inputs: keys 0, scalars 1, g 2, w 3, mu 4, nu 5.
  aliases = {4: 1, 5: 2}
  if has_master:
    out_shape.append(jax.ShapeDtypeStruct((n,), _F32))
    aliases[3] = 3
  else:
    aliases[3] = 0
  kernel = functools.partial(_adamw_kernel, n=n, block_size=block_size, hp=hp, fi=fi,
                             has_master=has_master)
  outs = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(n, block_size),),
      in_specs=[pl.BlockSpec((_pallas.KEYS_SIZE,), lambda i: (0,)),
                pl.BlockSpec((SCALARS_SIZE,), lambda i: (0,)),
                block, block, block, block],
      out_specs=[block] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=_pallas.compiler_params(interpret),
      name=f"adamw_sr_{fi.name}",
  )(keys, scalars, *flat)
  shape = g.shape
  new_p = _reference.decode(outs[0], fi).reshape(shape)
  new_master = outs[3].reshape(shape) if has_master else None
  return new_p, outs[1].reshape(shape), outs[2].reshape(shape), new_master


@dataclasses.dataclass(frozen=True)
class FusedAdamW:
  """AdamW whose update, stochastic rounding into 16-bit params included, is one fused pass.

  Bit-identical to ``precision.optim.stochastic_updates(optax.adamw(...), seed)`` (no
  master) or ``precision.optim.master_weights(optax.adamw(...), rounding="stochastic",
  seed=seed)`` (``keep_master=True``) with the same hyperparameters and decay mask.

  Attributes:
    learning_rate: float, or a schedule ``count -> lr`` (count before the step, as optax).
    b1, b2, eps, eps_root: optax.adamw's.
    weight_decay: float (0.0 skips it, as optax does).
    mask: None (llm.c: decay leaves with ndim >= 2), a pytree of bools like the params,
      or a callable ``params -> pytree of bools``.
    seed: int seed of the stochastic rounding; leaf i uses ``leaf_seed(seed, i)``.
    keep_master: keep an f32 master copy in the state (16-bit params are then its
      stochastic rounding).
    impl: "auto" (the Pallas kernel in a program lowered for a GPU, the XLA reference in
      one lowered for any other platform: decided at lowering, so `jax.export` for CUDA on
      a CPU machine gets the kernel), "xla" or "pallas".
    block_size: elements per Pallas program.
    interpret: the Pallas kernel's mode, wherever it is used: None (compiled Triton when
      lowered for a GPU, interpret mode otherwise), False (compiled for every platform:
      lowering for the CPU then fails) or True (interpret mode everywhere). Must be None
      with ``impl="xla"``.
    axis_name: None (default) when `update` sees whole leaves. Set it when `update` runs
      inside shard_map/pmap on ZeRO shards laid out as `precision.parallel` does: each
      leaf flattened row-major, zero-padded to a multiple of the axis size n, device r
      holding the contiguous flat elements [r*k, (r+1)*k), k = the shard's size. Leaf i's
      rounding then uses ``index_offset = axis_index(axis_name) * k`` (uint32), so every
      element draws the bits it would draw in an unsharded update and the result does not
      depend on the device count. Flat shards have ndim 1, so pass an explicit `mask`
      (the default decay rule reads ndim).

  Params must be bf16 or f16; grads any float dtype (upcast to f32).

  Examples:
    >>> opt = FusedAdamW(learning_rate=3e-4, weight_decay=0.1, seed=0)
    >>> state = opt.init(params_bf16)
    >>> params_bf16, state = jax.jit(opt.update)(grads, state, params_bf16)
  """

  learning_rate: float | Callable[[jax.Array], jax.Array]
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  eps_root: float = 0.0
  weight_decay: float = 1e-4
  mask: Any = None
  seed: int = 0
  keep_master: bool = False
  impl: str = "auto"
  block_size: int = _pallas.BLOCK_SIZE
  axis_name: str | None = None
  interpret: bool | None = None

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"impl={self.impl!r}; accepted: {', '.join(IMPLS)}")
    _pallas.check_interpret(self.interpret)
    if self.impl == "xla" and self.interpret is not None:
      raise ValueError(f"interpret={self.interpret!r} applies to the Pallas kernel; with "
                       "impl='xla' pass interpret=None")
    if callable(self.weight_decay) or not isinstance(self.weight_decay, (int, float)):
      raise ValueError(f"weight_decay={self.weight_decay!r}; accepted: a Python float")
    bs = self.block_size
    if bs < 1 or bs & (bs - 1):
      raise ValueError(f"block_size={bs}; accepted: a power of two")

  def _leaf(self, g, p, mu, nu, m, keys, scalars, hp, fi):
    fn = _leaf_by_impl(self.impl, self.interpret, self.block_size, hp, fi, m is not None)
    return fn(g, p, mu, nu, keys, scalars, *(() if m is None else (m,)))

  def init(self, params: Any) -> FusedAdamWState:
    """f32 zero moments (and the f32 master when `keep_master`), count 0."""
    _check_params(params)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params) if self.keep_master else None
    return FusedAdamWState(jnp.zeros((), jnp.int32), zeros, zeros, master)

  def _decay_flags(self, params: Any, treedef) -> list[bool]:
    if self.weight_decay == 0.0:  # optax skips a constant zero decay altogether
      return [False] * treedef.num_leaves
    mask = self.mask
    if mask is None:
      mask = llmc_decay_mask(params)
    elif callable(mask):
      mask = mask(params)
    flags = treedef.flatten_up_to(mask)
    for f in flags:
      if not isinstance(f, (bool, np.bool_)):
        raise ValueError(f"weight-decay mask leaves must be Python bools; got {f!r}")
    return [bool(f) for f in flags]

  def update(self, grads: Any, state: FusedAdamWState, params: Any,
             apply: jax.Array | None = None) -> tuple[Any, FusedAdamWState]:
    """One step. Returns (new params in their own dtype, new state); jit-compatible.

    `apply`: a bool scalar; where False the step is skipped inside the same pass (the
    state comes back bit for bit, the returned params must be discarded), so a guard
    around it keeps the donated state in place. None: always taken."""
    _check_params(params)
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = treedef.flatten_up_to(grads)
    mu_leaves = treedef.flatten_up_to(state.mu)
    nu_leaves = treedef.flatten_up_to(state.nu)
    if self.keep_master != (state.master is not None):
      raise ValueError(f"keep_master={self.keep_master} but the state "
                       f"{'has' if state.master is not None else 'has no'} master")
    m_leaves = (treedef.flatten_up_to(state.master) if state.master is not None
                else [None] * len(leaves))
    for a in mu_leaves + nu_leaves + [m for m in m_leaves if m is not None]:
      if a.dtype != _F32:
        raise ValueError(f"FusedAdamW keeps moments and master in float32; got {a.dtype}")
    decay = self._decay_flags(params, treedef)
    scalars = step_scalars(state.count, self.learning_rate, self.b1, self.b2,
                           self.weight_decay, apply)
    step = state.count.astype(jnp.uint32)
    outs = []
    for i, (g, p, mu, nu, m) in enumerate(zip(g_leaves, leaves, mu_leaves, nu_leaves,
                                              m_leaves)):
      fi = formats.info(p.dtype)
      hp = Hyper(self.b1, self.b2, self.eps, self.eps_root, decay[i])
      keys = _pallas.kernel_keys(_hash.leaf_seed(self.seed, i), step,
                                 _hash.shard_offset(self.axis_name, p.size))
      if g.shape != p.shape:
        raise ValueError(f"grad shape {g.shape} != param shape {p.shape} (leaf {i})")
      outs.append(self._leaf(g, p, mu, nu, m, keys, scalars, hp, fi))
    new_p, new_mu, new_nu, new_m = (list(t) for t in zip(*outs)) if outs else ([],) * 4
    count_inc = jnp.where(state.count < jnp.iinfo(jnp.int32).max, state.count + 1,
                          state.count)
    if apply is not None:
      count_inc = jnp.where(apply, count_inc, state.count)
    master = treedef.unflatten(new_m) if self.keep_master else None
    return treedef.unflatten(new_p), FusedAdamWState(
        count_inc, treedef.unflatten(new_mu), treedef.unflatten(new_nu), master)


def _leaf_by_impl(impl: str, interpret: bool | None, block_size: int, hp: Hyper,
                  fi: formats.FormatInfo, has_master: bool):
  """The leaf update ``(g, p, mu, nu, keys, scalars, *master) -> (p, mu, nu, master)`` of
  `impl`; "auto" and ``interpret=None`` are resolved by the platform lowered for."""

  def pallas(interpret):
    def f(g, p, mu, nu, keys, scalars, *m):
      return _leaf_pallas(g, p, mu, nu, m[0] if has_master else None, keys, scalars, hp,
                          fi, block_size=block_size, interpret=interpret)
    return f

  def xla(g, p, mu, nu, keys, scalars, *m):
    return _leaf_reference(g, p, mu, nu, m[0] if has_master else None, keys, scalars, hp, fi)

  if impl == "xla":
    return xla
  if impl == "pallas" and interpret is not None:
    return pallas(interpret)
  gpu = pallas(False if interpret is None else interpret)
  other = xla if impl == "auto" else pallas(True)
  return lambda *args: _pallas.on_gpu_platform(gpu, other, *args)


def _check_params(params: Any) -> None:
  for p in jax.tree.leaves(params):
    if p.dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
      raise ValueError(f"FusedAdamW rounds into 16-bit params; got a {p.dtype} leaf "
                       "(accepted: bfloat16, float16)")
