"""`run`: the recipe x seed grid of a task, resumable and shardable; `report_only`.

The grid: every recipe (the control first, fp32 by default) on seed indices 0..seeds-1,
recipe-major. Seed index i gives every recipe the same initial weights and data order
(``task.init(i)``, ``task.batches(i)``): common random numbers, so the difference of a
recipe from the control on the same seed is free of the seed-to-seed variation both
share. An A/A arm (`aa=True`) trains the control again on other seeds (i + AA_SEED_OFFSET),
paired with the control's index i: a recipe that is the control by construction, whose
verdict should be "no difference" (a check of the test on this task's noise).

Output folder: study.json (what the study is: task, recipes, seeds, steps; a rerun with
other settings is refused, one with more seeds adds them and keeps every finished cell),
cells/ (one folder per cell, see `_cells`), costs.json
(interleaved step timing), and the report: results.jsonl, summary.md, summary.json,
loss_curves.png, loss_scale.png.

Sharding: slice K of N runs cells K-1, K-1+N, ... of the grid; every slice writes into the
same folder, and `report_only` (``--report-only``) merges once all are finished. With
``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_COUNT`` set (a Slurm array job) and no shard
given, the slice is taken from them. A run of slice 1/1 writes the report at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from precision._plan import as_plan
from precision._recipe import Recipe
from precision.study import _batched
from precision.study import _cells
from precision.study import _config
from precision.study import _floor
from precision.study import _sequential
from precision.study._config import StudyConfig, check_int, make_config, parse_shard
from precision.study import _digest
from precision.study import _models
from precision.study import _report
from precision.study import _signals
from precision.study import _stats
from precision.study._task import Task

FORMAT = 1
_STUDY_FILE = "study.json"


class _Preflight:
  """What the study learns from the task before any cell: its kind, that its loss is a
  floating scalar, a digest of seed 0's initial params and first batch (a changed task
  is another study), and the fp8 GEMMs kept by role."""

  def __init__(self, task: Task, cfg: StudyConfig):
    model = task.init(0)
    self.kind = _models.model_kind(model)
    try:
      batch = next(iter(task.batches(0)))
    except StopIteration:
      raise ValueError("Task.batches(0) yielded no batch; accepted: an iterator of at "
                       "least `steps` batches") from None
    _models.check_loss(task, model, batch)
    self.digest = _digest.digest_of(model, batch)
    self.fp8_keeps: tuple[str, ...] = ()
    if self.kind == "nnx" and any(as_plan(r).fp8 is not None for r in cfg.recipes):
      self.fp8_keeps = _models.fp8_role_keeps(task, task.init(0), batch)


def identity(cfg: StudyConfig, task: Task, digest: str) -> dict:
  """What makes two runs the same study (settings that change no number are left out)."""
  return {"format": FORMAT, "task": task.name, "task_digest": digest,
          "recipes": [r.to_dict() for r in cfg.recipes], "control": cfg.control,
          "seeds": cfg.seeds, "steps": cfg.steps, "eval_every": cfg.eval_every,
          "aa": cfg.aa, "max_nonfinite": cfg.max_nonfinite,
          "overrides": [list(p) for p in cfg.overrides],
          # Keys only a floor / sequential study has: older studies keep their identity.
          # The floor's rule of which element it nudges (`_floor.RULE`): floor cells of
          # another rule are other runs.
          **({"floor": _floor.RULE} if cfg.floor else {}),
          **({"seeds": cfg.sequential.max_seeds,
              "sequential": dataclasses.asdict(cfg.sequential)} if cfg.sequential else {})}


def _check_out(out: str, ident: dict, extra: dict) -> None:
  path = os.path.join(out, _STUDY_FILE)
  if os.path.exists(path):
    with open(path) as f:
      try:
        old = json.load(f)
      except json.JSONDecodeError:
        raise ValueError(f"{path} is not a study file (unreadable JSON); use another "
                         "--out") from None
    old_ident = old.get("identity", {})
    diff = sorted(k for k in set(old_ident) | set(ident)
                  if k != "seeds" and old_ident.get(k) != ident.get(k))
    if diff:
      raise ValueError(f"--out {out} holds a study with another configuration (differs in: "
                       f"{', '.join(diff)}); accepted: the same task and settings to "
                       "continue it, or another --out")
    have, want = old_ident.get("seeds", 0), ident["seeds"]
    if want < have:
      raise ValueError(f"--out {out} holds a study of {have} seeds; accepted: --seeds >= "
                       f"{have} (a study grows by seeds: its finished cells are kept)")
    if want > have:
      # More seeds continue the study: seed i's cells are the same runs whatever the
      # seed count, so the finished ones stay and only the new seeds train.
      _cells.write_atomic(path, json.dumps({**old, "identity": ident}, indent=1))
    return
  # Slices started at once (a Slurm array) race to create the study: one may be writing
  # study.json (its temporary file) or have just renamed it and made cells/.
  taken = [n for n in (os.listdir(out) if os.path.isdir(out) else ())
           if not n.startswith(".") and not n.startswith(f"{_STUDY_FILE}.tmp-")]
  if taken:
    if os.path.exists(path):  # another slice created the study meanwhile
      return _check_out(out, ident, extra)
    raise ValueError(f"--out {out} exists and holds no study ({_STUDY_FILE} missing); "
                     "accepted: a new or empty folder, or a study's folder")
  os.makedirs(out, exist_ok=True)
  _cells.write_atomic(path, json.dumps({"identity": ident, **extra}, indent=1))


def _read_study(out: str) -> dict:
  path = os.path.join(out, _STUDY_FILE)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ValueError(f"--out {out} holds no study ({_STUDY_FILE} missing); run the study "
                     "into it first") from None


class _Compile_cache:
  """The persistent compilation cache pointed into the study folder while it runs: the
  seeds of a recipe compile to one program, loaded after its first compile."""

  def __init__(self, out: str):
    self.dir = os.path.join(out, ".compile_cache")

  def __enter__(self):
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    self.saved = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_compilation_cache_dir", self.dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return self

  def __exit__(self, *exc):
    for k, v in self.saved.items():
      jax.config.update(k, v)


def _bar(total: int, initial: int, desc: str, progress: bool):
  if not progress:
    return None
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr, unit="step")


def run(task: Task, recipes: Sequence[str | Recipe] | str = ("fp32", "bf16_mixed"),
        seeds: int | str = 3, steps: int = 100, out: str = "study_out", *,
        eval_every: int | None = None, save_every: int | None = None,
        shard: str | Sequence[int] | None = None, margin: float | None = None,
        target: float | None = None, alpha: float = _stats.ALPHA, test: str = "t",
        aa: bool = False, control: str = "fp32", growth_interval: str | int = "recipe",
        max_nonfinite: int = 50, timing_rounds: int = 5, progress: bool = True,
        overrides: Mapping[str, Any] | None = None, telemetry: int = 0,
        telemetry_whatif: bool = True, max_seeds: int | None = None,
        floor: bool | None = None, retry_failed: bool = False,
        stop_signal: str | int | None = "USR1", requeue: bool = False,
        seed_batch: int | None = None) -> _report.StudyResult | None:
  """Trains `task` under every recipe x seed and judges each recipe against the control.

  Args:
    task: the user's `Task`.
    recipes: preset names or Recipes (a comma-separated string too); the control (fp32
      unless `control` says otherwise) is added when missing.
    seeds: seeds per recipe (>= 2: a verdict needs pairs), or "auto": rounds of seeds
      (3, 6, 9, ... up to `max_seeds`) until every recipe is worse, better or holds up
      within `margin` (needed), a decided recipe taking no more seeds; the error rates
      hold under this stopping (`precision.study._sequential`). One slice only.
    max_seeds: the budget per recipe of seeds="auto" (default 12, >= 2).
    floor: add the chaos floor's arm: the control from initial weights one ulp away, on
      the same seeds and batches (None: on with seeds="auto"); its spread is reported
      beside the verdicts (summary.json "floor").
    steps: optimizer steps per cell.
    out: output folder; a rerun of the same study continues it (finished cells are not
      rerun, unfinished ones resume bit-exactly from their last checkpoint); a rerun with
      more `seeds` adds those seeds' cells (a verdict that "needs N seeds" gets them).
    eval_every, save_every: evaluation and checkpoint intervals (default steps // 10).
    shard: "K/N": run slice K of N of the grid (None: the Slurm array's slice, else 1/1).
    margin: equivalence margin in the metric's units: "holds up within margin" by two
      one-sided tests (None: no equivalence verdict).
    target: a metric value; time-to-target (first evaluated step at or below it) per
      cell and its paired difference from the control.
    alpha: family-wise error rate of the verdicts. test: "t" (paired t, default) or
      "sign_flip" (exact, distribution-free; needs more seeds).
    aa: add the A/A arm (the control on other seeds; its verdict should be none).
    control: the recipe the others are judged against.
    growth_interval: dynamic loss-scale growth interval ("recipe", "auto" or steps).
    max_nonfinite: consecutive non-finite steps after which a cell is "diverged".
    timing_rounds: rounds of interleaved step timing for the cost columns (0: none).
    progress: a tqdm bar over the slice's steps on stderr.
    overrides: {scope pattern: policy} every recipe is bound with (e.g. a head kept in
      f32: {"*head*": "f32"}); part of the study's identity.
    telemetry: numerics telemetry every this many steps (0: off): each cell's
      telemetry.jsonl gets every GEMM operand, cotangent and result's statistics
      (precision.numerics.TensorStats) and the monitors (max logits, log Z, update/param
      RMS, updates lost to rounding, Adam's RMS(g^2/v)); the report adds the first
      anomaly, the worst tensors and a heatmap per recipe. Measured by a separate
      program on the state before the step: the trajectory is the same with it off.
    telemetry_whatif: also compute the what-if columns (bf16, f16, E4M3, E5M2).
    retry_failed: train again the cells recorded as "failed" (from their last
      checkpoint), e.g. cells an earlier version failed for a full disk.
    stop_signal: besides SIGTERM, the signal that stops the study cleanly (Slurm's
      ``--signal=B:USR1@<seconds>`` warning; None: SIGTERM only): the step in flight
      finishes, the open cell saves at that step, the slice's stop record is written
      (stops/slice-K-of-N.json) and `Stopped` is raised; the same call continues
      bit-exactly. Handled only when `run` is called from the main thread.
    requeue: under Slurm, a stop also requeues this job (``scontrol requeue``).
    seed_batch: K, seeds of a recipe trained by one compiled program, 1 to `seeds`; 1:
      one program per cell. Over several local devices the seed axis is sharded over
      the most of them dividing K (seeds sharing a device run in a loop inside the
      program on forced CPU host devices, vmapped on an accelerator); there a seed's
      numbers depend on K and the device count (batched GEMMs sum in another order; each
      group is padded to K so they depend on nothing else), so both are part of the
      study's identity. On a CPU of one device the group's compiled one-seed step runs
      each seed on host threads: one-seed cells' numbers bit for bit, so the identity
      does not record it and the study continues with any K. None: the study's own
      choice when `out` holds one, else on an accelerator one seed per local device
      (K = min(seeds, local devices, 8); 1 on a one-device machine) and on CPU 1. With
      seeds="auto" each round's new seeds of an arm run in groups of up to K (1 to
      `max_seeds`); with `retry_failed` a failed cell is retried in a group of its own
      (padded to K: the same numbers).

  Returns:
    The StudyResult once every cell of the grid is finished (the report written into
    `out`), else None (other slices are still to run: then `report_only(out)`).

  Raises:
    ValueError: a bad argument, a task whose loss is not a floating scalar or that
      returns no f32 model, or an `out` holding another study's files.
    StudyEnvironmentError: the environment failed under a cell (a full disk, an I/O or
      permission error, memory exhausted): one line naming the cell, the path and the
      cause; the cell is left unfinished and the same call continues it.
    OSError: a file of the study outside the cells (study.json, the report) could not be
      written (its path and errno); every finished cell is kept.
    Stopped: SIGTERM or `stop_signal` arrived (everything saved; run again to continue).
  """
  if not isinstance(task, Task):
    raise ValueError(f"task={task!r}; accepted: a precision.study.Task")
  cfg = make_config(recipes, seeds, steps, eval_every=eval_every, save_every=save_every,
                    control=control, aa=aa, growth_interval=growth_interval,
                    max_nonfinite=max_nonfinite, overrides=overrides, max_seeds=max_seeds,
                    margin=margin, alpha=alpha, floor=floor)
  k, n = parse_shard(shard)
  if cfg.sequential is not None and (k, n) != (1, 1):
    raise ValueError(f"shard {k}/{n} with seeds='auto'; accepted: one slice (the rounds "
                     "of a sequential study depend on every cell of the round before)")
  if cfg.sequential is not None and test != "t":
    raise ValueError(f"test={test!r} with seeds='auto'; accepted: test='t' (the sequential "
                     "rule's boundaries are for the paired t statistic)")
  stops = _signals.stopping(out, (k, n), stop_signal, requeue)
  judge = _report.Judging(margin=margin, target=target, alpha=alpha, test=test)
  check_int("timing_rounds", timing_rounds, 0)
  check_int("telemetry", telemetry, 0)
  if not isinstance(telemetry_whatif, bool):
    raise ValueError(f"telemetry_whatif={telemetry_whatif!r}; accepted: True or False")
  if not isinstance(retry_failed, bool):
    raise ValueError(f"retry_failed={retry_failed!r}; accepted: True or False")
  # Seed batching (`_batched`): checked before the task runs, and the batches stackable
  # before anything is saved. The budget of seeds per recipe: a sequential study's
  # max_seeds (its rounds may reach it), else the seeds.
  budget = cfg.sequential.max_seeds if cfg.sequential is not None else cfg.seeds
  sb = _batched.resolve(seed_batch, out, budget, jax.local_device_count(),
                       "max_seeds" if cfg.sequential is not None else "the seeds per recipe")
  pre = _Preflight(task, cfg)
  if sb.k > 1:
    whole = (dataclasses.replace(cfg, seeds=budget).grid() if cfg.sequential is not None
             else cfg.grid()[k - 1::n])
    _batched.check_stackable(task, sorted({c.seed for c in whole}))
  settings = _cells.CellSettings(cfg.steps, cfg.eval_every, cfg.save_every,
                                 cfg.max_nonfinite, pre.fp8_keeps, cfg.overrides,
                                 telemetry, telemetry_whatif)
  _check_out(out, {**identity(cfg, task, pre.digest), **_batched.identity_items(sb)}, {
      "settings": {"save_every": cfg.save_every, "growth_interval": cfg.growth_interval},
      "kind": pre.kind, "fp8_kept_by_role": list(pre.fp8_keeps),
      **({"floor_nudge": _floor.describe(task)} if cfg.floor else {})})
  with _Compile_cache(out), stops:
    if cfg.sequential is not None:
      cfg = _sequential_rounds(task, cfg, settings, out, progress, retry_failed, sb)
    mine = cfg.grid()[k - 1::n]
    # An auto study's rounds retried its failed cells already (once).
    retry = retry_failed and cfg.sequential is None
    todo = [c for c in mine if _cells.to_run(out, c, retry)]
    bar = _bar(len(mine) * cfg.steps, (len(mine) - len(todo)) * cfg.steps,
               "study" if n == 1 else f"study {k}/{n}", progress)
    for group in ([[c] for c in todo] if sb.k == 1 else _batched.groups(todo, sb.k)):
      _run_group(task, cfg, group, settings, out, sb, bar, retry)
    if bar is not None:
      bar.close()
    if any(_cells.read_done(out, c) is None for c in cfg.grid()):
      return None
    _measure_costs(task, cfg, settings, out, timing_rounds)
  return _report.write(out, cfg, judge, task_name=task.name)


def _run_group(task: Task, cfg: StudyConfig, group: list, settings: _cells.CellSettings,
               out: str, sb: _batched.SeedBatch | None, bar, retry_failed: bool) -> None:
  """Trains one group of cells of one arm: a one-seed cell (`_cells.run_cell`) when seed
  batching is off (`sb` None or K 1), else a seed-batched group (`_batched.run_group`)."""
  _signals.check()  # a stop between cells: nothing is open
  if bar is not None:
    bar.set_postfix_str(group[0].name if len(group) == 1
                        else f"{group[0].name}..s{group[-1].index}")
  # One arm per group: the chaos floor's cells start from nudged weights.
  cell_task = _task_of(task, cfg, group[0])
  on_step = bar.update if bar else None
  if sb is not None and sb.k > 1:
    _batched.run_group(cell_task, group, settings, out, sb, on_step=on_step,
                       retry_failed=retry_failed)
  else:
    _cells.run_cell(cell_task, group[0], settings, out, on_step=on_step,
                    retry_failed=retry_failed)


def _task_of(task: Task, cfg: StudyConfig, cell: _cells.Cell) -> Task:
  """The task a cell trains: the chaos floor's cells start from nudged weights."""
  return _floor.nudged_task(task) if cell.arm == cfg.floor_arm else task


# --------------------------------------------------------------------------- seeds="auto"


def _next_round(out: str, cfg: StudyConfig, p: _sequential.Plan) -> StudyConfig:
  """The config of the study's next round, from its finished cells: the rule replayed
  over each judged arm's paired differences (`_sequential.replay`), a recipe still
  "continue" given the next look's seeds; a recipe with a diverged or failed cell, or
  whose pairs are missing a seed (the control's did not finish), takes no more."""
  ctrl = {}
  for c in (x for x in cfg.grid() if x.arm == cfg.control):
    d = _cells.read_done(out, c)
    if d is not None and d["status"] == "ok":
      ctrl[c.index] = d["final_metric"]
  want = {}
  for arm in cfg.judged_arms():
    done = [_cells.read_done(out, c) for c in cfg.grid() if c.arm == arm]
    if any(d is None for d in done):
      want[arm] = cfg.n_seeds(arm)  # this round is not finished yet
      continue
    if any(d["status"] != "ok" or d["index"] not in ctrl for d in done):
      want[arm] = len(done)
      continue
    deltas = [d["final_metric"] - ctrl[d["index"]] for d in done]
    dec = _sequential.replay({arm: deltas}, p)[arm]
    want[arm] = max(len(done), _sequential.seeds_to_run({arm: dec}, p)[arm])
  top = max(want.values(), default=cfg.seeds)
  return dataclasses.replace(cfg, seeds=top,
                             arm_seeds=tuple((a, k) for a, k in want.items() if k != top))


def _sequential_rounds(task: Task, cfg: StudyConfig, settings: _cells.CellSettings,
                       out: str, progress: bool, retry_failed: bool = False,
                       sb: _batched.SeedBatch | None = None) -> StudyConfig:
  """Runs rounds of a seeds="auto" study until no recipe takes another seed; returns the
  final config. Every round is recomputed from the finished cells, so a killed study
  rerun walks the same rounds (through the finished ones without training) and continues
  where it stopped; study.json's "sequential_state" records the last for `report_only`.
  Ends at the fixed point: the next round is this one and all its cells are finished
  (seeds only grow, up to the budget, so it is reached). With `retry_failed` a cell an
  earlier run finished as failed is run again, once in this call.

  With `sb` (K > 1) a round's new cells of each arm run as seed-batched groups of up to
  K (`_batched.run_group`). A group is padded to K, so a seed's numbers do not depend on
  which seeds share its round or its group: a study killed anywhere, inside a group
  too, and rerun regroups the unfinished cells and ends with the same cells."""
  p = _config.sequential_plan(cfg)
  path = os.path.join(out, _STUDY_FILE)
  ran: set[str] = set()
  while True:
    new = _next_round(out, cfg, p)
    todo = [c for c in new.grid()
            if c.name not in ran and _cells.to_run(out, c, retry_failed)]
    if new == cfg and not todo:
      return cfg
    cfg = new
    study = _read_study(out)
    study["sequential_state"] = {"seeds": cfg.seeds, "arm_seeds": [list(x) for x in
                                                                   cfg.arm_seeds]}
    _cells.write_atomic(path, json.dumps(study, indent=1))
    if not todo:
      continue  # a round finished before (a rerun): on to the next look
    bar = _bar(len(todo) * cfg.steps, 0, f"study: round to {cfg.seeds} seeds", progress)
    batched = sb is not None and sb.k > 1
    for group in _batched.groups(todo, sb.k) if batched else [[c] for c in todo]:
      ran.update(c.name for c in group)
      _run_group(task, cfg, group, settings, out, sb, bar, retry_failed)
    if bar is not None:
      bar.close()


def report_only(out: str, *, margin: float | None = None, target: float | None = None,
                alpha: float = _stats.ALPHA, test: str = "t", task: Task | None = None,
                timing_rounds: int = 5) -> _report.StudyResult:
  """Merges the finished cells in `out` (every slice's) and writes the report.

  Raises:
    ValueError: `out` holds no study, or cells are not finished (named, with the slice
      that runs them).
  """
  study = _read_study(out)
  cfg = _config.config_from_study(study)
  if cfg.sequential is not None and margin is None:
    margin = cfg.sequential.margin  # the margin its rule stopped recipes at
  judge = _report.Judging(margin=margin, target=target, alpha=alpha, test=test)
  missing = [c.name for c in cfg.grid() if _cells.read_done(out, c) is None]
  if missing:
    raise ValueError(f"{out}: cells {missing[:6]}{' ...' if len(missing) > 6 else ''} are "
                     "not finished; run their slices (--shard K/N), then --report-only")
  if task is not None:
    settings = _cells.CellSettings(cfg.steps, cfg.eval_every, cfg.save_every,
                                   cfg.max_nonfinite, tuple(study.get("fp8_kept_by_role", ())),
                                   cfg.overrides)
    with _Compile_cache(out):
      _measure_costs(task, cfg, settings, out, timing_rounds)
  return _report.write(out, cfg, judge, task_name=study["identity"]["task"])


def _measure_costs(task: Task, cfg: StudyConfig, settings: _cells.CellSettings, out: str,
                   rounds: int) -> None:
  """costs.json: median step time of each recipe, timed interleaved (round r runs every
  recipe's compiled step a few times before round r+1), so machine-load drift hits every
  recipe alike; the ratio to the control is what the report shows. Kept once measured."""
  path = os.path.join(out, "costs.json")
  if os.path.exists(path) or rounds == 0:
    return
  dev = jax.devices()[0]
  progs, states, batches = {}, {}, {}
  for arm, recipe, _ in cfg.arms():
    if recipe.name in progs:
      continue
    try:
      prog = _models.build(task, recipe, 0, settings.fp8_keeps, dict(settings.overrides))
      batch = next(iter(task.batches(0)))
      compiled = prog.step.lower(prog.state, batch, jnp.int32(0)).compile()
      progs[recipe.name], states[recipe.name], batches[recipe.name] = compiled, prog.state, batch
    except Exception as e:  # pylint: disable=broad-except
      print(f"timing of {recipe.name} skipped: {type(e).__name__}: {e}"[:300],
            file=sys.stderr)
  times: dict[str, list[float]] = {r: [] for r in progs}
  reps = 5
  # Round 0 is a warm-up, not timed: a process's first executions pay one-off costs
  # (thread pools, first touches of buffers) that would land on whichever recipe runs first.
  for r in range(rounds + 1):
    for name, compiled in progs.items():
      t0 = time.perf_counter()
      for i in range(reps):
        states[name], m = compiled(states[name], batches[name], jnp.int32(i))
      jax.block_until_ready(m)
      if r:
        times[name].append((time.perf_counter() - t0) / reps)
  median = {r: float(np.median(v)) for r, v in times.items()}
  base = median.get(cfg.control)
  _cells.write_atomic(path, json.dumps({
      "device": f"{dev.platform.upper()} ({dev.device_kind}, {jax.device_count()} devices, "
                f"{os.cpu_count()} CPU cores)",
      "platform": dev.platform, "rounds": rounds, "steps_per_round": reps,
      "median_step_s": median,
      "ratio_to_control": {r: (t / base if base else None) for r, t in median.items()},
  }, indent=1))
