"""The main job: the library's study (`precision.study`) on two byte-level language models.

  python -m experiments.sweep                 # default: all recipes, seeds until decided
  python -m experiments.sweep --quick         # about two minutes: tiny models, 3 recipes
  python -m experiments.sweep --recipes fp32,pure_bf16 --max-seeds 12 --margin 0.03
  python -m experiments.sweep --seeds 5 --steps 400   # a fixed number of seeds instead

Two tasks, each a `precision.study.Task` trained under every recipe x seed against fp32
on the embedded corpus (the Python standard library's sources; nothing is downloaded):
  * gpt: models/gpt.py, written for this library (explicit f32 islands, RMSNorm, RoPE);
  * plain_lm: models/plain_lm.py, written with no dtype in mind (Flax layers, einsum
    attention, jax.nn.softmax): what a user brings, reached only through the recipes.
Both are judged by validation bits per byte (BPB, lower is better) at the last step.

Seeds are the study's sequential rule (``seeds="auto"``, `precision.study._sequential`):
each task adds rounds of seeds (looks at 3, 6, ... up to --max-seeds) until every recipe is
worse, better, or holds up within --margin of fp32, at stated error rates under that
stopping; a decided recipe takes no more seeds. The chaos floor's arm (fp32 again from
initial weights one ulp away) says how far training moves by itself, so an "undecided
after N seeds" row says whether the margin sits below that motion.

Resumption is the study's: a rerun continues every unfinished cell bit-exactly. With a
fixed ``--seeds N``, ``--shard K/N`` (or a Slurm array) runs one slice into a shared --out,
then ``--report-only`` merges; the sequential rule decides each round from every finished
cell, so it runs in one process and refuses --shard. Outputs: OUT/gpt/ and OUT/plain_lm/ hold each study's
summary.md, summary.json, results.jsonl, loss_curves.png and loss_scale.png; OUT/summary.md
puts both tables together with the GPT's numeric gate (one forward and backward against
fp32 on the same weights and batch, limits in units of each format's unit roundoff).

Loss scaling: a preset's dynamic scale grows after 2000 finite steps, which a run of a few
hundred steps never reaches; the sweep sets the growth interval to steps // 15 so that
growth and back-off both happen, and the summary says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import time
import traceback
import warnings

import precision as mp
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from precision import study
from precision.checkpoint import CheckpointError
from experiments import data as data_lib
from experiments import gates
from models import gpt as gpt_lib
from models import plain_lm

# The default sweep's recipes: every preset but the microscaled ones (mxfp8, nvfp4), whose
# GEMMs are emulated on this CPU (quantise, dequantise, f32 GEMM) and which the measured
# default run in the README predates; name them with --recipes to add them.
MICROSCALED = ("mxfp8", "nvfp4")
ALL_RECIPES = tuple(r for r in mp.PRESETS if r not in MICROSCALED)
QUICK_RECIPES = ("fp32", "bf16_master", "f16_mixed")
TASKS = ("gpt", "plain_lm")


def _one_device_cpu() -> bool:
  """Whether the study's seed batching runs "threads" here (a CPU of one device)."""
  return jax.default_backend() == "cpu" and jax.local_device_count() == 1


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  """What the sweep runs. Defaults: the CPU main job, chosen from measurements on the
  project's 2-core CPU (README, "What the default sweep showed"):

  * lr 1e-3 for the GPT: at 3e-3 its runs are chaotic (the `tiny` GPT's bf16_mixed moved
    +0.006 and -0.036 BPB on two seeds; the `small` one's per-seed sd was 0.047), at 1e-3
    the sd of a bf16 recipe's per-seed difference is 0.0004. The plain LM is calm at 3e-3
    (0.0003) and keeps it.
  * model "tiny", 200 steps, batch 8 x 128: with 7 recipes, fp32 and the chaos floor a
    task runs 24 cells at 3 seeds and 48 at 6; a `small` GPT cell costs 2 to 3 times a
    `tiny` one, which would not fit 15 minutes.
  * margin 0.01 BPB: 0.3% of the metric, under half of what pure_bf16 loses, and 20 to 30
    times the bf16 recipes' spread, so the rule's first look (3 seeds, about sd < margin /
    6.5 with 6 recipes) can show a recipe within it.
  * max_seeds 6: looks at 3 and 6 seeds; a larger budget makes the first look's
    boundaries stricter (t > 15.9 at 3 seeds with 6, 20.1 with 9), and the worst case (96
    cells) still fits.

  Attributes:
    recipes: preset names (fp32, the control, is added when missing).
    seeds: "auto" (the study's sequential rule: rounds of seeds until every recipe is
      decided, up to `max_seeds`) or a fixed number of seeds per recipe (>= 2).
    max_seeds: the budget per recipe of seeds="auto".
    steps: optimizer steps per cell.
    model: GPT preset (models.gpt.CONFIGS); plain_d/plain_layers: the plain LM's size.
    batch, seq: training batches (bytes per step: batch sequences of seq + 1 bytes).
    lr, plain_lr: AdamW's peak learning rate for the GPT and the plain LM (warmup, then
      cosine decay, global-norm clip 1.0, as experiments.train).
    eval_every, eval_batches: validation cadence and fixed validation batches.
    save_every: a cell's checkpoint interval (None: steps // 2). A cell is seconds of
      work, and each save about 0.15 CPU-seconds: the study's default of steps // 10 cost
      ~9 saves a cell, 1.8 of the first default run's 18.2 CPU-minutes. A hard kill loses
      at most this many steps of one cell; SIGTERM / SIGUSR1 still save the step in flight.
    margin: equivalence margin in BPB ("holds up within margin").
    floor: the chaos floor's arm (fp32 from weights one ulp away), beside the verdicts.
    tasks: which of TASKS to run.
    gate_batch: batch of the numeric gate (0: no gate).
    timing_rounds: interleaved step-timing rounds per task (the step-time column).
    seed_batch: the study's seed_batch (K seeds of a recipe per compiled program; 1: one
      program per cell). None: on a CPU of one device, every seed a round adds to an
      arm in one group (K = the seeds per recipe, at most 8), which there runs the
      group's one compiled one-seed step on host threads: the numbers of one program
      per cell bit for bit, about 1.3x faster per training step and without each
      cell's own trace and compile (`python -m experiments.bench_study`); elsewhere
      the library's default.
  """

  recipes: tuple[str, ...] = ALL_RECIPES
  seeds: int | str = "auto"
  max_seeds: int = 6
  steps: int = 200
  model: str = "tiny"
  plain_d: int = 64
  plain_layers: int = 2
  batch: int = 8
  seq: int = 128
  lr: float = 1e-3
  plain_lr: float = 3e-3
  eval_every: int = 50
  eval_batches: int = 8
  save_every: int | None = None
  margin: float = 0.01
  floor: bool = True
  tasks: tuple[str, ...] = TASKS
  gate_batch: int = 4
  timing_rounds: int = 5
  seed_batch: int | None = None

  def __post_init__(self):
    if self.seeds != "auto" and not (isinstance(self.seeds, int)
                                     and not isinstance(self.seeds, bool) and self.seeds >= 2):
      raise ValueError(f"seeds={self.seeds!r}; accepted: 'auto' or an integer >= 2")
    if isinstance(self.max_seeds, bool) or not isinstance(self.max_seeds, int) \
        or self.max_seeds < 2:
      raise ValueError(f"max_seeds={self.max_seeds!r}; accepted: an integer >= 2")

  @property
  def sequential(self) -> bool:
    return self.seeds == "auto"

  def study_seed_batch(self) -> int | None:
    """The seed_batch the sweep's studies run with (see `seed_batch`)."""
    if self.seed_batch is not None:
      return self.seed_batch
    if _one_device_cpu():
      return min(self.max_seeds if self.sequential else self.seeds, 8)
    return None

  def seeds_words(self) -> str:
    return (f"seeds added in rounds until decided (up to {self.max_seeds} per recipe)"
            if self.sequential else f"{self.seeds} seeds per recipe")

  @classmethod
  def quick(cls, **overrides) -> SweepConfig:
    base = dict(recipes=QUICK_RECIPES, max_seeds=3, steps=24, model="tiny", plain_d=32,
                plain_layers=1, batch=4, seq=32, eval_every=8, eval_batches=1, gate_batch=2,
                timing_rounds=2)
    base.update(overrides)
    return cls(**base)


