"""Study throughput: the same grid run one program per cell and seed-batched, side by side.

  python -m experiments.bench_study                  # the sweep's tasks, 4 recipes x 8 seeds
  python -m experiments.bench_study --tasks gpt --steps 6 --seeds 4   # smaller
  python -m experiments.bench_study --seed-batch 4   # K seeds per program (default: seeds)

Each task of experiments.sweep (the GPT and the plain LM, at the sweep's sizes: batch 8
x 128 bytes) runs `precision.study.run` twice on the same grid, into fresh folders, in
one process: once with ``seed_batch=1`` (every cell its own program, as before seed
batching) and once with ``seed_batch=K`` (K seeds of a recipe in one program, the seed
axis sharded over the most local devices dividing K; seeds sharing a device looped on
CPU, vmapped on an accelerator: precision.study._batched). Printed per task and for the
whole grid:

  wall       the whole study run: building, compiling, training, evaluating, saving;
  train      the training steps alone (the sum of the cells' step times; a batched
             step's wall time counts once, shared by its seeds);
  steps/s    optimizer steps of all cells (recipes x seeds x steps) per second of each;
  ratio      seed-batched over one-program-per-cell.

The order is alternated per task (sequential first on the first task, batched first on
the next) so that machine-load drift does not favour one side. Writes bench_study.json
to --out (default ./bench_study_out) with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import precision as mp

import jax

from experiments import sweep
from experiments import data as data_lib
from precision import study
from precision.study import _cells

RECIPES = ("fp32", "bf16_mixed", "bf16_master", "f16_mixed")


def _train_seconds(out: str, cfg) -> float:
  """The sum of every cell's step times (batched: each seed's share of its step)."""
  total = 0.0
  for c in cfg.grid():
    total += sum(r["step_time_s"] for r in _cells.read_steps(out, c) if "step_time_s" in r)
  return total


def run_one(task, recipes, seeds, steps, out, seed_batch) -> dict:
  """One study of `task` into a fresh `out`: wall and train seconds, steps/s."""
  shutil.rmtree(out, ignore_errors=True)
  t0 = time.perf_counter()
  study.run(task, list(recipes), seeds, steps, out, eval_every=0, save_every=max(1, steps // 2),
            timing_rounds=0, progress=False, seed_batch=seed_batch)
  wall = time.perf_counter() - t0
  cfg = study.make_config(list(recipes), seeds, steps)
  train = _train_seconds(out, cfg)
  n = len(cfg.grid()) * steps
  done = {c.name: _cells.read_done(out, c) for c in cfg.grid()}
  statuses = sorted({d["status"] for d in done.values()})
  return {"seed_batch": seed_batch, "wall_s": wall, "train_s": train, "steps": n,
          "steps_per_s_wall": n / wall, "steps_per_s_train": n / train,
          "statuses": statuses,
          "fingerprints": {name: d.get("fingerprint") for name, d in done.items()}}


def bench(tasks, recipes, seeds, steps, seed_batch, out) -> dict:
  cfg = sweep.SweepConfig(recipes=tuple(recipes), seeds=seeds, steps=steps)
  corpus = data_lib.load_corpus()
  results = {}
  for i, name in enumerate(tasks):
    task = sweep.make_task(name, cfg, corpus)
    order = (1, seed_batch) if i % 2 == 0 else (seed_batch, 1)
    res = {}
    for k in order:
      res["batched" if k != 1 else "sequential"] = run_one(
          task, recipes, seeds, steps, os.path.join(out, f"{name}_k{k}"), k)
      r = res["batched" if k != 1 else "sequential"]
      print(f"  {name} seed_batch={k}: " + json.dumps(
          {key: v for key, v in r.items() if key != "fingerprints"}), file=sys.stderr,
          flush=True)
    # Whether the two sides trained the same bits (the final state's fingerprint).
    fs, fb = res["sequential"]["fingerprints"], res["batched"]["fingerprints"]
    res["equal_cells"] = sum(fs[c] is not None and fs[c] == fb.get(c) for c in fs)
    res["cells"] = len(fs)
    results[name] = res
  equal = sum(r["equal_cells"] for r in results.values())
  cells = sum(r["cells"] for r in results.values())
  total = {side: {"wall_s": sum(r[side]["wall_s"] for r in results.values()),
                  "train_s": sum(r[side]["train_s"] for r in results.values()),
                  "steps": sum(r[side]["steps"] for r in results.values())}
           for side in ("sequential", "batched")}
  for side in total.values():
    side["steps_per_s_wall"] = side["steps"] / side["wall_s"]
    side["steps_per_s_train"] = side["steps"] / side["train_s"]
  results["grid"] = {**total, "equal_cells": equal, "cells": cells}
  return results


def table(results: dict, seed_batch: int) -> str:
  lines = ["| task | side | wall s | steps/s (wall) | train s | steps/s (train) |",
           "|---|---|---|---|---|---|"]
  for name, res in results.items():
    for side in ("sequential", "batched"):
      r = res[side]
      label = "one program per cell" if side == "sequential" else f"seed_batch={seed_batch}"
      lines.append(f"| {name} | {label} | {r['wall_s']:.1f} | {r['steps_per_s_wall']:.2f} | "
                   f"{r['train_s']:.1f} | {r['steps_per_s_train']:.2f} |")
    s, b = res["sequential"], res["batched"]
    lines.append(f"| {name} | ratio (batched / sequential) | | "
                 f"{b['steps_per_s_wall'] / s['steps_per_s_wall']:.2f}x | | "
                 f"{b['steps_per_s_train'] / s['steps_per_s_train']:.2f}x |")
  lines.append("")
  lines.append("Cells whose final state has the same bits on both sides: " + "; ".join(
      f"{name} {res['equal_cells']} of {res['cells']}" for name, res in results.items()))
  return "\n".join(lines)


def main(argv=None) -> int:
  mp.enable_faithful_rounding()  # XLA flags: set here, before the first computation
  ap = argparse.ArgumentParser(prog="python -m experiments.bench_study", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tasks", default=",".join(sweep.TASKS))
  ap.add_argument("--recipes", default=",".join(RECIPES))
  ap.add_argument("--seeds", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--seed-batch", type=int, help="K (default: --seeds)")
  ap.add_argument("--out", default="bench_study_out")
  args = ap.parse_args(argv)
  tasks = [t for t in args.tasks.split(",") if t]
  bad = [t for t in tasks if t not in sweep.TASKS]
  if bad or not tasks:
    print(f"error: --tasks {args.tasks!r}; accepted: a comma-separated subset of "
          f"{', '.join(sweep.TASKS)}", file=sys.stderr)
    return 2
  recipes = [r for r in args.recipes.split(",") if r]
  k = args.seed_batch or args.seeds
  dev = jax.devices()[0]
  from precision.study import _batched  # pylint: disable=g-import-not-at-top
  try:
    sb = _batched.check_seed_batch(k, args.seeds, jax.local_device_count())
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"# Study throughput: {len(recipes)} recipes x {args.seeds} seeds x {args.steps} "
        f"steps per task, seed_batch={k} ({sb.devices} devices, seeds sharing one: "
        f"{sb.how}); {dev.platform.upper()} ({dev.device_kind}), "
        f"{jax.local_device_count()} local devices, {os.cpu_count()} CPU cores")
  try:
    results = bench(tasks, recipes, args.seeds, args.steps, k, args.out)
  except ValueError as e:
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  print(table(results, k))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_study.json"), "w") as f:
    json.dump({"recipes": recipes, "seeds": args.seeds, "steps": args.steps,
               "seed_batch": k, "device": f"{dev.platform} ({dev.device_kind})",
               "local_devices": jax.local_device_count(), "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
