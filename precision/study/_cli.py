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
--no-faithful-rounding). Bad input ends with a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import precision as mp


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m precision.study", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("task", help="FILE.py:NAME or package.module:NAME")
  ap.add_argument("--recipes", default="fp32,bf16_mixed,bf16_master,f16_mixed",
                  help="comma-separated presets; the control (fp32) is added if missing")
  ap.add_argument("--seeds", type=int, default=3, help="seeds per recipe (>= 2)")
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
  ap.add_argument("--seed-batch", type=int, metavar="K",
                  help="seeds of a recipe trained by one compiled program (1 to --seeds; "
                       "1: one program per cell; default: the study's own, else one seed "
                       "per local device)")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--no-faithful-rounding", action="store_true")
  return ap


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if not args.no_faithful_rounding:
    mp.enable_faithful_rounding()  # before the task's module can start JAX's backend
  from precision import study  # pylint: disable=g-import-not-at-top
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
          telemetry=args.telemetry,
          overrides=overrides or None,
          seed_batch=args.seed_batch)
  except ValueError as e:
    print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  if result is None:
    print(f"slice done: {args.out}. Once every slice is done: python -m precision.study "
          f"{args.task} --out {args.out} --report-only")
    return 0
  print(result.markdown)
  print(json.dumps({"out": args.out, "verdicts": {a: r["verdict"]
                                                 for a, r in result.rows.items()}}))
  return 0
