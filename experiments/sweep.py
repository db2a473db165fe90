"""The main job: train the GPT under every recipe, judge each against fp32.

  python -m experiments.sweep                 # default: `small` GPT, all recipes, 3 seeds
  python -m experiments.sweep --quick         # about a minute: tiny GPT, 3 recipes
  python -m experiments.sweep --recipes fp32,pure_bf16 --seeds 3 --steps 400

Scale-out: the recipe x seed grid splits into N slices, one per machine or GPU (e.g. a
scheduler array job); every slice writes into the same --out, then one call merges them:

  python -m experiments.sweep --out shared/sweep --shard 1/2   # on machine 1
  python -m experiments.sweep --out shared/sweep --shard 2/2   # on machine 2
  python -m experiments.sweep --out shared/sweep --report-only # once both are done

Slice K of N trains grid entries K-1, K-1+N, ... (recipe-major order, so every slice gets
a mix of recipes) and the numeric gates of recipes K-1, K-1+N, ...; its files are
parts/results-K-of-N.jsonl and parts/part-K-of-N.json (written last: it marks the slice
done). A run without --shard is slice 1 of 1 and merges at once; the merged outputs are
the same either way, timings aside.

Outputs in --out: results.jsonl (every step of every run, grid order), summary.md (per
recipe: a paired sign-flip test against fp32, Holm-corrected, with a 95% interval, the
fp32-spread rule, run health and cost with the machine load, and the numeric gate with its
limits and pass/fail), summary.json, loss_curves.png (each recipe minus fp32 on the same
seed, then the absolute curves) and loss_scale.png (scale, growth, back-off and skipped
steps) where a recipe scales its loss. A run that diverges or fails is recorded as such and
the sweep goes on. Faithful rounding is on (set before JAX starts).

Loss scaling: a preset's dynamic scale grows after 2000 finite steps, which a run of a few
hundred steps never reaches; by default the sweep sets the growth interval to steps // 15
(`--growth-interval`, "recipe" keeps the preset's) so growth and back-off both happen, and
summary.md says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys
import time
import traceback

import precision as mp

mp.enable_faithful_rounding()

from experiments import data as data_lib  # noqa: E402
from experiments import gates  # noqa: E402
from experiments import report  # noqa: E402
from experiments import trainlib  # noqa: E402
from models import gpt as gpt_lib  # noqa: E402

ALL_RECIPES = tuple(mp.PRESETS)
QUICK_RECIPES = ("fp32", "bf16_master", "f16_mixed")
# "auto" growth interval: the scale may double this many times over a run. From the
# presets' initial 2^15 that reaches 2^30, past where the `small` GPT's f16 gradients
# overflow (2^21-2^22 in a 300-step run), so a default run both grows and backs off.
GROWTH_STEPS_PER_RUN = 15
PARTS_DIR = "parts"
# Settings that may differ between the slices of one sweep.
_PER_SLICE = ("shard", "out", "progress")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """What the sweep runs. Defaults: the CPU main job (`small` GPT, every preset, 3 seeds).

  Attributes:
    recipes: preset names; fp32 is the control the others are judged against.
    seeds: seeds per recipe (seed s fixes init and data order for every recipe).
    steps, model, batch, seq, lr: the training run (experiments.trainlib.TrainConfig).
    eval_every, eval_batches: validation BPB cadence and batches.
    gate_batch: batch of the numeric gate.
    growth_interval: dynamic loss-scale growth interval in steps, an int >= 1; "auto"
      (steps // GROWTH_STEPS_PER_RUN, at least 1) or "recipe" (the preset's own).
    shard: (K, N): run slice K (1-based) of N of the recipe x seed grid.
    out: output directory (shared by the slices).
    progress: tqdm bars on stderr.
  """

  recipes: tuple[str, ...] = ALL_RECIPES
  seeds: int = 3
  steps: int = 300
  model: str | gpt_lib.GPTConfig = "small"
  batch: int = 8
  seq: int = 128
  lr: float = 3e-3
  eval_every: int = 30
  eval_batches: int = 8
  gate_batch: int = 4
  growth_interval: int | str = "auto"
  shard: tuple[int, int] = (1, 1)
  out: str = "sweep_out"
  progress: bool = True

  def __post_init__(self):
    object.__setattr__(self, "recipes", tuple(self.recipes))
    object.__setattr__(self, "shard", tuple(int(x) for x in self.shard))
    for name in ("seeds", "steps", "batch", "seq", "eval_batches", "gate_batch"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"SweepConfig.{name}={getattr(self, name)!r}; must be >= 1")
    if not self.recipes:
      raise ValueError("SweepConfig.recipes=(); name at least one preset")
    g = self.growth_interval
    if not (g in ("auto", "recipe") or (isinstance(g, int) and not isinstance(g, bool)
                                        and g >= 1)):
      raise ValueError(f"SweepConfig.growth_interval={g!r}; accepted: 'auto', 'recipe' or "
                       "an int >= 1 (steps)")
    k, n = self.shard if len(self.shard) == 2 else (0, 0)
    if len(self.shard) != 2 or not 1 <= k <= n:
      raise ValueError(f"SweepConfig.shard={self.shard!r}; must be (K, N) with 1 <= K <= N")

  @classmethod
  def quick(cls, **overrides) -> SweepConfig:
    base = dict(recipes=QUICK_RECIPES, seeds=2, steps=12, model="tiny", batch=4, seq=32,
                eval_every=6, eval_batches=1, gate_batch=2)
    base.update(overrides)
    return cls(**base)


def parse_shard(text: str) -> tuple[int, int]:
  """"K/N" -> (K, N) with 1 <= K <= N; a clear ValueError otherwise."""
  m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
  if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
    raise ValueError(f"--shard {text!r}; expected K/N with 1 <= K <= N, e.g. 1/4 "
                     "(a 0-based array index i is --shard $((i+1))/N)")
  return int(m.group(1)), int(m.group(2))


def growth_interval(cfg: SweepConfig) -> int | None:
  """The growth interval the sweep gives dynamic loss scales (None: the recipe's own)."""
  if cfg.growth_interval == "recipe":
    return None
  if cfg.growth_interval == "auto":
    return max(1, cfg.steps // GROWTH_STEPS_PER_RUN)
  return int(cfg.growth_interval)


def sweep_recipe(cfg: SweepConfig, name: str) -> mp.Recipe:
  """The preset `name` as this sweep trains it (dynamic loss scale: growth interval set)."""
  recipe = mp.get_recipe(name)
  g = growth_interval(cfg)
  if recipe.loss_scale.kind != "dynamic" or g is None:
    return recipe
  return recipe.replace(loss_scale=dataclasses.replace(recipe.loss_scale, growth_interval=g))


def grid(cfg: SweepConfig) -> list[tuple[str, int]]:
  """Every (recipe, seed) of the sweep, recipe-major."""
  return [(r, s) for r in cfg.recipes for s in range(cfg.seeds)]


def shard_jobs(cfg: SweepConfig) -> list[tuple[str, int]]:
  """The grid entries of slice cfg.shard = (K, N): entries K-1, K-1+N, ..."""
  k, n = cfg.shard
  return grid(cfg)[k - 1::n]


def shard_gate_recipes(cfg: SweepConfig) -> list[str]:
  k, n = cfg.shard
  return list(cfg.recipes[k - 1::n])


def _load_1m() -> float:
  try:
    return float(os.getloadavg()[0])
  except (AttributeError, OSError):  # not on every platform
    return float("nan")


def _status(summary: dict) -> str:
  vals = [summary.get("final_loss"), summary.get("final_val_bpb")]
  return "ok" if all(v is not None and math.isfinite(v) for v in vals) else "diverged"


def run_one(cfg: SweepConfig, recipe: str, seed: int, results) -> dict:
  """Trains one (recipe, seed); appends its steps to `results` (an open JSONL file)."""
  trained = sweep_recipe(cfg, recipe)
  overridden = trained != mp.get_recipe(recipe)
  tcfg = trainlib.TrainConfig(
      # trainlib takes a preset name or a Recipe; its per-step bar is labelled with the
      # name and needs a str, so a recipe the sweep changed runs without that bar (the
      # sweep's own bar still counts runs).
      recipe=trained if overridden else recipe, model=cfg.model, steps=cfg.steps,
      batch=cfg.batch, seq=cfg.seq, lr=cfg.lr, seed=seed, eval_every=cfg.eval_every,
      eval_batches=cfg.eval_batches, progress=cfg.progress and not overridden)
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
      "initial_loss_scale": (trained.loss_scale.initial_scale
                             if trained.loss_scale.kind != "none" else 1.0),
      "growth_interval": (trained.loss_scale.growth_interval
                          if trained.loss_scale.kind == "dynamic" else None),
      "final_loss_scale": hist_scale[-1] if hist_scale else summary.get("loss_scale", 1.0),
      "tokens_per_s": summary.get("tokens_per_s"),
      # The 1-minute load average as the run ends covers most of a run of a minute or
      # so: throughput on a loaded machine is flagged in summary.md.
      "load_1m": _load_1m(),
      "cpu_count": os.cpu_count(),
      "step_memory_bytes": mem.get("argument_plus_temp", float("nan")),
      "params": summary.get("params"),
      "fingerprint": summary.get("fingerprint"),
  }
  results.write(json.dumps({"recipe": recipe, "seed": seed, "status": status,
                            "summary": flat}) + "\n")
  return {"recipe": recipe, "seed": seed, "status": status, "error": None,
          "history": history, "summary": flat}


def _part_paths(out: str, k: int, n: int) -> tuple[str, str]:
  base = os.path.join(out, PARTS_DIR)
  return (os.path.join(base, f"results-{k}-of-{n}.jsonl"),
          os.path.join(base, f"part-{k}-of-{n}.json"))


def _write_atomic(path: str, text: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)  # readers (other slices merging) never see half a file


def config_to_json(cfg: SweepConfig) -> dict:
  d = dataclasses.asdict(cfg)
  d["recipes"], d["shard"] = list(cfg.recipes), list(cfg.shard)
  if isinstance(cfg.model, gpt_lib.GPTConfig):
    d["model"] = cfg.model.to_dict()
  return d


def config_from_json(d: dict, **overrides) -> SweepConfig:
  d = dict(d, **overrides)
  if isinstance(d.get("model"), dict):
    d["model"] = gpt_lib.GPTConfig.from_dict(d["model"])
  known = {f.name for f in dataclasses.fields(SweepConfig)}
  return SweepConfig(**{k: v for k, v in d.items() if k in known})


def run_sweep(cfg: SweepConfig) -> dict:
  """Runs slice cfg.shard of the sweep; a whole sweep (1 of 1) also writes the report.

  Returns:
    For a whole sweep, `write_report`'s dict (paths, rows, gates, markdown, elapsed_s);
    for a slice of N > 1, {"paths": its part files, "markdown": None, "elapsed_s"}.
  """
  for r in cfg.recipes:
    mp.get_recipe(r)  # unknown names fail before any training, listing the presets
  os.makedirs(os.path.join(cfg.out, PARTS_DIR), exist_ok=True)
  # Seeds of one recipe compile to the same program: a persistent compilation cache turns
  # every compile after the first into a load.
  import jax  # pylint: disable=g-import-not-at-top
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", os.path.join(cfg.out, ".compile_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    part = _run_part(cfg)
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)
  if cfg.shard[1] == 1:
    return write_report(*merge_parts(cfg.out, n=1))
  return {"paths": dict(zip(("results", "part"), _part_paths(cfg.out, *cfg.shard))),
          "markdown": None, "elapsed_s": part["elapsed_s"]}


def _run_part(cfg: SweepConfig) -> dict:
  t0, load0 = time.time(), _load_1m()
  k, n = cfg.shard
  results_path, part_path = _part_paths(cfg.out, k, n)
  if os.path.exists(part_path):
    os.remove(part_path)  # a rerun of this slice: not done until it finishes again
  jobs = shard_jobs(cfg)
  bar = None
  if cfg.progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(jobs), desc="sweep" if n == 1 else f"sweep {k}/{n}",
               file=sys.stderr)
  with open(results_path, "w") as results:
    for recipe, seed in jobs:
      if bar is not None:
        bar.set_postfix(recipe=recipe, seed=seed)
      run_one(cfg, recipe, seed, results)
      results.flush()
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  corpus = data_lib.load_corpus()
  gate_rows = []
  for recipe in shard_gate_recipes(cfg):
    try:
      gate_rows.append(gates.numeric_gate(recipe, cfg.model, batch=cfg.gate_batch,
                                          seq=cfg.seq, corpus=corpus))
    except Exception as e:  # pylint: disable=broad-except
      err = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      print(f"numeric gate for {recipe} failed: {err}", file=sys.stderr)
      gate_rows.append({"recipe": recipe, "error": err})
  part = {"config": config_to_json(cfg), "shard": [k, n], "jobs": [list(j) for j in jobs],
          "gates": gate_rows, "elapsed_s": time.time() - t0, "load_1m_start": load0,
          "load_1m_end": _load_1m(), "cpu_count": os.cpu_count(),
          "faithful_rounding": mp.faithful_rounding_enabled()}
  _write_atomic(part_path, json.dumps(part, indent=1, default=str))
  return part


