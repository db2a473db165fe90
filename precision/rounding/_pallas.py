"""Stochastic rounding as a Pallas kernel (GPU: Triton lowering; elsewhere: interpret mode).

Compiled or interpreted is decided when the program is lowered, for the platform it is
lowered for (`jax.lax.platform_dependent`), not from the machine's default backend:
a program lowered for CUDA or ROCm holds the compiled Triton kernel, one lowered for any
other platform Pallas' interpret mode (plain XLA ops). So ``jax.export.export(jax.jit(f),
platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
TRITON_CUSTOM_CALL)])`` serialises the GPU program on a CPU-only machine, each kernel a
Triton custom call (tests/test_gpu_lowering.py checks every kernel that way), and the
same jitted function still runs on the CPU. ``interpret=False`` forces the compiled
lowering for every platform (lowering for the CPU then fails: it has no Triton). There is
no TPU (Mosaic) kernel: a TPU program gets the XLA reference (impl="auto") or interpret
mode; the Triton kernels' masked loads of the partial last block have no Mosaic lowering.

The array is flattened (row-major over its logical shape, so transposed or sliced inputs
get the same flat indices as in the reference) and cut into 1-D blocks of `block_size`
elements. Program i handles positions [i * block_size, (i + 1) * block_size), whose flat
indices are those positions plus `index_offset` (a runtime uint32 read from the key
vector, so every shard offset shares one compiled kernel): it derives them from its
program id, computes each element's random bits there with
`_hash.bits_at` (no random array in memory) and rounds with `_reference.encode`, the same
function the XLA reference uses. The last block is partial when the size is not a
multiple of `block_size`: its loads and stores are masked. Each element is read once
(f32 or bf16) and written once (its 8- or 16-bit pattern).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from precision.rounding import _hash
from precision.rounding import _reference

_U32 = jnp.uint32
# 1024 elements per program, 4 warps: the shape of Triton's memory-bound vector kernels.
BLOCK_SIZE = 1024
NUM_WARPS = 4


# The custom-call target of a compiled (Triton) Pallas kernel in StableHLO. `jax.export`
# refuses to serialise it unless told, since its ABI carries no compatibility guarantee:
# ``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]``.
# (Public as `jax.experimental.pallas.triton.CUSTOM_CALL_TARGET_NAME` in newer JAX.)
TRITON_CUSTOM_CALL = getattr(plgpu, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
# Platforms whose lowering of a Pallas kernel is the compiled Triton one.
GPU_PLATFORMS = ("cuda", "rocm")


def check_interpret(interpret) -> bool | None:
  """`interpret` as given when it is None, True or False; ValueError otherwise."""
  if interpret is None or isinstance(interpret, (bool, np.bool_)):
    return None if interpret is None else bool(interpret)
  raise ValueError(f"interpret={interpret!r}; accepted: None (compiled when lowered for a "
                   "GPU, interpret mode for any other platform), True or False")


def on_gpu_platform(gpu: Callable[..., Any], other: Callable[..., Any], *args) -> Any:
  """``gpu(*args)`` in a program lowered for CUDA or ROCm, ``other(*args)`` in one lowered
  for any other platform: both are traced, the lowering keeps one (XLA removes the
  one-branch conditional that remains). Both must return the same types."""
  return jax.lax.platform_dependent(*args, default=other,
                                    **{p: gpu for p in GPU_PLATFORMS})


def block_indices(block_size: int, n: int) -> tuple[jax.Array, jax.Array]:
  """Inside a kernel: the uint32 positions (0..n-1, row-major) of this program's block and
  the in-bounds mask (False past the end of an array of `n` elements). The flat index that
  picks the random bits is ``position + index_offset`` (see `kernel_keys`)."""
  pid = pl.program_id(0).astype(_U32)
  local = jax.lax.broadcasted_iota(jnp.int32, (block_size,), 0).astype(_U32)
  position = pid * _U32(block_size) + local
  return position, position < _U32(n)


# The key vector every kernel reads: (k1, k2, index_offset, 0). Four entries, not three,
# because Triton block shapes must be powers of two; the last one is unused.
KEYS_SIZE = 4


def kernel_keys(seed: jax.Array, step, index_offset=0) -> jax.Array:
  """uint32[KEYS_SIZE] = (k1, k2, index_offset, 0) for one (seed, step) stream, computed
  once per call outside the kernel; the offset stays a runtime value (no recompile)."""
  k1, k2 = _hash.stream_keys(seed, step)
  return jnp.stack([k1, k2, _hash.offset_from(index_offset), jnp.zeros((), _U32)])


def bits_from_keys(position: jax.Array, keys_ref) -> jax.Array:
  """Inside a kernel: the random bits of the elements at `position` (uint32), i.e. of flat
  index ``keys_ref[2] + position`` (wrapping) in the stream (keys_ref[0], keys_ref[1])."""
  return _hash.bits_at(position + keys_ref[2], keys_ref[0], keys_ref[1])


def check_size(n: int) -> None:
  # Flat indices are uint32 (as in the reference); bigger arrays would wrap them.
  if n >= 2 ** 32:
    raise ValueError(f"Pallas stochastic rounding handles arrays below 2**32 elements; got {n}")


def compiler_params(interpret: bool):
  return None if interpret else plgpu.CompilerParams(num_warps=NUM_WARPS)


def _round_kernel(keys_ref, x_ref, o_ref, *, n, block_size, fi):
  position, in_bounds = block_indices(block_size, n)
  x = plgpu.load(x_ref, mask=in_bounds, other=0)
  rbits = bits_from_keys(position, keys_ref)
  plgpu.store(o_ref, _reference.encode(x, rbits, fi), mask=in_bounds)


@functools.partial(jax.jit, static_argnames=("dtype", "block_size", "interpret"))
def _round(x, keys, *, dtype, block_size, interpret):
  fi = _reference.target_info(dtype)
  n = x.size
  flat = x.reshape(-1)
  kernel = functools.partial(_round_kernel, n=n, block_size=block_size, fi=fi)
  bits = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(n, block_size),),
      in_specs=[pl.BlockSpec((KEYS_SIZE,), lambda i: (0,)),
                pl.BlockSpec((block_size,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block_size,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((n,), _reference.bits_dtype(fi)),
      interpret=interpret,
      compiler_params=compiler_params(interpret),
      name=f"stochastic_round_{fi.name}",
  )(keys, flat)
  return _reference.decode(bits, fi).reshape(x.shape)


def stochastic_round_pallas(x: jax.Array, dtype: Any, key, step=0, *, index_offset=0,
                            block_size: int = BLOCK_SIZE,
                            interpret: bool | None = None) -> jax.Array:
  """Pallas kernel for `stochastic_round`: bit-identical to `stochastic_round_reference`.

  Args:
    x: float32 array (bfloat16 allowed for fp8 targets), any shape.
    dtype: bf16, f16, e4m3 or e5m2 (dtype or name).
    key: int, uint32 scalar or jax.random key.
    step: step counter (uint32-convertible, may be traced).
    index_offset: flat index of `x`'s first element (uint32, wrapping; an int in
      [0, 2**32) or an integer scalar array, may be traced): element i draws the bits of
      index ``index_offset + i``, as in `stochastic_round_reference`. A runtime value:
      shards with different offsets share one compiled kernel.
    block_size: elements per program (a power of two for the Triton lowering).
    interpret: None (default): compiled (Triton) in a program lowered for a GPU
      (CUDA/ROCm), interpret mode in one lowered for any other platform; decided at
      lowering, so ``jax.export(..., platforms=["cuda"])`` on a CPU machine gets the
      compiled kernel. False: compiled for every platform (a CPU lowering then fails);
      True: interpret mode everywhere.

  Returns:
    An array of `dtype` with `x`'s shape.
  """
  fi = _reference.target_info(dtype)
  x = jnp.asarray(x)
  _reference.check_input(x, fi)
  check_size(x.size)
  if block_size < 1 or block_size & (block_size - 1):
    raise ValueError(f"block_size={block_size}; accepted: a power of two")
  interpret = check_interpret(interpret)
  keys = kernel_keys(_hash.seed_from(key), step, index_offset)
  if x.size == 0:
    return jnp.zeros(x.shape, fi.dtype)
  run = lambda interpret: functools.partial(
      _round, dtype=np.dtype(fi.dtype), block_size=block_size, interpret=interpret)
  if interpret is None:
    return on_gpu_platform(run(False), run(True), x, keys)
  return run(interpret)(x, keys)
