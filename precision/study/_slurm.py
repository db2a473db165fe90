"""The submit script of a study on a Slurm cluster (``--slurm-script PATH``).

``python -m precision.study TASK [study options] --slurm-script submit.sh`` trains nothing:
it writes a bash script that submits the same study as two Slurm jobs,

  * an array job of ``--slurm-tasks`` N tasks, one slice of the grid each (the study reads
    its slice from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT), warned by
    ``--signal=B:<stop signal>@<--slurm-warn seconds>`` before its time limit, with
    ``--requeue`` and ``--open-mode=append`` (a requeued task appends to its log, in
    <out>/.slurm/); the
    study runs as the batch shell itself (``exec``), so the warning reaches it: it saves,
    requeues its own array task and exits 75, and the requeued task continues bit-exactly;
  * the report (``--report-only``), a job that starts once every array task has ended
    well (``--dependency=afterok``) and is cancelled if one ends otherwise
    (``--kill-on-invalid-dep=yes``); submitting the script again then finishes the study:
    finished cells are not rerun and the report job waits for the new array.

The study's command is the one given, less the --slurm-* options, with ``--no-progress``
and ``--requeue`` added; ``--slurm-option`` adds #SBATCH lines to both jobs (a partition,
``--time``, ``--gres``). The script ``cd``s to the folder it was written from and runs the
Python that wrote it, so relative paths mean what they meant on the command line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Sequence

from precision.study import _cells

_OWN = ("slurm_script", "slurm_tasks", "slurm_warn", "slurm_option")
_BOTH = ("shard", "report_only")       # what the script decides per job
_ADDED = ("no_progress", "requeue")    # added to the array's command


def add_arguments(ap: argparse.ArgumentParser) -> None:
  """The command line's --slurm-* options."""
  g = ap.add_argument_group("Slurm (write a submit script instead of training)")
  g.add_argument("--slurm-script", metavar="PATH",
                 help="write the bash script that submits this study to Slurm as an array "
                      "job plus a dependent report job ('-': print it), then exit")
  g.add_argument("--slurm-tasks", type=int, default=4, metavar="N",
                 help="array tasks (slices of the grid) in the script (default 4)")
  g.add_argument("--slurm-warn", type=int, default=120, metavar="SECONDS",
                 help="the stop signal comes this long before the time limit (default 120)")
  g.add_argument("--slurm-option", action="append", default=[], metavar="OPT",
                 help="an #SBATCH option for both jobs (repeatable), e.g. "
                      "--slurm-option=--time=04:00:00 --slurm-option=--partition=gpu")


def command_of(ap: argparse.ArgumentParser, args: argparse.Namespace,
               drop: Sequence[str] = ()) -> list[str]:
  """The command line tokens that give `args` again (options at their defaults left out),
  less the options whose dest is in `drop`."""
  out, positional = [], []
  for action in ap._actions:  # pylint: disable=protected-access
    if action.dest in drop or isinstance(action, argparse._HelpAction):  # pylint: disable=protected-access
      continue
    value = getattr(args, action.dest, None)
    if not action.option_strings:
      positional.append(str(value))
      continue
    flag = max(action.option_strings, key=len)
    if isinstance(action, argparse._StoreTrueAction):  # pylint: disable=protected-access
      out += [flag] if value else []
    elif isinstance(action, argparse._StoreFalseAction):  # pylint: disable=protected-access
      out += [] if value else [flag]
    elif isinstance(action, argparse.BooleanOptionalAction):
      if value is not None and value != action.default:  # --flag / --no-flag
        out.append(action.option_strings[0] if value else action.option_strings[1])
    elif isinstance(action, argparse._AppendAction):  # pylint: disable=protected-access
      for item in value or ():
        out.append(f"{flag}={item}" if str(item).startswith("-") else flag)
        out += [] if str(item).startswith("-") else [str(item)]
    elif isinstance(action, argparse._StoreAction):  # pylint: disable=protected-access
      if value is not None and value != action.default:
        out.append(f"{flag}={value}" if str(value).startswith("-") else flag)
        out += [] if str(value).startswith("-") else [str(value)]
    else:
      raise ValueError(f"option {flag} ({type(action).__name__}) cannot be written into a "
                       "Slurm script; accepted: store, store_true/false, --x/--no-x and append options")
  return positional + out


