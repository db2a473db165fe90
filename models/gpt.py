"""A byte-level decoder-only transformer (GPT) in Flax NNX.

Token embedding over 256 byte values, rotary positions, pre-RMSNorm blocks of causal
multi-head attention (optional QK-norm) and a SwiGLU MLP, a final RMSNorm and an untied
`lm_head`. The model holds no dtype of its own: params are created in f32 and a precision
policy is applied from outside (`precision.flax.apply_recipe(model, recipe)`), which
reaches every GEMM layer (`nnx.Linear`, `nnx.Embed`) and norm (`nnx.RMSNorm`). Layer names
are chosen so fp8's default keep-high-precision patterns ("*lm_head*", "*embed*") match.

Numerics inside attention, which has no layer for the policy to reach:
  * both attention GEMMs (q.k^T and probs.v) go through `precision.ops.einsum`: operands
    in the activation (compute) dtype, f32 accumulation, result rounded once to the
    compute dtype, and the same for their backward GEMMs;
  * scores are upcast to f32 before the 1/sqrt(head_dim) scale, the causal mask and the
    softmax (an fp32 island, `precision.ops.attention_probs`); probabilities are cast back
    to the compute dtype for probs.v. Below f32 the backward pass keeps the compute-dtype
    scores and recomputes the f32 probabilities (same gradients, 4 bytes less per score);
  * rotary tables and rotation in f32 (`precision.ops.rotary_embedding`).

Examples:
  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> model = GPT(CONFIGS["tiny"], rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.mlp import MLP
from precision import ops
from precision import parallel

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of a GPT. All sizes are counts (not bytes).

  Attributes:
    vocab_size: number of token ids; 256 for raw bytes.
    seq_len: the training context length T (rotary needs no table, so longer inputs
      still run; this is the default the training loop uses).
    d_model: residual stream width.
    n_layers: number of transformer blocks.
    n_heads: attention heads; d_model must divide by it and the head dim must be even
      (rotary rotates pairs).
    d_ff: hidden width of the SwiGLU MLP.
    qk_norm: RMSNorm on each head's queries and keys before rotary (OLMo-2 / Gemma-3
      style); keeps attention logits bounded in low precision.
    rope_base: rotary base frequency.
    norm_eps: epsilon of every RMSNorm (added to the f32 mean of squares).
    init_std: std of the normal init of embeddings and GEMM kernels; residual output
      projections use init_std / sqrt(2 * n_layers) (GPT-2).
  """

  vocab_size: int = 256
  seq_len: int = 256
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 384
  qk_norm: bool = True
  rope_base: float = 10000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02

  def __post_init__(self):
    for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r}; must be a positive int")
    if self.d_model % self.n_heads:
      raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                       f"n_heads={self.n_heads}")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(f"GPTConfig head dim {self.d_model // self.n_heads} must be even "
                       "for rotary embeddings")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict; ``GPTConfig(**c.to_dict()) == c``."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"Unknown GPTConfig fields {sorted(unknown)}; accepted: {sorted(known)}")
    return cls(**d)

  def replace(self, **changes) -> GPTConfig:
    return dataclasses.replace(self, **changes)


# Presets. Parameter counts are those of `param_count(GPT(config))`.
CONFIGS: dict[str, GPTConfig] = {
    # ~115k params: 2 blocks of width 64. For tests: compiles in seconds on CPU.
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ff=128),
    # ~0.92M params: 4 blocks of width 128, T=256. The CPU default of the sweep. fp32,
    # batch 8 x 256 on the 2-core CPU: 0.23 s/step alone, 0.56 s/step with the machine
    # shared (step_time_s of `python -m experiments.train --model small`); 300 steps reach
    # 2.53 validation bits per byte (uniform: 8.0).
    "small": GPTConfig(seq_len=256, d_model=128, n_layers=4, n_heads=4, d_ff=384),
    # GPT-2 small's shape (12 x 768, 12 heads, T=1024) with a SwiGLU MLP of width 3072:
    # ~114M params (GPT-2's 124M include a 38.6M-param 50257-token embedding; ours has
    # 256 byte tokens). For GPUs.
    "gpt2_124m": GPTConfig(seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
}


