"""The GPU-only measurements in one script (under 8 minutes on one H200):

  python -m experiments.gpu_check            # on a GPU machine
  python -m experiments.gpu_check --dry-run  # tiny sizes, any backend: checks the script runs

1. Pallas kernels against their XLA references on the real GPU, bit for bit: stochastic
   rounding to bf16/f16/e4m3/e5m2 (f32 and bf16 inputs, odd sizes), fused AdamW + SR.
2. Memory bandwidth: a device-to-device copy (the measured ceiling) and the Pallas
   stochastic-rounding kernel as a fraction of it and of the datasheet peak.
3. bf16 vs fp32 train-step throughput on `gpt2_124m` with TF32 OFF (fp32 GEMMs at
   "highest" precision), and bf16 MFU (FLOPs per token = 6N + 6LCT, llm.c).
4. fp8 vs bf16 GEMM at 4096^3 and one training step (experiments.bench_fp8).

Prints a table last and writes gpu_check.json to --out (default $OUT or ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import precision as mp

mp.enable_faithful_rounding()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from experiments.timing import median_seconds  # noqa: E402

# Datasheet HBM bandwidth, bytes/s.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 0.3e12}


def pallas_bit_identity(n: int) -> dict:
  from precision.rounding import _pallas
  out = {}
  for src in (jnp.float32, jnp.bfloat16):
    targets = ("bf16", "f16", "e4m3", "e5m2") if src == jnp.float32 else ("e4m3", "e5m2")
    x = (jax.random.normal(jax.random.key(1), (n + 37,), jnp.float32) *
         jnp.exp2(jax.random.uniform(jax.random.key(2), (n + 37,), jnp.float32, -20, 20)))
    x = x.astype(src)
    for t in targets:
      ref = mp.rounding.stochastic_round_reference(x, t, 7, 3)
      got = _pallas.stochastic_round_pallas(x, t, 7, 3)
      same = np.asarray(jax.lax.bitcast_convert_type(ref, jnp.uint8 if ref.dtype.itemsize == 1 else jnp.uint16)
                        == jax.lax.bitcast_convert_type(got, jnp.uint8 if got.dtype.itemsize == 1 else jnp.uint16))
      out[f"{jnp.dtype(src).name}->{t}"] = float(same.mean())
  # Fused AdamW + SR: Pallas vs its XLA reference over 5 steps, with and without a master.
  params = {"w": (jax.random.normal(jax.random.key(3), (n // 256, 256), jnp.float32) * 0.02
                  ).astype(jnp.bfloat16),
            "b": jnp.zeros((256,), jnp.bfloat16)}
  for keep_master in (False, True):
    runs = {}
    for impl in ("xla", "pallas"):
      opt = mp.rounding.FusedAdamW(1e-3, weight_decay=0.1, seed=5, keep_master=keep_master,
                                   impl=impl)
      p, s = params, opt.init(params)
      step = jax.jit(opt.update)
      for k in range(5):
        g = jax.tree.map(lambda x: jax.random.normal(jax.random.key(10 + k), x.shape,
                                                     jnp.float32).astype(x.dtype), p)
        p, s = step(g, s, p)
      runs[impl] = p
    same = [np.mean(np.asarray(a).view(np.uint16) == np.asarray(b).view(np.uint16))
            for a, b in zip(jax.tree.leaves(runs["xla"]), jax.tree.leaves(runs["pallas"]))]
    out[f"fused_adamw_sr_master={keep_master}"] = float(np.min(same))
  return out


def bandwidth(n: int, repeats: int) -> dict:
  from precision.rounding import _pallas
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  copy = jax.jit(lambda x: x * 1.0 + 0.0)
  t_copy = median_seconds(copy, x, repeats=repeats)
  sr = jax.jit(lambda x: _pallas.stochastic_round_pallas(x, jnp.bfloat16, 0, 1))
  t_sr = median_seconds(sr, x, repeats=repeats)
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in kind), None)
  copy_bw, sr_bw = 8 * n / t_copy, 6 * n / t_sr  # bytes read + written
  return {"elements": n, "copy_bytes_per_s": copy_bw, "pallas_sr_bytes_per_s": sr_bw,
          "pallas_sr_vs_copy": sr_bw / copy_bw,
          "pallas_sr_vs_peak": None if peak is None else sr_bw / peak}


def train_throughput(model: str, batch: int, seq: int, repeats: int) -> dict:
  from experiments import bench
  # TF32 off: fp32 GEMMs at full precision, so "fp32" means fp32 (llm.c's -f 0).
  with jax.default_matmul_precision("highest"):
    res = bench.recipe_figures(model, batch, seq, ("fp32", "bf16_mixed", "bf16_master"), repeats)
  rows = res["rows"]
  return {"model": model, "batch": batch, "seq": seq,
          "tokens_per_s": {k: v["tokens_per_s"] for k, v in rows.items()},
          "bf16_over_fp32": rows["bf16_mixed"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"],
          "mfu": {k: v["mfu"] for k, v in rows.items()}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dry-run", action="store_true", help="tiny sizes on any backend")
  ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
  args = ap.parse_args(argv)
  dry = args.dry_run
  if not dry and jax.default_backend() != "gpu":
    print(f"gpu_check needs a GPU; this backend is {jax.default_backend()}. "
          "Use --dry-run to check the script on CPU.")
    return 2
  res = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "dry_run": dry}
  t0 = time.perf_counter()
  res["pallas_bit_identity"] = pallas_bit_identity(4096 if dry else 1 << 22)
  res["bandwidth"] = bandwidth(1 << 14 if dry else 1 << 28, 2 if dry else 20)
  res["train"] = (train_throughput("tiny", 2, 32, 1) if dry else
                  train_throughput("gpt2_124m", 8, 1024, 10))
  from experiments import bench_fp8
  res["fp8"] = bench_fp8.run(quick=dry)
  res["seconds"] = time.perf_counter() - t0
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
  b, tr = res["bandwidth"], res["train"]
  fmt = lambda v, s: "-" if v is None else format(v, s)
  print("\n| check | figure |\n|---|---|")
  for k, v in res["pallas_bit_identity"].items():
    if isinstance(v, float):
      print(f"| Pallas vs XLA reference, fraction of equal bits: {k} | {v:.6f} |")
  print(f"| copy bandwidth | {b['copy_bytes_per_s'] / 1e12:.2f} TB/s |")
  print(f"| Pallas SR bandwidth vs copy / vs peak | {b['pallas_sr_vs_copy']:.1%} / "
        f"{fmt(b['pallas_sr_vs_peak'], '.1%')} |")
  for k, v in tr["tokens_per_s"].items():
    print(f"| {tr['model']} {k} tokens/s (MFU) | {v:,.0f} ({fmt(tr['mfu'][k], '.1%')}) |")
  print(f"| bf16 / fp32 (TF32 off) throughput | {tr['bf16_over_fp32']:.2f}x |")
  print(f"| fp8 / bf16 GEMM {res['fp8']['gemm_n']}^3 | " + ", ".join(
      f"{k} {v:.2f}x" for k, v in res["fp8"]["gemm_fp8_over_bf16"].items()) + " |")
  print(f"| fp8 / bf16 train step | {res['fp8']['step_fp8_over_bf16']:.2f}x |")
  print(f"| total seconds | {res['seconds']:.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
