"""A byte-level language model written with no dtype in mind, as users write theirs.

Nothing here knows about `precision`: Flax's own nnx.Embed / nnx.Linear / nnx.LayerNorm
with biases, attention written with jnp.einsum and jax.nn.softmax, GELU, a plain
optax cross entropy. It is what the sweep's "uninstrumented" rows train: every recipe
reaches it only through `precision.flax.apply_recipe`, with none of the explicit f32
islands of models/gpt.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class PlainLM(nnx.Module):
  """tokens [B, T] int32 -> logits [B, T, vocab]: pre-norm causal attention + MLP blocks."""

  def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, *,
               rngs: nnx.Rngs):
    self.heads = heads
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (512, d)))
    self.blocks = nnx.List([_Block(d, heads, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


class _Block(nnx.Module):
  def __init__(self, d, heads, *, rngs):
    self.heads = heads
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.qkv, self.proj = nnx.Linear(d, 3 * d, rngs=rngs), nnx.Linear(d, d, rngs=rngs)
    self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, d)
    x = x + self.proj(a)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


def loss_fn(model: PlainLM, tokens):
  """Mean next-byte cross entropy (nats) of tokens [B, T+1]."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
