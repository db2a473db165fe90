"""`stochastic_round`: picks the implementation for the backend."""

from __future__ import annotations

from typing import Any

import jax

from precision.rounding._pallas import stochastic_round_pallas
from precision.rounding._reference import stochastic_round_reference

IMPLS = ("auto", "xla", "pallas")


def stochastic_round(x: jax.Array, dtype: Any, key, step=0, *, impl: str = "auto",
                     index_offset=0) -> jax.Array:
  """Rounds f32 `x` (or bf16 `x` for fp8 targets) to `dtype` (bf16, f16, e4m3, e5m2),
  up or down with probability proportional to the distance, unbiased in expectation.

  Args:
    x: float32 array (bfloat16 allowed when `dtype` is an fp8 format), any shape.
    dtype: target dtype or name: bf16, f16, e4m3 (float8_e4m3fn) or e5m2.
    key: an int seed, a uint32 scalar, or a `jax.random` key.
    step: uint32 step counter; (key, step, flat index) determine every random bit.
    impl: "xla" (plain jnp reference), "pallas" (kernel; interpret mode off GPU) or
      "auto" (Pallas on GPU, XLA elsewhere). All give bit-identical results.
    index_offset: the flat index of `x`'s first element: the element at row-major
      position i uses counter ``index_offset + i`` (uint32, wrapping). An int in
      [0, 2**32) or an integer scalar array (may be traced; the Pallas kernel reads it at
      run time). Default 0: `x` is the whole array. A contiguous slice ``x[a:b]`` of a flat
      array rounded with ``index_offset=a`` gives bit for bit ``stochastic_round(x)[a:b]``:
      a ZeRO shard holding flat elements [r*k, (r+1)*k) passes ``index_offset=r*k``.

  Returns:
    An array of `dtype` and `x`'s shape. Semantics (exact probabilities on the target
    grid, 24-bit resolution below its smallest subnormal, NaN/inf/overflow as the target's
    own cast, float8_e4m3fn overflow -> NaN) are in `precision.rounding._reference`.

  Examples:
    >>> y = stochastic_round(jnp.full((4,), 1.001, jnp.float32), jnp.bfloat16, key=0)
    >>> x = jnp.linspace(0.0, 1.0, 10, dtype=jnp.float32)
    >>> tail = stochastic_round(x[6:], jnp.bfloat16, key=0, index_offset=6)  # == full[6:]
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; accepted: {', '.join(IMPLS)}")
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "xla"
  if impl == "pallas":
    return stochastic_round_pallas(x, dtype, key, step, index_offset=index_offset)
  return stochastic_round_reference(x, dtype, key, step, index_offset=index_offset)
