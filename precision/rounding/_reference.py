"""Stochastic rounding in plain jnp: the XLA reference every kernel is compared with.

Semantics (f32 input; bf16 input is first widened to f32, which is exact):
  * a value representable in the target comes back unchanged (signed zeros included);
  * otherwise, with a < |x| < b its two neighbours in the target (same sign as x), the
    result is b with probability (|x| - a) / (b - a), else a;
  * NaN stays NaN (the sign is kept, the payload becomes the target's quiet NaN);
  * |x| >= the target's largest finite value `max`, infinities included: the target's own
    round-to-nearest-even cast (ml_dtypes / XLA). bf16, f16, e5m2: |x| < max + ulp/2 gives
    max, from max + ulp/2 on (the tie goes to the even neighbour, inf) +-inf. float8_e4m3fn
    has no inf: |x| <= 464 (= 448 + 16, the tie goes to even 448) gives +-448; anything
    larger, +-inf included, gives NaN.

Resolution of the random bits: in the f32 bit pattern the magnitude is monotone, so
rounding to a coarser grid of spacing 2**s f32-ulps is "add the top s random bits to the
magnitude, clear the low s bits": the carry rounds up with probability exactly
(dropped bits) / 2**s. s is 23 - target mantissa bits in the target's normal range and
grows by one per binade in its subnormal range (s <= 23). The probability is therefore
exact for every |x| at or above the target's smallest subnormal `tiny`. Below it
(a = 0, b = tiny) the choice compares |x| / tiny with 24 random bits, so
P(up) = ceil(|x| / tiny * 2**24) / 2**24: exact in the binade just below `tiny`, and
biased upwards by less than 2**-24 (in probability) further down.

The result is built as the target's bit pattern with integer ops (`encode`), not with a
float cast, so the XLA reference and the Pallas kernel cannot disagree through a backend's
cast rules (Triton's f32 -> fp8 conversion saturates infinities, XLA's does not).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision import formats
from precision.rounding import _hash

_U32 = jnp.uint32
SUPPORTED = ("bf16", "f16", "e4m3", "e5m2")


def target_info(dtype: Any) -> formats.FormatInfo:
  fi = formats.info(dtype)
  if fi.name not in SUPPORTED:
    raise ValueError(
        f"Stochastic rounding targets are {', '.join(SUPPORTED)}; got {fi.name!r}")
  return fi


def check_input(x: jax.Array, fi: formats.FormatInfo) -> None:
  ok = x.dtype == jnp.float32 or (x.dtype == jnp.bfloat16 and fi.bits == 8)
  if not ok:
    raise ValueError(
        f"stochastic_round to {fi.name} takes float32 input (or bfloat16 for fp8 "
        f"targets); got {x.dtype}")


def bits_dtype(fi: formats.FormatInfo) -> np.dtype:
  """The unsigned integer dtype holding the target's bit pattern (uint8 or uint16)."""
  return np.dtype(np.uint8) if fi.bits == 8 else np.dtype(np.uint16)


def _f32_bits(v: float) -> int:
  return int(np.array(v, np.float32).view(np.uint32))


def _target_constants(fi: formats.FormatInfo) -> dict[str, int]:
  """Bit patterns of the target (as Python ints) used by `encode`."""
  m = fi.mantissa_bits
  exp_ones = (2 ** fi.exponent_bits - 1) << m
  if fi.has_inf:  # S.11..10.11..1: all-ones mantissa at the top finite exponent
    max_bits = ((2 ** fi.exponent_bits - 2) << m) | ((1 << m) - 1)
  else:  # float8_e4m3fn: S.1111.110 (S.1111.111 is NaN)
    max_bits = exp_ones | ((1 << m) - 2)
  return {
      "max": max_bits,
      "inf": exp_ones,  # only meaningful when fi.has_inf
      # Quiet NaN: all-ones exponent and the top mantissa bit (e4m3fn's only NaN is
      # S.1111.111). These are the patterns XLA's f32 -> target cast gives for a quiet NaN.
      "nan": exp_ones | (1 << (m - 1)) if fi.has_inf else exp_ones | ((1 << m) - 1),
      "sign_shift": 32 - fi.bits,
  }


