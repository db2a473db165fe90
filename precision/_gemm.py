"""Policy GEMMs: operands in the compute dtype and f32 accumulation, forward AND backward.

Written by hand, `nnx.Linear(dtype=bf16, preferred_element_type=f32)` runs its forward GEMM
as bf16 x bf16 -> f32, but JAX's transpose rule then multiplies the f32 output cotangent by
a bf16 operand, so two of the three GEMMs of every layer run as f32 x bf16 (jax issue
34330) and XLA executes them in f32. The custom VJP here rounds the incoming cotangent to
the compute dtype once, so both backward GEMMs also take compute-dtype operands and
accumulate in f32 (`preferred_element_type=float32`), as cuBLAS/cuDNN mixed-precision
training does ("bf16 in, f32 accumulate").

Gradients leave the backward GEMMs straight from the f32 accumulator in the dtype of the
primal operand: an f32 kernel gets an f32 gradient that was never rounded to bf16, a bf16
activation gets a bf16 cotangent.

With an f32 compute dtype none of this is needed: the plain `lax` ops run, so an fp32
policy is bit-identical to the model without the library.

The backward GEMMs reuse JAX's own transpose rules for dot_general and
conv_general_dilated (private functions, reached through precision._compat), called with a
compute-dtype cotangent and `preferred_element_type=float32`; that keeps layouts, dimension numbers and padding
exactly those of JAX's automatic transpose.

The backward GEMMs may take another compute dtype than the forward one (`backward_dtype`:
a direction-specific autocast override). The residuals are then the operands themselves
(rounded to the backward dtype when that is narrower than theirs), never the forward's
compute-dtype copies: an f32 backward of a bf16 forward multiplies the f32 weights, not
their bf16 roundings. A backward in f32 (or wider) runs as JAX's own transpose would:
operands, cotangent and accumulation in that dtype, at the GEMM's `precision`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precision import _compat
from precision._dtypes import below_f32 as _below_f32

_F32 = np.dtype(np.float32)

# The platform branches and transposes traced per GEMM are library code to JAX (see
# _compat.mark_library_code): no cache-miss explanation per GEMM on a retrace.
_compat.mark_library_code(__file__)


class _Undefined(NamedTuple):
  """Stands in for the linear (undefined) operand of JAX's transpose rules: they read
  only `.aval` (shape, dtype of the cotangent to return, sharding, weak_type)."""
  aval: Any


def wider_float(*dtypes) -> np.dtype:
  """A float dtype holding every value of each of `dtypes` exactly: the widest, or f32 when
  two formats of one width differ (bf16 and f16, E4M3 and E5M2)."""
  ds = {np.dtype(d) for d in dtypes}
  if len(ds) == 1:
    return ds.pop()
  widest = max(ds, key=lambda d: d.itemsize)
  if sum(d.itemsize == widest.itemsize for d in ds) > 1:  # e.g. bf16 and f16
    return np.dtype(np.float32) if widest.itemsize < 4 else np.dtype(np.float64)
  return widest


def _target_aval(like: jax.Array, dtype: np.dtype):
  return jax.typeof(like).update(dtype=dtype, weak_type=False)


# ----------------------------------------------------------------------------- CPU


def _on_platform(fn, a, b, dimension_numbers=None):
  """`fn(a, b)` (an f32-accumulating GEMM of compute-dtype operands) on GPU/TPU; on the
  CPU backend, `fn` of the operands upcast to f32 unless the dot is one XLA:CPU runs
  natively (`_cpu_runs_natively`).

  XLA:CPU has no kernel for every operand layout of a bf16 x bf16 -> f32 dot: its YNNPACK
  fusions take the row-major layouts (batch dims first, the lhs contracted over its
  trailing dims), and the others fall back to a thunk that fails at run time with
  "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32" (e.g. the weight
  gradients, contracted over the token dim). Those are upcast to f32 first: a product of
  two bf16 (8-bit significand) or f16 (11-bit) values is exact in f32 (24 bits), so the
  upcast GEMM computes the same products with the same f32 accumulation (the native bf16
  GEMM accumulates in f32 too; only the summation order may differ). `precision.audit`
  and the CUDA lowering report the accelerator branch.
  """
  if dimension_numbers is not None and _cpu_runs_natively(a, b, dimension_numbers):
    return fn(a, b)
  cpu = lambda x, y: fn(x.astype(_F32), y.astype(_F32))
  return lax.platform_dependent(a, b, cpu=cpu, default=fn)


def _cpu_runs_natively(a, b, dimension_numbers) -> bool:
  """True for a bf16 x bf16 dot_general in the row-major form XLA:CPU's YNNPACK fusions
  run: batch dims leading and in order on both sides, the lhs contracted over its trailing
  dims, the rhs over the dims right after its batch dims or over its trailing dims (the
  forward GEMMs of x @ w, Flax's Linear/Einsum and attention written with einsum)."""
  bf16 = np.dtype(jnp.bfloat16)
  if np.dtype(a.dtype) != bf16 or np.dtype(b.dtype) != bf16:
    return False
  (lc, rc), (lb, rb) = dimension_numbers
  nb, nc = len(lb), len(lc)
  lead = tuple(range(nb))
  if tuple(lb) != lead or tuple(rb) != lead or nc == 0:
    return False
  if tuple(lc) != tuple(range(a.ndim - nc, a.ndim)):
    return False
  return tuple(rc) in (tuple(range(nb, nb + nc)), tuple(range(b.ndim - nc, b.ndim)))


def _operand_grads(t_lhs, t_rhs, gc, lc, rc, lhs_dtype, rhs_dtype, kw):
  """Both operand cotangents of a GEMM-like op from JAX's transpose rules `t_lhs`/`t_rhs`
  (`dot_general` or `conv_general_dilated`): compute-dtype cotangent `gc` against the
  compute-dtype residual operands `lc`, `rc`, accumulation `kw["preferred_element_type"]`
  (f32 below f32), returned in the operands' own dtypes."""
  ul, ur = _Undefined(_target_aval(lc, lhs_dtype)), _Undefined(_target_aval(rc, rhs_dtype))
  narrow = _below_f32(np.dtype(gc.dtype))
  run = _on_platform if narrow else (lambda fn, a, b: fn(a, b))
  dl = run(lambda g_, r_: t_lhs(g_, ul, r_, **kw), gc, rc)
  dr = run(lambda g_, l_: t_rhs(g_, l_, ur, **kw), gc, lc)
  return dl, dr


def _accumulator(compute: np.dtype) -> np.dtype:
  """f32 accumulation below f32; an f32 (or wider) GEMM accumulates in its own dtype."""
  return _F32 if _below_f32(compute) else compute


def _residuals(operands, compute: np.dtype, backward: np.dtype, cast):
  """What the forward keeps for the backward GEMMs: the compute-dtype operands `cast`
  (the forward's own) when both directions compute in one dtype; else each operand
  rounded to `backward`, or as it is when narrower than `backward` (the backward's cast
  of it is exact then, and the narrower copy is the smaller one)."""
  if backward == compute:
    return cast
  return tuple(x if np.dtype(x.dtype).itemsize < backward.itemsize else x.astype(backward)
               for x in operands)


def _result(acc, out_dtype: np.dtype, backward: np.dtype):
  """The GEMM's result: the accumulator rounded to `out_dtype`. A backward computing
  wider than `out_dtype` gets the result in the wider dtype (the same values, rounded to
  `out_dtype`): JAX gives a value's cotangent the value's dtype, so an `out_dtype` result
  would round the cotangent to `out_dtype` before the backward GEMMs see it (an f32
  backward of an f16 GEMM would multiply an f16 cotangent). The ops that consume it then
  see a wider operand (mixed with narrow values they promote, as autocast's promoting ops
  do)."""
  y = acc.astype(out_dtype)
  wide = wider_float(out_dtype, backward)
  return y if wide == out_dtype else y.astype(wide)


# ----------------------------------------------------------------------------- dot_general


class _Backward(NamedTuple):
  """The backward GEMMs' compute dtype and precision (hashable: a nondiff argument)."""
  compute: np.dtype
  precision: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8, 9))
