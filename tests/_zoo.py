"""A zoo of small models written the way other people write them, not the way we would.

None of these models knows about `precision`: biases everywhere, a subclassed nnx.Embed
with its own attribute and __call__, attention written with jnp.einsum and jax.nn.softmax,
a hand-written RMSNorm, a tanh logit soft-cap, tied embeddings (`attend`), Flax's own
nnx.MultiHeadAttention / nnx.Einsum / nnx.BatchNorm and Linen's
MultiHeadDotProductAttention / Conv / BatchNorm, a plain-JAX model (no Flax) with
lax.scan over layers and jax.checkpoint, a model under an explicit-sharding mesh with
`out_sharding=` annotations; and code that chose dtypes of its own: a function casting to
bf16 around jax.nn.dot_product_attention, a Flax NNX model configured `dtype=bfloat16`
(Flax's way of asking for mixed precision), an NNX model with Dropout trained through
split/merge/jax.grad, and a Linen model called with `train=`/`deterministic` keywords;
Flax's ImageNet ResNet (`BatchNorm(axis_name="batch")`) trained under shard_map over 8
devices and evaluated with `train=False` outside it.
An NNX scan-over-layers model (`nnx.vmap` to create the blocks, `nnx.scan` to apply them)
and Linen's (`nn.scan` of an `nn.remat`'d block).
Where Haiku and Equinox are installed (they are not dependencies): Haiku's transformer,
a Haiku `transform_with_state` model, and an Equinox model with `eqx.nn.State`.

Each case builds the same model (same seed) either plain (`recipe=None`: no library at all)
or under a recipe applied from outside, the one-line way a user would:
`precision.flax.apply_recipe(model, recipe)` (NNX), `precision.flax.linen_policy(...)`
(Linen) or `precision.autocast(fn, recipe)` (plain JAX). `Built.loss(params)` returns
(f32 loss, updated non-param state or None).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import precision as mp

VOCAB, T, B, D, HEADS = 64, 8, 4, 32, 4


@contextlib.contextmanager
def user_code(extra=None):
  """What the zoo's code assumes (JAX's defaults: standard dtype promotion, implicit rank
  broadcasting), whatever the test session sets; plus `extra` (e.g. a linen_policy)."""
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"), (
      extra or contextlib.nullcontext()):
    yield


@dataclasses.dataclass
class Built:
  loss: Callable[[Any], tuple[jax.Array, Any]]   # params -> (loss, new state or None)
  params: Any
  context: Callable[[], Any] = user_code  # entered around tracing
  # (params, state) -> outputs of the model in evaluation mode, where a case has one.
  evaluate: Callable[[Any, Any], jax.Array] | None = None


def _tokens(seed=1, batch=B):
  return jax.random.randint(jax.random.key(seed), (batch, T + 1), 0, VOCAB)


def _xent(logits, labels):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# ----------------------------------------------------------------------------- NNX models


class ScaledEmbed(nnx.Embed):
  """Gemma-style embedding: a subclass with an attribute of its own and its own __call__
  (scales by sqrt(d)); `attend` (inherited) ties the output head to it."""

  def __init__(self, num_embeddings, features, *, rngs, dtype=None):
    super().__init__(num_embeddings, features, rngs=rngs,
                     **({} if dtype is None else dict(dtype=dtype)))
    self.embed_dim = features

  def __call__(self, tokens):
    return super().__call__(tokens) * jnp.sqrt(float(self.embed_dim))


class MyRMSNorm(nnx.Module):
  """RMSNorm the way model code writes it: jnp ops, a (1 + scale) gain. With a `dtype`
  (mixed precision by hand) the statistics run in f32 and the result is cast back."""

  def __init__(self, dim, eps=1e-6, dtype=None):
    self.scale = nnx.Param(jnp.zeros((dim,)))
    self.eps, self.dtype = eps, dtype

  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(jnp.float32)  # f32 statistics
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(var + self.eps) * (1.0 + self.scale[...])
    return y if self.dtype is None else y.astype(self.dtype)


class EinsumBlock(nnx.Module):
  """Attention with Flax's nnx.Einsum projections (with biases), jnp.einsum scores and
  jax.nn.softmax; an MLP of raw param matmuls with biases.

  `dtype=None` is the model as written; `dtype=jnp.bfloat16` is the same model with mixed
  precision written by hand, the way Flax users do it today: Flax layers given
  `dtype`/`param_dtype`, einsums with `preferred_element_type=f32`, params cast at use, the
  softmax and norms upcast to f32 explicitly.
  """

  def __init__(self, *, rngs, dtype=None, d=D, heads=HEADS):
    k = d // heads
    self.dtype, self.d = dtype, d
    self.norm1, self.norm2 = MyRMSNorm(d, dtype=dtype), MyRMSNorm(d, dtype=dtype)
    lkw = {} if dtype is None else dict(dtype=dtype, param_dtype=jnp.float32)
    self.qkv = nnx.Einsum("btd,sdhk->sbthk", (3, d, heads, k), (3, 1, 1, heads, k),
                          rngs=rngs, **lkw)
    self.out = nnx.Linear(d, d, rngs=rngs, **lkw)
    init = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(init(rngs.params(), (d, 4 * d)))
    self.b1 = nnx.Param(jnp.zeros((4 * d,)))
    self.w2 = nnx.Param(init(rngs.params(), (4 * d, d)))
    self.b2 = nnx.Param(jnp.zeros((d,)))

  def _p(self, p):
    return p[...] if self.dtype is None else p[...].astype(self.dtype)

  def __call__(self, x):
    b, t, _ = x.shape
    dt = self.dtype
    q, k, v = self.qkv(self.norm1(x))
    if dt is None:
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    else:  # f32 scores for the softmax
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                          preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    if dt is not None:
      probs = probs.astype(dt)
    att = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, self.d)
    x = x + self.out(att)
    h = jax.nn.gelu(self.norm2(x) @ self._p(self.w1) + self._p(self.b1))
    return x + h @ self._p(self.w2) + self._p(self.b2)


class GemmaStyleLM(nnx.Module):
  """Scaled (subclassed) embedding, einsum attention blocks, a custom RMSNorm, tied
  output head (`attend`) and a tanh logit soft-cap. `dtype`: see EinsumBlock."""

  def __init__(self, *, rngs, n_layers=2, cap=30.0, dtype=None, vocab=VOCAB, d=D,
               heads=HEADS):
    self.embed = ScaledEmbed(vocab, d, rngs=rngs, dtype=dtype)
    self.blocks = nnx.List([EinsumBlock(rngs=rngs, dtype=dtype, d=d, heads=heads)
                            for _ in range(n_layers)])
    self.final_norm = MyRMSNorm(d, dtype=dtype)
    self.cap, self.dtype = cap, dtype

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    logits = self.embed.attend(self.final_norm(x))
    if self.dtype is not None:
      logits = logits.astype(jnp.float32)  # the soft-cap in f32
    return self.cap * jnp.tanh(logits / self.cap)


class BiasMLP(nnx.Module):
  """Flax defaults everywhere: Linear with biases, LayerNorm, BatchNorm (train mode)."""

  def __init__(self, *, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, use_running_average=False, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    h = jax.nn.relu(self.bn(self.up(x)))
    return self.down(jax.nn.gelu(self.norm(h)))


class MHAModel(nnx.Module):
  """Flax's own nnx.MultiHeadAttention (self-attention, causal mask) and a Linear head."""

  def __init__(self, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.attn(x, mask=nnx.make_causal_mask(tokens))
    return self.head(x)


class Bf16ConfiguredLM(nnx.Module):
  """Mixed precision the way Flax users configure it: every layer given
  `dtype=jnp.bfloat16` (params stay f32: Flax casts them at use), Flax's own
  MultiHeadAttention and LayerNorm, a pre-norm block, the logits cast to f32 for the loss."""

  def __init__(self, *, rngs, dtype=jnp.bfloat16):
    self.embed = nnx.Embed(VOCAB, D, dtype=dtype, rngs=rngs)
    self.norm1 = nnx.LayerNorm(D, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, dtype=dtype, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(D, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(D, 4 * D, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * D, D, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, dtype=dtype, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(tokens))
    x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
    return self.head(x).astype(jnp.float32)


class DropoutMLP(nnx.Module):
  """Flax's NNX MLP example: Linear, Dropout holding its own nnx.Rngs, BatchNorm."""

  def __init__(self, *, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.bn = nnx.BatchNorm(32, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.down = nnx.Linear(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.dropout(self.bn(self.up(x)))))


# ----------------------------------------------------------------------------- Linen models


class LinenDecoder(nn.Module):
  """A Linen decoder LM: Embed (tied head via attend), MultiHeadDotProductAttention with a
  causal mask, LayerNorm, Dense MLP with biases."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, D)
    x = embed(tokens)
    for _ in range(2):
      h = nn.LayerNorm()(x)
      h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(
          h, mask=nn.make_causal_mask(tokens))
      x = x + h
      h = nn.Dense(4 * D)(nn.LayerNorm()(x))
      x = x + nn.Dense(D)(nn.gelu(h))
    return embed.attend(nn.LayerNorm()(x))


class LinenResNet(nn.Module):
  """Conv + BatchNorm residual blocks (batch_stats), average pool, Dense classifier."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    for _ in range(2):
      y = nn.Conv(8, (3, 3), use_bias=False)(x)
      y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
      y = nn.Conv(8, (3, 3), use_bias=False)(y)
      x = nn.relu(x + nn.BatchNorm(use_running_average=not train)(y))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


class LinenTrainKeywords(nn.Module):
  """A Linen classifier called `model.apply(v, x, train=True, rngs={"dropout": k},
  mutable=["batch_stats"])`: BatchNorm and Dropout switched by the `train` keyword, a
  sub-block taking `deterministic`."""

  @nn.compact
  def __call__(self, x, *, train: bool):
    x = nn.Dense(32)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    x = _LinenDropoutBlock()(x, deterministic=not train)
    return nn.Dense(10)(x)


class _LinenDropoutBlock(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool):
    h = nn.Dropout(0.25)(nn.gelu(nn.Dense(32)(x)), deterministic=deterministic)
    return x + nn.LayerNorm()(h)


class _ImageNetBlock(nn.Module):
  """Flax ImageNet's ResNetBlock: conv-norm-relu-conv-norm (the last norm's scale
  initialised to zero), a 1x1 projection shortcut with its own norm where the shape
  changes."""
  filters: int
  norm: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, use_bias=False)
    y = nn.relu(self.norm()(conv(self.filters, (3, 3), self.strides)(x)))
    y = self.norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
    if x.shape != y.shape:
      x = self.norm(name="norm_proj")(
          conv(self.filters, (1, 1), self.strides, name="conv_proj")(x))
    return nn.relu(x + y)


class LinenImageNetResNet(nn.Module):
  """Flax's ImageNet ResNet, small: `__call__(x, train=True)`, every BatchNorm
  `partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
  axis_name="batch")` (statistics averaged over the devices the batch is split across), a
  strided stem with max pooling, two stages, mean pooling, Dense head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, axis_name="batch")
    x = nn.Conv(8, (3, 3), (2, 2), padding=[(1, 1), (1, 1)], use_bias=False,
                name="conv_init")(x)
    x = nn.relu(norm(name="bn_init")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    x = _ImageNetBlock(8, norm)(x)
    x = _ImageNetBlock(16, norm, strides=(2, 2))(x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class _LinenScanBlock(nn.Module):
  """One pre-norm residual block, in nn.scan's (carry, x) -> (carry, y) form."""

  @nn.compact
  def __call__(self, x, _):
    return x + nn.gelu(nn.Dense(x.shape[-1])(nn.LayerNorm()(x))), None


class LinenScanOverLayers(nn.Module):
  """Linen's scan over layers (MaxText's layout): the blocks one `nn.scan` of an
  `nn.remat`'d block, params stacked on a leading layer axis
  (variable_axes={"params": 0}, split_rngs={"params": True}), a Dense in and out."""
  n_layers: int = 3
  d: int = 16

  @nn.compact
  def __call__(self, x):
    blocks = nn.scan(nn.remat(_LinenScanBlock), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.n_layers)
    x, _ = blocks(name="blocks")(nn.Dense(self.d)(x), None)
    return nn.Dense(4)(x)


# ----------------------------------------------------------------------------- plain JAX


def plain_init(key, n_layers=3, d=D):
  keys = jax.random.split(key, 3)
  return {
      "w_in": jax.random.normal(keys[0], (16, d)) / 4.0,
      "layers": {"w": jax.random.normal(keys[1], (n_layers, d, d)) / math.sqrt(d),
                 "b": jnp.full((n_layers, d), 0.01)},
      "w_out": jax.random.normal(keys[2], (d, 10)) / math.sqrt(d),
  }


def plain_loss(params, x, labels):
  """No Flax: a stack of residual layers run by lax.scan, each rematerialised."""
  h = x @ params["w_in"]

  @jax.checkpoint
  def layer(h, wb):
    w, b = wb
    return h + jax.nn.silu(h @ w + b), None

  h, _ = jax.lax.scan(layer, h, (params["layers"]["w"], params["layers"]["b"]))
  return _xent(h @ params["w_out"], labels)


def own_bf16_init(key, d=D):
  keys = jax.random.split(key, 5)
  return {"wq": jax.random.normal(keys[0], (16, d)) / 4.0,
          "wk": jax.random.normal(keys[1], (16, d)) / 4.0,
          "wv": jax.random.normal(keys[2], (16, d)) / 4.0,
          "wo": jax.random.normal(keys[3], (d, 10)) / math.sqrt(d)}


def own_bf16_attention_loss(params, x, labels):
  """No Flax, and mixed precision by hand: q, k, v cast to bf16 for
  jax.nn.dot_product_attention (which then picks the BF16_BF16_F32 dot algorithm and an
  f32 softmax), the attention output back to f32 for the head and the loss."""
  b, t, _ = x.shape
  split = lambda h: h.reshape(b, t, HEADS, -1).astype(jnp.bfloat16)
  q, k, v = (split(x @ params[n]) for n in ("wq", "wk", "wv"))
  o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  h = o.reshape(b, t, -1).astype(jnp.float32)
  return _xent(h.mean(axis=1) @ params["wo"], labels)


# ----------------------------------------------------------------------------- cases


def _nnx_build(make, loss_of, recipe):
  with user_code():
    model = make()
  if recipe is not None:
    mp.flax.apply_recipe(model, recipe)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return loss_of(m), nnx.state(m, nnx.BatchStat) or None

  return Built(loss, params)


def _linen_context(recipe):
  if recipe is None:
    return contextlib.nullcontext()
  r = mp.get_recipe(recipe)
  return mp.flax.linen_policy(r.policy, fp32_ops=r.fp32_ops)


def _linen_build(model, x, recipe, loss_of, mutable=(), init_kwargs=None, apply_kwargs=None):
  with user_code(_linen_context(recipe)):
    variables = model.init(jax.random.key(0), x, **(init_kwargs or {}))
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}

  def loss(params):
    with _linen_context(recipe):
      out = model.apply({"params": params, **rest}, x, mutable=list(mutable) or False,
                        **(apply_kwargs or {}))
    y, new = out if mutable else (out, None)
    return loss_of(y), new

  return Built(loss, params, lambda: user_code(_linen_context(recipe)))


def gemma_style(recipe):
  tokens = _tokens()
  return _nnx_build(lambda: GemmaStyleLM(rngs=nnx.Rngs(0)),
                    lambda m: _xent(m(tokens[:, :-1]), tokens[:, 1:]), recipe)


def bias_mlp(recipe):
  x = jax.random.normal(jax.random.key(2), (B, 16))
  y = jax.random.normal(jax.random.key(3), (B, 8))
  return _nnx_build(lambda: BiasMLP(rngs=nnx.Rngs(0)),
                    lambda m: jnp.mean((m(x) - y) ** 2), recipe)


def nnx_mha(recipe):
  tokens = _tokens()
  return _nnx_build(lambda: MHAModel(rngs=nnx.Rngs(0)),
                    lambda m: _xent(m(tokens[:, :-1]), tokens[:, 1:]), recipe)


def linen_decoder(recipe):
  tokens = _tokens()
  return _linen_build(LinenDecoder(), tokens[:, :-1], recipe,
                      lambda logits: _xent(logits, tokens[:, 1:]))


def linen_resnet(recipe):
  x = jax.random.normal(jax.random.key(4), (B, 8, 8, 3))
  labels = jax.random.randint(jax.random.key(5), (B,), 0, 10)
  return _linen_build(LinenResNet(), x, recipe, lambda logits: _xent(logits, labels),
                      mutable=("batch_stats",))


def plain_jax(recipe):
  x = jax.random.normal(jax.random.key(6), (B, 16))
  labels = jax.random.randint(jax.random.key(7), (B,), 0, 10)
  fn = plain_loss if recipe is None else mp.autocast(plain_loss, recipe)
  return Built(lambda p: (fn(p, x, labels), None), plain_init(jax.random.key(0)))


def bf16_configured(recipe):
  tokens = _tokens()
  return _nnx_build(lambda: Bf16ConfiguredLM(rngs=nnx.Rngs(0)),
                    lambda m: _xent(m(tokens[:, :-1]), tokens[:, 1:]), recipe)


def dropout_mlp(recipe):
  """Trained the functional way: split once, merge inside jax.grad; the loss also returns
  the updated BatchNorm statistics and Dropout's RNG state (typed keys, counters)."""
  x = jax.random.normal(jax.random.key(8), (B, 16))
  y = jax.random.normal(jax.random.key(9), (B, 8))
  with user_code():
    model = DropoutMLP(rngs=nnx.Rngs(0, dropout=1))
  if recipe is not None:
    mp.flax.apply_recipe(model, recipe)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    value = jnp.mean((m(x) - y) ** 2)
    return value, nnx.state(m, nnx.BatchStat, nnx.RngState)

  return Built(loss, params)


def linen_train_keywords(recipe):
  x = jax.random.normal(jax.random.key(10), (B, 16))
  labels = jax.random.randint(jax.random.key(11), (B,), 0, 10)
  return _linen_build(LinenTrainKeywords(), x, recipe, lambda logits: _xent(logits, labels),
                      mutable=("batch_stats",), init_kwargs=dict(train=False),
                      apply_kwargs=dict(train=True, rngs={"dropout": jax.random.key(12)}))


def own_bf16_attention(recipe):
  x = jax.random.normal(jax.random.key(13), (B, T, 16))
  labels = jax.random.randint(jax.random.key(14), (B,), 0, 10)
  fn = own_bf16_attention_loss if recipe is None else mp.autocast(own_bf16_attention_loss,
                                                                  recipe)
  return Built(lambda p: (fn(p, x, labels), None), own_bf16_init(jax.random.key(0)))


CASES: dict[str, Callable[[str | None], Built]] = {
    "gemma_style_nnx": gemma_style,
    "bias_batchnorm_mlp_nnx": bias_mlp,
    "multihead_attention_nnx": nnx_mha,
    "decoder_linen": linen_decoder,
    "resnet_batchnorm_linen": linen_resnet,
    "plain_jax_scan_remat": plain_jax,
    "explicit_sharding_nnx": lambda recipe: sharded_lm(recipe),  # defined below: 2 devices
    "bf16_configured_nnx": bf16_configured,
    "dropout_split_merge_grad_nnx": dropout_mlp,
    "train_keywords_linen": linen_train_keywords,
    "own_bf16_attention_jax": own_bf16_attention,
}


# ----------------------------------------------------------------------------- sharded


class ShardedLM(nnx.Module):
  """An LM written for explicit sharding (jax.set_mesh with Explicit axes): the batch is
  sharded over "data" and every lookup and GEMM says where its result lives."""

  def __init__(self, *, rngs):
    init = nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.w = nnx.Param(init(rngs.params(), (D, 2 * D)))
    self.b = nnx.Param(jnp.zeros((2 * D,)))
    self.norm = nnx.LayerNorm(2 * D, rngs=rngs)
    self.head = nnx.Linear(2 * D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    batch = jax.sharding.PartitionSpec("data", None, None)
    x = self.embed(tokens, out_sharding=batch)
    h = jnp.einsum("btd,de->bte", x, self.w[...], out_sharding=batch) + self.b[...]
    h = self.norm(jax.nn.gelu(h))
    return self.head(h, out_sharding=batch)


def _sharded_context(mesh):
  @contextlib.contextmanager
  def context():
    with jax.set_mesh(mesh), user_code():
      yield
  return context


def sharded_lm(recipe):
  """ShardedLM on a 2-device mesh with an Explicit "data" axis, its batch sharded."""
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  context = _sharded_context(mesh)
  with context():
    model = ShardedLM(rngs=nnx.Rngs(0))
    if recipe is not None:
      mp.flax.apply_recipe(model, recipe)
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    tokens = jax.device_put(_tokens(batch=B), batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return _xent(m(tokens[:, :-1]).astype(jnp.float32), tokens[:, 1:]), None

  return Built(loss, params, context)


def imagenet_resnet(recipe):
  """LinenImageNetResNet run the way Flax's ImageNet example runs it, with shard_map over
  8 devices in place of pmap: a jitted `init(..., train=False)` outside (no "batch" axis
  there), each device's loss on its 2 examples pmean'd over "batch" and the BatchNorm
  statistics averaged across devices; `evaluate` is `apply(v, x, train=False)` outside,
  with the running statistics."""
  mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:8])
  spec = jax.sharding.PartitionSpec
  x = jax.random.normal(jax.random.key(21), (16, 8, 8, 3))
  labels = jax.random.randint(jax.random.key(22), (16,), 0, 10)
  model = LinenImageNetResNet()
  with user_code(_linen_context(recipe)):  # jitted, as the example's `initialized` does
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), x[:2])
  params, batch_stats = variables["params"], {"batch_stats": variables["batch_stats"]}

  def per_device(params, state, x, labels):
    with _linen_context(recipe):
      logits, new = model.apply({"params": params, **state}, x, mutable=["batch_stats"])
    return jax.lax.pmean(_xent(logits, labels), "batch"), new

  step = jax.shard_map(per_device, mesh=mesh,
                       in_specs=(spec(), spec(), spec("batch"), spec("batch")),
                       out_specs=(spec(), spec()))

  def evaluate(params, state):
    with _linen_context(recipe):
      return model.apply({"params": params, **state}, x, train=False)

  return Built(lambda p: step(p, batch_stats, x, labels), params, evaluate=evaluate)


