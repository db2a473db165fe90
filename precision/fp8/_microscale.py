"""Microscaled formats: MXFP8 and NVFP4 block quantisation, exact, with stochastic rounding.

A microscaled tensor stores small elements (E4M3/E5M2/E2M1) and one scale per `block`
contiguous elements along one axis (the contraction axis of the GEMM that reads it).

MXFP8 (OCP Microscaling Formats v1.0): E4M3 or E5M2 elements, one E8M0 scale (a power of
two, 2**s with s in [-127, 127]) per 32 elements. With `amax` the largest finite |x| of a
block, `emax` the exponent of the element format's max (E4M3 448 = 1.75 * 2**8: 8; E5M2
57344 = 1.75 * 2**15: 15), the scale exponent is

  "up"     s = ceil(log2(amax / fmax)): the smallest power of two with amax / 2**s <= fmax,
           so no element of the block saturates (Mishra et al. 2025, "Recipes for
           Pre-training LLMs with MXFP8": the OCP rule below can diverge in training);
  "floor"  s = floor(log2(amax)) - emax (the OCP v1.0 rule): amax / 2**s lies in
           [2**emax, 2**(emax + 1)), so a block whose amax significand exceeds the format
           max's (1.75 for E4M3 and E5M2) saturates its largest elements to +-fmax.

The two differ by one exactly where the significand of amax exceeds that of fmax. Both are
computed from the bits of amax (no log2, no division), then clamped to [-127, 127]; an
all-zero block gets s = -127. Elements: x / 2**s, computed exactly (integer exponent
arithmetic, f32 subnormals included: XLA CPU flushes subnormal products, this does not),
clipped to +-fmax when finite, rounded to nearest even in the element format. Non-finite
elements stay non-finite (inf -> E5M2 inf, or NaN in E4M3, which has no inf; NaN -> NaN)
and do not take part in amax, so an overflowed gradient still reaches the optimizer's guard.

NVFP4 (NVIDIA's NVFP4 recipe): E2M1 elements (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), one E4M3
scale per 16 elements and one f32 scale per tensor. With `A` the tensor's largest finite
|x|, in f32 arithmetic:

  tensor scale  ts = max(A / 2688, 2**-110)          (2688 = 6 * 448)
  block scale   sb = E4M3(min(block_amax / (6 * ts), 448))   (round to nearest even)
  elements      q  = E2M1(clip(x / (sb * ts), -6, 6))        (nearest even, or stochastic)
  value         q * (sb * ts)

The floor 2**-110 keeps every product sb * ts a normal f32 (sb >= 2**-9), so the result
does not depend on whether a backend flushes subnormals; it only changes tensors whose
amax is below 2688 * 2**-110 (about 2e-30). A block whose scale rounds to zero has zero
elements; a block holding inf or NaN gets a NaN scale (its elements are zero), so it reads
back as NaN: E2M1 has neither inf nor NaN.

2D weight tiles (NVIDIA's recipe for weights): one E4M3 scale per `tile` x `tile` tile
(16 x 16) of a matrix, the same formulas with block_amax the tile's; the tensor so
quantised reads the same along either axis, so the forward GEMM (contraction along one
axis) and the dgrad GEMM (along the other) multiply the same weight values.
`nvfp4_quantize_2d` returns the tile scales; `expand_tile_scales` repeats them into the
1 x tile block scales along one axis that `nvfp4_dequantize` and a block-scaled GEMM read.

Stochastic rounding onto E2M1 (gradients, NVIDIA's recipe): with a <= |y| < b the two
neighbouring E2M1 values, the result is b with probability (|y| - a) / (b - a), drawn from
24 of the 32 counter-based random bits of `precision.rounding` (a hash of seed, step and
the element's flat index): exact for every |y| whose distance to a is a multiple of
2**-24 (b - a), i.e. every |y| >= 0.25; below, biased upwards by less than 2**-24 in
probability, as the library's reference rounding.

Random Hadamard transform: the orthonormal 16 x 16 Sylvester-Hadamard matrix (entries
+-1/4) times a diagonal of random signs, applied to each run of 16 elements along an axis;
(H D a) . (H D b) = a . b in exact arithmetic, so applied to both operands along the
contraction it leaves a GEMM unchanged while spreading outliers over 16 elements.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
from jax import lax

from precision.rounding import _hash

_F32 = jnp.float32
_U32 = jnp.uint32
_I32 = jnp.int32
MX_ELEMENTS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SCALE_ROUNDINGS = ("up", "floor")
MX_BLOCK = 32
NV_BLOCK = 16
HADAMARD = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
NV_TENSOR_SCALE_MIN = 2.0 ** -110
E8M0_BIAS = 127


def _u32(v: int) -> np.uint32:
  return np.uint32(v)


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x.astype(_F32), _U32)


def _decompose(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Finite f32 x = (-1)**sign * M * 2**(e - 23), M an integer in [2**23, 2**24) (0 for
  zero), read from the bits (subnormals normalised). Returns (sign bit, M, e)."""
  bits = _bits(x)
  sign = bits & _u32(0x80000000)
  bexp = ((bits >> _u32(23)) & _u32(0xFF)).astype(_I32)
  mant = bits & _u32(0x7FFFFF)
  shift = jnp.maximum(lax.clz(mant).astype(_I32) - 8, 0)  # subnormals: top bit to 23
  sub = bexp == 0
  m = jnp.where(sub, mant << shift.astype(_U32), mant | _u32(0x800000))
  e = jnp.where(sub, -126 - shift, bexp - 127)
  return sign, jnp.where((bexp == 0) & (mant == 0), _u32(0), m), e


