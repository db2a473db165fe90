"""All benchmarks in one process: `python -m experiments.bench [--quick] [--out DIR]`.

Every figure is measured side by side in this one run and reported as medians and ratios,
never as a bare absolute time (absolute seconds are kept in the JSON for reference):

  policy     the policy wrapper vs the same model hand-written with Flax dtype arguments:
             step-time ratio, dot and convert counts, FLOPs (experiments.bench_policy)
  recipes    each recipe's GPT train step: compiled memory (arguments, outputs, temporaries,
             aliasing from donation) beside the analytic ledger `bytes_per_param`, activation
             memory relative to fp32, tokens/s and MFU where the device's peak is known
  optimizer  every recipe optimizer's update over a hand-written f32-master AdamW,
             interleaved, with temp bytes per param (experiments.bench_optim)
  rounding   stochastic vs nearest cast, fused vs unfused AdamW+SR (experiments.bench_rounding)
  fp8        fp8 vs bf16 GEMM and step (CPU: emulation overhead only) (experiments.bench_fp8)
  zero       ZeRO stages 0-3: per-device memory and bytes sent per step on 8 host devices
             (experiments.bench_parallel)
  telemetry  the study's numerics telemetry program against the GPT cell's step: the step
             time overhead of telemetry every 100 (and 10) steps (experiments.bench_telemetry)
  host       host time per training step of a small GPT with 1 to 16 blocks: nnx.jit of
             precision.train_step, precision.jit_train_step and split state + jax.jit, as
             ratios over the last (experiments.bench_host)

Outputs: DIR/bench.json and DIR/bench.md. CPU wall-clock of bf16 vs fp32 says nothing about
a GPU; the GPU figures come from experiments/gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import precision as mp  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments import data as data_lib  # noqa: E402
from experiments import mfu as mfu_lib  # noqa: E402
from experiments import trainlib  # noqa: E402
from models import gpt as gpt_lib  # noqa: E402

SECTIONS = ("policy", "recipes", "optimizer", "rounding", "fp8", "zero", "telemetry",
            "host")


def _nbytes(tree) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * x.size for x in jax.tree.leaves(tree)))


def _residual_bytes(run, state, batch: int, seq: int) -> int:
  """Bytes of everything the backward pass keeps from the forward (the vjp's residuals),
  from shapes only (nothing is computed)."""
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

  def residuals(params, model_state, tokens):
    f = lambda p: gpt_lib.loss_fn(nnx.merge(run.graphdef, p, model_state), tokens)
    return jax.tree.leaves(jax.vjp(f, params)[1])

  return _nbytes(jax.eval_shape(residuals, state.params, state.model_state, tokens))


def recipe_figures(model: str, batch: int, seq: int, recipes, repeats: int) -> dict:
  """Compiled memory, ledger, activation memory, tokens/s and MFU for each recipe's step."""
  corpus = data_lib.load_corpus()
  tokens, _ = data_lib.sample_batch(corpus.train, data_lib.init_sampler(0), batch, seq)
  tokens = jnp.asarray(tokens)
  built = {}
  for name in recipes:
    cfg = trainlib.TrainConfig(recipe=name, model=model, steps=100, batch=batch, seq=seq,
                               progress=False)
    run, state = trainlib.init_state(cfg)
    compiled = trainlib.compile_step(run, state, tokens)
    built[name] = [run, state, compiled]
  # Tokens/s: the recipes' steps interleaved, so machine noise hits them alike.
  times = {name: [] for name in recipes}
  for rep in range(repeats + 1):
    for name in recipes:
      run, state, compiled = built[name]
      t = time.perf_counter()
      p, s, o, metrics = compiled(state.params, state.model_state, state.opt_state, tokens)
      jax.block_until_ready(metrics)
      if rep:  # the first call of each is a warm-up
        times[name].append(time.perf_counter() - t)
      built[name][1] = state._replace(params=p, model_state=s, opt_state=o)
  cfg_m = gpt_lib.get_config(model)
  kind = jax.devices()[0].device_kind
  out = {}
  for name in recipes:
    run, state, compiled = built[name]
    recipe = mp.get_recipe(name)
    n = int(sum(x.size for x in jax.tree.leaves(state.params)))
    mem = mp.study.compiled_memory(compiled)
    ledger = mp.optim.memory_ledger(recipe)
    # Persistent state the step carries (its donated arguments): params + optimizer state.
    measured_persistent = _nbytes(state.params) + _nbytes(state.opt_state)
    ledger_persistent = n * (sum(ledger.values()) - ledger["grads"])  # grads are transient
    # Activation memory per sequence: the growth of the vjp residuals with the batch, so
    # weight copies (which do not grow with the batch) drop out.
    if recipe.fp8 is None:
      act = (_residual_bytes(run, state, 2 * batch, seq) -
             _residual_bytes(run, state, batch, seq)) / batch
    else:
      # fp8 GEMMs update their scaling state while they run, which a bare jax.vjp trace
      # does not allow (nnx's own vjp hides the residuals), so this figure is not taken.
      act = None
    tok_s = batch * seq / statistics.median(times[name])
    fpt = mfu_lib.flops_per_token(n, cfg_m.n_layers, cfg_m.d_model, seq)
    compute = "fp8" if recipe.fp8 is not None else (
        "bf16" if recipe.policy.compute_dtype != np.float32 else "fp32")
    out[name] = {
        "params": n, "memory": mem,
        "bytes_per_param": mp.optim.bytes_per_param(recipe),
        "persistent_bytes_measured": measured_persistent,
        "persistent_bytes_ledger": ledger_persistent,
        "ledger_rel_err": measured_persistent / ledger_persistent - 1.0,
        "activation_bytes_per_seq": act,
        "tokens_per_s": tok_s,
        "flops_per_token": fpt,
        "mfu": mfu_lib.mfu(tok_s, fpt, kind, compute),
    }
  base = out.get("fp32")
  for name, row in out.items():
    row["activation_vs_fp32"] = (
        row["activation_bytes_per_seq"] / base["activation_bytes_per_seq"]
        if base and row["activation_bytes_per_seq"] is not None else None)
    row["tokens_per_s_vs_fp32"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
  return {"model": model, "batch": batch, "seq": seq, "device_kind": kind, "rows": out}


def run(quick: bool = False, sections=SECTIONS) -> dict:
  """Runs the chosen sections; returns one JSON-safe dict keyed by section."""
  from experiments import bench_fp8, bench_optim, bench_parallel, bench_policy, bench_rounding
  from experiments import bench_host, bench_telemetry
  result = {"quick": quick, "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "platform": platform.platform(),
            "jax": jax.__version__, "faithful_rounding": mp.faithful_rounding_enabled()}
  runners = {
      "policy": lambda: bench_policy.run(quick),
      "recipes": lambda: recipe_figures(
          "tiny" if quick else "small", 4 if quick else 8, 32 if quick else 128,
          ("fp32", "bf16_mixed", "bf16_master") if quick else tuple(mp.PRESETS),
          2 if quick else 10),
      "optimizer": lambda: bench_optim.run(quick),
      "rounding": lambda: bench_rounding.run(quick),
      "fp8": lambda: bench_fp8.run(quick),
      "zero": lambda: bench_parallel.run(quick),
      "telemetry": lambda: bench_telemetry.run(quick),
      "host": lambda: bench_host.run(quick),
  }
  for name in sections:
    t = time.perf_counter()
    result[name] = runners[name]()
    result.setdefault("seconds", {})[name] = time.perf_counter() - t
  return result


def _f(x, spec=".3f"):
  return "-" if x is None else format(x, spec)


def markdown(res: dict) -> str:
  lines = [f"# Benchmarks ({res['backend']}: {res['device_kind']}; quick={res['quick']})", ""]
  if "policy" in res:
    lines += ["## Policy wrapper vs hand-written Flax", "",
              "| model | step time ratio | dots (ours/hand) | converts (ours/hand) | dot GFLOP |",
              "|---|---|---|---|---|"]
    for name, r in res["policy"].items():
      lines.append(f"| {name} | {r['time_ratio']:.3f} | {r['policy']['dots']}/{r['hand']['dots']} | "
                   f"{r['policy']['converts']}/{r['hand']['converts']} | "
                   f"{r['policy']['dot_flops'] / 1e9:.3f} |")
    lines.append("")
  if "recipes" in res:
    rr = res["recipes"]
    lines += [f"## Recipes: `{rr['model']}` train step, batch {rr['batch']} x seq {rr['seq']}", "",
              "| recipe | B/param | persistent measured/ledger - 1 | args MiB | temps MiB | "
              "alias MiB | activations vs fp32 | tokens/s vs fp32 | MFU |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rr["rows"].items():
      m = r["memory"]
      lines.append(
          f"| {name} | {r['bytes_per_param']:.0f} | {r['ledger_rel_err']:+.4%} | "
          f"{m['argument'] / 2**20:.2f} | {m['temp'] / 2**20:.2f} | {m['alias'] / 2**20:.2f} | "
          f"{_f(r['activation_vs_fp32'])} | {_f(r['tokens_per_s_vs_fp32'])} | "
          f"{_f(r['mfu'], '.1%')} |")
    lines.append("")
  if "optimizer" in res:
    o = res["optimizer"]
    lines += [f"## Optimizer update over {o['baseline']} ({o['repeats']} interleaved rounds)", "",
              "| transform | " + " | ".join(
                  f"{int(n) / 2**20:.0f}M ratio | over {o['unguarded']} | temp B/param"
                  for n in o["sizes"]) + " |",
              "|---|" + "---|---|---|" * len(o["sizes"])]
    first = o["ratio"][o["sizes"][0]]
    for k in first:
      lines.append(f"| {k} | " + " | ".join(
          f"{o['ratio'][n][k]:.2f} | {o['ratio_over_unguarded'][n][k]:.2f} | "
          f"{o['temp_bytes_per_param'][n][k]:.2f}" for n in o["sizes"]) + " |")
    for k in o["no_donation_ratio"][o["sizes"][0]]:
      lines.append(f"| {k}, no donation (over the undonated baseline) | " + " | ".join(
          f"{o['no_donation_ratio'][n][k]:.2f} | "
          f"{o['no_donation_temp_bytes_per_param'][n][k]:.2f}" for n in o["sizes"]) + " |")
    lines.append("")
  if "rounding" in res:
    r = res["rounding"]
    lines += ["## Rounding", "",
              f"- stochastic (XLA) over astype at {r['elements']:,} elements: {r['sr_over_astype']:.2f}x",
              f"- fused AdamW+SR over unfused: {r['fused_over_unfused']:.2f}x",
              f"- Pallas bandwidth fraction: {_f(r['pallas_bandwidth_fraction'], '.1%')} "
              "(GPU only)", ""]
  if "fp8" in res:
    f = res["fp8"]
    lines += ["## fp8 (" + ("CPU emulation: no speed claim" if f["backend"] != "gpu" else "GPU")
              + ")", "",
              "- GEMM fp8/bf16 throughput: " + ", ".join(
                  f"{k} {v:.2f}x" for k, v in f["gemm_fp8_over_bf16"].items()),
              f"- train step fp8/bf16 speed: {f['step_fp8_over_bf16']:.2f}x", ""]
  if "zero" in res:
    lines += ["## ZeRO stages (per device, KiB; zero_* = ZeRO paper's model)", "",
              "| recipe | stage | params | zero params | opt state | zero opt | temps | sent/step |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["zero"]["rows"]:
      lines.append(f"| {r['recipe']} | {r['stage']} | {r['params_KiB']} | {r['zero_params']} | "
                   f"{r['opt_KiB']} | {r['zero_opt']} | {r['temp_KiB']} | {r['sent_KiB']} |")
    lines.append("")
  if "telemetry" in res:
    t = res["telemetry"]
    lines += [f"## Numerics telemetry: GPT cell under {t['recipe']}, batch {t['batch']} x seq "
              f"{t['seq']} (medians of {t['repeats']}, interleaved)", "",
              "| model | GEMM tensors | what-if | telemetry / step | overhead every 100 steps | "
              "every 10 | compile s |", "|---|---|---|---|---|---|---|"]
    for name, r in t["rows"].items():
      for key, label in (("whatif", "yes"), ("no_whatif", "no")):
        c = r[key]
        lines.append(f"| {name} | {r['tensors']} | {label} | {c['telemetry_over_step']:.2f}x | "
                     f"{c['overhead_every_100']:.2%} | {c['overhead_every_10']:.1%} | "
                     f"{c['compile_s']:.1f} |")
    lines.append("")
  if "host" in res:
    h = res["host"]
    pats = ("nnx.jit", "jit_train_step", "split + jax.jit")
    lines += [f"## Host time per step: GPT of width 16 under {h['recipe']} (medians of "
              f"{h['repeats']} interleaved repeats of {h['steps']} steps)", "",
              "Step: call to results ready, the device idle before; host: the step less the "
              "compiled program called alone.", "",
              "| blocks | Variables | step ms: nnx.jit | jit_train_step | split + jax.jit | "
              "program alone | jit_train_step / split | nnx.jit / split | host ms: nnx.jit | "
              "jit_train_step | split + jax.jit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in h["layers"]:
      s, hs = h["seconds"][n], h["host_seconds"][n]
      lines.append(f"| {n} | {h['variables'][n]} | " + " | ".join(
          f"{s[p] * 1e3:.3f}" for p in pats + ("program alone",)) +
          f" | {h['helper_over_split'][n]:.2f} | {h['nnx_over_split'][n]:.2f} | " +
          " | ".join(f"{hs[p] * 1e3:.3f}" for p in pats) + " |")
    lines.append("")
  return "\n".join(lines) + "\n"


def _set_xla_flags() -> None:
  """ZeRO figures need 8 host devices, and every bf16/f16 op rounds as stated. XLA reads
  its flags once, when the first computation starts the backend: main() calls this first,
  so importing the module (tests do) changes no flag."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  mp.enable_faithful_rounding()


def main(argv=None) -> int:
  _set_xla_flags()
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (tests)")
  ap.add_argument("--out", default="bench_out")
  ap.add_argument("--sections", default=",".join(SECTIONS),
                  help=f"comma-separated subset of {','.join(SECTIONS)}")
  args = ap.parse_args(argv)
  sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  bad = [s for s in sections if s not in SECTIONS]
  if bad:
    raise ValueError(f"Unknown sections {bad}; accepted: {', '.join(SECTIONS)}")
  res = run(args.quick, sections)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
  md = markdown(res)
  with open(os.path.join(args.out, "bench.md"), "w") as f:
    f.write(md)
  print(md)
  return 0


if __name__ == "__main__":
  sys.exit(main())