def get_config(name: str | GPTConfig) -> GPTConfig:
  """A preset config by name (a GPTConfig passes through)."""
  if isinstance(name, GPTConfig):
    return name
  if name not in CONFIGS:
    raise ValueError(f"Unknown model config {name!r}; presets: {', '.join(CONFIGS)}")
  return CONFIGS[name]


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary positions: [B, T, D] -> [B, T, D]."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    c = config
    init = nnx.initializers.normal(c.init_std)
    out_init = nnx.initializers.normal(c.init_std / math.sqrt(2 * c.n_layers))
    self.n_heads, self.head_dim, self.rope_base = c.n_heads, c.head_dim, c.rope_base
    # One fused GEMM for q, k and v: fewer, larger dots (cheaper on CPU, same math).
    self.qkv = nnx.Linear(c.d_model, 3 * c.d_model, use_bias=False, kernel_init=init,
                          rngs=rngs)
    self.out = nnx.Linear(c.d_model, c.d_model, use_bias=False, kernel_init=out_init,
                          rngs=rngs)
    if c.qk_norm:
      self.q_norm = nnx.RMSNorm(c.head_dim, epsilon=c.norm_eps, rngs=rngs)
      self.k_norm = nnx.RMSNorm(c.head_dim, epsilon=c.norm_eps, rngs=rngs)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    B, T, D = x_BxTxD.shape
    H, K = self.n_heads, self.head_dim
    qkv_BxTx3xHxK = self.qkv(x_BxTxD).reshape(B, T, 3, H, K)
    q_BxTxHxK, k_BxTxHxK, v_BxTxHxK = (qkv_BxTx3xHxK[:, :, i] for i in range(3))
    if self.q_norm is not None:
      q_BxTxHxK, k_BxTxHxK = self.q_norm(q_BxTxHxK), self.k_norm(k_BxTxHxK)
    pos_T = jnp.arange(T, dtype=jnp.int32)
    q_BxTxHxK = ops.rotary_embedding(q_BxTxHxK, pos_T, self.rope_base)
    k_BxTxHxK = ops.rotary_embedding(k_BxTxHxK, pos_T, self.rope_base)
    att_BxHxTxT = ops.einsum("bthk,bshk->bhts", q_BxTxHxK, k_BxTxHxK,
                             compute_dtype=q_BxTxHxK.dtype)
    # f32 for the scale, mask and softmax: exp and a long sum (the softmax f32 island).
    # Below f32 its backward keeps the compute-dtype scores, not the f32 probabilities.
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    probs_BxHxTxT = ops.attention_probs(att_BxHxTxT, causal_TxT, 1.0 / math.sqrt(K))
    probs_BxHxTxT = probs_BxHxTxT.astype(v_BxTxHxK.dtype)
    y_BxTxHxK = ops.einsum("bhts,bshk->bthk", probs_BxHxTxT, v_BxTxHxK,
                           compute_dtype=v_BxTxHxK.dtype)
    return self.out(y_BxTxHxK.reshape(B, T, D))


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    c = config
    self.attn_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.mlp = MLP(c.d_model, c.d_ff, init_std=c.init_std,
                   out_init_std=c.init_std / math.sqrt(2 * c.n_layers), rngs=rngs)

  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD))
    return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))


class GPT(nnx.Module):
  """Byte-level GPT: tokens [B, T] int32 -> logits [B, T, vocab_size].

  Logits come out in the dtype the policy gives `lm_head` (f32 without a policy); the
  loss (`loss_fn`) upcasts to f32 in any case. The embedding, each block, the final norm
  and the head are ZeRO-3 layers (`precision.parallel.call_layer`): under
  `data_parallel(..., zero_stage=3, gather="layer")` with
  ``loss_fn(params, tokens) = gpt.loss_fn(nnx.merge(graphdef, params, rest), tokens)``
  they are gathered one at a time.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = nnx.Embed(c.vocab_size, c.d_model,
                           embedding_init=nnx.initializers.normal(c.init_std), rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.n_layers)])
    self.final_norm = nnx.RMSNorm(c.d_model, epsilon=c.norm_eps, rngs=rngs)
    self.lm_head = nnx.Linear(c.d_model, c.vocab_size, use_bias=False,
                              kernel_init=nnx.initializers.normal(c.init_std), rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    if not jnp.issubdtype(tokens_BxT.dtype, jnp.integer):
      raise ValueError(f"GPT tokens must be integers, got {tokens_BxT.dtype}")
    # Each call_layer is one ZeRO-3 layer under data_parallel(gather="layer"): its params
    # are gathered when it runs and re-gathered in backward. Elsewhere it is module(x).
    x_BxTxD = parallel.call_layer(self.embed, tokens_BxT)
    for block in self.blocks:
      x_BxTxD = parallel.call_layer(block, x_BxTxD)
    return parallel.call_layer(self.lm_head, parallel.call_layer(self.final_norm, x_BxTxD))


def loss_fn(model: GPT, tokens_BxT1: jax.Array) -> jax.Array:
  """Mean next-byte cross entropy in nats, f32 scalar.

  tokens_BxT1: [B, T+1] int32; the model reads tokens[:, :-1] and predicts tokens[:, 1:].
  """
  logits_BxTxV = model(tokens_BxT1[:, :-1])
  return ops.cross_entropy(logits_BxTxV, tokens_BxT1[:, 1:])  # f32: the loss


def param_count(model: nnx.Module) -> int:
  """Number of scalar parameters (nnx.Param leaves) of `model`."""
  return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
