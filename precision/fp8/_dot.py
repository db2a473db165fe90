"""The fp8 dot_general: quantize, GEMM on fp8 operands with f32 accumulation, dequantize.

Forward: lhs and rhs quantized (E4M3 by default) with their scales, one GEMM on the fp8
arrays with ``preferred_element_type=f32``, the f32 result multiplied by the scales and
rounded once to the output dtype. Backward (custom VJP): the incoming gradient quantized
(E5M2 by default, the "hybrid" format: more range, less precision, as gradients need),
both gradient GEMMs on fp8 operands with f32 accumulation.

Any dimension_numbers are handled by moving the operands to a canonical batched layout
(lhs [B, M, K], rhs [B, K, N]) with transposes and reshapes outside the custom VJP, so the
VJP itself only ever sees batched matmuls; JAX differentiates the layout changes.

Where the scale is constant along the contraction (current, delayed, per_channel) it
factors out of the sum: ``C = (qA @ qB) * sA * sB`` with one fp8 GEMM. Block scaling
(1x128 / 128x128) cannot factor out, so the contraction is split into 128-long tiles: one
fp8 GEMM per tile (a batched dot), each tile's f32 partial sum multiplied by its two scales
and summed in f32 -- DeepSeek-V3's "promotion to f32 every 128 elements".

Microscaled scalings (mxfp8, nvfp4: one scale per 32 or 16 elements along the
contraction) take their own route after the layout change, `precision.fp8._microdot`:
stateless (the state passes through unchanged), emulated on dequantised f32 operands.

On this machine (XLA CPU, jax 0.10.2) dot_general accepts float8 operands with an f32
preferred type: the jaxpr and HLO show the fp8 dot; XLA CPU converts the operands to f32
inside the op. That is a faithful emulation of an fp8 tensor core: every fp8 value is
exact in f32 and so is the product of two (at most 2 x 4 significand bits), so only the
f32 accumulation order can differ from a GPU. No speed follows from it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precision._policy import parse_dtype
from precision._recipe import FP8_SCALINGS, MICRO_SCALINGS, Fp8Config
from precision.fp8 import _scaling as sc
from precision.fp8._microdot import MicroSpec, micro_dot
from precision.fp8._sharding import explicit_spec as _spec

_F32 = jnp.float32
OPERANDS = ("lhs", "rhs", "grad")


class Fp8DotState(NamedTuple):
  """Scaling state of one fp8 GEMM: one OperandState per operand (f32 leaves only)."""

  lhs: sc.OperandState
  rhs: sc.OperandState
  grad: sc.OperandState


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
  """How each operand of one fp8 GEMM is scaled (static, hashable).

  rhs is taken to be the weight (as in nnx.Linear, LinearGeneral and Einsum, whose kernel
  is the second operand): with block scaling it gets `weight_block` tiles, lhs and the
  gradient get `activation_block` tiles.
  """

  lhs: sc.OperandRecipe
  rhs: sc.OperandRecipe
  grad: sc.OperandRecipe
  # The microscaled GEMM's spec (mxfp8 / nvfp4 scaling), else None.
  micro: MicroSpec | None = None

  @classmethod
  def from_config(cls, config: Fp8Config, scaling: str | Mapping[str, str] | None = None) -> Fp8Spec:
    """Spec from a Recipe's Fp8Config; `scaling` overrides the recipe per operand, e.g.
    ``{"rhs": "block"}`` or one name for all three ("lhs", "rhs", "grad")."""
    per_op = {op: config.scaling for op in OPERANDS}
    if isinstance(scaling, str):
      per_op = {op: scaling for op in OPERANDS}
    elif scaling is not None:
      unknown = set(scaling) - set(OPERANDS)
      if unknown:
        raise ValueError(f"fp8 scaling overrides for {sorted(unknown)}; accepted operands: "
                         f"{', '.join(OPERANDS)}")
      per_op.update(scaling)
    for op, name in per_op.items():
      if name not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {name!r} for {op}; accepted: {', '.join(FP8_SCALINGS)}")
    micro = {name for name in per_op.values() if name in MICRO_SCALINGS}
    if micro and set(per_op.values()) != {config.scaling}:
      raise ValueError(
          f"fp8 scaling {per_op} mixes microscaled and other scalings (or differs from "
          f"the config's {config.scaling!r}); accepted: one microscaled scaling for all "
          "three operands, set as Fp8Config.scaling")
    act, wgt = config.activation_block, config.weight_block
    if "block" in per_op.values() and not act[1] == wgt[0] == wgt[1]:
      raise ValueError(
          f"fp8 block scaling needs equal contraction tiles: activation_block={act} and "
          f"weight_block={wgt}; accepted: activation_block=(r, k), weight_block=(k, k)")

    def recipe(op: str, fmt: str, block: tuple[int, int]) -> sc.OperandRecipe:
      return sc.OperandRecipe(
          fmt=fmt, scaling=per_op[op], block=block, history_len=config.amax_history_len,
          amax_compute=config.amax_compute, margin=config.margin,
          power_of_two=config.power_of_two)

    return cls(lhs=recipe("lhs", config.forward_format, act),
               rhs=recipe("rhs", config.forward_format, (wgt[1], wgt[0])),
               grad=recipe("grad", config.backward_format, act),
               micro=MicroSpec.from_config(config) if micro else None)

  def init_state(self) -> Fp8DotState:
    """Zero histories, unit scales, zero counters."""
    return Fp8DotState(*(sc.init_operand_state(getattr(self, op)) for op in OPERANDS))


@dataclasses.dataclass(frozen=True)
class _Static:
  spec: Fp8Spec
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any


def _repeat_to(x: jax.Array, axis: int, reps: int, length: int) -> jax.Array:
  if x.shape[axis] == 1:
    return x
  return lax.slice_in_dim(jnp.repeat(x, reps, axis=axis), 0, length, axis=axis)


def scaled_matmul(x: sc.Quantized, y: sc.Quantized, out_spec: tuple | None = None
                  ) -> jax.Array:
  """fp8 [B, M, K] x fp8 [B, K, N] -> f32 [B, M, N], dequantized with both scale grids.

  Scales constant along K: one GEMM, then ``* (sx * sy)`` (the order Flax's fp8_ops uses).
  Otherwise one GEMM per contraction tile of length c, each f32 partial scaled by its
  tiles' scales and the tiles summed in f32. `out_spec`: the result's PartitionSpec
  entries under explicit sharding (needed when K is sharded: a weight gradient summed over
  a sharded batch).
  """
  shard = lambda *entries: (None if out_spec is None
                            else jax.sharding.PartitionSpec(*entries))
  qa, sa, (tm, tka) = x
  qb, sb, (tkb, tn) = y
  b, m, k = qa.shape
  n = qb.shape[2]
  tiled = [t for t, grid_k in ((tka, sa.shape[2]), (tkb, sb.shape[1])) if grid_k > 1]
  if not tiled:
    if b == 1:  # a plain 2-D GEMM (same kernel, hence same summation order, as Flax's)
      out = lax.dot_general(qa[0], qb[0], (((1,), (0,)), ((), ())),
                            preferred_element_type=_F32,
                            out_sharding=shard(*(out_spec or ())[1:]))[None]
    else:
      out = lax.dot_general(qa, qb, (((2,), (1,)), ((0,), (0,))), preferred_element_type=_F32,
                            out_sharding=shard(*(out_spec or ())))
    sx = _repeat_to(sa, 1, tm, m)  # [B'|1, M|1, 1]
    sy = _repeat_to(sb, 2, tn, n)  # [B'|1, 1, N|1]
    return out * (sx * sy)
  c = min(tiled)
  if max(tiled) % c:
    raise ValueError(f"fp8 contraction tiles {tiled} must divide one another")
  kb = -(-k // c)
  qa = jnp.pad(qa, ((0, 0), (0, 0), (0, kb * c - k))).reshape(b, m, kb, c)
  qb = jnp.pad(qb, ((0, 0), (0, kb * c - k), (0, 0))).reshape(b, kb, c, n)
  # One f32 partial sum per contraction tile: [B, Kb, M, N].
  part = lax.dot_general(qa, qb, (((3,), (2,)), ((0, 2), (0, 1))), preferred_element_type=_F32,
                         out_sharding=shard(*(out_spec[:1] + (None,) + out_spec[1:]))
                         if out_spec else None)
  sx = _repeat_to(_repeat_to(sa, 1, tm, m), 2, tka // c if sa.shape[2] > 1 else 1, kb)
  sy = _repeat_to(_repeat_to(sb, 2, tn, n), 1, tkb // c if sb.shape[1] > 1 else 1, kb)
  sx = jnp.transpose(sx, (0, 2, 1))[:, :, :, None]  # [B', Kb|1, M|1, 1]
  sy = sy[:, :, None, :]  # [B', Kb|1, 1, N|1]
  return jnp.sum(part * (sx * sy), axis=1)


def _quantize_current(x: jax.Array, recipe: sc.OperandRecipe, side: str):
  scale, tile = sc.current_scales(x, recipe, side)
  return sc.quantize(x, scale, tile, recipe)


def _forward(static: _Static, a, b, sa, sb):
  spec = static.spec
  xa, sat_a, unf_a = sc.quantize(a, sa, sc.operand_tile(spec.lhs, a.shape, "left"), spec.lhs)
  xb, sat_b, unf_b = sc.quantize(b, sb, sc.operand_tile(spec.rhs, b.shape, "right"), spec.rhs)
  out = scaled_matmul(xa, xb).astype(static.out_dtype)
  return out, (sat_a, unf_a, sat_b, unf_b), xa, xb


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_bmm(static: _Static, a, b, sa, sb, grad_state: sc.OperandState):
  out, stats, _, _ = _forward(static, a, b, sa, sb)
  return out, stats, grad_state


def _fp8_bmm_fwd(static: _Static, a, b, sa, sb, grad_state):
  out, stats, xa, xb = _forward(static, a, b, sa, sb)
  # Per-tensor operands are kept in fp8 for the backward GEMMs (as Transformer Engine
  # does: a per-tensor scale survives transposition). Row/tile-scaled operands must be
  # re-quantized along the backward GEMM's contraction, so their input is kept instead.
  ra = xa.q if static.spec.lhs.per_tensor else a
  rb = xb.q if static.spec.rhs.per_tensor else b
  # The gradient state passes through unchanged (the "token"): threaded into the next use
  # of this GEMM, its cotangent brings that use's new state back to this one (below).
  return (out, stats, grad_state), (ra, rb, sa, sb, grad_state)


def _transposed(res, scale, recipe: sc.OperandRecipe, side: str) -> sc.Quantized:
  """The operand, transposed to [B, C, R], in fp8 for a backward GEMM."""
  t = jnp.swapaxes(res, 1, 2)
  if recipe.per_tensor:  # `res` is already fp8 with a scalar scale
    return sc.Quantized(t, scale, sc.operand_tile(recipe, t.shape, side))
  return _quantize_current(t, recipe, side)[0]


def _fp8_bmm_bwd(static: _Static, res, cts):
  spec = static.spec
  ra, rb, sa, sb, gs = res
  g, later = cts[0], cts[2]
  rg = spec.grad
  g_amax = sc.tensor_amax(g)
  if rg.scaling == "delayed":
    sg = sc.scale_from_amax(sc.history_amax(gs.amax_history, rg), rg, gs.scale).reshape(1, 1, 1)
    history = sc.push_history(gs.amax_history, g_amax)
    qg, sat, unf = sc.quantize(g, sg, sc.operand_tile(rg, g.shape, "left"), rg)
  else:
    history = g_amax.reshape(1)
    qg, sat, unf = _quantize_current(g, rg, "left")
  # dA [B, M, K] = g [B, M, N] @ B^T [B, N, K]: contraction over N.
  da = scaled_matmul(qg, _transposed(rb, sb, spec.rhs, "right"))
  # dB [B, K, N] = (g^T [B, N, M] @ A [B, M, K])^T: contraction over M, written with g as
  # the left operand as Flax's fp8_ops does (same GEMM, same summation order). A per-tensor
  # scaled g is reused as is; a row/tile-scaled one is re-quantized along M (DeepSeek's
  # 128x1 gradient tiles), as is a row/tile-scaled A.
  if rg.per_tensor:
    gt = jnp.swapaxes(qg.q, 1, 2)
    qgt = sc.Quantized(gt, qg.scale, sc.operand_tile(rg, gt.shape, "left"))
  else:
    qgt = _quantize_current(jnp.swapaxes(g, 1, 2), rg, "left")[0]
  if spec.lhs.per_tensor:  # `ra` is already fp8 with a scalar scale
    qa = sc.Quantized(ra, sa, sc.operand_tile(spec.lhs, ra.shape, "right"))
  else:
    qa = _quantize_current(ra, spec.lhs, "right")[0]
  # Under explicit sharding, M (the batch rows) may be sharded: the weight gradient is
  # laid out as the weight is.
  b_spec = _spec(rb)
  out_spec = None if _spec(qgt.q) is None else (
      (None, None, None) if b_spec is None else (b_spec[0], b_spec[2], b_spec[1]))
  db = jnp.swapaxes(scaled_matmul(qgt, qa, out_spec), 1, 2)
  own = sc.OperandState(history, sc.record_scale(qg.scale), sat, unf)
  return (da.astype(static.lhs_dtype), db.astype(static.rhs_dtype),
          jnp.zeros_like(sa), jnp.zeros_like(sb), sc.combine_grad_states(own, later))


_fp8_bmm.defvjp(_fp8_bmm_fwd, _fp8_bmm_bwd)


def _forward_scale(x: jax.Array, recipe: sc.OperandRecipe, st: sc.OperandState, side: str):
  """Scale grid for a forward operand and its new amax history (no gradient flows here)."""
  x = lax.stop_gradient(x)
  amax = sc.tensor_amax(x)
  if recipe.scaling == "delayed":
    scale = sc.scale_from_amax(sc.history_amax(st.amax_history, recipe), recipe, st.scale)
    return scale.reshape(1, 1, 1), sc.push_history(st.amax_history, amax)
  scale, _ = sc.current_scales(x, recipe, side)
  return scale, amax.reshape(1)


def _axes(dims, ndim: int, what: str) -> tuple[int, ...]:
  out = tuple(int(d) % ndim if -ndim <= int(d) < ndim else -1 for d in dims)
  if -1 in out:
    raise ValueError(f"fp8 dot_general: {what} dims {tuple(dims)} out of range for rank {ndim}")
  return out


def _merge(x, groups: tuple[int, ...], shape: tuple[int, ...]):
  """x reshaped to `shape`, merging consecutive groups of `groups` axes. Under explicit
  sharding a merged axis keeps the sharding of its leading axis (a major-axis sharding
  survives the merge); a sharded trailing axis is replicated first."""
  spec = _spec(x)
  if spec is None:
    return x.reshape(shape)
  out, start, keep = [], 0, list(spec)
  for size in groups:
    members = list(range(start, start + size))
    if any(keep[i] is not None for i in members[1:]):
      for i in members[1:]:
        keep[i] = None
      x = jax.sharding.reshard(x, jax.sharding.PartitionSpec(*keep))
    out.append(keep[members[0]] if members else None)
    start += size
  return jax.lax.reshape(x, shape, out_sharding=jax.sharding.PartitionSpec(*out))


def _split(x, shape, groups: tuple[int, ...]):
  """The inverse of `_merge` for the (batch, rows, cols) result: each axis split back into
  its group, the leading one keeping the axis's sharding."""
  spec = _spec(x)
  if spec is None:
    return x.reshape(shape)
  out = []
  for entry, size in zip(spec, groups):
    out += ([entry] + [None] * (size - 1)) if size else []
  return jax.lax.reshape(x, tuple(shape), out_sharding=jax.sharding.PartitionSpec(*out))


def fp8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, state: Fp8DotState,
                    spec: Fp8Spec, *, out_dtype: Any = None) -> tuple[jax.Array, Fp8DotState]:
  """`lax.dot_general` through fp8, functional form.

  Args:
    lhs, rhs: float operands (any float dtype); rhs is the weight for block tiling.
    dimension_numbers: as `lax.dot_general`.
    state: this GEMM's Fp8DotState (``spec.init_state()`` at first).
    spec: the per-operand recipes (``Fp8Spec.from_config(config)``).
    out_dtype: dtype of the result (default lhs.dtype); the GEMM accumulates in f32.

  Returns:
    (out, new_state). new_state carries the updated lhs/rhs histories, scales and counters;
    its `grad` field has the values of `state.grad`, unchanged: the gradient operand's new
    state is the *cotangent* of `state.grad` (it only exists in the backward pass).
    Differentiate with respect to `state.grad` and store that "gradient" as the new grad
    state.

  A GEMM used several times in one differentiated function (tied weights, a recurrence,
  micro-batches): pass each call's `new_state` to the next call, as for the forward state
  (an NNX module does it by itself). `new_state.grad` is then a token whose cotangent
  carries the later uses' gradient state back to the earlier ones, and the state that
  comes out is that of one use of the concatenated gradient operand: amax history and
  scale combined by max, saturation and underflow counts summed. Two calls given the same
  `state.grad` would instead have their states added by autodiff.

  Examples:
    >>> import jax, jax.numpy as jnp, precision as mp
    >>> spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling="current", power_of_two=True))
    >>> x, w = jnp.ones((4, 8)), jnp.full((8, 3), 0.5)
    >>> y, st = mp.fp8.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), spec.init_state(), spec)
    >>> y[0, 0].item(), st.rhs.amax_history[0].item()
    (4.0, 0.5)
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lc, lb = _axes(lc, lhs.ndim, "lhs contracting"), _axes(lb, lhs.ndim, "lhs batch")
  rc, rb = _axes(rc, rhs.ndim, "rhs contracting"), _axes(rb, rhs.ndim, "rhs batch")
  lf = tuple(i for i in range(lhs.ndim) if i not in lc + lb)
  rf = tuple(i for i in range(rhs.ndim) if i not in rc + rb)
  size = lambda x, axes: math.prod(x.shape[i] for i in axes)
  bsz, m, k, n = size(lhs, lb), size(lhs, lf), size(lhs, lc), size(rhs, rf)
  if size(rhs, rc) != k or size(rhs, rb) != bsz:
    raise ValueError(f"fp8 dot_general: shapes {lhs.shape} x {rhs.shape} do not match "
                     f"dimension_numbers {dimension_numbers}")
  a = _merge(jnp.transpose(lhs, lb + lf + lc), (len(lb), len(lf), len(lc)), (bsz, m, k))
  b = _merge(jnp.transpose(rhs, rb + rc + rf), (len(rb), len(rc), len(rf)), (bsz, k, n))
  out_dtype = lhs.dtype if out_dtype is None else parse_dtype(out_dtype)
  out_shape = ([lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lf]
               + [rhs.shape[i] for i in rf])
  if spec.micro is not None:  # microscaled: stateless, the state passes through
    out = micro_dot(a, b, spec.micro, out_dtype)
    return _split(out, out_shape, (len(lb), len(lf), len(rf))), state
  sa, hist_a = _forward_scale(a, spec.lhs, state.lhs, "left")
  sb, hist_b = _forward_scale(b, spec.rhs, state.rhs, "right")
  static = _Static(spec, np.dtype(out_dtype), np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  out, (sat_a, unf_a, sat_b, unf_b), grad_token = _fp8_bmm(static, a, b, sa, sb, state.grad)
  new_state = Fp8DotState(
      lhs=sc.OperandState(hist_a, sc.record_scale(sa), sat_a, unf_a),
      rhs=sc.OperandState(hist_b, sc.record_scale(sb), sat_b, unf_b),
      grad=grad_token)
  return _split(out, out_shape, (len(lb), len(lf), len(rf))), new_state
