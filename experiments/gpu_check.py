"""The GPU-only measurements in one script (under 8 minutes on one H200 without the study
check, whose time on a GPU is not yet measured):

  PYTHONPATH=. python -m experiments.gpu_check            # on a GPU machine
  PYTHONPATH=. python -m experiments.gpu_check --dry-run  # tiny sizes, any backend
  PYTHONPATH=. python -m experiments.gpu_check --only kernels,train   # a subset

Runs from a checkout on the JAX the machine already has (jax 0.10.2 to 0.12.x, flax,
optax, orbax-checkpoint), with no install and no network: ``PYTHONPATH=.`` makes the
checkout's `precision`, `models` and `experiments` importable; nothing reads an installed
distribution's metadata and nothing is downloaded (the training data is the running
Python's standard library, see experiments/data.py). The first lines printed are the
Python, JAX, jaxlib and Flax (and optax, orbax-checkpoint, NumPy) versions it runs on,
where `precision` was imported from, the backend, and the faithful-rounding mode the
backend is in.

Checks (`--only`, comma-separated; default all):
  kernels    Pallas kernels against their XLA references on the real GPU, bit for bit:
             stochastic rounding to bf16/f16/e4m3/e5m2 (f32 and bf16 inputs, odd
             sizes), fused AdamW + SR with and without a master copy.
  bandwidth  a device-to-device copy (the measured ceiling) and the Pallas
             stochastic-rounding kernel as a fraction of it and of the datasheet peak.
  train      bf16 vs fp32 train-step throughput on `gpt2_124m` with TF32 OFF (fp32 GEMMs
             at "highest" precision), and bf16 MFU (FLOPs per token = 6N + 6LCT, llm.c).
  fp8        fp8 vs bf16 GEMM at 4096^3 and one training step (experiments.bench_fp8).
  micro      the mxfp8 / nvfp4 GEMMs (forward and both gradients of one 2048^3 GEMM under
             autocast) with Fp8Config(micro_gemm="block_scaled"), lowered as
             jax.nn.scaled_matmul, against the emulation ("emulated"): whether XLA
             compiles the block-scaled GEMMs on this GPU (cuDNN on compute capability
             >= 10, expanded elsewhere), their largest difference from the emulation
             relative to its largest value, and both times. What "auto" picks here too.
  study      study throughput (experiments.bench_study): the sweep's tasks, 4 recipes x 8
             seeds, one program per cell against seed_batch=8 (the seed axis over the
             GPUs dividing 8), wall and training steps/s side by side and their ratio.

Prints a table last and writes gpu_check.json (versions included) to --out (default $OUT
or ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time

import jax  # importing JAX starts no backend: the faithful-rounding switch still works
import jax.numpy as jnp
import numpy as np

from experiments.timing import median_seconds

CHECKS = ("kernels", "bandwidth", "train", "fp8", "micro", "study")
# Versions printed first; a package missing from the machine prints "not installed".
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "ml_dtypes")


def versions() -> dict[str, str]:
  """{"python": ..., package: __version__ or "not installed"} of the running interpreter."""
  out = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      out[name] = str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except ImportError:
      out[name] = "not installed"
  return out


def parse_checks(text: str) -> tuple[str, ...]:
  """"kernels,train" -> ("kernels", "train"), in CHECKS order; ArgumentTypeError else."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  bad = [n for n in names if n not in CHECKS]
  if bad or not names:
    raise argparse.ArgumentTypeError(
        f"--only {text!r}: unknown check(s) {bad}; accepted: a comma-separated subset of "
        f"{', '.join(CHECKS)}")
  return tuple(c for c in CHECKS if c in names)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m experiments.gpu_check", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--dry-run", action="store_true", help="tiny sizes on any backend")
  ap.add_argument("--only", type=parse_checks, default=CHECKS,
                  help=f"comma-separated checks to run (default: {','.join(CHECKS)})")
  ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
  return ap


# Datasheet HBM bandwidth, bytes/s.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 0.3e12}


def _bits(a):
  return jax.lax.bitcast_convert_type(a, jnp.uint8 if a.dtype.itemsize == 1 else jnp.uint16)


