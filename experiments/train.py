"""Train the byte-level GPT on the embedded corpus under a precision recipe.

  python -m experiments.train --recipe bf16_master --model small --steps 300 --batch 8 \\
      --seq 256 --lr 3e-3 --seed 0 --ckpt-dir /tmp/run --save-every 100 \\
      [--resume | --resume-or-start] [--convert] [--allow-change lr,steps] \\
      [--out steps.jsonl] [--eval-every 50]

Writes one JSON line per step to --out (loss, grad norm, loss scale, skipped steps,
non-finite counts, tokens/s, validation bits per byte every --eval-every steps), shows a
progress bar on stderr, and prints a JSON summary as its last line (status, final
validation BPB, compiled step memory, SHA-256 fingerprint of the final params and
optimizer state; a non-finite number prints as null).

Checkpoints: --ckpt-dir belongs to one run (recipe, model, seed) and one writer at a time.
A fresh run refuses a directory that holds checkpoints; --resume continues the newest
intact one (a damaged newer step is reported and passed over) and fails when there is
nothing to resume, --resume-or-start starts fresh then; --convert continues another run's
checkpoint under this recipe and seed; --allow-unverified resumes a step without
checksums (an earlier format), with a warning. A resume with other --steps, --batch, --seq, --lr
or --warmup than the checkpoint was trained with is refused (one line listing every
change) unless --allow-change names those flags (or --convert is given). A record cut
by a kill at the end of --out is dropped on resume, with a warning.

Exit status: 0 when the run finished with a finite loss and validation BPB; 2 for a bad
command line (every flag, and the writability of --ckpt-dir and --out, are checked before
any work; one line on stderr); 1 when the run cannot start or continue (checkpoint
directory locked, owned by another run, nothing to resume, no intact checkpoint, changed
hyperparameters, a checkpoint or --out write that failed, memory exhausted) or
diverged (--max-nonfinite-steps consecutive non-finite steps, or a non-finite final
result): one "error:" line on stderr (what, where, the errno, what to do; the traceback
only with --debug), and for a divergence the summary on stdout. An unreadable newest
checkpoint step is passed over with a warning line and the newest readable one resumed.
The logic lives in experiments/trainlib.py (`train(TrainConfig(...))`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import errno
import math
import os
import sys
import tempfile
import traceback
import warnings

import precision as mp

from experiments import trainlib  # noqa: E402
from precision import checkpoint as ckpt_lib  # noqa: E402

PROG = "python -m experiments.train"


def _int_type(lo: int, hi: int | None = None):
  def parse(text: str) -> int:
    try:
      v = int(text, 10)
    except ValueError:
      v = None
    if v is None or v < lo or (hi is not None and v > hi):
      rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
      raise argparse.ArgumentTypeError(f"{text!r}: accepted: an integer {rng}")
    return v
  return parse


def _positive_float(text: str) -> float:
  try:
    v = float(text)
  except ValueError:
    v = math.nan
  if not (math.isfinite(v) and v > 0):
    raise argparse.ArgumentTypeError(f"{text!r}: accepted: a finite number > 0")
  return v


# Flags of the hyperparameters a resume compares with the checkpoint's train config.
_CHANGEABLE = ("steps", "batch", "seq", "lr", "warmup")


def _fields(text: str) -> tuple[str, ...]:
  names = tuple(n.strip().lstrip("-") for n in text.split(",") if n.strip())
  bad = [n for n in names if n not in _CHANGEABLE]
  if not names or bad:
    raise argparse.ArgumentTypeError(
        f"{(bad[0] if bad else text)!r}: accepted: a comma-separated list of "
        f"{', '.join(_CHANGEABLE)}")
  return names


def _writable_dir_problem(path: str) -> str | None:
  """Why checkpoints cannot be written under `path` (None when they can), probing the
  directory (or its nearest existing parent, which is left as it was)."""
  path = os.path.abspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    return "it exists and is not a directory"
  probe_in = path
  while not os.path.exists(probe_in):
    probe_in = os.path.dirname(probe_in)
  if not os.path.isdir(probe_in):
    return f"{probe_in} is not a directory"
  try:
    tempfile.TemporaryDirectory(dir=probe_in, prefix=".precision-probe-").cleanup()
  except OSError as e:
    return f"{probe_in} is not writable ({e.strerror or e})"
  return None


def _out_problem(path: str) -> str | None:
  path = os.path.abspath(path)
  if os.path.isdir(path):
    return "it is a directory"
  parent = os.path.dirname(path)
  if not os.path.isdir(parent):
    return f"its directory {parent} does not exist"
  if os.path.exists(path) and not os.access(path, os.W_OK):
    return "it is not writable"
  try:
    tempfile.NamedTemporaryFile(dir=parent, prefix=".precision-probe-").close()
  except OSError as e:
    return f"{parent} is not writable ({e.strerror or e})"
  return None


class _Parser(argparse.ArgumentParser):
  """argparse with its exit code 2, but the error in one line (no usage block)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
  d = trainlib.TrainConfig()
  ap = _Parser(prog=PROG, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--recipe", default=d.recipe, choices=list(mp.PRESETS))
  ap.add_argument("--model", default=d.model, choices=["tiny", "small", "gpt2_124m"])
  ap.add_argument("--steps", type=_int_type(1), default=d.steps)
  ap.add_argument("--batch", type=_int_type(1), default=d.batch)
  ap.add_argument("--seq", type=_int_type(1), default=None,
                  help="tokens per sequence (default: the model's seq_len)")
  ap.add_argument("--lr", type=_positive_float, default=d.lr)
  ap.add_argument("--warmup", type=_int_type(0), default=None,
                  help="warmup steps, at most --steps (default: steps // 10, at most 100)")
  ap.add_argument("--seed", type=_int_type(0, 2 ** 32 - 1), default=d.seed)
  ap.add_argument("--eval-every", type=_int_type(0), default=d.eval_every)
  ap.add_argument("--eval-batches", type=_int_type(1), default=d.eval_batches)
  ap.add_argument("--ckpt-dir", default=None)
  ap.add_argument("--save-every", type=_int_type(0), default=d.save_every)
  ap.add_argument("--keep", type=_int_type(1), default=d.keep)
  resume = ap.add_mutually_exclusive_group()
  resume.add_argument("--resume", action="store_true",
                      help="continue from --ckpt-dir; fail if there is nothing to resume")
  resume.add_argument("--resume-or-start", action="store_true",
                      help="continue from --ckpt-dir, or start fresh if it holds nothing")
  ap.add_argument("--convert", action="store_true",
                  help="with --resume: continue a checkpoint of another recipe or seed")
  ap.add_argument("--allow-change", type=_fields, default=(), metavar="FIELD[,FIELD]",
                  help="with --resume: hyperparameters that may differ from the "
                       f"checkpoint's ({', '.join(_CHANGEABLE)})")
  ap.add_argument("--allow-unverified", action="store_true",
                  help="with --resume: a checkpoint step without checksums (an earlier "
                       "format, or its integrity.json deleted) may be resumed, with a "
                       "warning")
  ap.add_argument("--stop-after", type=_int_type(1), default=None,
                  help="stop after this many steps, at most --steps (the schedule still "
                       "spans --steps)")
  ap.add_argument("--max-nonfinite-steps", type=_int_type(1), default=d.max_nonfinite_steps,
                  help="stop with an error after this many consecutive steps with "
                       "non-finite gradients")
  ap.add_argument("--out", default=None, help="JSONL file of per-step metrics")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--debug", action="store_true",
                  help="print the traceback of an error, not only its line")
  return ap


