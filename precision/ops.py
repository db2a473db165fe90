"""fp32 islands: the ops a model author calls where low precision is unsafe.

Each op upcasts its input to f32, computes there, and returns the input's dtype (cross
entropy returns f32: it is a loss). GEMM helpers take operands in a compute dtype and
accumulate in f32 via ``preferred_element_type``.

| op                 | computes in | returns        | why f32 (PyTorch autocast fp32 list, seeds 000-003) |
|--------------------|-------------|----------------|------------------------------------------------------|
| softmax            | f32         | input dtype    | exp and a long sum; bf16 sums lose small terms      |
| log_softmax        | f32         | input dtype    | log of a sum, as above                               |
| logsumexp          | f32         | input dtype    | as above                                             |
| cross_entropy      | f32         | f32            | the loss; logits can overflow f16 (max 65504)        |
| rms_norm           | f32         | input dtype    | mean of squares and rsqrt                            |
| layer_norm         | f32         | input dtype    | mean, variance and rsqrt                             |
| rotary_embedding   | f32         | input dtype    | sin/cos of large position * frequency products       |
| dot_general/einsum | operands in compute dtype | compute dtype | accumulation in f32 (preferred_element_type), backward GEMMs too |
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision.flax._gemm import policy_dot_general, policy_einsum

_F32 = jnp.float32


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Softmax computed in f32 (exp and normaliser), returned in x's dtype."""
  return jax.nn.softmax(x.astype(_F32), axis=axis, where=where).astype(x.dtype)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """log_softmax computed in f32, returned in x's dtype."""
  return jax.nn.log_softmax(x.astype(_F32), axis=axis).astype(x.dtype)


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
  """logsumexp computed in f32, returned in x's dtype."""
  return jax.nn.logsumexp(x.astype(_F32), axis=axis, keepdims=keepdims).astype(x.dtype)


def cross_entropy(logits: jax.Array, labels: jax.Array, where: jax.Array | None = None) -> jax.Array:
  """Mean cross entropy over tokens, in f32 (nats).

  Args:
    logits: [..., V] any float dtype; upcast to f32 before log-softmax.
    labels: [...] integer class ids.
    where: optional [...] bool mask of tokens that count.
  Returns:
    f32 scalar.
  """
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"cross_entropy labels must be integers, got {labels.dtype}")
  logp = jax.nn.log_softmax(logits.astype(_F32), axis=-1)  # f32: log of a long sum
  nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  if where is None:
    return jnp.mean(nll)
  w = jnp.broadcast_to(where, nll.shape).astype(_F32)
  return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
  """RMSNorm over the last axis; statistics in f32, result in x's dtype."""
  xf = x.astype(_F32)  # f32: mean of squares and rsqrt
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(_F32)
  return y.astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float = 1e-6) -> jax.Array:
  """LayerNorm over the last axis; statistics in f32, result in x's dtype."""
  xf = x.astype(_F32)  # f32: mean, variance and rsqrt
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * scale.astype(_F32)
  if bias is not None:
    y = y + bias.astype(_F32)
  return y.astype(x.dtype)


def rotary_tables(positions: jax.Array, head_dim: int, base: float = 10000.0):
  """(sin, cos) tables of shape [..., head_dim // 2] in f32 for integer positions."""
  if head_dim % 2:
    raise ValueError(f"rotary head_dim must be even, got {head_dim}")
  inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=_F32) / head_dim))
  inv_freq = inv_freq.reshape((1,) * positions.ndim + (-1,))
  angles = positions.astype(_F32)[..., None] * inv_freq  # f32: position * freq is large
  return jnp.sin(angles), jnp.cos(angles)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (half-split layout) on x [..., T, H, D]; positions [..., T].

  Tables and rotation in f32, result in x's dtype.
  """
  sin, cos = rotary_tables(positions, x.shape[-1], base)
  sin, cos = sin[..., None, :], cos[..., None, :]  # broadcast over heads
  xf = x.astype(_F32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  # Explicit broadcast (rank promotion may be set to "raise"): tables [..., T, 1, D/2].
  sin = jnp.broadcast_to(sin.reshape((1,) * (x1.ndim - sin.ndim) + sin.shape), x1.shape)
  cos = jnp.broadcast_to(cos.reshape((1,) * (x1.ndim - cos.ndim) + cos.shape), x1.shape)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _common_dtype(operands, what: str):
  dtypes = {np.dtype(o.dtype) for o in operands}
  if len(dtypes) != 1:
    raise ValueError(
        f"{what}: operands have dtypes {sorted(d.name for d in dtypes)}; pass compute_dtype= "
        "(e.g. jnp.bfloat16) to say which dtype the GEMM runs in")
  return dtypes.pop()


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, compute_dtype: Any = None,
                precision=None) -> jax.Array:
  """dot_general with both operands in `compute_dtype`, f32 accumulation, and the result
  rounded once to `compute_dtype` (default: the operands' common dtype).

  The backward GEMMs also take compute-dtype operands and accumulate in f32 (a custom VJP;
  see precision.flax.policy_dot_general), unlike `lax.dot_general(...,
  preferred_element_type=f32)` whose transpose multiplies an f32 cotangent by a bf16 operand.
  """
  if compute_dtype is None:
    compute_dtype = _common_dtype((lhs, rhs), "dot_general")
  return policy_dot_general(lhs, rhs, dimension_numbers, compute_dtype, precision=precision)


def einsum(subscripts: str, *operands: jax.Array, compute_dtype: Any = None,
           precision=None) -> jax.Array:
  """einsum with operands in `compute_dtype` (default: their common dtype), f32
  accumulation forward and backward, result in `compute_dtype`.

  Examples:
    >>> scores = ops.einsum("bqhd,bkhd->bhqk", q, k)   # q, k bf16 -> bf16, f32 accumulate
  """
  if compute_dtype is None:
    compute_dtype = _common_dtype(operands, "einsum")
  return policy_einsum(subscripts, *operands, compute_dtype=compute_dtype, precision=precision)