def _optimizer(cfg: SweepConfig, lr: float) -> optax.GradientTransformation:
  """experiments.train's inner optimizer: global-norm clip 1.0 (in f32), then AdamW
  (b1 0.9, b2 0.95, weight decay 0.1 on matrices only) at a linear warmup over steps // 10
  (at most 100) and a cosine decay to lr / 10. The recipe wraps it (master weights, loss
  scale, skips)."""
  warmup = max(1, min(100, cfg.steps // 10))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup,
      decay_steps=max(cfg.steps, warmup + 1), end_value=lr * 0.1)
  adamw = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                      mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
  return optax.chain(mp.optim.clip_by_global_norm(1.0), adamw)


def _batches(corpus, cfg: SweepConfig):
  def batches(seed):
    sampler = data_lib.init_sampler(seed)
    while True:
      tokens, sampler = data_lib.sample_batch(corpus.train, sampler, cfg.batch, cfg.seq)
      yield tokens
  return batches


def _bpb_evaluate(loss_fn, val_tokens):
  # Jitted once per model structure (nnx.jit caches by graph); the model runs under its
  # recipe, as it trained, in evaluation mode.
  jit_loss = nnx.jit(lambda m, t: loss_fn(m, t))

  def evaluate(model):
    return data_lib.bits_per_byte(float(np.mean([float(jit_loss(model, jnp.asarray(b)))
                                                 for b in val_tokens])))
  return evaluate


def make_task(name: str, cfg: SweepConfig, corpus=None) -> study.Task:
  """The sweep's task `name` ("gpt" or "plain_lm") on the embedded corpus."""
  corpus = corpus or data_lib.load_corpus()
  val = data_lib.validation_batches(corpus.validation, cfg.eval_batches, cfg.batch, cfg.seq)
  if name == "gpt":
    gcfg = gpt_lib.get_config(cfg.model)
    return study.Task(init=lambda seed: gpt_lib.GPT(gcfg, rngs=nnx.Rngs(seed)),
                      loss=gpt_lib.loss_fn, batches=_batches(corpus, cfg),
                      optimizer=_optimizer(cfg, cfg.lr),
                      evaluate=_bpb_evaluate(gpt_lib.loss_fn, val),
                      name=f"gpt ({cfg.model}), validation BPB")
  if name == "plain_lm":
    return study.Task(
        init=lambda seed: plain_lm.PlainLM(d=cfg.plain_d, layers=cfg.plain_layers,
                                           rngs=nnx.Rngs(seed)),
        loss=plain_lm.loss_fn, batches=_batches(corpus, cfg),
        optimizer=_optimizer(cfg, cfg.plain_lr),
        evaluate=_bpb_evaluate(plain_lm.loss_fn, val),
        name=f"plain_lm (d={cfg.plain_d}, {cfg.plain_layers} layers, no dtype in mind), "
             "validation BPB")
  raise ValueError(f"task {name!r}; accepted: {', '.join(TASKS)}")


def _run_task(name, cfg, out, shard, report_only, progress, corpus):
  task = make_task(name, cfg, corpus)
  where = os.path.join(out, name)
  if report_only:
    return study.report_only(where, margin=cfg.margin, task=task,
                             timing_rounds=cfg.timing_rounds)
  return study.run(task, cfg.recipes, cfg.seeds, cfg.steps, where, eval_every=cfg.eval_every,
                   shard=shard, margin=cfg.margin, growth_interval="auto",
                   timing_rounds=cfg.timing_rounds, progress=progress, floor=cfg.floor,
                   save_every=cfg.save_every or max(1, cfg.steps // 2),
                   seed_batch=cfg.study_seed_batch(),
                   **({"max_seeds": cfg.max_seeds} if cfg.sequential else {}))


def _gate_markdown(cfg: SweepConfig, corpus) -> str:
  rows = []
  for r in cfg.recipes:
    try:
      rows.append(gates.judge(gates.numeric_gate(r, cfg.model, batch=cfg.gate_batch,
                                                 seq=cfg.seq, corpus=corpus)))
    except Exception as e:  # pylint: disable=broad-except
      rows.append({"recipe": r, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200]})
  lines = ["## Numeric gate (gpt)", "",
           "One forward and backward of the same weights and batch under the recipe and "
           "under fp32; each error over its limit (a multiple of the format's unit "
           "roundoff u).", "",
           "| recipe | loss rel err | logits mean rel err | logits p99 rel err | worst grad "
           "err | non-finite | gate |", "|---|---|---|---|---|---|---|"]
  for g in rows:
    if "error" in g:
      lines.append(f"| {g['recipe']} | - | - | - | - | - | FAIL: {g['error']} |")
      continue
    cell = lambda k: f"{g[k]:.2e} / {g['limits'][k]:.1e}"
    lines.append(f"| {g['recipe']} | {cell('loss_rel_err')} | {cell('logits_mean_rel_err')} "
                 f"| {cell('logits_p99_rel_err')} | {cell('grad_worst_scaled_mean_err')} | "
                 f"{g['nonfinite']} | {'pass' if g['passed'] else 'FAIL: ' + '; '.join(g['failures'])} |")
  return "\n".join(lines) + "\n"


def _short_verdict(row: dict, margin: float) -> str:
  """A recipe's decision in a few words: the rule's verdict, its mean difference and the
  seeds it took (the task's own table has the intervals and every seed)."""
  code, n = row.get("verdict_code"), row.get("seeds_used")
  mean = row.get("mean_delta")
  delta = "" if mean is None else f"Δ {mean:+.4f}" + (
      f" ({100 * row['relative_delta']:+.2g}%)" if row.get("relative_delta") is not None else "")
  if code == "holds_up" or (code == "no_difference" and row.get("equivalent")):
    words = f"holds up within ±{margin:g}"
  elif code in ("worse", "better"):
    # A shown difference smaller than the margin: both decisions hold, and the row says so.
    words = code + (f" and holds up within ±{margin:g}" if row.get("equivalent") else "") + (
        " (practically equivalent: " + row["practically_equivalent"] + ")"
        if row.get("practically_equivalent") else "")
  elif code == "no_difference":
    words = f"no difference detected, not shown within ±{margin:g}"
  elif code == "undecided":
    words = f"undecided after {n} seeds"
  else:  # diverged, failed: the study's words say on which seeds
    words = row.get("verdict", code)
  return f"{words}; {delta}, {n} seeds" if delta else f"{words}; {n} seeds"


def _decisions_markdown(cfg: SweepConfig, results: dict) -> str:
  """Both tasks side by side: each recipe's decision and seeds, and each task's chaos
  floor (the motion of fp32 against itself) with its control metric."""
  names = list(results)
  lines = ["## Decisions", "",
           "Δ = recipe - fp32 in validation BPB on the same seed (lower is better); the "
           "seeds are those the recipe ran. Each task's section below has the intervals, "
           "every seed's Δ, the costs and the rules.", "",
           "| recipe | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
  rows = {t: r.summary["recipes"] for t, r in results.items()}
  for arm in rows[names[0]]:
    if any(rows[t].get(arm, {}).get("verdict_code") in ("control", "floor") for t in names):
      continue
    lines.append(f"| {arm} | " + " | ".join(
        _short_verdict(rows[t][arm], cfg.margin) if arm in rows[t] else "-" for t in names)
        + " |")
  lines.append("")
  for t, r in results.items():
    ctrl = [x for x in rows[t]["fp32"]["final_metric"] if x is not None]
    floor = r.summary.get("floor") or {}
    words = (f"chaos floor rms {floor['rms']:.3g} BPB over {len(floor.get('deltas', []))} "
             f"seeds (max {floor['max_abs']:.3g})" if floor.get("rms") is not None
             else "no chaos floor")
    below = (f"; the margin ±{cfg.margin:g} is below it" if floor.get("margin_below_floor")
             else f"; the margin ±{cfg.margin:g} is above it" if floor.get("rms") is not None
             else "")
    lines.append(f"- {t}: fp32 {np.mean(ctrl):.4f} BPB over {len(ctrl)} seeds; "
                 f"{words}{below}.")
  return "\n".join(lines) + "\n"


def run_sweep(cfg: SweepConfig, out: str, shard=None, report_only=False, progress=True):
  """Runs (a slice of) both studies; with every cell done writes OUT/summary.md.

  Returns:
    {"results": {task: StudyResult | None}, "markdown": the combined summary or None
    (slices still to run), "elapsed_s", "cpu_s"}.

  Raises:
    ValueError: a shard with seeds="auto" (one line; nothing is written).
  """
  if shard is not None and cfg.sequential:
    raise ValueError(f"shard={shard!r} with seeds='auto'; accepted: a fixed number of seeds "
                     "(--seeds N) to run slices: the sequential rule decides each round from "
                     "every finished cell, in one process")
  t0, c0 = time.time(), _cpu_s()
  corpus = data_lib.load_corpus()
  results = {name: _run_task(name, cfg, out, shard, report_only, progress, corpus)
             for name in cfg.tasks}
  if any(r is None for r in results.values()):
    return {"results": results, "markdown": None, "elapsed_s": time.time() - t0,
            "cpu_s": _cpu_s() - c0}
  parts = [f"# Recipe sweep\n\n{len(cfg.tasks)} tasks, {cfg.steps} steps, batch "
           f"{cfg.batch} x seq {cfg.seq}, lr {cfg.lr:g} (gpt) / {cfg.plain_lr:g} (plain_lm), "
           f"{cfg.seeds_words()}, margin "
           f"±{cfg.margin:g} BPB, {_batching_words(cfg)}, faithful rounding "
           f"{mp.faithful_rounding_enabled()}. Each "
           "task's own folder holds its summary, curves and every step; the tables below "
           "are theirs.\n", _decisions_markdown(cfg, results)]
  for name, r in results.items():
    parts.append(r.markdown.replace("# Study: ", f"## {name}: ", 1))
  if cfg.gate_batch and "gpt" in cfg.tasks:
    parts.append(_gate_markdown(cfg, corpus))
  elapsed, cpu = time.time() - t0, _cpu_s() - c0
  load = os.getloadavg()
  parts.append(f"This invocation took {elapsed / 60:.1f} min wall and {cpu / 60:.1f} "
               f"CPU-minutes on {os.cpu_count()} CPU cores, load average at its end "
               f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min; other "
               "jobs included); cells finished by an earlier invocation are not counted.\n")
  md = "\n".join(parts)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(md)
  return {"results": results, "markdown": md, "elapsed_s": elapsed, "cpu_s": cpu}


def _batching_words(cfg: SweepConfig) -> str:
  k = cfg.study_seed_batch()
  if k is None or k == 1:
    return "one program per cell" if k == 1 else "the library's seed batching"
  if _one_device_cpu():
    return (f"up to {k} seeds of a recipe per group on host threads (the numbers of one "
            "program per cell)")
  return f"seed_batch {k}"


def _cpu_s() -> float:
  """This process's user + system CPU seconds (XLA's threads included)."""
  t = os.times()
  return t.user + t.system


def _fault_line(e: BaseException, out: str) -> str:
  """One line for a fault of the environment: the study's own (it names the cell, the
  path and the cause), or an OSError of the sweep's files (its errno and path)."""
  if isinstance(e, OSError) and not isinstance(e, CheckpointError):
    code = errno.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
    where = f" at {e.filename}" if e.filename else ""
    e = (f"sweep stopped, writing its files in {out} failed{where}: {e.strerror or e} "
         f"({code}); every finished cell is kept; fix it, then rerun the same command")
  elif isinstance(e, MemoryError):
    e = ("sweep stopped: out of host memory (MemoryError); every finished cell is kept; "
         "free memory, then rerun the same command")
  return " ".join(str(e).split())


def main(argv=None) -> int:
  mp.enable_faithful_rounding()  # XLA flags: set here, before the first computation
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--recipes", help=f"comma-separated presets (default: {','.join(ALL_RECIPES)}; "
                                    f"also {','.join(MICROSCALED)})")
  ap.add_argument("--seeds", help="'auto' (default: rounds of seeds until every recipe is "
                                  "decided) or a fixed number of seeds per recipe")
  ap.add_argument("--max-seeds", type=int, help="the budget per recipe of --seeds auto "
                                               f"(default {SweepConfig.max_seeds})")
  ap.add_argument("--steps", type=int)
  ap.add_argument("--model", choices=tuple(gpt_lib.CONFIGS))
  ap.add_argument("--tasks", help=f"comma-separated, of {','.join(TASKS)} (default both)")
  ap.add_argument("--margin", type=float,
                  help=f"equivalence margin in BPB (default {SweepConfig.margin})")
  ap.add_argument("--out", default="sweep_out")
  ap.add_argument("--shard", help="K/N: run slice K of N of each task's grid (with --seeds N)")
  ap.add_argument("--seed-batch", type=int, metavar="K",
                  help="seeds of a recipe per compiled program (1: one program per cell; "
                       "default: every seed of a round in one group on a CPU of one "
                       "device, with the numbers of one program per cell)")
  ap.add_argument("--report-only", action="store_true")
  ap.add_argument("--quick", action="store_true", help="tiny models, 3 recipes")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--debug", action="store_true",
                  help="print the traceback of an error, not only its line")
  args = ap.parse_args(argv)
  seeds = args.seeds
  if seeds is not None and seeds != "auto":
    try:
      seeds = int(seeds)
    except ValueError:
      ap.error(f"--seeds {seeds!r}; accepted: auto or an integer >= 2")
  if args.max_seeds is not None and seeds not in (None, "auto"):
    ap.error(f"--max-seeds {args.max_seeds} with --seeds {seeds}; accepted: --max-seeds "
             "only with --seeds auto (the default)")
  overrides = {k: v for k, v in dict(seeds=seeds, max_seeds=args.max_seeds, steps=args.steps,
                                     model=args.model, margin=args.margin,
                                     seed_batch=args.seed_batch).items()
               if v is not None}
  if args.recipes:
    overrides["recipes"] = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
  if args.tasks:
    overrides["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [t for t in overrides["tasks"] if t not in TASKS]
    if bad:
      ap.error(f"--tasks {bad}; accepted: {', '.join(TASKS)}")
  try:
    cfg = SweepConfig.quick(**overrides) if args.quick else SweepConfig(**overrides)
  except ValueError as e:
    ap.error(str(e).replace("max_seeds=", "--max-seeds ").replace("seeds=", "--seeds "))
  # A compilation-cache entry that cannot be written is only a slower compile; a full
  # disk is reported by the study's own writes, in one line.
  for verb in ("writing", "reading"):
    warnings.filterwarnings("ignore", message=f"Error {verb} persistent compilation cache")
  try:
    result = run_sweep(cfg, args.out, shard=args.shard, report_only=args.report_only,
                       progress=not args.no_progress)
  except ValueError as e:
    if args.debug:
      traceback.print_exc()
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  except (study.StudyEnvironmentError, OSError, MemoryError, CheckpointError) as e:
    # A fault of the machine (a full disk, permissions, memory): one line, and the same
    # command continues once it is fixed.
    if args.debug:
      traceback.print_exc()
    print(f"error: {_fault_line(e, args.out)}", file=sys.stderr)
    return 1
  if result["markdown"] is None:
    print(f"slice done in {result['elapsed_s'] / 60:.1f} min. Once every slice is done: "
          f"python -m experiments.sweep --out {args.out} --report-only"
          + (" --quick" if args.quick else ""))
    return 0
  print(result["markdown"])
  print(json.dumps({"out": args.out, "elapsed_s": round(result["elapsed_s"], 1),
                    "cpu_s": round(result["cpu_s"], 1),
                    "verdicts": {t: {a: {"verdict": r["verdict_code"],
                                         "seeds_used": r.get("seeds_used"),
                                         "decided": r.get("decided")}
                                     for a, r in res.rows.items() if not r.get("control")}
                                 for t, res in result["results"].items()}}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
