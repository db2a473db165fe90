"""The study's command line: ``python -m precision.study FILE_OR_MODULE:TASK [options]``.

  python -m precision.study my_task.py:task --recipes fp32,bf16_mixed,f16_mixed \\
      --seeds 5 --steps 200 --out study_out [--margin 0.01] [--target 2.5]
  python -m precision.study my_task.py:task ... --shard 2/4     # one slice of the grid
  python -m precision.study my_task.py:task ... --report-only   # merge the slices

TASK names a `precision.study.Task` or a function of no arguments returning one. Rerunning
the same command after an interruption continues every unfinished cell bit-exactly and
never reruns a finished one. In a Slurm array job the slice is read from
SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT when --shard is not given. Faithful
rounding is on (bf16/f16 values are rounded as their dtypes say; off with
--no-faithful-rounding). Bad input ends with a one-line error and exit status 2. A fault
of the environment (a full disk, an I/O or permission error, memory exhausted) ends with
one line naming the cell, the path and the cause, and exit status 1: nothing is recorded
as the model's result, and the same command continues once the cause is fixed
(--debug adds the traceback). --retry-failed trains again the cells recorded as failed.
SIGTERM or --stop-signal (USR1: Slurm's warning) saves and exits 75; --slurm-script PATH
writes the script that submits the study to Slurm as an array job plus its report.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings

from precision import _numerics
from precision.checkpoint import CheckpointError
from precision.study import _signals
from precision.study import _slurm


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m precision.study", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("task", help="FILE.py:NAME or package.module:NAME")
  ap.add_argument("--recipes", default="fp32,bf16_mixed,bf16_master,f16_mixed",
                  help="comma-separated presets; the control (fp32) is added if missing")
  ap.add_argument("--seeds", type=_seeds_arg, default=3,
                  help="seeds per recipe (>= 2), or auto: rounds of seeds until every "
                       "recipe is decided (needs --margin; up to --max-seeds)")
  ap.add_argument("--max-seeds", type=int, help="budget per recipe of --seeds auto "
                  "(default 12, >= 2)")
  ap.add_argument("--floor", action=argparse.BooleanOptionalAction, default=None,
                  help="add the chaos floor's arm: the control from weights one ulp away "
                       "(default: on with --seeds auto)")
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--out", default="study_out")
  ap.add_argument("--eval-every", type=int, help="default steps // 10")
  ap.add_argument("--save-every", type=int, help="checkpoint interval (default steps // 10)")
  ap.add_argument("--shard", help="K/N: run slice K of N of the grid")
  ap.add_argument("--report-only", action="store_true",
                  help="merge the finished cells of every slice and write the report")
  ap.add_argument("--margin", type=float, help="equivalence margin (metric units)")
  ap.add_argument("--target", type=float, help="metric value for time-to-target")
  ap.add_argument("--alpha", type=float, default=0.05, help="family-wise error rate")
  ap.add_argument("--test", default="t", help="t (paired t, default) or sign_flip")
  ap.add_argument("--aa", action="store_true", help="add the A/A arm (control vs itself)")
  ap.add_argument("--control", default="fp32")
  ap.add_argument("--override", action="append", default=[], metavar="PATTERN=POLICY",
                  help="bind every recipe with this override (repeatable), e.g. "
                  "'*head*=p=f32,c=f32,o=f32' or '*head*=f32'")
  ap.add_argument("--growth-interval", default="recipe",
                  help="dynamic loss-scale growth interval: recipe, auto or steps")
  ap.add_argument("--timing-rounds", type=int, default=5,
                  help="interleaved timing rounds for the step-time column (0: none)")
  ap.add_argument("--telemetry", type=int, default=0, metavar="N",
                  help="numerics telemetry every N steps (0: off): per-tensor statistics "
                       "of every GEMM, monitors, first anomaly and heatmaps in the report")
  ap.add_argument("--retry-failed", action="store_true",
                  help="train again the cells recorded as failed (from their last "
                       "checkpoint), e.g. failed for a full disk by an earlier version")
  ap.add_argument("--debug", action="store_true",
                  help="print the traceback of an error, not only its line")
  ap.add_argument("--seed-batch", type=int, metavar="K",
                  help="seeds of a recipe trained by one compiled program (1 to --seeds, "
                       "or to --max-seeds with --seeds auto: each round's new seeds in "
                       "groups of K; 1: one program per cell; on a CPU of one device "
                       "the one-seed step on host threads, with one-seed cells' numbers; "
                       "default: the study's own, else one seed per local device on an "
                       "accelerator, 1 on CPU)")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--no-faithful-rounding", action="store_true")
  # Stopping on a signal (_signals) and the Slurm submit script (_slurm).
  ap.add_argument("--stop-signal", default="USR1",
                  help="besides SIGTERM, the signal that stops the study cleanly: it saves and "
                       f"exits {_signals.REQUEUE_EXIT} (run again to continue; default USR1)")
  ap.add_argument("--requeue", action="store_true",
                  help="under Slurm, a stop also requeues this job (scontrol requeue)")
  _slurm.add_arguments(ap)
  return ap


def _seeds_arg(text: str):
  if text.strip() == "auto":
    return "auto"
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}; accepted: an integer >= 2 or auto") from None


def main(argv=None) -> int:
  """The command; SIGTERM and --stop-signal are handled from its start to its return (a
  stop during the imports is acted on at the first cell; Slurm's SIGTERM that follows a
  job's requeue of itself does not cut its exit short)."""
  args = _parser().parse_args(argv)
  try:
    handling = _signals.handling(args.stop_signal)
  except ValueError as e:
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  with handling:
    return _main(args)


def _main(args) -> int:
  if args.slurm_script:
    try:
      return _slurm.write_from_cli(_parser(), args)
    except ValueError as e:
      print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
      return 2
  if not args.no_faithful_rounding:
    _numerics.enable_faithful_rounding()  # before the task's module can start JAX's backend
  from precision import study  # pylint: disable=g-import-not-at-top
  from precision.study import _faults  # pylint: disable=g-import-not-at-top
  # A cache entry that cannot be written (or was cut by a full disk) is only a slower
  # compile; a full disk is reported by the study's own writes, in one line.
  for verb in ("writing", "reading"):
    warnings.filterwarnings("ignore", message=f"Error {verb} persistent compilation cache")
  try:
    overrides = {}
    for item in args.override:
      if "=" not in item:
        raise ValueError(f"--override {item!r}; accepted: PATTERN=POLICY, e.g. '*head*=f32'")
      pattern, policy = item.split("=", 1)
      overrides[pattern] = policy
    task = study.load_task(args.task)
    if args.report_only:
      if args.shard:
        raise ValueError("--report-only merges every slice; accepted: no --shard with it")
      result = study.report_only(args.out, margin=args.margin, target=args.target,
                                 alpha=args.alpha, test=args.test, task=task,
                                 timing_rounds=args.timing_rounds)
    else:
      result = study.run(
          task, args.recipes, args.seeds, args.steps, args.out, eval_every=args.eval_every,
          save_every=args.save_every, shard=args.shard, margin=args.margin,
          target=args.target, alpha=args.alpha, test=args.test, aa=args.aa,
          control=args.control, growth_interval=args.growth_interval,
          timing_rounds=args.timing_rounds, progress=not args.no_progress,
          telemetry=args.telemetry, retry_failed=args.retry_failed,
          overrides=overrides or None, max_seeds=args.max_seeds, floor=args.floor,
          stop_signal=args.stop_signal, requeue=args.requeue, seed_batch=args.seed_batch)
  except ValueError as e:
    if args.debug:
      traceback.print_exc()
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  except _signals.Stopped as e:
    print(f"{e}; run the same command again to continue (the stop's record: "
          f"{e.record.get('file')})", file=sys.stderr)
    return _signals.REQUEUE_EXIT
  except (study.StudyEnvironmentError, OSError, MemoryError, CheckpointError) as e:
    if args.debug:
      traceback.print_exc()
    if not isinstance(e, study.StudyEnvironmentError):
      # Outside a cell: the study's folder, its report or a costs file.
      e = _faults.fault(None, f"writing the study's files in {args.out}", None, e)
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 1
  if result is None:
    print(f"slice done: {args.out}. Once every slice is done: python -m precision.study "
          f"{args.task} --out {args.out} --report-only")
    return 0
  print(result.markdown)
  print(json.dumps({"out": args.out, "verdicts": {a: r["verdict"]
                                                 for a, r in result.rows.items()}}))
  return 0
