"""fp8 vs bf16: GEMM throughput and one training step, side by side in one run.

On a GPU with fp8 tensor cores (H100/H200, sm_89+) this prints fp8 over bf16 throughput
for a 4096x4096x4096 GEMM (current, delayed and block scaling, quantization included) and
for one training step of an MLP stack under fp8_hybrid vs bf16_mixed. On CPU the fp8 GEMM
is emulated (XLA CPU converts fp8 operands to f32 inside the dot), so the figures are the
*overhead of the emulation* at small sizes: no speed claim follows from them.

Usage: python -m experiments.bench_fp8 [--quick]
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import precision as mp
from experiments.timing import median_seconds

_F32, _BF16 = jnp.float32, jnp.bfloat16
_DN = (((1,), (0,)), ((), ()))


def gemm_times(n: int, reps: int) -> dict[str, float]:
  """Seconds per n x n x n GEMM: bf16 (f32 accumulation, bf16 out) and fp8 per recipe
  (quantization of both operands and dequantization included)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (n, n), _BF16)
  w = (0.05 * jax.random.normal(k2, (n, n), _F32)).astype(_BF16)
  out = {"bf16": median_seconds(jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, _DN, preferred_element_type=_F32).astype(_BF16)), x, w, repeats=reps)}
  for scaling in ("current", "delayed", "block"):
    spec = mp.fp8.Fp8Spec.from_config(mp.Fp8Config(scaling=scaling))
    state = spec.init_state()
    fn = jax.jit(lambda a, b, s, spec=spec: mp.fp8.fp8_dot_general(
        a, b, _DN, s, spec, out_dtype=_BF16))
    out[f"fp8_{scaling}"] = median_seconds(fn, x, w, state, repeats=reps)
  return out


class _MLPStack(nnx.Module):
  def __init__(self, d: int, layers: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(d, d, use_bias=False, dtype=_BF16, rngs=rngs)
                            for _ in range(layers)])

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.gelu(layer(x))
    return x


def step_time(recipe_name: str, d: int, tokens: int, layers: int, reps: int) -> float:
  """Seconds per training step (forward, backward, Adam) of an MLP stack."""
  model = _MLPStack(d, layers, nnx.Rngs(0))
  recipe = mp.get_recipe(recipe_name)
  if recipe.fp8 is not None:
    mp.fp8.apply_fp8(model, recipe.fp8, recipe.policy)
  opt = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (tokens, d), _BF16)

  @nnx.jit
  def step(model, opt, x):
    loss_fn = lambda m, x: jnp.mean(m(x).astype(_F32) ** 2)
    loss, grads = mp.value_and_grad(loss_fn)(model, x)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes int/float scalars
      opt.update(model, grads)
    return loss

  return median_seconds(step, model, opt, x, repeats=reps)


def run(quick: bool = False) -> dict[str, Any]:
  """Runs the benchmark; returns the figures (seconds and ratios) and prints them."""
  backend = jax.default_backend()
  gpu = backend == "gpu"
  n = 4096 if gpu else (256 if quick else 512)
  reps = 20 if gpu else (3 if quick else 5)
  gemm = gemm_times(n, reps)
  flops = 2.0 * n ** 3
  d, tokens, layers = (4096, 8192, 4) if gpu else ((128, 256, 2) if quick else (256, 512, 2))
  steps = {name: step_time(name, d, tokens, layers, reps) for name in ("bf16_mixed", "fp8_hybrid")}
  result = {
      "backend": backend, "gemm_n": n, "gemm_seconds": gemm,
      "gemm_tflops": {k: flops / v / 1e12 for k, v in gemm.items()},
      "gemm_fp8_over_bf16": {k: gemm["bf16"] / v for k, v in gemm.items() if k != "bf16"},
      "step_shape": {"d": d, "tokens": tokens, "layers": layers},
      "step_seconds": steps,
      "step_fp8_over_bf16": steps["bf16_mixed"] / steps["fp8_hybrid"],
  }
  print(f"backend: {backend} ({jax.devices()[0].device_kind})")
  if not gpu:
    print("CPU emulation: no speed claim. fp8 dots are emulated (operands converted to f32 "
          "inside XLA CPU's dot); the ratios below measure emulation overhead only.")
  print(f"GEMM {n}x{n}x{n}: " + ", ".join(
      f"{k} {v * 1e3:.2f} ms ({result['gemm_tflops'][k]:.3f} TFLOP/s)" for k, v in gemm.items()))
  print("  throughput fp8/bf16: " + ", ".join(
      f"{k} {v:.2f}x" for k, v in result["gemm_fp8_over_bf16"].items()))
  print(f"train step (MLP d={d}, tokens={tokens}, layers={layers}): "
        f"bf16_mixed {steps['bf16_mixed'] * 1e3:.2f} ms, fp8_hybrid "
        f"{steps['fp8_hybrid'] * 1e3:.2f} ms; fp8/bf16 speed {result['step_fp8_over_bf16']:.2f}x")
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
  run(parser.parse_args().quick)


if __name__ == "__main__":
  main()