def _read_runs(path: str) -> dict[tuple[str, int], list[dict]]:
  """(recipe, seed) -> its records, in file order, from one results JSONL file."""
  out: dict[tuple[str, int], list[dict]] = {}
  with open(path) as f:
    for line in f:
      if line.strip():
        rec = json.loads(line)
        out.setdefault((rec["recipe"], rec["seed"]), []).append(rec)
  return out


def _run_from_records(recipe: str, seed: int, records: list[dict]) -> dict:
  run = {"recipe": recipe, "seed": seed, "status": "failed", "error": None, "history": [],
         "summary": {}}
  for rec in records:
    if "status" in rec:
      run.update(status=rec["status"], error=rec.get("error"), summary=rec.get("summary", {}))
    else:
      run["history"].append({k: v for k, v in rec.items() if k not in ("recipe", "seed")})
  return run


def load_runs(out: str) -> list[dict]:
  """The runs recorded in out/results.jsonl (step records and each run's final record)."""
  return [_run_from_records(r, s, recs)
          for (r, s), recs in _read_runs(os.path.join(out, "results.jsonl")).items()]


def merge_parts(out: str, n: int | None = None
                ) -> tuple[SweepConfig, list[dict], list[dict], list[dict]]:
  """Reads every finished slice in out/parts and writes the merged out/results.jsonl.

  Args:
    out: the sweep's --out.
    n: the slice count to merge (None: the only one present).

  Returns:
    (config, runs in grid order, raw gate rows in recipe order, the slices' part records).

  Raises:
    ValueError naming what is missing or inconsistent: a slice not done, slices of
    different sweeps, a (recipe, seed) absent or without its final record.
  """
  found: dict[int, dict[int, str]] = {}
  for path in glob.glob(os.path.join(out, PARTS_DIR, "part-*-of-*.json")):
    m = re.search(r"part-(\d+)-of-(\d+)\.json$", path)
    if m:
      found.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
  if not found:
    raise ValueError(f"{out} has no finished slice ({PARTS_DIR}/part-K-of-N.json); run the "
                     "sweep into it first (python -m experiments.sweep --out DIR [--shard K/N])")
  if n is None:
    if len(found) != 1:
      raise ValueError(
          f"{out}/{PARTS_DIR} holds finished slices of sweeps split {sorted(found)} ways; "
          "expected one sweep's. Remove the stale part-K-of-N.json files.")
    n = next(iter(found))
  have = found.get(n, {})
  missing = [k for k in range(1, n + 1) if k not in have]
  if missing:
    raise ValueError(f"{out}: slices {missing} of {n} are not done (no "
                     f"{PARTS_DIR}/part-K-of-{n}.json); run them with --shard K/{n}, then "
                     "--report-only")
  parts = []
  for k in range(1, n + 1):
    with open(have[k]) as f:
      parts.append(json.load(f))
  same = lambda c: {k: v for k, v in c.items() if k not in _PER_SLICE}
  for p in parts[1:]:
    if same(p["config"]) != same(parts[0]["config"]):
      diff = sorted(k for k in same(p["config"])
                    if p["config"].get(k) != parts[0]["config"].get(k))
      raise ValueError(f"{out}: slice {p['shard'][0]}/{n} ran different settings from slice "
                       f"1/{n} ({', '.join(diff)}); rerun the slices with one command line")
  cfg = config_from_json(parts[0]["config"], out=out, shard=(1, 1))
  records: dict[tuple[str, int], list[dict]] = {}
  for k in range(1, n + 1):
    records.update(_read_runs(_part_paths(out, k, n)[0]))
  absent = [j for j in grid(cfg) if not any("status" in r for r in records.get(j, []))]
  if absent:
    raise ValueError(f"{out}: runs {absent[:6]}{' ...' if len(absent) > 6 else ''} have no "
                     "final record in the slices' results; rerun their slices")
  lines = [json.dumps(rec) for j in grid(cfg) for rec in records[j]]
  _write_atomic(os.path.join(out, "results.jsonl"), "\n".join(lines) + "\n")
  runs = [_run_from_records(r, s, records[(r, s)]) for r, s in grid(cfg)]
  by_recipe = {g["recipe"]: g for p in parts for g in p["gates"]}
  gate_rows = [by_recipe[r] for r in cfg.recipes if r in by_recipe]
  return cfg, runs, gate_rows, parts


