"""The numeric gate: one recipe against fp32 on the same weights and batch, with limits.

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

Gradients of loss-scaled recipes are taken on the scaled loss and unscaled in f32, as the
recipe's optimizer does. fp8 recipes are measured in steady state: one forward and backward
on the batch first fills their amax histories.

Limits (`limits`, `judge`): the gate passes when every error is within a multiple of the
unit roundoff u of the format the recipe rounds GEMM inputs to, and nothing is non-finite.
u is that of the coarser of the param and compute formats (bf16 2^-8, f16 2^-11, f32
2^-24); fp8 recipes use their forward format (E4M3: 2^-4) for loss and logits and their
backward format (E5M2: 2^-3) for gradients. The multiples (`GateLimits`): loss u/4, logits
mean 2.5u, logits p99 10u, worst gradient 8u. The logits-mean one is the project's bf16
acceptance limit for a policy-wrapped model (logits mean relative error <= 1e-2, about
2.56u of bf16; tests/test_flax_nnx.py) written in units of u so it carries to every
format; the others leave at least 2.3x headroom over what rounding alone gives on the
`small` GPT (`python -m experiments.gates --model small`, batch 4 x 128: bf16 loss 0.02u,
logits mean 1.25u, p99 4.28u, worst gradient 3.07u; f16 0.01u, 1.26u, 4.32u, 2.61u).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
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

    # mp.value_and_grad without an optimizer state is nnx.value_and_grad that also carries
    # fp8 gradient-scaling state; for models without fp8 GEMMs it is the plain one.
    (_, (loss, logits)), grads = mp.value_and_grad(scaled, has_aux=True)(m)
    grads = jax.tree.map(lambda g: g.astype(_F32) / jnp.asarray(loss_scale, _F32), grads)
    return loss, logits, grads

  loss, logits, grads = run(params, rest, jnp.asarray(tokens))
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
  return float(loss), np.asarray(logits), flat


def numeric_gate(recipe: str | mp.Recipe, model: str | gpt_lib.GPTConfig = "tiny", *,
                 batch: int = 4, seq: int | None = None, seed: int = 0,
                 corpus: data_lib.Corpus | None = None) -> dict[str, Any]:
  """The gate's errors of `recipe` against fp32 (see the module docstring).

  Args:
    recipe: a preset name or Recipe.
    model: a preset name of `models.gpt.CONFIGS` or a GPTConfig.
    batch, seq: the validation batch (seq None: the model's seq_len).
    seed: initialisation seed of both models.
    corpus: the embedded corpus (None: loaded).

  Returns:
    {"recipe", "loss_rel_err", "logits_mean_rel_err", "logits_p99_rel_err",
    "grad_worst_scaled_mean_err", "grad_worst_tensor", "nonfinite"}; floats are relative
    errors (dimensionless), `judge` adds the limits and the pass/fail.
  """
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
    nnx.jit(lambda m, t: mp.value_and_grad(
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


METRICS = ("loss_rel_err", "logits_mean_rel_err", "logits_p99_rel_err",
           "grad_worst_scaled_mean_err")


@dataclasses.dataclass(frozen=True)
class GateLimits:
  """The gate's limits as multiples of the unit roundoff u (see the module docstring).

  Attributes:
    loss: on loss_rel_err (forward u).
    logits_mean, logits_p99: on the logits' mean and 99th-percentile relative errors
      (forward u).
    grad: on grad_worst_scaled_mean_err (backward u).
  """

  loss: float = 0.25
  logits_mean: float = 2.5
  logits_p99: float = 10.0
  grad: float = 8.0


def _element_u(name: str) -> float:
  """Unit roundoff of an fp8 config's element format (E2M1, nvfp4's, is no policy dtype:
  its u = 2^-2 comes from ml_dtypes)."""
  if name == "e2m1":
    return float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).eps) / 2
  return mp.formats.info(name).unit_roundoff


def unit_roundoffs(recipe: str | mp.Recipe) -> tuple[float, float, str]:
  """(forward u, backward u, description) of the formats `recipe` rounds GEMM inputs to.

  Without fp8 both are u of the coarser of the param and compute dtypes; with fp8 they are
  u of the forward (E4M3) and backward (E5M2) formats.

  Examples:
    >>> unit_roundoffs("bf16_master")
    (0.00390625, 0.00390625, 'bf16 u = 2^-8')
    >>> unit_roundoffs("fp8_hybrid")[2]
    'e4m3 u = 2^-4 forward, e5m2 u = 2^-3 backward'
  """
  recipe = mp.get_recipe(recipe)
  if recipe.fp8 is not None:
    fwd, bwd = (_element_u(recipe.fp8.forward_format), _element_u(recipe.fp8.backward_format))
    return (fwd, bwd,
            f"{recipe.fp8.forward_format} u = 2^{int(math.log2(fwd))} forward, "
            f"{recipe.fp8.backward_format} u = 2^{int(math.log2(bwd))} backward")
  coarse = max((mp.formats.info(recipe.policy.param_dtype),
                mp.formats.info(recipe.policy.compute_dtype)), key=lambda f: f.unit_roundoff)
  u = coarse.unit_roundoff
  return u, u, f"{coarse.name} u = 2^{int(math.log2(u))}"


def limits(recipe: str | mp.Recipe, multiples: GateLimits = GateLimits()) -> dict[str, float]:
  """metric name -> the largest value that passes, for `recipe` (relative errors)."""
  fwd, bwd, _ = unit_roundoffs(recipe)
  return {"loss_rel_err": multiples.loss * fwd,
          "logits_mean_rel_err": multiples.logits_mean * fwd,
          "logits_p99_rel_err": multiples.logits_p99 * fwd,
          "grad_worst_scaled_mean_err": multiples.grad * bwd}


def judge(row: dict[str, Any], multiples: GateLimits = GateLimits()) -> dict[str, Any]:
  """`row` (a `numeric_gate` result) plus its limits and verdict.

  Returns:
    A new dict with "limits" (metric -> limit), "u" (the formats' unit roundoffs in
    words), "passed" (bool) and "failures" (list of "metric value > limit" strings; a
    non-finite count or a missing metric fails too).

  Examples:
    >>> row = {"recipe": "bf16_master", "loss_rel_err": 7e-5, "logits_mean_rel_err": 0.02,
    ...        "logits_p99_rel_err": 0.02, "grad_worst_scaled_mean_err": 0.01, "nonfinite": 0}
    >>> judge(row)["failures"]
    ['logits_mean_rel_err 2.00e-02 > 9.77e-03']
  """
  lim = limits(row["recipe"], multiples)
  failures = []
  for k in METRICS:
    v = row.get(k)
    if v is None or not math.isfinite(v) or v > lim[k]:
      failures.append(f"{k} {v:.2e} > {lim[k]:.2e}" if isinstance(v, float) and
                      math.isfinite(v) else f"{k} {v!r} not finite")
  if row.get("nonfinite", 0):
    failures.append(f"nonfinite {row['nonfinite']} > 0")
  return {**row, "limits": lim, "u": unit_roundoffs(row["recipe"])[2],
          "passed": not failures, "failures": failures}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="The numeric gate of every preset recipe, with "
                               "each error also in units of the recipe's unit roundoff u.")
  ap.add_argument("--model", default="small", choices=tuple(gpt_lib.CONFIGS))
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--recipes", default=",".join(mp.PRESETS))
  args = ap.parse_args(argv)
  mp.enable_faithful_rounding()  # before the first JAX computation, as the sweep does
  corpus = data_lib.load_corpus()
  print("| recipe | u | loss | logits mean | logits p99 | worst grad | non-finite | gate |")
  print("|---|---|---|---|---|---|---|---|")
  for name in args.recipes.split(","):
    g = judge(numeric_gate(name, args.model, batch=args.batch, seq=args.seq, corpus=corpus))
    fwd, bwd, _ = unit_roundoffs(name)
    cell = lambda k, u: f"{g[k]:.2e} ({g[k] / u:.2f}u)"
    print(f"| {name} | {g['u']} | {cell('loss_rel_err', fwd)} | "
          f"{cell('logits_mean_rel_err', fwd)} | {cell('logits_p99_rel_err', fwd)} | "
          f"{cell('grad_worst_scaled_mean_err', bwd)} | {g['nonfinite']} | "
          f"{'pass' if g['passed'] else 'FAIL: ' + '; '.join(g['failures'])} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