def _dot(x, w, dimension_numbers, precision, compute, x_dtype, w_dtype, out_dtype,
         out_sharding, bwd):
  return _dot_fwd(x, w, dimension_numbers, precision, compute, x_dtype, w_dtype, out_dtype,
                  out_sharding, bwd)[0]


def _dot_fwd(x, w, dimension_numbers, precision, compute, x_dtype, w_dtype, out_dtype,
             out_sharding, bwd):
  xc, wc = x.astype(compute), w.astype(compute)
  mm = lambda a, b: lax.dot_general(a, b, dimension_numbers, precision=precision,
                                    preferred_element_type=_accumulator(compute),
                                    out_sharding=out_sharding)
  out = _on_platform(mm, xc, wc, dimension_numbers) if _below_f32(compute) else mm(xc, wc)
  # Residuals in the compute dtype when the backward shares it: half the bytes of f32.
  return (_result(out, out_dtype, bwd.compute),
          _residuals((x, w), compute, bwd.compute, (xc, wc)))


def _dot_bwd(dimension_numbers, precision, compute, x_dtype, w_dtype, out_dtype,
             out_sharding, bwd, res, g):
  del precision, compute, out_dtype, out_sharding  # shardings: from the operands
  xc, wc = (r.astype(bwd.compute) for r in res)
  gc = g.astype(bwd.compute)  # round the cotangent once: both GEMMs are compute x compute
  kw = dict(dimension_numbers=dimension_numbers, precision=bwd.precision,
            preferred_element_type=_accumulator(bwd.compute), out_sharding=None)
  return _operand_grads(_compat.dot_general_transpose_lhs,
                        _compat.dot_general_transpose_rhs, gc, xc, wc, x_dtype, w_dtype, kw)


