"""fp32 islands: the ops a model author calls where low precision is unsafe.

Each op upcasts its input to f32, computes there, and returns the input's dtype (cross
entropy returns f32: it is a loss). GEMM helpers take operands in a compute dtype and
accumulate in f32 via ``preferred_element_type``.

Activation memory. Differentiated naively, an island keeps its f32 intermediates for the
backward pass (the f32 upcast of a norm's input, a softmax's f32 output): 4 bytes per
element where the activation itself takes 2 in bf16. For inputs below f32 (f16, bf16, fp8)
every island here is a custom VJP that keeps only the low-precision input (plus params and
masks, which do not grow with the batch) and, in the backward pass, recomputes the same f32
forward from it and differentiates that with JAX's own rules. The upcast is exact and the
recomputation repeats the same f32 ops on the same inputs, so values and gradients are those
of the naive version, bit for bit (tests/test_activation_memory.py); the price is one more
f32 forward of the island in the backward pass (cheap, memory-bound elementwise work and
row reductions, as FlashAttention recomputes its probabilities). f32 inputs take the plain
path: an fp32 policy stays bit-identical to a model written without the library.
`rotary_embedding` is linear in x: its VJP keeps only the positions, whatever the dtype.

| op                 | computes in | returns        | why f32 (PyTorch autocast's fp32 list, LLM precision maps) |
|--------------------|-------------|----------------|------------------------------------------------------|
| softmax            | f32         | input dtype    | exp and a long sum; bf16 sums lose small terms      |
| log_softmax        | f32         | input dtype    | log of a sum, as above                               |
| logsumexp          | f32         | input dtype    | as above                                             |
| cross_entropy      | f32         | f32            | the loss; logits can overflow f16 (max 65504)        |
| rms_norm           | f32         | input dtype    | mean of squares and rsqrt                            |
| layer_norm         | f32         | input dtype    | mean, variance and rsqrt                             |
| rotary_embedding   | f32         | input dtype    | sin/cos of large position * frequency products       |
| attention_probs    | f32         | scores' dtype  | scale, mask and softmax of attention scores          |
| dot_general/einsum | operands in compute dtype | compute dtype | accumulation in f32 (preferred_element_type), backward GEMMs too |
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision._dtypes import below_f32 as _below_f32  # narrow inputs: islands save them for backward
from precision._gemm import policy_dot_general, policy_einsum

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _f32_island(fn, out_dtype, x, params, consts):
  """`fn(x.astype(f32), params, consts).astype(out_dtype)`, whose backward pass keeps only
  `x` (in its own, narrow dtype), `params` and `consts` and recomputes the f32 forward.

  fn: an f32 function (xf, params, consts) -> f32 array, differentiable in xf and params
    (a pytree of float arrays, or None); consts: a pytree of arrays it only reads (masks).
    Static arguments (axis, eps, scale) are bound into fn (e.g. functools.partial).
  """
  return fn(x.astype(_F32), params, consts).astype(out_dtype)


def _f32_island_fwd(fn, out_dtype, x, params, consts):
  out = fn(x.astype(_F32), params, consts).astype(out_dtype)
  # Residuals: x in its narrow dtype (2 bytes per element for bf16), not the f32 upcast or
  # the f32 intermediates plain autodiff would keep.
  return out, (x, params, consts)


def _f32_island_bwd(fn, out_dtype, res, g):
  x, params, consts = res
  # The upcast is exact and fn repeats the forward's f32 ops on the same inputs, so the
  # recomputed values are the forward's; jax.vjp then differentiates them with the same
  # rules (and the same f32 ops) that plain autodiff of the forward would use.
  _, vjp = jax.vjp(lambda xf, p: fn(xf, p, consts), x.astype(_F32), params)
  dxf, dparams = vjp(g.astype(_F32))  # the transpose of .astype(out_dtype)
  return dxf.astype(x.dtype), dparams, None  # the transpose of .astype(f32)


_f32_island.defvjp(_f32_island_fwd, _f32_island_bwd)


def _softmax_fn(axis, xf, params, where):
  del params
  return softmax(xf, axis=axis, where=where)


def softmax(x: jax.Array, axis: int = -1, where: jax.Array | None = None) -> jax.Array:
  """Softmax computed in f32 (exp and normaliser), returned in x's dtype.

  For x below f32 the backward pass keeps x itself, not the f32 probabilities, and
  recomputes them (see the module docstring); values and gradients are unchanged.
  """
  if _below_f32(x.dtype):
    return _f32_island(functools.partial(_softmax_fn, axis), x.dtype, x, None, where)
  return jax.nn.softmax(x.astype(_F32), axis=axis, where=where).astype(x.dtype)


def _log_softmax_fn(axis, xf, params, consts):
  del params, consts
  return log_softmax(xf, axis=axis)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """log_softmax computed in f32, returned in x's dtype (backward keeps x, see softmax)."""
  if _below_f32(x.dtype):
    return _f32_island(functools.partial(_log_softmax_fn, axis), x.dtype, x, None, None)
  return jax.nn.log_softmax(x.astype(_F32), axis=axis).astype(x.dtype)


