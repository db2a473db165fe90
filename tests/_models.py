"""Small models shared by the Flax/audit tests and experiments/bench_policy.py.

Each model is written once and built two ways:
- library path (`handwritten=None`): plain layers, policy-agnostic code calling
  precision.ops for attention scores/softmax; precision is applied from outside with
  precision.flax.apply_policy / linen_policy.
- hand-written path (`handwritten=jnp.bfloat16`): the way Flax users write mixed precision
  today, every layer given `dtype=bf16, param_dtype=f32, preferred_element_type=f32`,
  einsums with `preferred_element_type=f32`, and explicit casts back to bf16 after each
  GEMM. Flax's norm layers mix bf16 inputs with f32 statistics, so the hand-written models
  must be run under `jax.numpy_dtype_promotion("standard")`.
With `handwritten=jnp.float32` the hand-written path is the plain fp32 model without the
library (no precision.ops), used for the bit-identity gates.
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision import ops

F32 = jnp.float32


def _act(y, dtype):
  return y if dtype is None else y.astype(dtype)


def _attention(q, k, v, handwritten):
  """Causal attention over [B, T, H, Dh]; scores and softmax as each path writes them."""
  t = q.shape[1]
  mask = jnp.tril(jnp.ones((t, t), dtype=bool))
  scale = q.shape[-1] ** -0.5
  if handwritten is None:
    s = ops.einsum("bqhd,bkhd->bhqk", q * scale, k)
    p = ops.softmax(s, axis=-1, where=mask)          # f32 island, returns s.dtype
    return ops.einsum("bhqk,bkhd->bqhd", p, v)
  s = jnp.einsum("bqhd,bkhd->bhqk", q * jnp.asarray(scale, q.dtype), k,
                 preferred_element_type=F32)
  p = jax.nn.softmax(s.astype(F32), axis=-1, where=mask).astype(handwritten)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=F32)
  return o.astype(handwritten)


def _gemm_kwargs(handwritten):
  if handwritten is None:
    return {}
  return dict(dtype=handwritten, param_dtype=F32, preferred_element_type=F32)


# ----------------------------------------------------------------------------- NNX


class MLP(nnx.Module):
  """x [B, d_in] float -> Linear -> LayerNorm -> gelu -> Linear -> [B, d_out]."""

  def __init__(self, d_in=16, d_hidden=32, d_out=8, *, rngs, handwritten=None):
    kw = _gemm_kwargs(handwritten)
    self.handwritten = handwritten
    self.up = nnx.Linear(d_in, d_hidden, rngs=rngs, **kw)
    norm_kw = {} if handwritten is None else dict(dtype=handwritten, param_dtype=F32)
    self.norm = nnx.LayerNorm(d_hidden, rngs=rngs, **norm_kw)
    self.down = nnx.Linear(d_hidden, d_out, rngs=rngs, **kw)

  def __call__(self, x):
    h = _act(self.up(x), self.handwritten)
    h = jax.nn.gelu(self.norm(h))
    return self.down(h)


class Block(nnx.Module):
  """Pre-norm transformer block: RMSNorm, causal attention, RMSNorm, gelu MLP (no biases)."""

  def __init__(self, d, heads, *, rngs, handwritten=None):
    kw = dict(use_bias=False, rngs=rngs, **_gemm_kwargs(handwritten))
    norm_kw = {} if handwritten is None else dict(dtype=handwritten, param_dtype=F32)
    self.handwritten, self.heads = handwritten, heads
    self.norm1 = nnx.RMSNorm(d, rngs=rngs, **norm_kw)
    self.qkv = nnx.Linear(d, 3 * d, **kw)
    self.proj = nnx.Linear(d, d, **kw)
    self.norm2 = nnx.RMSNorm(d, rngs=rngs, **norm_kw)
    self.up = nnx.Linear(d, 4 * d, **kw)
    self.down = nnx.Linear(4 * d, d, **kw)

  def __call__(self, x):
    b, t, d = x.shape
    hw = self.handwritten
    qkv = _act(self.qkv(self.norm1(x)), hw).reshape(b, t, 3, self.heads, d // self.heads)
    o = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], hw).reshape(b, t, d)
    x = x + self.proj(o).astype(x.dtype)
    h = jax.nn.gelu(_act(self.up(self.norm2(x)), hw))
    return x + self.down(h).astype(x.dtype)


class AttentionLM(nnx.Module):
  """tokens [B, T] int32 -> Embed -> n_layers Blocks -> RMSNorm -> lm_head -> logits [B, T, V]."""

  def __init__(self, vocab=64, d=32, heads=4, n_layers=1, *, rngs, handwritten=None):
    self.handwritten = handwritten
    emb_kw = {} if handwritten is None else dict(dtype=handwritten, param_dtype=F32)
    self.embed = nnx.Embed(vocab, d, rngs=rngs, **emb_kw)
    self.blocks = nnx.List([Block(d, heads, rngs=rngs, handwritten=handwritten)
                            for _ in range(n_layers)])
    norm_kw = {} if handwritten is None else dict(dtype=handwritten, param_dtype=F32)
    self.norm = nnx.RMSNorm(d, rngs=rngs, **norm_kw)
    self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs, **_gemm_kwargs(handwritten))

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.lm_head(self.norm(x))


def lm_loss(model, tokens):
  """Next-token cross entropy (f32) of an AttentionLM on `tokens` [B, T]."""
  logits = model(tokens[:, :-1])
  return ops.cross_entropy(logits, tokens[:, 1:])


def mlp_loss(model, x, y):
  out = model(x)
  return jnp.mean(jnp.square(out.astype(F32) - y))


# ----------------------------------------------------------------------------- Linen


def _linen_gemm_kwargs(handwritten):
  # Linen's Dense has no preferred_element_type field: hand-written code passes it through
  # its dot_general.
  if handwritten is None:
    return {}
  return dict(dtype=handwritten, param_dtype=F32,
              dot_general=functools.partial(jax.lax.dot_general, preferred_element_type=F32))


class LinenMLP(nn.Module):
  d_hidden: int = 32
  d_out: int = 8
  handwritten: object = None

  @nn.compact
  def __call__(self, x):
    kw = _linen_gemm_kwargs(self.handwritten)
    norm_kw = {} if self.handwritten is None else dict(dtype=self.handwritten, param_dtype=F32)
    h = _act(nn.Dense(self.d_hidden, name="up", **kw)(x), self.handwritten)
    h = jax.nn.gelu(nn.LayerNorm(name="norm", **norm_kw)(h))
    return nn.Dense(self.d_out, name="down", **kw)(h)


class LinenBlock(nn.Module):
  d: int
  heads: int
  handwritten: object = None

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    hw = self.handwritten
    kw = dict(use_bias=False, **_linen_gemm_kwargs(hw))
    norm_kw = {} if hw is None else dict(dtype=hw, param_dtype=F32)
    h = nn.RMSNorm(name="norm1", **norm_kw)(x)
    qkv = _act(nn.Dense(3 * d, name="qkv", **kw)(h), hw).reshape(b, t, 3, self.heads, d // self.heads)
    o = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], hw).reshape(b, t, d)
    x = x + nn.Dense(d, name="proj", **kw)(o).astype(x.dtype)
    h = nn.RMSNorm(name="norm2", **norm_kw)(x)
    h = jax.nn.gelu(_act(nn.Dense(4 * d, name="up", **kw)(h), hw))
    return x + nn.Dense(d, name="down", **kw)(h).astype(x.dtype)


class LinenAttentionLM(nn.Module):
  vocab: int = 64
  d: int = 32
  heads: int = 4
  n_layers: int = 1
  handwritten: object = None

  @nn.compact
  def __call__(self, tokens):
    hw = self.handwritten
    emb_kw = {} if hw is None else dict(dtype=hw, param_dtype=F32)
    x = nn.Embed(self.vocab, self.d, name="embed", **emb_kw)(tokens)
    for i in range(self.n_layers):
      x = LinenBlock(self.d, self.heads, hw, name=f"block{i}")(x)
    x = nn.RMSNorm(name="norm", **emb_kw)(x)
    return nn.Dense(self.vocab, use_bias=False, name="lm_head", **_linen_gemm_kwargs(hw))(x)


# ----------------------------------------------------------------------------- HLO counts

_DEF = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\((%[\w.\-]+), (%[\w.\-]+)\).*?"
                  r"lhs_contracting_dims=\{([\d,]*)\}")
_CONVERT = re.compile(r"= \S+ convert\(")


def _dims(s: str) -> list[int]:
  return [int(d) for d in s.split(",") if d]


def hlo_stats(hlo_text: str) -> dict:
  """{"dots", "dot_flops" (2 * MACs summed over dots), "converts"} of compiled HLO text."""
  shapes = {}
  for line in hlo_text.splitlines():
    m = _DEF.match(line)
    if m:
      shapes[m.group(1)] = _dims(m.group(2))
  dots, flops = 0, 0
  for m in _DOT.finditer(hlo_text):
    out, lhs, contract = _dims(m.group(1)), shapes[m.group(2)], _dims(m.group(4))
    dots += 1
    flops += 2 * int(np.prod(out)) * int(np.prod([lhs[i] for i in contract]))
  return {"dots": dots, "dot_flops": flops, "converts": len(_CONVERT.findall(hlo_text))}