_dot.defvjp(_dot_fwd, _dot_bwd)


def _canonical_dims(dimension_numbers):
  (lc, rc), (lb, rb) = dimension_numbers
  return ((tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
          (tuple(int(i) for i in lb), tuple(int(i) for i in rb)))


def _check_compute(compute: np.dtype) -> None:
  if compute.itemsize == 1 and jnp.issubdtype(compute, jnp.floating):
    raise ValueError(
        f"compute dtype {compute.name} is an fp8 format: an fp8 GEMM needs scaling (an "
        "unscaled cast turns 500 into NaN in E4M3); use an fp8 recipe (precision.get_recipe("
        "'fp8_hybrid'), precision.Fp8Config) instead of an fp8 compute dtype")


_SAME = object()   # backward_precision default: the forward's `precision`


def _backward(compute: np.dtype, backward_dtype: Any, precision, backward_precision
              ) -> _Backward:
  bwd = compute if backward_dtype is None else np.dtype(backward_dtype)
  _check_compute(bwd)
  return _Backward(bwd, precision if backward_precision is _SAME else backward_precision)


def policy_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, compute_dtype: Any,
                       precision=None, out_sharding=None, out_dtype: Any = None, *,
                       backward_dtype: Any = None, backward_precision: Any = _SAME
                       ) -> jax.Array:
  """`lax.dot_general` with both operands in `compute_dtype` and f32 accumulation.

  Forward: cast lhs/rhs to `compute_dtype`, `dot_general(..., preferred_element_type=f32)`,
  round the result once to `out_dtype` (default `compute_dtype`). Backward (compute dtype
  below f32): the cotangent is rounded to `compute_dtype` and both gradient GEMMs are
  compute x compute -> f32; each gradient is returned in its operand's own dtype, straight
  from the f32 accumulator (an f32 kernel's gradient is never rounded to bf16).

  Args:
    lhs, rhs: floating arrays of any float dtype.
    dimension_numbers: as `lax.dot_general`.
    compute_dtype: operand dtype of all three GEMMs (bf16, f16, f32, ...); not fp8 (fp8
      needs scaling: precision.fp8).
    out_sharding: as `lax.dot_general` (explicit sharding).
    out_dtype: the result dtype (e.g. f32 to keep the accumulator); default compute_dtype.
    backward_dtype: operand dtype of the two gradient GEMMs (default compute_dtype); f32
      there runs them as JAX's transpose of an f32 GEMM (f32 cotangent, f32 operands:
      the original ones, not their compute-dtype roundings). An f32 `compute_dtype` with
      a narrower `backward_dtype` is an f32 forward with narrow gradient GEMMs.
    backward_precision: `precision` of the gradient GEMMs (default: `precision`).
  Returns:
    An array of `out_dtype`; with a `backward_dtype` wider than `out_dtype`, an array of
    the wider dtype holding the result rounded to `out_dtype` (so that its cotangent
    reaches the backward GEMMs unrounded).
  """
  compute = np.dtype(compute_dtype)
  _check_compute(compute)
  out = compute if out_dtype is None else np.dtype(out_dtype)
  dims = _canonical_dims(dimension_numbers)
  bwd = _backward(compute, backward_dtype, precision, backward_precision)
  if not _below_f32(compute) and not _below_f32(bwd.compute) and (
      bwd.compute == compute and bwd.precision == precision):
    # f32 (or wider) compute: JAX's own rules already run every GEMM in `compute`.
    res = lax.dot_general(lhs.astype(compute), rhs.astype(compute), dims, precision=precision,
                          preferred_element_type=compute, out_sharding=out_sharding)
    return res.astype(out)
  return _dot(lhs, rhs, dims, precision, compute, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
              out, out_sharding, bwd)


