"""Step time of policy-wrapped models over the same models written by hand with Flax.

For an attention block (1 layer) and a small GPT-sized stack (4 layers, d=256), builds the
model twice: `precision.flax.apply_policy(model, "p=f32,c=bf16,o=f32")` and hand-written
Flax (`dtype=bf16, param_dtype=f32, preferred_element_type=f32` on every layer), compiles
one value_and_grad step of each, and times them interleaved in one run (median over
repeats). Prints the step-time ratio policy / hand-written, compiled-HLO dot and convert
counts and dot FLOPs, and the backward GEMMs whose operands are mixed (f32 x bf16).

CPU figures only here: on CPU XLA runs bf16 GEMMs by upcasting, so the ratio measures the
overhead of the wrapper (converts, custom VJP), not tensor-core speed.

Usage: python -m experiments.bench_policy [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

import precision as mp
from precision.flax import apply_policy

_MODELS_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "tests", "_models.py")


def _load_models():
  spec = importlib.util.spec_from_file_location("_precision_test_models", _MODELS_PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Linen dataclasses look their module up by name
  spec.loader.exec_module(module)
  return module


def _step(models, model, tokens, promotion):
  graphdef, state = nnx.split(model)

  def step(state, tokens):
    with jax.numpy_dtype_promotion(promotion):
      return jax.value_and_grad(lambda st: models.lm_loss(nnx.merge(graphdef, st), tokens))(state)

  compiled = jax.jit(step).lower(state, tokens).compile()
  return compiled, state


def _bench_one(models, name, cfg, batch, seq, repeats):
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, cfg["vocab"])
  policy = apply_policy(models.AttentionLM(rngs=nnx.Rngs(0), **cfg), "p=f32,c=bf16,o=f32")
  hand = models.AttentionLM(rngs=nnx.Rngs(0), handwritten=jnp.bfloat16, **cfg)
  runs = {"policy": _step(models, policy, tokens, "strict"),
          "hand": _step(models, hand, tokens, "standard")}
  times = {k: [] for k in runs}
  for k, (fn, state) in runs.items():
    jax.block_until_ready(fn(state, tokens))  # warm up
  for _ in range(repeats):
    for k, (fn, state) in runs.items():  # interleaved: both see the same machine load
      t0 = time.perf_counter()
      jax.block_until_ready(fn(state, tokens))
      times[k].append(time.perf_counter() - t0)
  out = {"model": name, "config": dict(cfg, batch=batch, seq=seq), "repeats": repeats}
  for k, (fn, state) in runs.items():
    stats = models.hlo_stats(fn.as_text())
    graphdef_state = nnx.split(policy if k == "policy" else hand)
    promo = "strict" if k == "policy" else "standard"

    def traced(state, tokens, graphdef=graphdef_state[0], promo=promo):
      with jax.numpy_dtype_promotion(promo):
        return jax.value_and_grad(
            lambda st: models.lm_loss(nnx.merge(graphdef, st), tokens))(state)

    report = mp.audit(traced, state, tokens)
    out[k] = dict(median_ms=1e3 * statistics.median(times[k]), dots=stats["dots"],
                  converts=stats["converts"], dot_flops=stats["dot_flops"],
                  mixed_bwd_gemms=sum(1 for g in report.gemms if g.lhs_dtype != g.rhs_dtype))
  out["time_ratio"] = out["policy"]["median_ms"] / out["hand"]["median_ms"]
  return out


def run(quick: bool = False) -> dict:
  """Runs both benchmarks; returns {"attention_block": {...}, "gpt_stack": {...}}."""
  models = _load_models()
  repeats = 5 if quick else 30
  configs = {
      "attention_block": (dict(vocab=256, d=128, heads=4, n_layers=1), 4, 64),
      "gpt_stack": (dict(vocab=256, d=256, heads=8, n_layers=4 if not quick else 2), 4, 128),
  }
  return {name: _bench_one(models, name, cfg, b, t, repeats)
          for name, (cfg, b, t) in configs.items()}


def _print(results: dict) -> None:
  print(f"{'model':<16} {'variant':<7} {'median ms':>10} {'dots':>5} {'converts':>9} "
        f"{'dot GFLOP':>10} {'mixed bwd GEMMs':>16}")
  for name, r in results.items():
    for k in ("policy", "hand"):
      v = r[k]
      print(f"{name:<16} {k:<7} {v['median_ms']:>10.2f} {v['dots']:>5} {v['converts']:>9} "
            f"{v['dot_flops'] / 1e9:>10.4f} {v['mixed_bwd_gemms']:>16}")
    print(f"{name:<16} step-time ratio policy/hand = {r['time_ratio']:.3f} "
          f"(median of {r['repeats']}, interleaved, {jax.devices()[0].platform})")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller stack")
  _print(run(parser.parse_args().quick))