def parse_args(argv=None) -> trainlib.TrainConfig:
  """The TrainConfig of a command line; a bad one exits 2 with one line on stderr."""
  ap = build_parser()
  a = ap.parse_args(argv)
  resume = a.resume or a.resume_or_start
  if resume and not a.ckpt_dir:
    ap.error(f"argument --{'resume' if a.resume else 'resume-or-start'}: needs --ckpt-dir")
  if a.convert and not resume:
    ap.error("argument --convert: only with --resume or --resume-or-start")
  for flag in ("allow_change", "allow_unverified"):
    if getattr(a, flag) and not resume:
      ap.error(f"argument --{flag.replace('_', '-')}: only with --resume or "
               "--resume-or-start")
  if a.ckpt_dir is not None:
    problem = _writable_dir_problem(a.ckpt_dir) if a.ckpt_dir else "it is empty"
    if problem:
      ap.error(f"argument --ckpt-dir: {a.ckpt_dir!r} cannot hold checkpoints: {problem}")
  if a.out is not None:
    problem = _out_problem(a.out) if a.out else "it is empty"
    if problem:
      ap.error(f"argument --out: {a.out!r} cannot be written: {problem}")
  try:
    return trainlib.TrainConfig(
        recipe=a.recipe, model=a.model, steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr,
        warmup=a.warmup, seed=a.seed, eval_every=a.eval_every, eval_batches=a.eval_batches,
        ckpt_dir=a.ckpt_dir, save_every=a.save_every, keep=a.keep, resume=resume,
        start_if_nothing=a.resume_or_start, convert=a.convert,
        allow_change=a.allow_change, allow_unverified=a.allow_unverified,
        stop_after=a.stop_after,
        max_nonfinite_steps=a.max_nonfinite_steps, out=a.out, progress=not a.no_progress)
  except trainlib.ConfigError as e:
    # Cross-flag ranges (--warmup / --stop-after above --steps), named by their flag.
    text = str(e)
    for field in ("warmup", "stop_after"):
      text = text.replace(f"TrainConfig.{field}=", f"--{field.replace('_', '-')} ")
    ap.error(text)