# ----------------------------------------------------------------------------- grouped GEMMs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _ragged(x, w, group_sizes, dims, precision, compute, x_dtype, w_dtype, out_dtype, bwd):
  return _ragged_fwd(x, w, group_sizes, dims, precision, compute, x_dtype, w_dtype,
                     out_dtype, bwd)[0]


def _ragged_fwd(x, w, group_sizes, dims, precision, compute, x_dtype, w_dtype, out_dtype,
                bwd):
  xc, wc = x.astype(compute), w.astype(compute)
  mm = lambda a, b: lax.ragged_dot_general(a, b, group_sizes, dims, precision=precision,
                                           preferred_element_type=_accumulator(compute))
  # XLA:CPU expands a grouped GEMM into masked dense dot_generals of every layout; the CPU
  # branch upcasts (exact products, f32 accumulation either way: see _on_platform).
  out = _on_platform(mm, xc, wc) if _below_f32(compute) else mm(xc, wc)
  return (_result(out, out_dtype, bwd.compute),
          (_residuals((x, w), compute, bwd.compute, (xc, wc)), group_sizes))


def _ragged_bwd(dims, precision, compute, x_dtype, w_dtype, out_dtype, bwd, res, g):
  del precision, compute, out_dtype
  (xr, wr), group_sizes = res
  xc, wc = xr.astype(bwd.compute), wr.astype(bwd.compute)
  gc = g.astype(bwd.compute)  # rounded once: the ragged dlhs and the per-group drhs
  kw = dict(ragged_dot_dimension_numbers=dims, precision=bwd.precision,
            preferred_element_type=_accumulator(bwd.compute), group_offset=None)
  ux = _compat.undefined(_target_aval(xc, x_dtype))
  uw = _compat.undefined(_target_aval(wc, w_dtype))
  t = _compat.ragged_dot_general_transpose
  run = _on_platform if _below_f32(bwd.compute) else (lambda fn, a, b: fn(a, b))
  dx = run(lambda g_, w_: t(g_, ux, w_, group_sizes, **kw)[0], gc, wc)
  dw = run(lambda g_, x_: t(g_, x_, uw, group_sizes, **kw)[1], gc, xc)
  return dx, dw, None   # group sizes are integers: no cotangent


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def policy_ragged_dot_general(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                              ragged_dot_dimension_numbers, compute_dtype: Any,
                              precision=None, out_dtype: Any = None, *,
                              backward_dtype: Any = None, backward_precision: Any = _SAME
                              ) -> jax.Array:
  """`lax.ragged_dot_general` (a grouped GEMM: one weight per expert group of lhs rows)
  with both operands in `compute_dtype` and f32 accumulation, forward and backward.

  As `policy_dot_general`, for the ragged case: the forward grouped GEMM and both
  gradient GEMMs (the ragged dlhs, one group's cotangent rows against that group's
  weight, and the per-group drhs, each group's rows contracted into its own weight
  gradient) take compute-dtype operands (the cotangent rounded once) and accumulate in
  f32; gradients are returned in the operands' own dtypes. The backward reuses JAX's
  transpose rule of ragged_dot_general, so its dimension numbers are JAX's.

  Args:
    lhs, rhs: floating arrays (lhs [m, k] rows sorted by group, rhs [g, k, n] for
      `lax.ragged_dot`'s dimension numbers).
    group_sizes: integer array, the rows of each group.
    ragged_dot_dimension_numbers: a `lax.RaggedDotDimensionNumbers`.
    compute_dtype, precision, out_dtype, backward_dtype, backward_precision: as
      `policy_dot_general`.
  Returns:
    An array of `out_dtype` (default compute_dtype); see policy_dot_general for a wider
    backward dtype.
  """
  compute = np.dtype(compute_dtype)
  _check_compute(compute)
  out = compute if out_dtype is None else np.dtype(out_dtype)
  dims = ragged_dot_dimension_numbers
  bwd = _backward(compute, backward_dtype, precision, backward_precision)
  if not _below_f32(compute) and not _below_f32(bwd.compute) and (
      bwd.compute == compute and bwd.precision == precision):
    res = lax.ragged_dot_general(lhs.astype(compute), rhs.astype(compute), group_sizes,
                                 dims, precision=precision, preferred_element_type=compute)
    return res.astype(out)
  return _ragged(lhs, rhs, group_sizes, dims, precision, compute, np.dtype(lhs.dtype),
                 np.dtype(rhs.dtype), out, bwd)