def write_report(cfg: SweepConfig, runs: list[dict], gate_rows: list[dict],
                 parts: list[dict]) -> dict:
  """summary.md, summary.json and the plots in cfg.out from the runs, raw gate rows and
  the slices' part records."""
  recipes = tuple(dict.fromkeys(r["recipe"] for r in runs))
  ledger = {r: mp.optim.bytes_per_param(mp.get_recipe(r)) for r in recipes}
  rows = report.summarize(runs, ledger)
  judged = [g if "error" in g else gates.judge(g) for g in gate_rows]
  elapsed = float(sum(p["elapsed_s"] for p in parts))
  longest = max(p["elapsed_s"] for p in parts)
  n = len(parts)
  scaled = [r for r in recipes if mp.get_recipe(r).loss_scale.kind == "dynamic"]
  g = growth_interval(cfg)
  if scaled and g is not None:
    scale_note = (f"Loss scaling: the dynamic loss scale of {', '.join(scaled)} grows after "
                  f"{g} finite steps in this sweep, a sweep setting (`--growth-interval`, "
                  f"default steps // {GROWTH_STEPS_PER_RUN}) so that growth and back-off "
                  "both happen in a run this short; the presets' own interval is "
                  f"{mp.get_recipe(scaled[0]).loss_scale.growth_interval} steps "
                  "(`--growth-interval recipe`).")
  elif scaled:
    scale_note = (f"Loss scaling: {', '.join(scaled)} keep the presets' own growth "
                  "interval.")
  else:
    scale_note = ""
  faithful = all(p.get("faithful_rounding", False) for p in parts)
  model = cfg.model if isinstance(cfg.model, str) else "custom GPTConfig"
  header = (f"# Recipe sweep\n\nModel `{model}`, {cfg.steps} steps, batch {cfg.batch} x seq "
            f"{cfg.seq}, lr {cfg.lr}, {cfg.seeds} seeds per recipe (seed s: the same initial "
            f"weights and data order for every recipe), faithful rounding {faithful}. "
            + (f"Ran in one process, {elapsed / 60:.1f} min. " if n == 1 else
               f"Ran as {n} slices (`--shard K/{n}`): {elapsed / 60:.1f} min of compute in "
               f"all, the longest slice {longest / 60:.1f} min. ")
            + "Validation bits per byte (BPB): lower is better. Step memory = compiled "
            "arguments + temporaries. " + scale_note + "\n")
  md = report.summary_markdown(rows, judged, header, seeds=cfg.seeds)
  paths = {"results": os.path.join(cfg.out, "results.jsonl"),
           "summary_md": os.path.join(cfg.out, "summary.md"),
           "summary_json": os.path.join(cfg.out, "summary.json"),
           "loss_curves": os.path.join(cfg.out, "loss_curves.png")}
  _write_atomic(paths["summary_md"], md)
  slices = [{k: p[k] for k in ("shard", "elapsed_s", "load_1m_start", "load_1m_end",
                                "cpu_count")} for p in parts]
  _write_atomic(paths["summary_json"], json.dumps(
      {"config": config_to_json(cfg), "rows": rows, "gates": judged, "slices": slices,
       "elapsed_s": elapsed, "longest_slice_s": longest}, indent=1, default=str))
  report.plot_val_curves(runs, paths["loss_curves"], control=report.CONTROL, rows=rows)
  scaled_runs = [r for r in runs if r["recipe"] in scaled]
  if scaled_runs:
    paths["loss_scale"] = os.path.join(cfg.out, "loss_scale.png")
    report.plot_loss_scale(scaled_runs, paths["loss_scale"], note=(
        f"growth interval {g} steps (sweep setting)" if g is not None else ""))
  return {"paths": paths, "rows": rows, "gates": judged, "markdown": md,
          "elapsed_s": elapsed}