def pallas_bit_identity(n: int) -> dict:
  import precision as mp  # pylint: disable=g-import-not-at-top
  out = {}
  for src in (jnp.float32, jnp.bfloat16):
    targets = ("bf16", "f16", "e4m3", "e5m2") if src == jnp.float32 else ("e4m3", "e5m2")
    x = (jax.random.normal(jax.random.key(1), (n + 37,), jnp.float32) *
         jnp.exp2(jax.random.uniform(jax.random.key(2), (n + 37,), jnp.float32, -20, 20)))
    x = x.astype(src)
    for t in targets:
      ref = mp.rounding.stochastic_round_reference(x, t, 7, 3)
      got = mp.rounding.stochastic_round_pallas(x, t, 7, 3)
      same = np.asarray(_bits(ref) == _bits(got))
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
  import precision as mp  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
  copy = jax.jit(lambda x: x * 1.0 + 0.0)
  t_copy = median_seconds(copy, x, repeats=repeats)
  sr = jax.jit(lambda x: mp.rounding.stochastic_round_pallas(x, jnp.bfloat16, 0, 1))
  t_sr = median_seconds(sr, x, repeats=repeats)
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in PEAK_BANDWIDTH.items() if k in kind), None)
  copy_bw, sr_bw = 8 * n / t_copy, 6 * n / t_sr  # bytes read + written
  return {"elements": n, "copy_bytes_per_s": copy_bw, "pallas_sr_bytes_per_s": sr_bw,
          "pallas_sr_vs_copy": sr_bw / copy_bw,
          "pallas_sr_vs_peak": None if peak is None else sr_bw / peak}