# ----------------------------------------------------------------------------- convolution


class _ConvParams(NamedTuple):
  """Canonical, hashable parameters of one conv_general_dilated (as JAX's jaxpr holds them)."""
  window_strides: tuple
  padding: tuple
  lhs_dilation: tuple
  rhs_dilation: tuple
  dimension_numbers: Any
  feature_group_count: int
  batch_group_count: int
  precision: Any


def _canonical_conv_params(lhs, rhs, **kwargs) -> _ConvParams:
  # Let JAX canonicalise padding strings, default dilations and dimension numbers by
  # tracing the plain op abstractly; the parameters are then exactly those of its jaxpr.
  fn = functools.partial(lax.conv_general_dilated, **kwargs)
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
                             jax.ShapeDtypeStruct(rhs.shape, lhs.dtype))
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "conv_general_dilated"]
  return conv_params_of(eqn.params)


def conv_params_of(params: dict) -> _ConvParams:
  """The _ConvParams of a traced conv_general_dilated equation's params."""
  return _ConvParams(tuple(params["window_strides"]),
                     tuple(tuple(q) for q in params["padding"]),
                     tuple(params["lhs_dilation"]), tuple(params["rhs_dilation"]),
                     params["dimension_numbers"], params["feature_group_count"],
                     params["batch_group_count"], params["precision"])


