"""fp8 grouped GEMMs: `lax.ragged_dot`'s expert GEMMs with one scale per expert group.

A mixture-of-experts layer in sorted dispatch multiplies the rows of each expert group
(lhs [M, K], rows sorted by expert; `group_sizes` [G] rows per group) by that expert's
weight (rhs [G, K, N]). Every quantity is scaled per group, from this step's data:

  forward  out[r] = (Q(x / sx[g]) @ Q(w[g] / sw[g]))[r] * sx[g] * sw[g]     (r in group g)
  dgrad    dx[r]  = (Q_g(ct / sg[g]) @ Q(w[g] / sw[g])^T)[r] * sg[g] * sw[g]
  wgrad    dw[g]  = (Q(x / sx[g])^T @ Q_g(ct / sg[g]))[rows of g] * sx[g] * sg[g]

with sx[g], sg[g] the scales of group g's rows of lhs and of the cotangent (amax over
those rows only) and sw[g] expert g's weight scale. Rows past the last group (the padding
of a capacity buffer: ``sum(group_sizes) < M``) belong to no group: they feed no amax
and their results are zero, as ragged_dot's. One expert's outlier cannot coarsen another
expert's scale, and an expert that received no token keeps the unit scale.

The scales are current (this step's amaxes) for every per-tensor scaling, delayed
included: which rows an expert receives changes every step with the routing, so a history
per expert would scale this step's tokens by other tokens' amaxes (and an expert idle for
a while would keep a stale one). Grouped GEMMs therefore hold no scaling state.

Microscaled recipes (mxfp8, nvfp4) quantise in blocks along each GEMM's contraction as
`precision.fp8._microdot` does, on dequantised f32 operands: along K (forward) and N
(dgrad) a block never spans two groups; along M (wgrad) the blocks are counted from each
group's first row, so a block never spans two groups either (a group's last block may be
short), and padding rows are zeroed before quantisation.

The GEMMs run as `lax.ragged_dot_general` on fp8 operands with f32 accumulation (the
emulated microscaled ones on f32 operands), so XLA expands them as it expands every
grouped GEMM; the dequantisation multiplies the f32 result by the per-row scales.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from precision.fp8 import _microscale as ms
from precision.fp8 import _scaling as sc

_F32 = jnp.float32
# lax.ragged_dot's dimension numbers and those of its weight gradient (the ragged
# contraction over M: one [K, N] result per group).
BASIC = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
_WGRAD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def is_basic(dims) -> bool:
  """Whether ragged_dot_general dimension numbers are lax.ragged_dot's (lhs [M, K]
  ragged along M, rhs [G, K, N]): the grouped GEMMs run in fp8."""
  return (tuple(map(tuple, dims.dot_dimension_numbers[0])) == ((1,), (1,))
          and tuple(map(tuple, dims.dot_dimension_numbers[1])) == ((), ())
          and tuple(dims.lhs_ragged_dimensions) == (0,)
          and tuple(dims.rhs_group_dimensions) == (0,))


def group_ids(group_sizes: jax.Array, m: int) -> jax.Array:
  """The group of each of `m` rows, int32 [m]; G (one past the last group) for rows past
  sum(group_sizes)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(
      jnp.int32)


def group_amax(x: jax.Array, gid: jax.Array, n_groups: int) -> jax.Array:
  """max |x| over each group's rows of x [M, C], f32 [G] (0 for an empty group; rows of
  no group are left out)."""
  rows = jnp.max(jnp.abs(x.astype(_F32)), axis=1)
  amax = jax.ops.segment_max(rows, gid, num_segments=n_groups + 1)[:n_groups]
  return jnp.maximum(amax, 0.0)   # segment_max of an empty segment is -inf


def _per_row(per_group: jax.Array, gid: jax.Array) -> jax.Array:
  """A per-group value [G] for each row [M] (1 for rows of no group)."""
  return jnp.concatenate([per_group, jnp.ones((1,), per_group.dtype)])[gid]


@dataclasses.dataclass(frozen=True)
class _Static:
  lhs: sc.OperandRecipe
  rhs: sc.OperandRecipe
  grad: sc.OperandRecipe
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any


def _scales(amax: jax.Array, recipe: sc.OperandRecipe) -> jax.Array:
  return sc.scale_from_amax(amax, recipe, jnp.ones((), _F32))


