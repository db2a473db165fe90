"""`stochastic_round`: picks the implementation for the backend."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision.rounding import _pallas
from precision.rounding._pallas import stochastic_round_pallas
from precision.rounding._reference import stochastic_round_reference

IMPLS = ("auto", "xla", "pallas")


def stochastic_round(x: jax.Array, dtype: Any, key, step=0, *, impl: str = "auto",
                     index_offset=0, interpret: bool | None = None) -> jax.Array:
  """Rounds f32 `x` (or bf16 `x` for fp8 targets) to `dtype` (bf16, f16, e4m3, e5m2),
  up or down with probability proportional to the distance, unbiased in expectation.

  Args:
    x: float32 array (bfloat16 allowed when `dtype` is an fp8 format), any shape.
    dtype: target dtype or name: bf16, f16, e4m3 (float8_e4m3fn) or e5m2.
    key: the seed: an int in [0, 2**32), an integer scalar array (uint32 or int32; may
      be traced), or a `jax.random` key (typed or raw).
    step: the uint32 step counter: an int in [0, 2**32) or an integer scalar array (may
      be traced; a traced value is taken mod 2**32, so the optimizer's int32 count is
      fine). (key, step, flat index) determine every random bit.
    impl: "xla" (plain jnp reference), "pallas" (the kernel) or "auto": the Pallas
      kernel in a program lowered for a GPU (CUDA/ROCm), the XLA reference in one lowered
      for any other platform (decided at lowering, so a program exported for CUDA from a
      CPU machine holds the kernel). All give bit-identical results.
    index_offset: the flat index of `x`'s first element: the element at row-major
      position i uses counter ``index_offset + i`` (uint32, wrapping). An int in
      [0, 2**32) or an integer scalar array (may be traced; the Pallas kernel reads it at
      run time). Default 0: `x` is the whole array. A contiguous slice ``x[a:b]`` of a flat
      array rounded with ``index_offset=a`` gives bit for bit ``stochastic_round(x)[a:b]``:
      a ZeRO shard holding flat elements [r*k, (r+1)*k) passes ``index_offset=r*k``.
    interpret: the Pallas kernel's mode, wherever it is used: None (compiled when
      lowered for a GPU, interpret mode otherwise), False (compiled Triton for every
      platform: lowering for the CPU then fails) or True (interpret mode everywhere).
      Must be None with ``impl="xla"``.

  Raises:
    ValueError: an unknown `impl` or target, a wrong input dtype, or a `key`, `step` or
      `index_offset` that is not a uint32 counter as described above (a bool, a float,
      NaN, a string, an int outside [0, 2**32), a concrete array value outside it, a
      non-scalar); the message names the argument and what is accepted.

  Returns:
    An array of `dtype` and `x`'s shape. Semantics (exact probabilities on the target
    grid, 24-bit resolution below its smallest subnormal, NaN/inf/overflow as the target's
    own cast, float8_e4m3fn overflow -> NaN) are in `precision.rounding._reference`.

  Examples:
    >>> y = stochastic_round(jnp.full((4,), 1.001, jnp.float32), jnp.bfloat16, key=0)
    >>> x = jnp.linspace(0.0, 1.0, 10, dtype=jnp.float32)
    >>> tail = stochastic_round(x[6:], jnp.bfloat16, key=0, index_offset=6)  # == full[6:]
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    raise ValueError(f"stochastic_round: x={x!r} (a {type(x).__name__}); accepted: a float32 "
                     "array (bfloat16 for fp8 targets)")
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; accepted: {', '.join(IMPLS)}")
  interpret = _pallas.check_interpret(interpret)
  if impl == "xla" and interpret is not None:
    raise ValueError(f"interpret={interpret!r} applies to the Pallas kernel; with "
                     "impl='xla' pass interpret=None")
  pallas = lambda x: stochastic_round_pallas(
      x, dtype, key, step, index_offset=index_offset,
      interpret=False if interpret is None else interpret)
  xla = lambda x: stochastic_round_reference(x, dtype, key, step, index_offset=index_offset)
  if impl == "pallas":
    return stochastic_round_pallas(x, dtype, key, step, index_offset=index_offset,
                                   interpret=interpret)
  if impl == "xla":
    return xla(x)
  x = jnp.asarray(x)
  if x.size == 0:  # nothing to round; platform_dependent needs no kernel for it
    return xla(x)
  return _pallas.on_gpu_platform(pallas, xla, x)