def encode(x: jax.Array, rbits: jax.Array, fi: formats.FormatInfo) -> jax.Array:
  """Stochastically rounds `x` to format `fi` with uint32 random bits `rbits`; returns the
  target's bit patterns as uint8 (fp8) or uint16 (bf16, f16).

  Elementwise and shape-agnostic, integer and exact float ops only: the Pallas kernels
  call this same function on a block, so both implementations share one definition.
  """
  x = x.astype(jnp.float32)
  u = jax.lax.bitcast_convert_type(x, _U32)
  sign = u & _U32(0x80000000)
  mag = u & _U32(0x7FFFFFFF)
  ax = jax.lax.bitcast_convert_type(mag, jnp.float32)  # |x|
  # Unbiased f32 exponent of |x|; f32 subnormals share the exponent of the smallest normal.
  e_x = jnp.maximum((mag >> _U32(23)).astype(jnp.int32) - 127, -126)
  e_min = int(np.log2(fi.smallest_normal))
  shift = (23 - fi.mantissa_bits) + jnp.maximum(e_min - e_x, 0)  # int32, >= 1
  # Grid path: the target spacing is 2**shift f32-ulps of |x|'s binade and at most the
  # binade itself (shift <= 23). For bf16 shift is always 16: its grid is f32's with the
  # low 16 bits cleared, f32 subnormals included (their value is linear in the pattern).
  grid = shift <= 23
  s = jnp.clip(shift, 1, 23).astype(_U32)
  mask = (_U32(1) << s) - _U32(1)
  rnd = rbits >> (_U32(32) - s)  # the top s random bits
  mag_grid = (mag + rnd) & ~mask
  # Below the smallest subnormal `tiny` (a = 0, b = tiny): up with probability |x| / tiny,
  # compared at 24-bit resolution. |x| * 2**(24 - log2 tiny) is an exact power-of-two
  # scaling (bf16 never takes this path; its scale is clamped to stay a finite f32).
  log2_tiny = int(np.log2(fi.smallest_subnormal))
  scaled = ax * np.float32(2.0 ** min(24 - log2_tiny, 127))
  r24 = (rbits >> _U32(8)).astype(jnp.float32)  # < 2**24: exact in f32
  mag_tiny = jnp.where(r24 < scaled, _U32(_f32_bits(fi.smallest_subnormal)), _U32(0))
  mag_new = jnp.where(grid, mag_grid, mag_tiny)  # f32 pattern of a target value <= max

  # f32 magnitude pattern -> target magnitude pattern, exactly.
  m_bits = fi.mantissa_bits
  if fi.exponent_bias == 127:  # bf16: the top 16 bits (normal and subnormal alike)
    t_mag = mag_new >> _U32(16)
  else:
    rebias = _U32((127 - fi.exponent_bias) << 23)
    normal = mag_new >= _U32(_f32_bits(fi.smallest_normal))
    t_normal = (jnp.where(normal, mag_new, rebias) - rebias) >> _U32(23 - m_bits)
    # Subnormal (or zero): the count of `tiny`s, an integer < 2**m_bits, exact in f32.
    v = jax.lax.bitcast_convert_type(mag_new, jnp.float32)
    t_sub = (v * np.float32(2.0 ** -log2_tiny)).astype(jnp.int32).astype(_U32)
    t_mag = jnp.where(normal, t_normal, t_sub)

  # Specials: the target's own round-to-nearest-even cast (see the module docstring).
  c = _target_constants(fi)
  ulp_max = 2.0 ** (np.floor(np.log2(fi.max)) - m_bits)
  halfway = np.float32(fi.max + ulp_max / 2)  # exact in f32 for every target
  if fi.has_inf:
    over = jnp.where(ax < halfway, _U32(c["max"]), _U32(c["inf"]))
  else:
    over = jnp.where(ax <= halfway, _U32(c["max"]), _U32(c["nan"]))
  t_mag = jnp.where(ax >= np.float32(fi.max), over, t_mag)  # inf included; NaN compares False
  t_mag = jnp.where(jnp.isnan(x), _U32(c["nan"]), t_mag)
  out = t_mag | (sign >> _U32(c["sign_shift"]))
  return out.astype(bits_dtype(fi))


def decode(bits: jax.Array, fi: formats.FormatInfo) -> jax.Array:
  """Target bit patterns (uint8/uint16 from `encode`) -> the target dtype (a bitcast)."""
  return jax.lax.bitcast_convert_type(bits, fi.dtype)


def round_bits(x: jax.Array, rbits: jax.Array, fi: formats.FormatInfo) -> jax.Array:
  """Stochastically rounds f32 `x` to format `fi` using uint32 random bits `rbits`; returns
  an array of the target dtype. ``decode(encode(x, rbits, fi), fi)``."""
  return decode(encode(x, rbits, fi), fi)


def stochastic_round_reference(x: jax.Array, dtype: Any, seed, step=0, *,
                               index_offset=0) -> jax.Array:
  """XLA reference: stochastically rounds `x` to `dtype` with bits from (seed, step, index).

  Args:
    x: float32 array (bfloat16 allowed for fp8 targets), any shape; the flat index is
      row-major over the logical shape.
    dtype: bf16, f16, e4m3 (float8_e4m3fn) or e5m2, as a dtype or a name.
    seed: int, uint32 scalar or jax.random key; see `_hash.seed_from`.
    step: uint32-convertible step counter.
    index_offset: added (uint32, wrapping) to every flat index: the element at row-major
      position i of `x` draws the bits of index ``index_offset + i``. An int in [0, 2**32)
      or an integer scalar array (may be traced). Rounding a contiguous slice ``x[a:b]`` of
      a flat array with ``index_offset=a`` gives exactly ``result[a:b]`` of rounding all of
      it (how ZeRO shards round as the unsharded update does).

  Returns:
    An array of `dtype` and `x`'s shape.
  """
  fi = target_info(dtype)
  x = jnp.asarray(x)
  check_input(x, fi)
  rbits = _hash.random_bits(_hash.seed_from(seed), step, x.shape, index_offset)
  return round_bits(x, rbits, fi)