def _quantize(x: jax.Array, scale: jax.Array, recipe: sc.OperandRecipe) -> jax.Array:
  """x / scale (broadcast) in the recipe's fp8 format: f32 division, finite values
  clipped to the format's max, non-finite ones kept (as `precision.fp8._scaling`)."""
  y = x.astype(_F32) / scale
  fmax = jnp.asarray(recipe.fmax, _F32)
  return jnp.where(jnp.isfinite(y), jnp.clip(y, -fmax, fmax), y).astype(recipe.dtype)


def _mm(a, b, group_sizes, dims):
  return lax.ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=_F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(static: _Static, x, w, group_sizes):
  return _grouped_fwd(static, x, w, group_sizes)[0]


def _grouped_fwd(static: _Static, x, w, group_sizes):
  n_groups = w.shape[0]
  gid = group_ids(group_sizes, x.shape[0])
  sx = _scales(group_amax(x, gid, n_groups), static.lhs)                  # [G]
  sw = _scales(jnp.max(jnp.abs(w.astype(_F32)), axis=(1, 2)), static.rhs)  # [G]
  qx = _quantize(x, _per_row(sx, gid)[:, None], static.lhs)
  qw = _quantize(w, sw[:, None, None], static.rhs)
  acc = _mm(qx, qw, group_sizes, BASIC)
  out = acc * (_per_row(sx, gid) * _per_row(sw, gid))[:, None]
  return out.astype(static.out_dtype), (qx, qw, sx, sw, group_sizes)