CASES["imagenet_resnet_batch_axis_linen"] = imagenet_resnet


# ----------------------------------------------------------------------------- Haiku, Equinox
# Optional: neither is a dependency of the library; their cases exist where they are
# installed (pip install dm-haiku equinox).

try:
  import haiku as hk  # pylint: disable=g-import-not-at-top
except ImportError:
  hk = None
try:
  import equinox as eqx  # pylint: disable=g-import-not-at-top
except ImportError:
  eqx = None


def _haiku_transformer_fn(tokens):
  """Haiku's transformer example, small: hk.Embed, pre-norm hk.MultiHeadAttention with a
  causal mask, hk.LayerNorm, an hk.Linear MLP with gelu."""
  x = hk.Embed(VOCAB, D)(tokens)
  mask = jnp.tril(jnp.ones((1, 1, tokens.shape[1], tokens.shape[1]), dtype=bool))
  for _ in range(2):
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    x = x + hk.MultiHeadAttention(HEADS, D // HEADS, w_init=hk.initializers.VarianceScaling(
        1.0))(h, h, h, mask=mask)
    h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
    x = x + hk.Linear(D)(jax.nn.gelu(hk.Linear(4 * D)(h)))
  return hk.Linear(VOCAB)(hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x))


def _haiku_stateful_fn(x, is_training=True):
  """A Haiku model with state (transform_with_state): hk.Linear, hk.BatchNorm's moving
  averages (f32) and a bf16 feature cache it keeps itself."""
  h = jax.nn.relu(hk.Linear(32)(x))
  h = hk.BatchNorm(True, True, 0.9)(h, is_training)
  cache = hk.get_state("cache", h.shape, jnp.bfloat16, init=jnp.zeros)
  hk.set_state("cache", (0.5 * cache + h).astype(jnp.bfloat16))
  return hk.Linear(8)(h)


