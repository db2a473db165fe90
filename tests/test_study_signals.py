"""A study stopped by a signal (Slurm's warning signal, SIGTERM) saves, records why, and
continues bit-exactly; the Slurm submit script the command line writes.

In-process: a task whose data loader sends the process SIGUSR1 at a chosen batch (and
whose stop's save receives SIGTERM halfway) stops with `Stopped`, its stop record written,
and a rerun ends equal to an uninterrupted run (every step record, fingerprints,
verdicts). As a command: `python -m precision.study` sent SIGUSR1 mid-cell exits 75 and
its rerun ends equal to the same uninterrupted run. The README's "On a Slurm cluster" script is what `--slurm-script` writes.
The real cluster is tests/test_slurm.py (marked slurm).
"""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
import pytest

from precision import checkpoint as ckpt_lib
from precision import study
from precision.study import _cells
from precision.study import _signals
from precision.study import _slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "study_tasks")
SMALL = dict(seeds=2, steps=12, eval_every=4, save_every=4, timing_rounds=0, progress=False)


@contextlib.contextmanager
def user_code():
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def _task(signal_at=None, signum=signal.SIGUSR1):
  """params_mlp's task; with `signal_at`, seed 0's loader signals this process as it
  hands out that batch (the same numbers either way)."""
  base = study.load_task(os.path.join(TASKS, "params_mlp.py:task"))
  if signal_at is None:
    return base

  def batches(seed):
    for i, b in enumerate(base.batches(seed)):
      if seed == 0 and i == signal_at:
        os.kill(os.getpid(), signum)
      yield b

  return study.Task(init=base.init, loss=base.loss, batches=batches,
                    optimizer=base.optimizer, name=base.name)


def _run(task, out, **kw):
  with user_code():
    return study.run(task, ["fp32"], out=str(out), **{**SMALL, **kw})