def _grouped_bwd(static: _Static, res, ct):
  qx, qw, sx, sw, group_sizes = res
  n_groups = qw.shape[0]
  gid = group_ids(group_sizes, qx.shape[0])
  sg = _scales(group_amax(ct, gid, n_groups), static.grad)
  qg = _quantize(ct, _per_row(sg, gid)[:, None], static.grad)
  # dgrad: the ragged dlhs, g [M, N] against each group's w[g]^T [N, K].
  dx = _mm(qg, jnp.swapaxes(qw, 1, 2), group_sizes, BASIC)
  dx = dx * (_per_row(sg, gid) * _per_row(sw, gid))[:, None]
  # wgrad: the per-group drhs, x[rows of g]^T @ g[rows of g] -> [G, K, N].
  dw = _mm(qx, qg, group_sizes, _WGRAD) * (sx * sg)[:, None, None]
  return dx.astype(static.lhs_dtype), dw.astype(static.rhs_dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# ----------------------------------------------------------------------------- microscaled


def _block_ids(gid: jax.Array, group_sizes: jax.Array, block: int, m: int) -> jax.Array:
  """For rows [M]: the index of their block along M, blocks of `block` rows counted from
  each group's first row; rows of no group get the last index (dropped)."""
  n_groups = group_sizes.shape[0]
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum(group_sizes.astype(jnp.int32))[:-1]])
  rows = jnp.arange(m, dtype=jnp.int32)
  local = rows - jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])[gid]
  per_group = -(-m // block)           # blocks a group of up to M rows can have
  ids = gid * per_group + local // block
  return jnp.where(gid < n_groups, ids, n_groups * per_group)


def _micro_along_rows(spec, x: jax.Array, gid, group_sizes, fmt: str) -> jax.Array:
  """x [M, C] quantised to MXFP8 and read back in f32, in blocks along M that never span
  two groups (`_block_ids`): each block's E8M0 scale from its amax, per column."""
  m = x.shape[0]
  n_groups = group_sizes.shape[0]
  ids = _block_ids(gid, group_sizes, spec.block, m)
  n_blocks = n_groups * (-(-m // spec.block)) + 1
  a = jnp.abs(x.astype(_F32))
  a = jnp.where(jnp.isfinite(a), a, 0.0)
  amax = jnp.maximum(jax.ops.segment_max(a, ids, num_segments=n_blocks), 0.0)  # [nb, C]
  s = ms.e8m0_exponent(amax, fmt, spec.scale_rounding)[ids]                    # [M, C]
  y = ms.ldexp(x.astype(_F32), -s)
  fmax = jnp.asarray(float(ml_dtypes.finfo(ms.MX_ELEMENTS[fmt]).max), _F32)
  q = jnp.where(jnp.isfinite(y), jnp.clip(y, -fmax, fmax), y).astype(ms.MX_ELEMENTS[fmt])
  return ms.ldexp(q.astype(_F32), s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _micro_grouped(static, x, w, group_sizes):
  return _micro_fwd(static, x, w, group_sizes)[0]


def _micro_fwd(static, x, w, group_sizes):
  spec = static.spec
  xq = spec.fake_quantize(x, 1, spec.forward_format)               # blocks along K
  wq = spec.fake_quantize(w, 1, spec.forward_format)               # per expert, along K
  out = _mm(xq, wq, group_sizes, BASIC)
  return out.astype(static.out_dtype), (x, w, group_sizes)


def _micro_bwd(static, res, ct):
  spec = static.spec
  x, w, group_sizes = res
  gid = group_ids(group_sizes, x.shape[0])
  in_group = (gid < group_sizes.shape[0])[:, None]
  ct = jnp.where(in_group, ct.astype(_F32), 0.0)
  gq = spec.fake_quantize(ct, 1, spec.backward_format)             # blocks along N
  wq = spec.fake_quantize(w, 2, spec.forward_format)               # per expert, along N
  dx = _mm(gq, jnp.swapaxes(wq, 1, 2), group_sizes, BASIC)
  xz = jnp.where(in_group, x.astype(_F32), 0.0)
  xm = _micro_along_rows(spec, xz, gid, group_sizes, spec.forward_format)
  gm = _micro_along_rows(spec, ct, gid, group_sizes, spec.backward_format)
  dw = _mm(xm, gm, group_sizes, _WGRAD)
  return dx.astype(static.lhs_dtype), dw.astype(static.rhs_dtype), None


_micro_grouped.defvjp(_micro_fwd, _micro_bwd)


@dataclasses.dataclass(frozen=True)
class _MicroStatic:
  spec: Any
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any


def fp8_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, spec, *,
                   out_dtype: Any = None) -> jax.Array:
  """`lax.ragged_dot(lhs, rhs, group_sizes)` through fp8 with per-expert scaling.

  Args:
    lhs: [M, K] float rows sorted by group; rows past sum(group_sizes) are padding.
    rhs: [G, K, N] float, one weight per expert.
    group_sizes: int [G].
    spec: a `precision.fp8.Fp8Spec` (``Fp8Spec.from_config(recipe.fp8)``): its formats
      (E4M3 forward, E5M2 gradient); per-tensor scalings scale per expert group from
      this step's amaxes, microscaled ones (`spec.micro`, mxfp8 only) in blocks.
    out_dtype: the result's dtype (default lhs.dtype); accumulation is f32.
  Returns:
    [M, N] in `out_dtype`. Differentiable in lhs and rhs (E5M2 cotangent, f32
    accumulation, gradients in the operands' dtypes).
  Raises:
    ValueError: nvfp4 (its tensor scale and 2-D weight tiles are not defined per group
      here) or shapes that are not lax.ragged_dot's.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (rhs.shape[0],) or (
      lhs.shape[1] != rhs.shape[1]):
    raise ValueError(f"fp8_ragged_dot: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                     f"{group_sizes.shape}; accepted: [M, K], [G, K, N], [G]")
  out_dtype = np.dtype(lhs.dtype if out_dtype is None else out_dtype)
  dts = (out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype))
  if spec.micro is not None:
    if spec.micro.scaling != "mxfp8":
      raise ValueError(f"fp8_ragged_dot: {spec.micro.scaling} grouped GEMMs are not "
                       "supported; accepted: per-tensor fp8 scalings or mxfp8")
    for what, size in (("K (forward contraction)", lhs.shape[1]),
                       ("N (dgrad contraction)", rhs.shape[2])):
      if size % spec.micro.block:
        raise ValueError(f"fp8_ragged_dot: micro_block={spec.micro.block} does not divide "
                         f"{what} = {size}; accepted: a block dividing K and N (along M "
                         "the blocks are counted per group)")
    with jax.named_scope("mxfp8_gemm"):
      return _micro_grouped(_MicroStatic(spec.micro, *dts), lhs, rhs, group_sizes)
  return _grouped(_Static(spec.lhs, spec.rhs, spec.grad, *dts), lhs, rhs, group_sizes)