def _sbatch_lines(options: Sequence[str]) -> list[str]:
  return [f"#SBATCH {opt}" for opt in options]


def script(study: Sequence[str], out: str, *, tasks: int, warn: int, stop_signal: str,
           options: Sequence[str] = (), workdir: str, python: str) -> str:
  """The submit script: `study` is the study's arguments (task first, no slice options),
  `out` its --out; see the module docstring for what the script does."""
  if isinstance(tasks, bool) or not isinstance(tasks, int) or tasks < 1:
    raise ValueError(f"--slurm-tasks {tasks!r}; accepted: an integer >= 1")
  if isinstance(warn, bool) or not isinstance(warn, int) or not 0 <= warn <= 65535:
    raise ValueError(f"--slurm-warn {warn!r}; accepted: seconds, 0 to 65535 (Slurm's range)")
  for opt in options:
    if not opt.startswith("-") or "\n" in opt:
      raise ValueError(f"--slurm-option {opt!r}; accepted: one sbatch option, e.g. "
                       "--time=04:00:00")
  sig = stop_signal.upper().removeprefix("SIG")
  run = shlex.join([python, "-m", "precision.study", *study, "--no-progress", "--requeue"])
  report = shlex.join([python, "-m", "precision.study", *study, "--report-only"])
  # In the study's folder, hidden: a folder that holds anything else is not a new study's.
  logs = os.path.join(out, ".slurm")
  name = shlex.quote("study-" + os.path.basename(os.path.normpath(out)))
  array_job = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --array=0-{tasks - 1}",
               f"#SBATCH --signal=B:{sig}@{warn}", "#SBATCH --requeue",
               "#SBATCH --open-mode=append",
               f"#SBATCH --output={shlex.quote(os.path.join(logs, '%A_%a.out'))}",
               *_sbatch_lines(options), f"exec {run}"]
  report_job = ["#!/bin/bash", f"#SBATCH --job-name={name}-report",
                "#SBATCH --open-mode=append",
                f"#SBATCH --output={shlex.quote(os.path.join(logs, 'report_%j.out'))}",
                *_sbatch_lines(options), f"exec {report}"]
  lines = [
      "#!/bin/bash",
      f"# The study in {out} on Slurm: {tasks} array tasks (one slice of the grid each),",
      "# then the report once all of them ended well. Run it: bash THIS_FILE (again after a",
      "# failed task: finished cells are kept). A task warned by SIG" + sig + f" {warn} s before",
      "# its time limit saves, requeues itself and exits 75; it continues where it stopped.",
      "set -euo pipefail",
      f"cd {shlex.quote(workdir)}",
      f"mkdir -p {shlex.quote(logs)}",
      "array=$(sbatch --parsable <<'EOF'", *array_job, "EOF", ")",
      'array=${array%%;*}',
      "report=$(sbatch --parsable --dependency=afterok:$array --kill-on-invalid-dep=yes "
      "<<'EOF'", *report_job, "EOF", ")",
      'report=${report%%;*}',
      f'echo "array job $array ({tasks} tasks), report job $report after it; logs in '
      f'{logs}"',
  ]
  return "\n".join(lines) + "\n"


def write_from_cli(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """--slurm-script: writes the script of the study `args` describes; exit status."""
  for dest in _BOTH:
    if getattr(args, dest, None):
      flag = "--" + dest.replace("_", "-")
      raise ValueError(f"{flag} with --slurm-script; accepted: the study's options alone "
                       "(the script gives each array task its slice and runs the report)")
  text = script(command_of(ap, args, drop=_OWN + _BOTH + _ADDED), args.out,
                tasks=args.slurm_tasks, warn=args.slurm_warn, stop_signal=args.stop_signal,
                options=args.slurm_option, workdir=os.getcwd(), python=sys.executable)
  if args.slurm_script == "-":
    sys.stdout.write(text)
    return 0
  folder = os.path.dirname(os.path.abspath(args.slurm_script))
  os.makedirs(folder, exist_ok=True)
  _cells.write_atomic(args.slurm_script, text)
  os.chmod(args.slurm_script, 0o755)
  print(f"wrote {args.slurm_script}: submit the study with: bash {args.slurm_script}")
  return 0
