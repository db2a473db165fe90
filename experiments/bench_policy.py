"""Step time of the policy mechanism over the same models written by hand with Flax.

Each model is built twice: plain code with `precision.flax.apply_recipe(model,
"bf16_mixed")` (precision.autocast: every GEMM bf16 x bf16 -> f32 forward and backward,
f32 ops, recomputed f32 glue), and the same model with mixed precision written by hand the
way Flax users do it (`dtype=bf16, param_dtype=f32`, `preferred_element_type=f32`,
explicit f32 casts for softmax and norms). One value_and_grad step of each is compiled and
timed interleaved in one run (median over repeats), with the compiled HLO's dot and convert
counts and dot FLOPs, and the backward GEMMs whose operands are mixed (f32 x bf16).

  attention_block   tests/_models.py AttentionLM, 1 layer, d=128
  gpt_stack         tests/_models.py AttentionLM, 4 layers, d=256 (a small GPT)
  einsum_attention  tests/_zoo.py GemmaStyleLM: nnx.Einsum projections, jnp.einsum
                    attention with jax.nn.softmax, custom RMSNorm, tied head, tanh soft-cap

CPU figures only here: both variants run the same GEMMs (XLA:CPU takes the row-major
bf16 x bf16 -> f32 ones natively and upcasts the rest), so the ratio measures the
mechanism's overhead (converts, custom VJPs, recomputation), not tensor-core speed.

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

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def _load(name: str):
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, os.path.join(_TESTS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Linen dataclasses look their module up by name
  spec.loader.exec_module(module)
  return module


def _step(model, loss, tokens):
  graphdef, state = nnx.split(model)

  def step(state, tokens):
    return jax.value_and_grad(lambda st: loss(nnx.merge(graphdef, st), tokens))(state)

  zoo = _load("_zoo")
  with zoo.user_code():  # the models' own code assumes JAX's default promotion
    lowered = jax.jit(step).lower(state, tokens)
    compiled = lowered.compile()
    report = mp.audit.audit(step, state, tokens)
  return compiled, state, report


def _cases(quick: bool):
  models, zoo = _load("_models"), _load("_zoo")
  f32 = jnp.float32

  def lm(cfg):
    return (lambda: mp.flax.apply_recipe(models.AttentionLM(rngs=nnx.Rngs(0), **cfg),
                                         "bf16_mixed"),
            lambda: models.AttentionLM(rngs=nnx.Rngs(0), handwritten=jnp.bfloat16, **cfg),
            models.lm_loss, cfg["vocab"])

  def gemma_loss(m, tokens):
    return zoo._xent(m(tokens[:, :-1]).astype(f32), tokens[:, 1:])

  ecfg = dict(vocab=256, d=128, heads=4, n_layers=2)
  return {
      "attention_block": (lm(dict(vocab=256, d=128, heads=4, n_layers=1)), 4, 64),
      "gpt_stack": (lm(dict(vocab=256, d=256, heads=8, n_layers=2 if quick else 4)), 4, 128),
      "einsum_attention": ((
          lambda: mp.flax.apply_recipe(zoo.GemmaStyleLM(rngs=nnx.Rngs(0), **ecfg),
                                       "bf16_mixed"),
          lambda: zoo.GemmaStyleLM(rngs=nnx.Rngs(0), dtype=jnp.bfloat16, **ecfg),
          gemma_loss, ecfg["vocab"]), 4, 64),
  }


def _bench_one(name, case, batch, seq, repeats):
  (make_policy, make_hand, loss, vocab) = case
  models = _load("_models")
  tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, vocab)
  runs = {"policy": _step(make_policy(), loss, tokens), "hand": _step(make_hand(), loss, tokens)}
  times = {k: [] for k in runs}
  for fn, state, _ in runs.values():
    jax.block_until_ready(fn(state, tokens))  # warm up
  for _ in range(repeats):
    for k, (fn, state, _) in runs.items():  # interleaved: both see the same machine load
      t0 = time.perf_counter()
      jax.block_until_ready(fn(state, tokens))
      times[k].append(time.perf_counter() - t0)
  out = {"model": name, "config": dict(batch=batch, seq=seq), "repeats": repeats}
  for k, (fn, state, report) in runs.items():
    stats = models.hlo_stats(fn.as_text())
    out[k] = dict(median_ms=1e3 * statistics.median(times[k]), dots=stats["dots"],
                  converts=stats["converts"], dot_flops=stats["dot_flops"],
                  mixed_bwd_gemms=sum(1 for g in report.gemms if g.lhs_dtype != g.rhs_dtype))
  out["time_ratio"] = out["policy"]["median_ms"] / out["hand"]["median_ms"]
  out["convert_ratio"] = out["policy"]["converts"] / out["hand"]["converts"]
  return out


def run(quick: bool = False) -> dict:
  """Runs every case; returns {name: {...}}."""
  repeats = 5 if quick else 30
  return {name: _bench_one(name, case, b, t, repeats)
          for name, (case, b, t) in _cases(quick).items()}


def _print(results: dict) -> None:
  print(f"{'model':<17} {'variant':<7} {'median ms':>10} {'dots':>5} {'converts':>9} "
        f"{'dot GFLOP':>10} {'mixed bwd GEMMs':>16}")
  for name, r in results.items():
    for k in ("policy", "hand"):
      v = r[k]
      print(f"{name:<17} {k:<7} {v['median_ms']:>10.2f} {v['dots']:>5} {v['converts']:>9} "
            f"{v['dot_flops'] / 1e9:>10.4f} {v['mixed_bwd_gemms']:>16}")
    print(f"{name:<17} step time policy/hand = {r['time_ratio']:.3f}, converts "
          f"{r['convert_ratio']:.3f} (median of {r['repeats']}, interleaved, "
          f"{jax.devices()[0].platform}, load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller stack")
  _print(run(parser.parse_args().quick))