def results_without_time(out):
  """results.jsonl (every step record and each cell's outcome with its fingerprint),
  less the wall-clock fields."""
  with open(os.path.join(out, "results.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  for r in recs:
    r.pop("step_time_s", None)
    if "outcome" in r:
      r["outcome"].pop("timing", None)
  return recs


def summary(out):
  with open(os.path.join(out, "summary.json")) as f:
    return study.comparable(json.load(f))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  out = tmp_path_factory.mktemp("ref")
  _run(_task(), out)
  return str(out)


def test_warning_signal_saves_the_open_cell_and_the_rerun_is_bit_exact(reference, tmp_path,
                                                                      monkeypatch):
  before = signal.getsignal(signal.SIGUSR1)
  real_save = ckpt_lib.Checkpointer.save
  saves = []

  def save_with_a_term_halfway(self, step, *a, **kw):
    saves.append(step)
    if step == 7:  # the stop's save (off schedule: save_every is 4)
      os.kill(os.getpid(), signal.SIGTERM)  # unhandled, it would end the process here
    return real_save(self, step, *a, **kw)

  monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save_with_a_term_halfway)
  out = tmp_path / "stopped"
  # Batch 6 is handed out for step 6 (the 7th step): that step finishes, then it stops.
  with pytest.raises(study.Stopped) as stop:
    _run(_task(signal_at=6), out)
  monkeypatch.undo()
  assert saves == [4, 7]
  assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored
  rec = stop.value.record
  assert (rec["signal"], rec["signals_received"], rec["cell"], rec["saved_at_step"]) == (
      "SIGUSR1", 2, "fp32__s0", 7)
  assert rec["exit_code"] == study.REQUEUE_EXIT == 75 and rec["requeued"] is False
  with open(os.path.join(out, "stops", "slice-1-of-1.json")) as f:
    assert json.load(f) == rec
  cell = os.path.join(out, "cells", "fp32__s0")
  assert not os.path.exists(os.path.join(cell, "done.json"))
  assert ckpt_lib.Checkpointer(os.path.join(cell, "ckpt")).steps() == [4, 7]
  assert not os.path.exists(os.path.join(out, "cells", "fp32__s1"))  # never started
  result = _run(_task(), out)
  assert result is not None
  assert results_without_time(str(out)) == results_without_time(reference)
  assert summary(str(out)) == summary(reference)
  attempts = _cells.read_jsonl(os.path.join(cell, "attempts.jsonl"))
  assert [(a["event"], a["step"]) for a in attempts] == [("start", 0), ("resume", 7)]


def test_a_stop_signal_that_cannot_be_handled_is_refused(tmp_path):
  for bad in ("KILL", "SIGSTOP", "NOPE", 0, True):
    with pytest.raises(ValueError, match="stop signal"):
      _run(_task(), tmp_path / "bad", stop_signal=bad)
  assert _signals.parse_signal("usr2") is signal.SIGUSR2
  assert _signals.parse_signal(10) is signal.SIGUSR1


def test_slurm_job_names_the_array_task_not_the_array(monkeypatch):
  for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
    monkeypatch.delenv(k, raising=False)
  assert _signals.slurm_job() is None
  assert _signals.requeue_slurm_job() == (False, "not under Slurm (no SLURM_JOB_ID)")
  monkeypatch.setenv("SLURM_JOB_ID", "41")
  assert _signals.slurm_job() == "41"
  # The last task of an array has the array's own job id: `scontrol requeue 40` would
  # requeue every task of it.
  monkeypatch.setenv("SLURM_JOB_ID", "40")
  monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
  monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
  assert _signals.slurm_job() == "40_3"


def _cli_env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  return env


def _cli_cmd(out):
  # paced_mlp: params_mlp's numbers, each batch 0.1 s in coming: a cell runs ~1.2 s.
  return [sys.executable, "-m", "precision.study", os.path.join(TASKS, "paced_mlp.py:task"),
          "--recipes", "fp32", "--seeds", "2", "--steps", "12", "--eval-every", "4",
          "--save-every", "4", "--timing-rounds", "0", "--out", out, "--no-progress"]


def test_the_command_sent_its_warning_signal_mid_cell_exits_75_and_resumes(reference,
                                                                          tmp_path):
  out = str(tmp_path / "stopped")
  proc = subprocess.Popen(_cli_cmd(out), cwd=ROOT, env=_cli_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  steps = os.path.join(out, "cells", "fp32__s0", "steps.jsonl")
  deadline = time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    if len(_cells.read_jsonl(steps)) >= 3:  # the step-0 evaluation and 2 steps
      proc.send_signal(signal.SIGUSR1)
      break
    time.sleep(0.01)
  _, err = proc.communicate(timeout=240)
  assert proc.returncode == 75, err[-3000:]
  assert "stopped by SIGUSR1 in cell fp32__s0 at step" in err
  with open(os.path.join(out, "stops", "slice-1-of-1.json")) as f:
    rec = json.load(f)
  assert rec["signal"] == "SIGUSR1" and 2 <= rec["saved_at_step"] < 12
  # The rerun, here in this process (one interpreter start fewer), continues the cell.
  with user_code():
    study.run(study.load_task(os.path.join(TASKS, "paced_mlp.py:task")), ["fp32"],
              out=out, **SMALL)
  attempts = _cells.read_jsonl(os.path.join(out, "cells", "fp32__s0", "attempts.jsonl"))
  assert [(a["event"], a["step"]) for a in attempts] == [("start", 0),
                                                         ("resume", rec["saved_at_step"])]
  # The same numbers as the uninterrupted run of params_mlp in this process.
  assert results_without_time(out) == results_without_time(reference)
  def unnamed(s):  # the tasks' names differ ("paced-mlp"), nothing else
    return {**s, "task": None, "config": {**s["config"], "task": None}}

  assert unnamed(summary(out)) == unnamed(summary(reference))


# ------------------------------------------------------------------ the submit script

def readme_slurm_section():
  """The README's "On a Slurm cluster": its --slurm-script command and the script shown."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = text[text.index("## On a Slurm cluster"):]
  section = section[:section.index("\n## ", 5)]
  command = next(b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
                 if "--slurm-script" in b)
  command = command.strip().splitlines()[0]
  shown = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", section, flags=re.S)[0]
  return command, shown


def test_the_readme_shows_the_script_the_command_writes(tmp_path):
  command, shown = readme_slurm_section()
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "precision.study"]
  # The README's script was written in /home/you/project by its venv's Python.
  workdir = re.search(r"^cd (.+)$", shown, flags=re.M).group(1)
  python = re.search(r"^exec (\S+) -m precision.study", shown, flags=re.M).group(1)
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    from precision.study import _cli  # pylint: disable=g-import-not-at-top
    assert _cli.main(argv[3:]) == 0
  finally:
    os.chdir(cwd)
  path = argv[argv.index("--slurm-script") + 1]
  with open(tmp_path / path) as f:
    written = f.read()
  assert written.replace(str(tmp_path), workdir).replace(sys.executable, python) == shown


def test_slurm_script_options_are_checked(tmp_path, capsys):
  from precision.study import _cli  # pylint: disable=g-import-not-at-top
  base = ["t.py:task", "--out", str(tmp_path / "o"), "--slurm-script", "-"]
  for extra, msg in ((["--shard", "1/2"], "--shard with --slurm-script"),
                     (["--slurm-tasks", "0"], "--slurm-tasks 0"),
                     (["--slurm-warn", "-1"], "--slurm-warn -1"),
                     (["--slurm-option", "time=1"], "--slurm-option 'time=1'"),
                     (["--stop-signal", "KILL"], "stop signal 'KILL'")):
    assert _cli.main(base + extra) == 2
    assert msg in capsys.readouterr().err
  assert _cli.main(base + ["--seeds", "5", "--override", "*head*=f32",
                           "--stop-signal", "USR2", "--slurm-option=--time=1:00"]) == 0
  text = capsys.readouterr().out
  assert "#SBATCH --signal=B:USR2@120" in text and "#SBATCH --time=1:00" in text
  run_line = next(l for l in text.splitlines() if l.startswith("exec") and "--requeue" in l)
  argv = shlex.split(run_line)[1:]
  assert argv[argv.index("--seeds") + 1] == "5" and "--override=*head*=f32" not in argv
  assert argv[argv.index("--override") + 1] == "*head*=f32"
  assert argv[argv.index("--stop-signal") + 1] == "USR2"
  # The command written gives back the options it was written from.
  ap = _cli._parser()  # pylint: disable=protected-access
  again = _slurm.command_of(ap, ap.parse_args(argv[3:]))
  assert ap.parse_args(again) == ap.parse_args(argv[3:])


def test_handling_nests_and_leaves_no_request_behind():
  before = signal.getsignal(signal.SIGTERM)
  with _signals.handling("USR2") as outer:
    assert outer.signals == (signal.SIGTERM, signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)
    with _signals.handling():  # run's, inside the command's: the request stands
      assert _signals.requested() == (signal.SIGUSR2, 1)
      os.kill(os.getpid(), signal.SIGUSR1)
      assert _signals.requested() == (signal.SIGUSR2, 2)
    assert signal.getsignal(signal.SIGUSR1) is not _signals._on_signal  # pylint: disable=protected-access
    with pytest.raises(study.Stopped, match="stopped by SIGUSR2"):
      _signals.check()
  assert _signals.requested() is None and signal.getsignal(signal.SIGTERM) is before