def ldexp(x: jax.Array, k: jax.Array) -> jax.Array:
  """x * 2**k (f32 x, int32 k, broadcast), rounded once to nearest even f32, subnormals
  included, with integer operations only (no backend's flush of subnormals applies)."""
  x = x.astype(_F32)
  sign, m, e = _decompose(x)
  big = e + jnp.asarray(k, _I32)  # unbiased exponent of the result
  normal = sign | ((jnp.clip(big, -126, 127) + 127).astype(_U32) << _u32(23)) | (
      m & _u32(0x7FFFFF))
  r = jnp.clip(-126 - big, 1, 31).astype(_U32)  # right shift into the subnormal range
  q = m >> r
  rem = m & ((_u32(1) << r) - _u32(1))
  half = _u32(1) << (r - _u32(1))
  up = (rem > half) | ((rem == half) & ((q & _u32(1)) == 1))
  sub = sign | (q + up.astype(_U32))
  out = jnp.where(big > 127, sign | _u32(0x7F800000), jnp.where(big >= -126, normal, sub))
  out = jnp.where(m == 0, sign, out)
  return jnp.where(jnp.isfinite(x), lax.bitcast_convert_type(out, _F32), x)


def _to_blocks(x: jax.Array, axis: int, block: int, what: str) -> tuple[jax.Array, int]:
  """x with `axis` moved last and split into [..., n, block]."""
  axis = _axis(axis, x.ndim)
  k = x.shape[axis]
  if k % block:
    raise ValueError(f"{what}: block={block} does not divide the length {k} of axis {axis} "
                     f"(shape {x.shape}); accepted: a block size dividing that axis")
  x = jnp.moveaxis(x, axis, -1)
  return x.reshape(x.shape[:-1] + (k // block, block)), axis


def _from_blocks(x: jax.Array, axis: int) -> jax.Array:
  return jnp.moveaxis(x.reshape(x.shape[:-2] + (-1,)), -1, axis)


def _axis(axis: int, ndim: int) -> int:
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not (
      -ndim <= axis < ndim):
    raise ValueError(f"axis={axis!r}; accepted: an int in [{-ndim}, {ndim})")
  return int(axis) % ndim


def _check_block(block: Any) -> int:
  if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
    raise ValueError(f"block={block!r}; accepted: an int >= 1")
  return int(block)


def _finite_abs(x: jax.Array) -> jax.Array:
  a = jnp.abs(x.astype(_F32))
  return jnp.where(jnp.isfinite(a), a, jnp.zeros_like(a))


def e8m0_exponent(amax: jax.Array, fmt: str, rounding: str) -> jax.Array:
  """The MXFP8 scale exponent s (int32, in [-127, 127]) of blocks with largest finite
  magnitude `amax` (f32, >= 0), for element format `fmt` and scale `rounding`."""
  if rounding not in SCALE_ROUNDINGS:
    raise ValueError(f"scale_rounding={rounding!r}; accepted: {', '.join(SCALE_ROUNDINGS)}")
  fmax = float(ml_dtypes.finfo(MX_ELEMENTS[fmt]).max)
  fm, fe = np.frexp(fmax)  # fmax = fm * 2**fe, fm in [0.5, 1)
  emax, fmax_sig = int(fe) - 1, int(fm * 2 ** 24)  # significand as an integer in [2**23, 2**24)
  _, m, e = _decompose(amax)
  s = e - emax
  if rounding == "up":
    s = s + (m > _u32(fmax_sig)).astype(_I32)
  s = jnp.where(amax > 0, s, -E8M0_BIAS)
  return jnp.clip(s, -E8M0_BIAS, E8M0_BIAS)


def mxfp8_quantize(x: jax.Array, fmt: str = "e4m3", *, axis: int = -1, block: int = MX_BLOCK,
                   scale_rounding: str = "up") -> tuple[jax.Array, jax.Array]:
  """MXFP8 quantisation of `x` (any float dtype) in blocks of `block` along `axis`.

  Returns:
    (elements, scales): elements in float8_e4m3fn / float8_e5m2, the shape of x; scales
    in float8_e8m0fnu (2**s), the shape of x with `axis` of length ``len / block``.

  Raises:
    ValueError: an unknown `fmt` or `scale_rounding`, or a block not dividing the axis.
  """
  if fmt not in MX_ELEMENTS:
    raise ValueError(f"fmt={fmt!r}; accepted: {', '.join(MX_ELEMENTS)}")
  xb, axis = _to_blocks(x.astype(_F32), axis, _check_block(block), "mxfp8_quantize")
  s = e8m0_exponent(jnp.max(_finite_abs(xb), axis=-1), fmt, scale_rounding)
  y = ldexp(xb, -s[..., None])
  fmax = jnp.asarray(float(ml_dtypes.finfo(MX_ELEMENTS[fmt]).max), _F32)
  q = jnp.where(jnp.isfinite(xb), jnp.clip(y, -fmax, fmax), y).astype(MX_ELEMENTS[fmt])
  scales = lax.bitcast_convert_type((s + E8M0_BIAS).astype(jnp.uint8), jnp.float8_e8m0fnu)
  return _from_blocks(q, axis), jnp.moveaxis(scales, -1, axis)


def mxfp8_dequantize(elements: jax.Array, scales: jax.Array, *, axis: int = -1) -> jax.Array:
  """f32 values of an MXFP8 tensor (exact: element * 2**s, subnormals included); the
  block length is ``elements.shape[axis] // scales.shape[axis]``. A NaN scale (E8M0
  0xFF) reads as NaN."""
  axis = _axis(axis, elements.ndim)
  block = elements.shape[axis] // scales.shape[axis]
  qb, _ = _to_blocks(elements.astype(_F32), axis, block, "mxfp8_dequantize")
  sbits = jnp.moveaxis(lax.bitcast_convert_type(scales, jnp.uint8), axis, -1).astype(_I32)
  v = ldexp(qb, (sbits - E8M0_BIAS)[..., None])
  v = jnp.where((sbits == 255)[..., None], jnp.full_like(v, jnp.nan), v)
  return _from_blocks(v, axis)


def nvfp4_tensor_scale(x: jax.Array) -> jax.Array:
  """The NVFP4 per-tensor f32 scale: max(amax / 2688, 2**-110), amax over finite |x|."""
  amax = jnp.max(_finite_abs(x))
  return jnp.maximum(amax / jnp.asarray(6.0 * E4M3_MAX, _F32),
                     jnp.asarray(NV_TENSOR_SCALE_MIN, _F32))


def data_digest(x: jax.Array) -> jax.Array:
  """A uint32 digest of x's f32 bits and positions: the `step` of the stochastic
  rounding stream of a tensor, so that each distinct tensor draws its own bits."""
  idx = lax.iota(_U32, x.size).reshape(x.shape)
  return jnp.sum(_hash.mix32(_bits(x) ^ _hash.mix32(idx)), dtype=_U32)


def _e2m1_stochastic(y: jax.Array, rbits: jax.Array) -> jax.Array:
  """|y| <= 6 (f32) rounded stochastically onto the E2M1 grid (exact f32 arithmetic:
  the spacings 0.5, 1, 2 are powers of two)."""
  a = jnp.abs(y)
  ulp = jnp.where(a < 2.0, jnp.asarray(0.5, _F32),
                  jnp.where(a < 4.0, jnp.asarray(1.0, _F32), jnp.asarray(2.0, _F32)))
  t = a / ulp
  lo = jnp.floor(t)
  u = (rbits >> _u32(8)).astype(_F32) * jnp.asarray(2.0 ** -24, _F32)
  r = (lo + (u < t - lo).astype(_F32)) * ulp
  return jnp.copysign(r, y)


def nvfp4_quantize(x: jax.Array, *, axis: int = -1, block: int = NV_BLOCK,
                   stochastic: bool = False, seed: Any = 0, step: Any = None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4 quantisation of `x` (any float dtype) in blocks of `block` along `axis`.

  Args:
    stochastic: round the elements stochastically (unbiased) instead of to nearest even.
    seed, step: the random stream of the stochastic rounding (uint32 counters, see
      `precision.rounding`); step None: `data_digest(x)`, a stream per distinct tensor.

  Returns:
    (elements float4_e2m1fn with x's shape, block scales float8_e4m3fn with `axis` of
    length ``len / block``, tensor scale f32 scalar).
  """
  x32 = x.astype(_F32)
  ts = nvfp4_tensor_scale(x32)
  xb, axis = _to_blocks(x32, axis, _check_block(block), "nvfp4_quantize")
  bad = jnp.any(~jnp.isfinite(xb), axis=-1)
  sbf = jnp.max(_finite_abs(xb), axis=-1) / (jnp.asarray(6.0, _F32) * ts)
  sbf = jnp.minimum(sbf, jnp.asarray(E4M3_MAX, _F32))
  sb = jnp.where(bad, jnp.full_like(sbf, jnp.nan), sbf).astype(jnp.float8_e4m3fn)
  d = (sb.astype(_F32) * ts)[..., None]
  usable = jnp.isfinite(d) & (d > 0)
  y = jnp.clip(xb / jnp.where(usable, d, jnp.ones_like(d)), -E2M1_MAX, E2M1_MAX)
  if stochastic:
    if step is None:
      step = data_digest(x32)
    moved = jnp.moveaxis(x32, axis, -1)
    rbits = _hash.random_bits(seed, step, moved.shape).reshape(y.shape)
    y = _e2m1_stochastic(y, rbits)
  y = jnp.where(usable, y, jnp.zeros_like(y))
  return (_from_blocks(y.astype(jnp.float4_e2m1fn), axis), jnp.moveaxis(sb, -1, axis), ts)


def nvfp4_quantize_2d(x: jax.Array, *, axes: tuple[int, int] = (-2, -1), tile: int = NV_BLOCK
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4 quantisation of `x` in `tile` x `tile` tiles over the two `axes` (nearest even).

  Each tile is one block of `tile`**2 elements: its amax sets its E4M3 scale, as
  `nvfp4_quantize` computes a block's (same tensor scale, same arithmetic).

  Returns:
    (elements float4_e2m1fn with x's shape, tile scales float8_e4m3fn with each of
    `axes` of length ``len / tile``, tensor scale f32 scalar).

  Raises:
    ValueError: equal axes, or a tile not dividing one of them.
  """
  tile = _check_block(tile)
  r, c = (_axis(a, x.ndim) for a in axes)
  if r == c:
    raise ValueError(f"axes={axes!r}; accepted: two different axes")
  for a in (r, c):
    if x.shape[a] % tile:
      raise ValueError(f"nvfp4_quantize_2d: tile={tile} does not divide the length "
                       f"{x.shape[a]} of axis {a} (shape {x.shape}); accepted: a tile "
                       "dividing both axes")
  y = jnp.moveaxis(x.astype(_F32), (r, c), (-2, -1))
  lead, (nr, nc) = y.shape[:-2], y.shape[-2:]
  # [..., nr/t, t, nc/t, t] -> [..., nr/t, nc/t, t*t]: one block per tile, row-major.
  y = jnp.swapaxes(y.reshape(lead + (nr // tile, tile, nc // tile, tile)), -3, -2)
  q, sb, ts = nvfp4_quantize(y.reshape(lead + (nr // tile, nc // tile, tile * tile)),
                             axis=-1, block=tile * tile)
  q = jnp.swapaxes(q.reshape(lead + (nr // tile, nc // tile, tile, tile)), -3, -2)
  q = jnp.moveaxis(q.reshape(lead + (nr, nc)), (-2, -1), (r, c))
  return q, jnp.moveaxis(sb[..., 0], (-2, -1), (r, c)), ts


def expand_tile_scales(tile_scales: jax.Array, axes: tuple[int, int], axis: int,
                       tile: int = NV_BLOCK) -> jax.Array:
  """The 1 x `tile` block scales along `axis` (one of `axes`) of a 2D-tiled tensor: its
  tile scales repeated `tile` times along the other axis."""
  r, c = (_axis(a, tile_scales.ndim) for a in axes)
  axis = _axis(axis, tile_scales.ndim)
  if axis not in (r, c):
    raise ValueError(f"axis={axis}; accepted: one of the tiled axes {r}, {c}")
  return jnp.repeat(tile_scales, tile, axis=c if axis == r else r)


def nvfp4_dequantize(elements: jax.Array, block_scales: jax.Array, tensor_scale: jax.Array,
                     *, axis: int = -1) -> jax.Array:
  """f32 values of an NVFP4 tensor: element * (block scale * tensor scale), f32 products
  (the order `nvfp4_quantize` divides by)."""
  axis = _axis(axis, elements.ndim)
  block = elements.shape[axis] // block_scales.shape[axis]
  qb, _ = _to_blocks(elements.astype(_F32), axis, block, "nvfp4_dequantize")
  d = jnp.moveaxis(block_scales.astype(_F32), axis, -1) * tensor_scale.astype(_F32)
  return _from_blocks(qb * d[..., None], axis)


def hadamard_matrix(seed: Any = 0, size: int = HADAMARD) -> jax.Array:
  """H D: the orthonormal Sylvester-Hadamard matrix of order `size` (a power of two;
  entries +-1/sqrt(size), exact for 16: +-1/4) times random signs D from `seed`. f32."""
  if size < 1 or size & (size - 1):
    raise ValueError(f"size={size!r}; accepted: a power of two")
  h = np.ones((1, 1))
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  h = jnp.asarray(h / np.sqrt(size), _F32)
  signs = _hash.random_bits(seed, 0, (size,)) >> _u32(31)
  d = jnp.where(signs == 1, jnp.asarray(-1.0, _F32), jnp.asarray(1.0, _F32))
  return h * d[None, :]


def random_hadamard(x: jax.Array, axis: int, seed: Any = 0, size: int = HADAMARD) -> jax.Array:
  """x (f32) with every run of `size` elements along `axis` multiplied by H D
  (`hadamard_matrix`); the axis length must be a multiple of `size`.

  Computed as a fast Walsh-Hadamard transform (log2(size) stages of sums and differences,
  then the exact scaling by 1/sqrt(size) for sizes 4**k), so it adds no GEMM to the
  program (the audit counts GEMMs) and rounds only in those sums.
  """
  if size < 1 or size & (size - 1):
    raise ValueError(f"size={size!r}; accepted: a power of two")
  xb, axis = _to_blocks(x.astype(_F32), axis, size, "random_hadamard")
  signs = _hash.random_bits(seed, 0, (size,)) >> _u32(31)
  d = jnp.where(signs == 1, jnp.asarray(-1.0, _F32), jnp.asarray(1.0, _F32))
  y = xb * d.reshape((1,) * (xb.ndim - 1) + (size,))
  lead = y.shape[:-1]
  h = 1
  while h < size:  # Sylvester order: stage h pairs the elements whose index differs in bit h
    y = y.reshape(lead + (size // (2 * h), 2, h))
    a, b = y[..., 0, :], y[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (size,))
    h *= 2
  return _from_blocks(y * jnp.asarray(1.0 / np.sqrt(size), _F32), axis)