def haiku_transformer(recipe):
  tokens = _tokens()
  f = hk.without_apply_rng(hk.transform(_haiku_transformer_fn))
  with user_code():
    params = f.init(jax.random.key(0), tokens[:, :-1])
  apply = f.apply if recipe is None else mp.autocast(f.apply, recipe)
  return Built(lambda p: (_xent(apply(p, tokens[:, :-1]), tokens[:, 1:]), None), params)


def haiku_stateful(recipe):
  x = jax.random.normal(jax.random.key(15), (B, 16))
  y = jax.random.normal(jax.random.key(16), (B, 8))
  f = hk.transform_with_state(_haiku_stateful_fn)
  with user_code():
    params, state = f.init(jax.random.key(0), x)
  apply = f.apply if recipe is None else mp.autocast(f.apply, recipe, state_outputs=1)

  def loss(p):
    out, new_state = apply(p, state, None, x)
    return jnp.mean((out - y) ** 2), new_state

  return Built(loss, params)


class _EqxStatefulMLP(eqx.Module if eqx is not None else object):
  """Equinox's stateful example: Linear, eqx.nn.BatchNorm (state in eqx.nn.State), Linear."""

  lin1: Any
  norm: Any
  lin2: Any

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.lin1 = eqx.nn.Linear(16, 32, key=k1)
    self.norm = eqx.nn.BatchNorm(32, axis_name="batch", mode="ema")
    self.lin2 = eqx.nn.Linear(32, 8, key=k2)

  def __call__(self, x, state):
    h, state = self.norm(jax.nn.relu(self.lin1(x)), state)
    return self.lin2(h), state