def train_throughput(model: str, batch: int, seq: int, repeats: int) -> dict:
  from experiments import bench  # pylint: disable=g-import-not-at-top
  # TF32 off: fp32 GEMMs at full precision, so "fp32" means fp32 (llm.c's -f 0).
  with jax.default_matmul_precision("highest"):
    res = bench.recipe_figures(model, batch, seq, ("fp32", "bf16_mixed", "bf16_master"), repeats)
  rows = res["rows"]
  return {"model": model, "batch": batch, "seq": seq,
          "tokens_per_s": {k: v["tokens_per_s"] for k, v in rows.items()},
          "bf16_over_fp32": rows["bf16_mixed"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"],
          "mfu": {k: v["mfu"] for k, v in rows.items()}}


def micro_lowering(n: int, repeats: int) -> dict:
  """mxfp8 / nvfp4 block-scaled GEMMs against their emulation on one [n, n] x [n, n]
  GEMM, forward and gradients (see the module docstring); an error is reported, not
  raised (it is the finding: this GPU's XLA cannot compile them)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import precision as mp  # pylint: disable=g-import-not-at-top
  from precision.fp8 import _microdot  # pylint: disable=g-import-not-at-top
  k = jax.random.split(jax.random.key(0), 2)
  x = jax.random.normal(k[0], (n, n), jnp.float32)
  w = jax.random.normal(k[1], (n, n), jnp.float32) / np.sqrt(n)
  out: dict = {"n": n, "auto_picks": _microdot.resolve_gemm("auto")}
  for name in ("mxfp8", "nvfp4"):
    base = mp.get_recipe(name)
    runs = {}
    for mode in ("emulated", "block_scaled"):
      recipe = base.replace(name=f"{name}_{mode}", fp8=dataclasses.replace(
          base.fp8, keep_first_last=False, micro_gemm=mode))
      fn = jax.jit(jax.value_and_grad(mp.autocast(
          lambda x, w: jnp.sum(jnp.square(x @ w)), recipe), argnums=(0, 1)))
      try:
        value = jax.block_until_ready(fn(x, w))
        runs[mode] = (value, median_seconds(fn, x, w, repeats=repeats))
      except Exception as e:  # pylint: disable=broad-except
        runs[mode] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    row = {f"{m}_s": t for m, (_, t) in runs.items()}
    (ve, _), (vb, _) = runs["emulated"], runs["block_scaled"]
    if ve is not None and vb is not None:
      le, lb = jax.tree.leaves(ve), jax.tree.leaves(vb)
      row["max_rel_diff"] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
                                for a, b in zip(le, lb))
    out[name] = row
  return out


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  dry, checks = args.dry_run, args.only
  info = versions()
  print("gpu_check on " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
  import precision as mp  # pylint: disable=g-import-not-at-top
  # Before the first computation (XLA reads its flags once); raises if a backend already
  # started without it.
  mp.enable_faithful_rounding()
  info["precision_from"] = os.path.dirname(os.path.abspath(mp.__file__))
  info["backend"] = jax.default_backend()
  info["device_kind"] = jax.devices()[0].device_kind
  info["faithful_rounding"] = mp.faithful_rounding_enabled()  # what the backend does
  # Per dtype: a GPU may contract bf16/f16 multiply-adds into FMAs whatever the flags.
  info["faithful_rounding_status"] = mp.faithful_rounding_status()
  print(f"precision from {info['precision_from']}; backend {info['backend']} "
        f"({info['device_kind']}); faithful rounding "
        f"{'on' if info['faithful_rounding'] else 'OFF'} "
        f"{info['faithful_rounding_status']}", flush=True)
  if not dry and info["backend"] != "gpu":
    print(f"gpu_check needs a GPU; this backend is {info['backend']}. "
          "Use --dry-run to check the script on CPU.")
    return 2
  res = {**info, "dry_run": dry, "checks": list(checks)}
  t0 = time.perf_counter()
  if "kernels" in checks:
    res["pallas_bit_identity"] = pallas_bit_identity(4096 if dry else 1 << 22)
  if "bandwidth" in checks:
    res["bandwidth"] = bandwidth(1 << 14 if dry else 1 << 28, 2 if dry else 20)
  if "train" in checks:
    res["train"] = (train_throughput("tiny", 2, 32, 1) if dry else
                    train_throughput("gpt2_124m", 8, 1024, 10))
  if "fp8" in checks:
    from experiments import bench_fp8  # pylint: disable=g-import-not-at-top
    res["fp8"] = bench_fp8.run(quick=dry)
  if "micro" in checks:
    res["micro"] = micro_lowering(256 if dry else 2048, 2 if dry else 10)
  if "study" in checks:
    from experiments import bench_study  # pylint: disable=g-import-not-at-top
    # The sweep's plain LM is written as users write it, with JAX's default promotion
    # (a caller such as the test suite may have made rank promotion raise).
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
      res["study"] = (bench_study.bench(["plain_lm"], ["fp32", "bf16_mixed"], 2, 2, 2,
                                        os.path.join(args.out, "study")) if dry else
                      bench_study.bench(["gpt", "plain_lm"], list(bench_study.RECIPES), 8,
                                        20, 8, os.path.join(args.out, "study")))
  res["seconds"] = time.perf_counter() - t0
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
  fmt = lambda v, s: "-" if v is None else format(v, s)
  print("\n| check | figure |\n|---|---|")
  print(f"| versions | jax {info['jax']}, jaxlib {info['jaxlib']}, flax {info['flax']} |")
  for k, v in res.get("pallas_bit_identity", {}).items():
    if isinstance(v, float):
      print(f"| Pallas vs XLA reference, fraction of equal bits: {k} | {v:.6f} |")
  if "bandwidth" in res:
    b = res["bandwidth"]
    print(f"| copy bandwidth | {b['copy_bytes_per_s'] / 1e12:.2f} TB/s |")
    print(f"| Pallas SR bandwidth vs copy / vs peak | {b['pallas_sr_vs_copy']:.1%} / "
          f"{fmt(b['pallas_sr_vs_peak'], '.1%')} |")
  if "train" in res:
    tr = res["train"]
    for k, v in tr["tokens_per_s"].items():
      print(f"| {tr['model']} {k} tokens/s (MFU) | {v:,.0f} ({fmt(tr['mfu'][k], '.1%')}) |")
    print(f"| bf16 / fp32 (TF32 off) throughput | {tr['bf16_over_fp32']:.2f}x |")
  if "fp8" in res:
    print(f"| fp8 / bf16 GEMM {res['fp8']['gemm_n']}^3 | " + ", ".join(
        f"{k} {v:.2f}x" for k, v in res["fp8"]["gemm_fp8_over_bf16"].items()) + " |")
    print(f"| fp8 / bf16 train step | {res['fp8']['step_fp8_over_bf16']:.2f}x |")
  if "micro" in res:
    m = res["micro"]
    print(f"| micro_gemm 'auto' picks here | {m['auto_picks']} |")
    for name in ("mxfp8", "nvfp4"):
      r = m[name]
      t = lambda v: f"{v * 1e3:.2f} ms" if isinstance(v, float) else str(v)
      print(f"| {name} {m['n']}^3 fwd+grads: emulated / block_scaled / max rel diff | "
            f"{t(r['emulated_s'])} / {t(r['block_scaled_s'])} / "
            f"{fmt(r.get('max_rel_diff'), '.2e')} |")
  if "study" in res:
    for name, r in res["study"].items():
      sq, bt = r["sequential"], r["batched"]
      print(f"| study {name}: steps/s one program per cell / seed-batched (wall; train) | "
            f"{sq['steps_per_s_wall']:.2f} / {bt['steps_per_s_wall']:.2f} = "
            f"{bt['steps_per_s_wall'] / sq['steps_per_s_wall']:.2f}x; "
            f"{sq['steps_per_s_train']:.2f} / {bt['steps_per_s_train']:.2f} = "
            f"{bt['steps_per_s_train'] / sq['steps_per_s_train']:.2f}x |")
  print(f"| total seconds | {res['seconds']:.0f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