def _json_safe(x):
  """Non-finite floats as null: the summary never reports NaN as a number."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_json_safe(v) for v in x]
  return x


def _fail(code: int, message: str, debug: bool = False):
  """Exits with one error line (after the traceback of the error being handled, with
  --debug)."""
  if debug:
    traceback.print_exc()
  print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
  sys.exit(code)


@contextlib.contextmanager
def _one_line_warnings():
  """Checkpoint warnings (a damaged step passed over, a dead writer's lock taken over) and
  run warnings (a torn --out record dropped) print as one line each, like the errors."""
  plain = warnings.formatwarning

  def fmt(message, category, filename, lineno, line=None):
    if issubclass(category, (ckpt_lib.CheckpointWarning, trainlib.TrainWarning)):
      return f"{PROG}: warning: {' '.join(str(message).split())}\n"
    return plain(message, category, filename, lineno, line)

  warnings.formatwarning = fmt
  try:
    yield
  finally:
    warnings.formatwarning = plain


def _environment_line(e: BaseException, cfg: trainlib.TrainConfig) -> str:
  """One line for a fault of the machine (disk, permissions, memory) met by the run."""
  resume = ("then rerun with --resume-or-start to continue from the last checkpoint"
            if cfg.ckpt_dir else "then rerun")
  if isinstance(e, OSError):
    code = errno.errorcode.get(e.errno, "") if e.errno else ""
    where = f" at {e.filename}" if e.filename else ""
    what = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there",
            errno.EACCES: "give this user permission there",
            errno.EPERM: "give this user permission there",
            errno.EROFS: "make that filesystem writable"}.get(e.errno, "fix it")
    return f"{e.strerror or e} ({code or type(e).__name__}){where}; {what}, {resume}"
  if isinstance(e, MemoryError):
    return f"out of host memory (MemoryError); free memory or use a smaller --batch, {resume}"
  first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return f"out of device memory ({first[:200]}); use a smaller --batch or --model, {resume}"


def _is_device_oom(e: BaseException) -> bool:
  import jax  # pylint: disable=g-import-not-at-top
  return (isinstance(e, jax.errors.JaxRuntimeError)
          and str(e).lstrip().startswith("RESOURCE_EXHAUSTED"))


def main(argv=None) -> dict:
  """Runs the CLI; returns the summary (exits non-zero as the module docstring says)."""
  # Before JAX starts (XLA reads its flags once): every bf16/f16 op rounds as stated.
  mp.enable_faithful_rounding()
  cfg = parse_args(argv)
  debug = build_parser().parse_args(argv).debug
  try:
    with _one_line_warnings():
      summary = trainlib.train(cfg)
  except trainlib.ConfigError as e:
    _fail(2, str(e), debug)
  except trainlib.DivergedError as e:
    e.summary.pop("history", None)
    print(json.dumps(_json_safe(e.summary), allow_nan=False), flush=True)
    _fail(1, f"the run diverged: {e}", debug)
  except (trainlib.TrainingError, ckpt_lib.CheckpointError) as e:
    # The library's keyword is the CLI's flag here.
    _fail(1, str(e).replace("pass allow_unverified=True", "pass --allow-unverified"), debug)
  except (OSError, MemoryError) as e:
    _fail(1, _environment_line(e, cfg), debug)
  except Exception as e:  # pylint: disable=broad-except  (re-raised unless out of memory)
    if not _is_device_oom(e):
      raise
    _fail(1, _environment_line(e, cfg), debug)
  summary.pop("history")
  print(json.dumps(_json_safe(summary), allow_nan=False), flush=True)
  if summary["status"] != "ok":
    _fail(1, f"the run diverged: final loss {summary['final_loss']}, final validation BPB "
             f"{summary['final_val_bpb']} (not finite)")
  return summary


if __name__ == "__main__":
  main()