def _logsumexp_fn(axis, keepdims, xf, params, consts):
  del params, consts
  return logsumexp(xf, axis=axis, keepdims=keepdims)


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
  """logsumexp computed in f32, returned in x's dtype (backward keeps x, see softmax)."""
  if _below_f32(x.dtype):
    return _f32_island(functools.partial(_logsumexp_fn, axis, keepdims), x.dtype, x, None,
                       None)
  return jax.nn.logsumexp(x.astype(_F32), axis=axis, keepdims=keepdims).astype(x.dtype)


def _attention_probs_fn(scale, sf, params, mask):
  del params
  sf = sf * scale
  if mask is not None:
    mask = jnp.broadcast_to(mask.reshape((1,) * (sf.ndim - mask.ndim) + mask.shape), sf.shape)
    sf = jnp.where(mask, sf, jnp.finfo(_F32).min)
  return softmax(sf, axis=-1)


def attention_probs(scores: jax.Array, mask: jax.Array | None = None,
                    scale: float = 1.0) -> jax.Array:
  """Attention probabilities from raw q.k scores: scale, mask and softmax in f32, the
  result rounded once to scores' dtype (for the probs.v GEMM).

  Computes `softmax(where(mask, scores.astype(f32) * scale, finfo(f32).min))` over the last
  axis; a fully masked row comes out uniform. For scores below f32 the backward pass keeps
  the scores themselves (2 bytes per element in bf16) instead of the f32 probabilities, and
  recomputes those (see the module docstring): 4 bytes per score fewer, same gradients.

  Args:
    scores: [..., Tq, Tk] floating, e.g. the bf16 output of `einsum("bthk,bshk->bhts")`.
    mask: optional bool array broadcastable (trailing axes) to scores; True = attend.
    scale: a Python number multiplying the scores in f32, e.g. 1 / sqrt(head_dim).
  Returns:
    probabilities [..., Tq, Tk] in scores' dtype.

  Examples:
    >>> causal = jnp.tril(jnp.ones((T, T), bool))
    >>> probs = ops.attention_probs(scores, causal, 1 / math.sqrt(head_dim))
  """
  if not jnp.issubdtype(scores.dtype, jnp.floating):
    raise ValueError(f"attention_probs scores must be floating, got {scores.dtype}")
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
    raise ValueError(f"attention_probs scale must be a Python number, got {scale!r}")
  if mask is not None:
    if mask.dtype != np.bool_:
      raise ValueError(f"attention_probs mask must be bool, got {mask.dtype}")
    if mask.ndim > scores.ndim:
      raise ValueError(f"attention_probs mask of shape {mask.shape} has more axes than "
                       f"scores {scores.shape}")
  fn = functools.partial(_attention_probs_fn, float(scale))
  if _below_f32(scores.dtype):
    return _f32_island(fn, scores.dtype, scores, None, mask)
  return fn(scores.astype(_F32), None, mask).astype(scores.dtype)


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


def _lead(p: jax.Array, like: jax.Array) -> jax.Array:
  """p (a [D] scale or bias) in f32 with leading unit axes to like's rank: an explicit
  broadcast, since rank promotion may be set to "raise"."""
  return p.astype(_F32).reshape((1,) * (like.ndim - p.ndim) + p.shape)


