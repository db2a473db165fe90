"""The main job: train the GPT under every recipe, judge each against fp32.

  python -m experiments.sweep                 # default: `small` GPT, all recipes, 3 seeds
  python -m experiments.sweep --quick         # about a minute: tiny GPT, 3 recipes
  python -m experiments.sweep --recipes fp32,pure_bf16 --seeds 3 --steps 400

Outputs in --out: results.jsonl (every step of every run), summary.md (one row per recipe
with verdicts against the fp32 control's spread, seed 001's rule, and seed 000's numeric
gate table), summary.json, loss_curves.png (validation BPB vs step, seeds shaded) and
loss_scale.png where a recipe scales its loss. A run that diverges or fails is recorded
as such and the sweep goes on. Faithful rounding is on (set before JAX starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import precision as mp

mp.enable_faithful_rounding()

from experiments import data as data_lib  # noqa: E402
from experiments import gates  # noqa: E402
from experiments import report  # noqa: E402
from experiments import trainlib  # noqa: E402

ALL_RECIPES = tuple(mp.PRESETS)
QUICK_RECIPES = ("fp32", "bf16_master", "f16_mixed")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """What the sweep runs. Defaults: the CPU main job (under 15 minutes on 2 cores)."""

  recipes: tuple[str, ...] = ALL_RECIPES
  seeds: int = 3
  steps: int = 300
  model: str = "small"
  batch: int = 8
  seq: int = 128
  lr: float = 3e-3
  eval_every: int = 30
  eval_batches: int = 8
  gate_batch: int = 4
  out: str = "sweep_out"
  progress: bool = True

  @classmethod
  def quick(cls, **overrides) -> SweepConfig:
    base = dict(recipes=QUICK_RECIPES, seeds=2, steps=12, model="tiny", batch=4, seq=32,
                eval_every=6, eval_batches=1, gate_batch=2)
    base.update(overrides)
    return cls(**base)


def _status(summary: dict) -> str:
  vals = [summary.get("final_loss"), summary.get("final_val_bpb")]
  return "ok" if all(v is not None and math.isfinite(v) for v in vals) else "diverged"


def run_one(cfg: SweepConfig, recipe: str, seed: int, results) -> dict:
  """Trains one (recipe, seed); appends its steps to `results` (an open JSONL file)."""
  tcfg = trainlib.TrainConfig(
      recipe=recipe, model=cfg.model, steps=cfg.steps, batch=cfg.batch, seq=cfg.seq,
      lr=cfg.lr, seed=seed, eval_every=cfg.eval_every, eval_batches=cfg.eval_batches,
      progress=cfg.progress)
  try:
    summary = trainlib.train(tcfg)
  except Exception as e:  # pylint: disable=broad-except
    # A failing recipe is a result, not the end of the sweep.
    err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    traceback.print_exc(file=sys.stderr)
    results.write(json.dumps({"recipe": recipe, "seed": seed, "status": "failed",
                              "error": err}) + "\n")
    return {"recipe": recipe, "seed": seed, "status": "failed", "error": err, "history": [],
            "summary": {}}
  history = summary.pop("history", [])
  status = _status(summary)
  for rec in history:
    results.write(json.dumps({"recipe": recipe, "seed": seed, **rec}) + "\n")
  mem = summary.get("memory", {})
  hist_scale = [h["loss_scale"] for h in history if "loss_scale" in h]
  flat = {
      "final_val_bpb": summary.get("final_val_bpb"),
      "final_loss": summary.get("final_loss"),
      "nonfinite_steps": summary.get("nonfinite_steps", 0),
      "skipped_steps": summary.get("skipped_steps", 0),
      "final_loss_scale": hist_scale[-1] if hist_scale else summary.get("loss_scale", 1.0),
      "tokens_per_s": summary.get("tokens_per_s"),
      "step_memory_bytes": mem.get("argument_plus_temp", float("nan")),
      "params": summary.get("params"),
      "fingerprint": summary.get("fingerprint"),
  }
  results.write(json.dumps({"recipe": recipe, "seed": seed, "status": status,
                            "summary": flat}) + "\n")
  return {"recipe": recipe, "seed": seed, "status": status, "error": None,
          "history": history, "summary": flat}


def run_sweep(cfg: SweepConfig) -> dict:
  """Runs every (recipe, seed), the numeric gates, and writes the outputs. Returns paths
  and the summary rows."""
  for r in cfg.recipes:
    mp.get_recipe(r)  # unknown names fail before any training, listing the presets
  os.makedirs(cfg.out, exist_ok=True)
  # Seeds of one recipe compile to the same program: a persistent compilation cache turns
  # every compile after the first into a load.
  import jax  # pylint: disable=g-import-not-at-top
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", os.path.join(cfg.out, ".compile_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    return _run_sweep(cfg)
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)


def _run_sweep(cfg: SweepConfig) -> dict:
  t0 = time.time()
  runs = []
  jobs = [(r, s) for r in cfg.recipes for s in range(cfg.seeds)]
  bar = None
  if cfg.progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(jobs), desc="sweep", file=sys.stderr)
  with open(os.path.join(cfg.out, "results.jsonl"), "w") as results:
    for recipe, seed in jobs:
      if bar is not None:
        bar.set_postfix(recipe=recipe, seed=seed)
      runs.append(run_one(cfg, recipe, seed, results))
      results.flush()
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  corpus = data_lib.load_corpus()
  gate_rows = []
  for recipe in cfg.recipes:
    try:
      gate_rows.append(gates.numeric_gate(recipe, cfg.model, batch=cfg.gate_batch,
                                          seq=cfg.seq, corpus=corpus))
    except Exception as e:  # pylint: disable=broad-except
      print(f"numeric gate for {recipe} failed: {type(e).__name__}: {e}", file=sys.stderr)
  return write_report(cfg, runs, gate_rows, time.time() - t0)


def write_report(cfg: SweepConfig, runs: list[dict], gate_rows: list[dict],
                 elapsed: float) -> dict:
  """summary.md, summary.json and the plots in cfg.out from the runs and gate rows."""
  recipes = tuple(dict.fromkeys(r["recipe"] for r in runs))
  ledger = {r: mp.optim.bytes_per_param(mp.get_recipe(r)) for r in recipes}
  rows = report.summarize(runs, ledger)
  header = (f"# Recipe sweep\n\nModel `{cfg.model}`, {cfg.steps} steps, batch {cfg.batch} x "
            f"seq {cfg.seq}, lr {cfg.lr}, seeds {cfg.seeds}, faithful rounding "
            f"{mp.faithful_rounding_enabled()}, {elapsed / 60:.1f} min. Verdict (seed 001's "
            "rule): a difference from fp32 counts only beyond the fp32 control's range over "
            "seeds. Paired verdict: same seed = same init and data order; every seed's "
            "difference has one sign and the mean exceeds two standard errors. Step memory "
            "= compiled arguments + temporaries.\n")
  md = report.summary_markdown(rows, gate_rows, header)
  paths = {"results": os.path.join(cfg.out, "results.jsonl"),
           "summary_md": os.path.join(cfg.out, "summary.md"),
           "summary_json": os.path.join(cfg.out, "summary.json"),
           "loss_curves": os.path.join(cfg.out, "loss_curves.png")}
  with open(paths["summary_md"], "w") as f:
    f.write(md)
  with open(paths["summary_json"], "w") as f:
    json.dump({"config": dataclasses.asdict(cfg), "rows": rows, "gates": gate_rows,
               "elapsed_s": elapsed}, f, indent=1, default=str)
  report.plot_metric(runs, "val_bpb", paths["loss_curves"], "validation bits per byte",
                     baseline=report.CONTROL)
  scaled = [r for r in runs if mp.get_recipe(r["recipe"]).loss_scale.kind != "none"]
  if scaled:
    paths["loss_scale"] = os.path.join(cfg.out, "loss_scale.png")
    report.plot_metric(scaled, "loss_scale", paths["loss_scale"], "loss scale", log=True)
  return {"paths": paths, "rows": rows, "gates": gate_rows, "markdown": md,
          "elapsed_s": elapsed}


def load_runs(out: str) -> list[dict]:
  """The runs recorded in out/results.jsonl (step records and each run's final record)."""
  runs: dict[tuple[str, int], dict] = {}
  with open(os.path.join(out, "results.jsonl")) as f:
    for line in f:
      rec = json.loads(line)
      run = runs.setdefault((rec["recipe"], rec["seed"]), {
          "recipe": rec["recipe"], "seed": rec["seed"], "status": "failed", "error": None,
          "history": [], "summary": {}})
      if "status" in rec:
        run.update(status=rec["status"], error=rec.get("error"),
                   summary=rec.get("summary", {}))
      else:
        run["history"].append({k: v for k, v in rec.items() if k not in ("recipe", "seed")})
  return list(runs.values())


def rebuild_report(out: str) -> dict:
  """Rewrites a finished sweep's summary and plots from its results.jsonl and summary.json
  (the numeric gates and settings are read back, nothing is trained)."""
  with open(os.path.join(out, "summary.json")) as f:
    saved = json.load(f)
  conf = dict(saved["config"], out=out, recipes=tuple(saved["config"]["recipes"]))
  return write_report(SweepConfig(**conf), load_runs(out), saved["gates"], saved["elapsed_s"])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--recipes", help=f"comma-separated presets (default: all: {','.join(ALL_RECIPES)})")
  ap.add_argument("--seeds", type=int, help="seeds per recipe (default 3, as seed 001)")
  ap.add_argument("--steps", type=int)
  ap.add_argument("--model", choices=("tiny", "small", "gpt2_124m"))
  ap.add_argument("--batch", type=int)
  ap.add_argument("--seq", type=int)
  ap.add_argument("--lr", type=float)
  ap.add_argument("--out", default="sweep_out")
  ap.add_argument("--quick", action="store_true", help="about a minute: tiny model, 3 recipes")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--report-only", action="store_true",
                  help="rebuild summary.md and the plots of an existing --out, no training")
  args = ap.parse_args(argv)
  if args.report_only:
    print(rebuild_report(args.out)["markdown"])
    return 0
  overrides = {k: v for k, v in dict(seeds=args.seeds, steps=args.steps, model=args.model,
                                     batch=args.batch, seq=args.seq, lr=args.lr).items()
               if v is not None}
  if args.recipes:
    overrides["recipes"] = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
  overrides["out"] = args.out
  overrides["progress"] = not args.no_progress
  cfg = SweepConfig.quick(**overrides) if args.quick else SweepConfig(**overrides)
  result = run_sweep(cfg)
  print(result["markdown"])
  print(json.dumps({"out": cfg.out, "elapsed_s": round(result["elapsed_s"], 1),
                    "files": sorted(os.path.basename(p) for p in result["paths"].values())}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