def equinox_stateful(recipe):
  x = jax.random.normal(jax.random.key(17), (B, 16))
  y = jax.random.normal(jax.random.key(18), (B, 8))
  with user_code():
    model, state = eqx.nn.make_with_state(_EqxStatefulMLP)(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def step(params, state, x):
    m = eqx.combine(params, static)
    return jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

  run = step if recipe is None else mp.autocast(step, recipe, state_outputs=1)

  def loss(p):
    out, new_state = run(p, state, x)
    return jnp.mean((out - y) ** 2), new_state

  return Built(loss, params)


if hk is not None:
  CASES["transformer_haiku"] = haiku_transformer
  CASES["transform_with_state_haiku"] = haiku_stateful
if eqx is not None:
  CASES["stateful_equinox"] = equinox_stateful


# ----------------------------------------------------------------------------- scan over layers


class ScanBlock(nnx.Module):
  def __init__(self, rngs, d=16):
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.linear = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    return x + jax.nn.gelu(self.linear(self.norm(x)))


class ScanOverLayers(nnx.Module):
  """Flax's scan-over-layers example (MaxText's layout): the blocks created by `nnx.vmap`
  (params with a leading layer axis) and applied by `nnx.scan`."""

  def __init__(self, n_layers, rngs, d=16):
    self.inp = nnx.Linear(8, d, rngs=rngs)

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs):
      return ScanBlock(rngs, d)

    self.blocks = create_block(rngs)
    self.out = nnx.Linear(d, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return self.out(forward(self.inp(x), self.blocks))


def scan_over_layers(recipe):
  x = jax.random.normal(jax.random.key(19), (B, 8))
  y = jax.random.normal(jax.random.key(20), (B, 4))
  return _nnx_build(lambda: ScanOverLayers(3, nnx.Rngs(0)),
                    lambda m: jnp.mean((m(x) - y) ** 2), recipe)


CASES["scan_over_layers_nnx"] = scan_over_layers


# ----------------------------------------------------------------------------- MoE


EXPERTS, TOP_K, CAPACITY = 4, 2, 6


class MixtralMoE(nnx.Module):
  """Mixtral's sparse MoE block as MaxText writes it (sorted dispatch): a router, top-k
  of its logits, softmax over the k, tokens sorted by expert and run through SwiGLU
  experts with `lax.ragged_dot`, combined back with a scatter-add; plus Switch's
  load-balancing loss over the router's probabilities."""

  def __init__(self, d, hidden, *, rngs):
    init = nnx.initializers.lecun_normal()
    self.router = nnx.Linear(d, EXPERTS, use_bias=False, rngs=rngs)
    self.w_gate = nnx.Param(init(rngs.params(), (EXPERTS, d, hidden)))
    self.w_up = nnx.Param(init(rngs.params(), (EXPERTS, d, hidden)))
    self.w_down = nnx.Param(init(rngs.params(), (EXPERTS, hidden, d)))

  def __call__(self, x):
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = self.router(x)
    top, experts = jax.lax.top_k(logits, TOP_K)
    weights = jax.nn.softmax(top, axis=-1)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    token = order // TOP_K
    xs = x[token]
    sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(xs, self.w_gate[...], sizes)) * jax.lax.ragged_dot(
        xs, self.w_up[...], sizes)
    ys = jax.lax.ragged_dot(h, self.w_down[...], sizes) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros_like(x).at[token].add(ys)
    probs = jax.nn.softmax(logits, axis=-1)
    load = jnp.mean(jax.nn.one_hot(experts[:, 0], EXPERTS), axis=0)
    aux = EXPERTS * jnp.sum(load * jnp.mean(probs, axis=0))
    return out.reshape(shape), aux


