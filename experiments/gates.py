"""The numeric gate of seed 000: one recipe against fp32 on the same weights and batch.

Both models are initialised from the same seed in f32; the recipe's copy then has the
recipe applied (params cast to its param dtype, GEMMs in its compute dtype, fp8 where it
says). One forward and backward on the same validation batch gives:

  loss_rel_err                |L - L32| / |L32|
  logits_mean_rel_err, _p99   mean and 99th percentile over elements of
                              |l - l32| / max(|l32|, rms(l32)): relative error, with the
                              denominator floored at the tensor's RMS so logits near zero
                              do not turn rounding noise into huge ratios
  grad_worst_scaled_mean_err  max over parameter tensors of mean|g - g32| / mean|g32|
  nonfinite                   non-finite elements in the recipe's loss, logits and grads

Seed 000 measured loss 1.2e-4, logits mean 2.0e-3 / p99 6.8e-3, grads 1.0e-2 for bf16.
Gradients of loss-scaled recipes are taken on the scaled loss and unscaled in f32, as the
recipe's optimizer does. fp8 recipes are measured in steady state: one forward and backward
on the batch first fills their amax histories.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import precision as mp
import precision.flax  # noqa: F401
import precision.fp8  # noqa: F401
from experiments import data as data_lib
from models import gpt as gpt_lib

_F32 = jnp.float32


def _forward_backward(model: nnx.Module, tokens: np.ndarray, loss_scale: float):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def run(params, rest, tokens):
    m = nnx.merge(graphdef, params, rest)

    def scaled(m):
      logits = m(tokens[:, :-1])
      loss = mp.ops.cross_entropy(logits, tokens[:, 1:])  # f32
      return loss * jnp.asarray(loss_scale, _F32), (loss, logits.astype(_F32))

    # mp.fp8.value_and_grad is nnx.value_and_grad that also carries fp8 gradient-scaling
    # state; for models without fp8 GEMMs it is the plain one.
    (_, (loss, logits)), grads = mp.fp8.value_and_grad(scaled, has_aux=True)(m)
    grads = jax.tree.map(lambda g: g.astype(_F32) / jnp.asarray(loss_scale, _F32), grads)
    return loss, logits, grads

  loss, logits, grads = run(params, rest, jnp.asarray(tokens))
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  return float(loss), np.asarray(logits), flat


def numeric_gate(recipe: str | mp.Recipe, model: str | gpt_lib.GPTConfig = "tiny", *,
                 batch: int = 4, seq: int | None = None, seed: int = 0,
                 corpus: data_lib.Corpus | None = None) -> dict[str, Any]:
  """Seed 000's table for `recipe` against fp32 (see the module docstring)."""
  recipe = mp.get_recipe(recipe)
  cfg = gpt_lib.get_config(model)
  seq = seq or cfg.seq_len
  corpus = corpus or data_lib.load_corpus()
  tokens = data_lib.validation_batches(corpus.validation, 1, batch, seq)[0]
  ref = gpt_lib.GPT(cfg, rngs=nnx.Rngs(seed))
  test = gpt_lib.GPT(cfg, rngs=nnx.Rngs(seed))
  mp.flax.apply_recipe(test, recipe)
  if recipe.fp8 is not None:
    # Steady state, not the first step: one forward and backward on the batch fills the
    # amax histories, as any step after the first has them (a fresh delayed-scaling state
    # quantizes with unit scales).
    nnx.jit(lambda m, t: mp.fp8.value_and_grad(
        lambda mm: mp.ops.cross_entropy(mm(t[:, :-1]), t[:, 1:]))(m)[0])(test, jnp.asarray(tokens))
  scale = recipe.loss_scale.initial_scale if recipe.loss_scale.kind != "none" else 1.0
  loss32, logits32, grads32 = _forward_backward(ref, tokens, 1.0)
  loss, logits, grads = _forward_backward(test, tokens, scale)
  if set(grads) != set(grads32):
    raise ValueError(f"Parameter trees differ: {sorted(set(grads) ^ set(grads32))[:3]}")
  floor = max(float(np.sqrt(np.mean(logits32.astype(np.float64) ** 2))), 1e-30)
  rel = np.abs(logits - logits32) / np.maximum(np.abs(logits32), floor)
  grad_errs = {k: float(np.mean(np.abs(grads[k] - grads32[k])) /
                        max(float(np.mean(np.abs(grads32[k]))), 1e-30)) for k in grads}
  worst = max(grad_errs, key=grad_errs.get)
  nonfinite = int((not np.isfinite(loss)) + np.sum(~np.isfinite(logits)) +
                  sum(int(np.sum(~np.isfinite(g))) for g in grads.values()))
  return {
      "recipe": recipe.name,
      "loss_rel_err": abs(loss - loss32) / abs(loss32),
      "logits_mean_rel_err": float(np.mean(rel)),
      "logits_p99_rel_err": float(np.percentile(rel, 99)),
      "grad_worst_scaled_mean_err": grad_errs[worst],
      "grad_worst_tensor": worst,
      "nonfinite": nonfinite,
  }
