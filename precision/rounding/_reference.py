"""Stochastic rounding in plain jnp: the XLA reference every kernel is compared with.

Semantics (f32 input; bf16 input is first widened to f32, which is exact):
  * a value representable in the target comes back unchanged;
  * otherwise, with a < |x| < b its two neighbours in the target (same sign as x), the
    result is b with probability (|x| - a) / (b - a), else a;
  * NaN stays NaN, +-inf stays +-inf (float8_e4m3fn has no inf: +-inf becomes NaN, as the
    target's own cast does);
  * |x| >= the target's largest finite value: the target's own round-to-nearest cast
    (bf16/f16/e5m2: values past max + ulp/2 become inf; e4m3fn: NaN).

How: in the f32 bit pattern, the magnitude is monotone, so rounding to a coarser grid of
spacing 2**s f32-ulps is "add s random bits to the magnitude, clear the low s bits": the
carry rounds up with probability exactly (dropped bits) / 2**s. s is 23 - target mantissa
bits in the target's normal range, and grows by one per binade in its subnormal range. The
probability is therefore exact for every value at or above the target's smallest
subnormal. Below it (a = 0, b = smallest subnormal) the choice uses 24 random bits, so
P(up) = ceil(|x| / b * 2**24) / 2**24: biased by at most 2**-24.
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


def round_bits(x: jax.Array, rbits: jax.Array, fi: formats.FormatInfo) -> jax.Array:
  """Stochastically rounds f32 `x` to format `fi` using uint32 random bits `rbits`.

  Elementwise and shape-agnostic: the Pallas kernels call this same function on a block.
  """
  x = x.astype(jnp.float32)
  u = jax.lax.bitcast_convert_type(x, _U32)
  sign = u & _U32(0x80000000)
  mag = u & _U32(0x7FFFFFFF)
  # Unbiased f32 exponent of |x|; f32 subnormals share the exponent of the smallest normal.
  e_x = jnp.maximum((mag >> _U32(23)).astype(jnp.int32) - 127, -126)
  e_min = int(np.log2(fi.smallest_normal))
  shift = (23 - fi.mantissa_bits) + jnp.maximum(e_min - e_x, 0)  # int32, >= 1
  # Grid path: valid while the target spacing is at most |x|'s f32 binade (shift <= 23),
  # and always for f32 subnormals (their value is linear in the bit pattern).
  f32_subnormal = mag < _U32(0x00800000)
  grid = (shift <= 23) | f32_subnormal
  s = jnp.clip(shift, 1, 31).astype(_U32)
  mask = (_U32(1) << s) - _U32(1)
  rnd = rbits >> (_U32(32) - s)
  mag_grid = (mag + rnd) & ~mask
  # Below the smallest subnormal: up to the smallest subnormal with probability |x| / b,
  # compared at 24-bit resolution. |x| * 2**(24 - log2 b) is an exact power-of-two scaling.
  log2_tiny = int(np.log2(fi.smallest_subnormal))
  # (For bf16, whose grid matches f32's down to f32 subnormals, this path is never taken and
  # the scale is clamped to stay a finite f32.)
  scaled = jnp.abs(x) * np.float32(2.0 ** min(24 - log2_tiny, 127))
  r24 = (rbits >> _U32(8)).astype(jnp.float32)
  tiny_bits = np.uint32(np.float32(fi.smallest_subnormal).view(np.uint32))
  mag_tiny = jnp.where(r24 < scaled, _U32(tiny_bits), _U32(0))
  mag_new = jnp.where(grid, mag_grid, mag_tiny)
  rounded = jax.lax.bitcast_convert_type(sign | mag_new, jnp.float32)
  # rounded is exactly representable in the target, so this cast is exact.
  out = rounded.astype(fi.dtype)
  nearest = x.astype(fi.dtype)
  special = ~jnp.isfinite(x) | (jnp.abs(x) >= np.float32(fi.max))
  return jnp.where(special, nearest, out)


def stochastic_round_reference(x: jax.Array, dtype: Any, seed, step=0) -> jax.Array:
  """XLA reference: stochastically rounds `x` to `dtype` with bits from (seed, step, index)."""
  fi = target_info(dtype)
  x = jnp.asarray(x)
  check_input(x, fi)
  rbits = _hash.random_bits(_hash.seed_from(seed), step, x.shape)
  return round_bits(x, rbits, fi)