def report_only(out: str) -> dict:
  """Merges the finished slices in `out` and writes the report; nothing is trained."""
  return write_report(*merge_parts(out))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--recipes", help=f"comma-separated presets (default: all: {','.join(ALL_RECIPES)})")
  ap.add_argument("--seeds", type=int, help="seeds per recipe (default 3)")
  ap.add_argument("--steps", type=int)
  ap.add_argument("--model", choices=tuple(gpt_lib.CONFIGS))
  ap.add_argument("--batch", type=int)
  ap.add_argument("--seq", type=int)
  ap.add_argument("--lr", type=float)
  ap.add_argument("--growth-interval",
                  help="dynamic loss-scale growth interval: auto (default: steps // "
                  f"{GROWTH_STEPS_PER_RUN}), recipe (the preset's), or a number of steps")
  ap.add_argument("--out", default="sweep_out")
  ap.add_argument("--shard", help="K/N: run slice K of N of the recipe x seed grid into "
                  "--out (then --report-only once all N are done)")
  ap.add_argument("--quick", action="store_true", help="about a minute: tiny model, 3 recipes")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--report-only", action="store_true",
                  help="merge the finished slices in --out and write summary.md and the "
                  "plots; no training")
  args = ap.parse_args(argv)
  if args.report_only:
    if args.shard:
      ap.error("--report-only merges every slice; drop --shard")
    try:
      result = report_only(args.out)
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(result["markdown"])
    return 0
  overrides = {k: v for k, v in dict(seeds=args.seeds, steps=args.steps, model=args.model,
                                     batch=args.batch, seq=args.seq, lr=args.lr).items()
               if v is not None}
  if args.recipes:
    overrides["recipes"] = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
  if args.growth_interval is not None:
    g = args.growth_interval
    overrides["growth_interval"] = int(g) if g.isdigit() else g
  if args.shard:
    try:
      overrides["shard"] = parse_shard(args.shard)
    except ValueError as e:
      ap.error(str(e))
  overrides["out"] = args.out
  overrides["progress"] = not args.no_progress
  try:
    cfg = SweepConfig.quick(**overrides) if args.quick else SweepConfig(**overrides)
  except ValueError as e:
    ap.error(str(e))
  result = run_sweep(cfg)
  if result["markdown"] is None:
    k, n = cfg.shard
    print(f"slice {k}/{n} done in {result['elapsed_s'] / 60:.1f} min: "
          f"{result['paths']['results']}. Once all {n} are done: "
          f"python -m experiments.sweep --out {cfg.out} --report-only")
    return 0
  print(result["markdown"])
  print(json.dumps({"out": cfg.out, "elapsed_s": round(result["elapsed_s"], 1),
                    "files": sorted(os.path.basename(p) for p in result["paths"].values())}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