def _rms_norm_fn(eps, xf, scale, consts):
  del consts
  return rms_norm(xf, scale, eps)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
  """RMSNorm over the last axis; statistics in f32, result in x's dtype.

  For x below f32 the backward pass keeps x (not its f32 upcast) and recomputes the f32
  statistics (see the module docstring); values and gradients are unchanged.
  """
  if _below_f32(x.dtype):
    return _f32_island(functools.partial(_rms_norm_fn, eps), x.dtype, x, scale, None)
  xf = x.astype(_F32)  # f32: mean of squares and rsqrt
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * _lead(scale, y)
  return y.astype(x.dtype)


def _layer_norm_fn(eps, xf, params, consts):
  del consts
  return layer_norm(xf, *params, eps=eps)


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float = 1e-6) -> jax.Array:
  """LayerNorm over the last axis; statistics in f32, result in x's dtype.

  For x below f32 the backward pass keeps x (not its f32 upcast) and recomputes the f32
  statistics (see the module docstring); values and gradients are unchanged.
  """
  if _below_f32(x.dtype):
    return _f32_island(functools.partial(_layer_norm_fn, eps), x.dtype, x, (scale, bias),
                       None)
  xf = x.astype(_F32)  # f32: mean, variance and rsqrt
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * _lead(scale, y)
  if bias is not None:
    y = y + _lead(bias, y)
  return y.astype(x.dtype)


def rotary_tables(positions: jax.Array, head_dim: int, base: float = 10000.0):
  """(sin, cos) tables of shape [..., head_dim // 2] in f32 for integer positions."""
  if head_dim % 2:
    raise ValueError(f"rotary head_dim must be even, got {head_dim}")
  inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=_F32) / head_dim))
  inv_freq = inv_freq.reshape((1,) * positions.ndim + (-1,))
  angles = positions.astype(_F32)[..., None] * inv_freq  # f32: position * freq is large
  return jnp.sin(angles), jnp.cos(angles)


def _rotate(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  """Rotary embedding of x [..., T, H, D] in f32, returned in x's dtype; linear in x."""
  sin, cos = rotary_tables(positions, x.shape[-1], base)
  sin, cos = sin[..., None, :], cos[..., None, :]  # broadcast over heads
  xf = x.astype(_F32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  # Explicit broadcast (rank promotion may be set to "raise"): tables [..., T, 1, D/2].
  sin = jnp.broadcast_to(sin.reshape((1,) * (x1.ndim - sin.ndim) + sin.shape), x1.shape)
  cos = jnp.broadcast_to(cos.reshape((1,) * (x1.ndim - cos.ndim) + cos.shape), x1.shape)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rotary(x, positions, base):
  return _rotate(x, positions, base)


def _rotary_fwd(x, positions, base):
  # Plain autodiff would keep the sin/cos tables broadcast to x's shape (in f32, 4 bytes
  # per element of x, whatever x's dtype); the rotation is linear in x, so its transpose
  # needs only the positions.
  return _rotate(x, positions, base), positions


def _rotary_bwd(base, positions, g):
  # JAX's transpose of the same linear map (tables recomputed from the positions): the
  # same f32 ops, so the same gradient as plain autodiff.
  aval = jax.ShapeDtypeStruct(g.shape, g.dtype)
  (dx,) = jax.linear_transpose(lambda x: _rotate(x, positions, base), aval)(g)
  return dx, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (half-split layout) on x [..., T, H, D]; positions [..., T].

  Tables and rotation in f32, result in x's dtype. With integer positions the backward
  pass keeps only the positions (the rotation is linear in x) and recomputes the tables;
  gradients are those of plain autodiff.
  """
  if jnp.issubdtype(positions.dtype, jnp.integer):
    return _rotary(x, positions, float(base))
  return _rotate(x, positions, base)


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


__all__ = [
    "attention_probs",
    "cross_entropy",
    "dot_general",
    "einsum",
    "layer_norm",
    "log_softmax",
    "logsumexp",
    "rms_norm",
    "rotary_embedding",
    "rotary_tables",
    "softmax",
]