class MixtralStyleLM(nnx.Module):
  """A Mixtral-style decoder: RMSNorm, causal jax.nn.dot_product_attention with
  nnx.Linear projections, a top-2 MoE block per layer, an untied head."""

  def __init__(self, *, rngs, n_layers=2, d=D, heads=HEADS):
    self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
    self.norms = nnx.List([nnx.RMSNorm(d, rngs=rngs) for _ in range(2 * n_layers)])
    self.qkv = nnx.List([nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
                         for _ in range(n_layers)])
    self.out = nnx.List([nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(n_layers)])
    self.moe = nnx.List([MixtralMoE(d, 2 * d, rngs=rngs) for _ in range(n_layers)])
    self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)
    self.heads = heads

  def __call__(self, tokens):
    x = self.embed(tokens)
    b, t, d = x.shape
    aux = 0.0
    for i in range(len(self.qkv)):
      q, k, v = jnp.split(self.qkv[i](self.norms[2 * i](x)), 3, axis=-1)
      heads = lambda a: a.reshape(b, t, self.heads, d // self.heads)
      att = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
      x = x + self.out[i](att.reshape(b, t, d))
      y, a = self.moe[i](self.norms[2 * i + 1](x))
      x, aux = x + y, aux + a
    return self.head(x), aux


def mixtral_style(recipe):
  tokens = _tokens()

  def loss_of(m):
    logits, aux = m(tokens[:, :-1])
    return _xent(logits, tokens[:, 1:]) + 0.01 * aux

  return _nnx_build(lambda: MixtralStyleLM(rngs=nnx.Rngs(0)), loss_of, recipe)


class SwitchMoE(nn.Module):
  """A Switch Transformer MoE layer (top-1, capacity-padded einsum dispatch, as T5X and
  Mesh TensorFlow write it): tokens beyond an expert's capacity are dropped, unfilled
  capacity slots are zero rows."""

  hidden: int = 2 * D

  @nn.compact
  def __call__(self, x):
    t, d = x.shape
    probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, name="router")(x), axis=-1)
    expert = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1)
    onehot = jax.nn.one_hot(expert, EXPERTS)
    position = (jnp.cumsum(onehot, axis=0) * onehot).sum(axis=-1).astype(jnp.int32) - 1
    dispatch = (onehot[:, :, None] * jax.nn.one_hot(position, CAPACITY)[:, None, :])
    combine = dispatch * gate[:, None, None]
    w_in = self.param("w_in", nn.initializers.lecun_normal(), (EXPERTS, d, self.hidden))
    w_out = self.param("w_out", nn.initializers.lecun_normal(), (EXPERTS, self.hidden, d))
    xe = jnp.einsum("tec,td->ecd", dispatch, x)
    h = nn.gelu(jnp.einsum("ecd,edh->ech", xe, w_in))
    y = jnp.einsum("tec,ecd->td", combine, jnp.einsum("ech,ehd->ecd", h, w_out))
    aux = EXPERTS * jnp.sum(jnp.mean(onehot, axis=0) * jnp.mean(probs, axis=0))
    return y, aux


class SwitchLM(nn.Module):
  """Embed, LayerNorm, a Switch MoE layer with a residual, a Dense head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    b, t, d = x.shape
    y, aux = SwitchMoE()(nn.LayerNorm()(x).reshape(b * t, d))
    x = x + y.reshape(b, t, d)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x)), aux


def switch_linen(recipe):
  tokens = _tokens()

  def loss_of(out):
    logits, aux = out
    return _xent(logits, tokens[:, 1:]) + 0.01 * aux

  return _linen_build(SwitchLM(), tokens[:, :-1], recipe, loss_of)


CASES["mixtral_ragged_moe_nnx"] = mixtral_style
CASES["switch_capacity_moe_linen"] = switch_linen