def _conv_call(lhs, rhs, params: _ConvParams, preferred, out_sharding=None):
  # _ConvParams' fields are lax.conv_general_dilated's keyword arguments.
  return lax.conv_general_dilated(lhs, rhs, **params._asdict(),
                                  preferred_element_type=preferred, out_sharding=out_sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _conv(lhs, rhs, params, compute, lhs_dtype, rhs_dtype, out_dtype, out_sharding, bwd):
  return _conv_fwd(lhs, rhs, params, compute, lhs_dtype, rhs_dtype, out_dtype,
                   out_sharding, bwd)[0]


def _conv_fwd(lhs, rhs, params, compute, lhs_dtype, rhs_dtype, out_dtype, out_sharding,
              bwd):
  lc, rc = lhs.astype(compute), rhs.astype(compute)
  cv = lambda a, b: _conv_call(a, b, params, _accumulator(compute), out_sharding)
  out = _on_platform(cv, lc, rc) if _below_f32(compute) else cv(lc, rc)
  return (_result(out, out_dtype, bwd.compute),
          _residuals((lhs, rhs), compute, bwd.compute, (lc, rc)))


def _conv_bwd(params, compute, lhs_dtype, rhs_dtype, out_dtype, out_sharding, bwd, res, g):
  del compute, out_dtype, out_sharding
  lc, rc = (r.astype(bwd.compute) for r in res)
  gc = g.astype(bwd.compute)  # compute x compute backward convolutions
  kw = dict(params._replace(precision=bwd.precision)._asdict(),
            preferred_element_type=_accumulator(bwd.compute), out_sharding=None)
  return _operand_grads(_compat.conv_transpose_lhs,
                        _compat.conv_transpose_rhs, gc, lc, rc, lhs_dtype,
                        rhs_dtype, kw)


_conv.defvjp(_conv_fwd, _conv_bwd)


def policy_conv(lhs: jax.Array, rhs: jax.Array, params: _ConvParams, compute_dtype: Any,
                out_dtype: Any = None, out_sharding=None, *, backward_dtype: Any = None,
                backward_precision: Any = _SAME) -> jax.Array:
  """The policy convolution for canonical `params` (see policy_conv_general_dilated;
  `backward_dtype`, `backward_precision`: as policy_dot_general's, the latter default
  `params.precision`)."""
  compute = np.dtype(compute_dtype)
  _check_compute(compute)
  out = compute if out_dtype is None else np.dtype(out_dtype)
  bwd = _backward(compute, backward_dtype, params.precision, backward_precision)
  if not _below_f32(compute) and not _below_f32(bwd.compute) and (
      bwd.compute == compute and bwd.precision == params.precision):
    return _conv_call(lhs.astype(compute), rhs.astype(compute), params, compute,
                      out_sharding).astype(out)
  return _conv(lhs, rhs, params, compute, np.dtype(lhs.dtype), np.dtype(rhs.dtype), out,
               out_sharding, bwd)


def policy_conv_general_dilated(lhs: jax.Array, rhs: jax.Array, window_strides, padding,
                                lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
                                feature_group_count: int = 1, batch_group_count: int = 1,
                                precision=None, *, compute_dtype: Any,
                                out_sharding=None, out_dtype: Any = None) -> jax.Array:
  """`lax.conv_general_dilated` with compute-dtype operands and f32 accumulation in the
  forward and both backward convolutions; returns `out_dtype` (default compute_dtype)."""
  params = _canonical_conv_params(lhs, rhs, window_strides=window_strides, padding=padding,
                                  lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                                  dimension_numbers=dimension_numbers,
                                  feature_group_count=feature_group_count,
                                  batch_group_count=batch_group_count, precision=precision)
  return policy_conv(lhs, rhs, params, compute_dtype, out_dtype, out_sharding)


# ----------------------------------------------------------------------------- callables


def _scoped(scope: str):
  return jax.named_scope(scope) if scope else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class PolicyDotGeneral:
  """A `dot_general` callable for a Flax layer's `dot_general` attribute (or
  `jnp.einsum(..., _dot_general=...)`): compute-dtype operands, f32 accumulation, forward
  and backward (`policy_dot_general`).

  Hashable and static (NNX stores it in the graph definition). `scope` becomes a
  `jax.named_scope`, so `precision.audit` attributes the GEMMs to it. A
  `preferred_element_type` passed by the caller is the result dtype (the accumulation is
  f32 either way): `preferred_element_type=f32` keeps the f32 accumulator unrounded.
  """

  compute_dtype: np.dtype
  scope: str = ""

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    with _scoped(self.scope):
      return policy_dot_general(lhs, rhs, dimension_numbers, self.compute_dtype,
                                precision=precision, out_sharding=out_sharding,
                                out_dtype=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class PolicyConv:
  """A `conv_general_dilated` callable for a Flax Conv layer (see PolicyDotGeneral)."""

  compute_dtype: np.dtype
  scope: str = ""

  def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
               dimension_numbers=None, feature_group_count=1, batch_group_count=1,
               precision=None, preferred_element_type=None, out_sharding=None):
    with _scoped(self.scope):
      return policy_conv_general_dilated(
          lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
          feature_group_count, batch_group_count, precision,
          compute_dtype=self.compute_dtype, out_sharding=out_sharding,
          out_dtype=preferred_element_type)


def policy_einsum(subscripts: str, *operands: jax.Array, compute_dtype: Any,
                  dot_general=None, precision=None) -> jax.Array:
  """`jnp.einsum` whose contractions go through a policy dot_general (or `dot_general`),
  returning `compute_dtype`.

  Operands reach the GEMM in their own dtypes (a narrower one is widened exactly to the
  widest first, as jnp.einsum would promote): the cast to `compute_dtype` happens inside
  the GEMM's custom VJP, so an f32 kernel's gradient leaves the f32 accumulator unrounded.
  """
  dg = dot_general if dot_general is not None else PolicyDotGeneral(np.dtype(compute_dtype))
  widest = wider_float(*(o.dtype for o in operands))
  ops = [o.astype(widest) for o in operands]
  out = jnp.einsum(subscripts, *ops, precision=precision, _dot_general=dg)
  return out.astype(compute_dtype)
