"""Per-device memory and bytes moved per step of ZeRO stages 0-3 on 8 host devices.

For an MLP (quick: ~0.09M params, full: ~6.3M) and the fp32 and bf16_master recipes, each
stage's step is compiled with `precision.parallel.data_parallel` and reported side by
side (row "3L": stage 3 with `gather="layer"`, params gathered layer by layer and
re-gathered in backward): params and optimizer-state bytes each device holds (from the compiled shardings),
the ZeRO paper's model of the same, temporaries from `memory_analysis()`, and the bytes
one device sends per step (ring algorithm) in the compiled executable and in the lowered
program (CPU widens 16-bit collectives to f32; the lowered dtypes are what NCCL moves).
Host CPU devices only: no GPU figure is measured here.

  python -m experiments.bench_parallel [--quick]
"""

from __future__ import annotations

import os
import sys

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from precision import parallel  # noqa: E402
from precision.parallel._report import format_table  # noqa: E402

DEVICES = 8


def _model(quick: bool):
  d_in, hidden, d_out = (64, 255, 37) if quick else (512, 2047, 509)
  r = np.random.default_rng(0)
  params = {
      "w1": (r.normal(size=(d_in, hidden)) / np.sqrt(d_in)).astype(np.float32),
      "b1": np.zeros((hidden,), np.float32),
      "w2": (r.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
      "w3": (r.normal(size=(hidden, d_out)) / np.sqrt(hidden)).astype(np.float32),
  }
  batch = {"x": r.normal(size=(8 * DEVICES, d_in)).astype(np.float32),
           "y": r.normal(size=(8 * DEVICES, d_out)).astype(np.float32)}
  return params, batch


def _loss(params, batch):
  """MLP regression written as three ZeRO-3 layers (`gathered_layer`): plain GEMMs on
  full params at stages 0-2 and stage 3 gather="step", gathered layer by layer under
  gather="layer" (the helper is a no-op without shards)."""
  f32 = jnp.float32

  def first(p, x):
    dt = p["w1"].dtype
    h = jnp.dot(x.astype(dt), p["w1"], preferred_element_type=f32)
    return jnp.tanh(h + p["b1"].astype(f32)[None, :]).astype(dt)

  def hidden(p, h):
    return jnp.tanh(jnp.dot(h, p["w2"], preferred_element_type=f32)).astype(p["w2"].dtype)

  def last(p, h):
    return jnp.dot(h.astype(p["w3"].dtype), p["w3"], preferred_element_type=f32)

  h = parallel.gathered_layer(first)({"w1": params["w1"], "b1": params["b1"]}, batch["x"])
  h = parallel.gathered_layer(hidden)({"w2": params["w2"]}, h)
  y = parallel.gathered_layer(last)({"w3": params["w3"]}, h)
  return jnp.mean(jnp.square(y - batch["y"]))


# (row label, zero_stage, gather): stage 3 both ways, "3L" = gathered layer by layer.
CONFIGS = ((0, 0, "step"), (1, 1, "step"), (2, 2, "step"), (3, 3, "step"), ("3L", 3, "layer"))


def run(quick: bool = True) -> dict:
  """Compiles every (recipe, stage) step; returns {"rows": [...], "param_count": int}."""
  if jax.device_count() < DEVICES:
    raise ValueError(f"bench_parallel needs {DEVICES} devices, found {jax.device_count()}; "
                     "run it as a script or set XLA_FLAGS=--xla_force_host_platform_device_"
                     "count=8 before JAX starts")
  mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
  params, batch = _model(quick)
  rows = []
  with jax.numpy_dtype_promotion("strict"):
    for recipe in ("fp32", "bf16_master"):
      for stage, zero_stage, gather in CONFIGS:
        dp = parallel.data_parallel(_loss, optax.adamw(1e-3), mesh, zero_stage=zero_stage,
                                    recipe=recipe, gather=gather)
        state = dp.init(params)
        gbatch = dp.shard_batch(batch)
        mem = dp.memory_report(state, gbatch)
        sent = dp.collective_report(state, gbatch).sent_bytes
        sent_lowered = dp.collective_report(state, gbatch, compiled=False).sent_bytes
        kib = lambda b: round(b / 1024, 1)
        rows.append({
            "recipe": recipe, "stage": stage,
            "params_KiB": kib(mem.params_bytes), "zero_params": kib(mem.formula_params),
            "opt_KiB": kib(mem.opt_state_bytes), "zero_opt": kib(mem.formula_opt_state),
            "zero_grads": kib(mem.formula_grads), "temp_KiB": kib(mem.temp_bytes),
            "sent_KiB": kib(sent), "sent_lowered_KiB": kib(sent_lowered),
        })
        del state
  return {"rows": rows, "param_count": mem.param_count}


def main(argv: list[str]) -> None:
  # XLA reads its flags when the backend starts (the first computation, below): 8 host
  # devices for the ZeRO stages.
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
  if not os.environ.get("JAX_PLATFORMS"):   # host CPU devices only (jax read the variable
    jax.config.update("jax_platforms", "cpu")   # at import: set its config instead)
  out = run(quick="--quick" in argv)
  print(f"{out['param_count']} params on {DEVICES} host CPU devices; per-device KiB "
        "(zero_* = ZeRO paper model; sent = ring bytes one device sends per step)")
  print(format_table(out["rows"]))
  by = {(r["recipe"], r["stage"]): r for r in out["rows"]}
  for recipe in ("fp32", "bf16_master"):
    s0 = by[recipe, 0]
    ratios = ", ".join(
        f"stage {s}: opt {by[recipe, s]['opt_KiB'] / s0['opt_KiB']:.3f}, params "
        f"{by[recipe, s]['params_KiB'] / s0['params_KiB']:.3f}, sent "
        f"{by[recipe, s]['sent_KiB'] / s0['sent_KiB']:.3f}, temp "
        f"{by[recipe, s]['temp_KiB'] / s0['temp_KiB']:.3f}" for s in (1, 2, 3, "3L"))
    print(f"{recipe} vs stage 0: {ratios}")


if __name__ == "__main__":
  main(sys.argv[1:])
