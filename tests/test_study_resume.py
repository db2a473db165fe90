"""Killing `python -m precision.study` at random points and rerunning the same command
ends with the summary an uninterrupted run writes; finished cells are never rerun.

The task is tests/study_tasks/params_mlp.py (a param pytree). Each attempt is SIGKILLed
at a random point (while importing, compiling or restoring, or after a random number of
new steps: mid-step, mid-evaluation or mid-save alike); after 10 kills the command runs to
its end.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = os.path.join(ROOT, "tests", "study_tasks", "params_mlp.py:task")
KILLS = 10


def _cmd(out):
  return [sys.executable, "-m", "precision.study", TASK, "--recipes", "fp32,bf16_mixed",
          "--seeds", "2", "--steps", "120", "--eval-every", "20", "--save-every", "4",
          "--timing-rounds", "0", "--margin", "0.05", "--out", out, "--no-progress"]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  return env


def _comparable(out):
  from precision import study
  with open(os.path.join(out, "summary.json")) as f:
    return study.comparable(json.load(f))


def _cells(out):
  root = os.path.join(out, "cells")
  return sorted(os.listdir(root)) if os.path.isdir(root) else []


def _progress(out):
  """Step records written so far over every cell (a resume cuts some back)."""
  total = 0
  for cell in _cells(out):
    path = os.path.join(out, "cells", cell, "steps.jsonl")
    if os.path.exists(path):
      with open(path) as f:
        total += sum(1 for line in f if line.endswith("\n"))
  return total


def _attempts(out, cell):
  path = os.path.join(out, "cells", cell, "attempts.jsonl")
  return sum(1 for line in open(path) if line.strip()) if os.path.exists(path) else 0


@pytest.mark.slow  # a few minutes: CI runs it (python -m pytest -m slow)
def test_random_kills_then_rerun_equal_an_uninterrupted_run(tmp_path):
  ref = str(tmp_path / "ref")
  t0 = time.time()
  p = subprocess.run(_cmd(ref), cwd=ROOT, env=_env(), capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  duration = time.time() - t0

  out = str(tmp_path / "killed")
  rng = random.Random(20261201)
  kills, finished_at = 0, {}   # cell -> attempts count when first seen finished
  while kills < KILLS:
    proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    # Each attempt is killed either at a random moment of its start (importing, compiling,
    # restoring: 0.3 to 3 s after launch, or at its first new step record at the latest)
    # or after a random number (1 to 12) of new step records, plus a few milliseconds
    # (mid-step, mid-evaluation or mid-save): at most ~15 of the 480 steps go by per
    # attempt, so all 10 kills land before the study could finish.
    start = _progress(out)
    wanted = rng.choice([0, rng.randint(1, 12), rng.randint(1, 12)])
    deadline = time.time() + (rng.uniform(0.3, 3.0) if wanted == 0 else 600)
    while proc.poll() is None and time.time() < deadline and (
        _progress(out) - start < max(wanted, 1)):
      time.sleep(0.002)
    time.sleep(rng.uniform(0.0, 0.005))
    assert proc.poll() is None, "the study finished before it was killed 10 times"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kills += 1
    for cell in _cells(out):
      if os.path.exists(os.path.join(out, "cells", cell, "done.json")):
        finished_at.setdefault(cell, _attempts(out, cell))
  assert kills == KILLS
  p = subprocess.run(_cmd(out), cwd=ROOT, env=_env(), capture_output=True, text=True,
                     timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]

  assert _comparable(out) == _comparable(ref)
  for cell in _cells(ref):
    done = [json.load(open(os.path.join(d, "cells", cell, "done.json"))) for d in (ref, out)]
    assert done[0]["fingerprint"] == done[1]["fingerprint"], cell
  # A finished cell is never started again: its attempt count froze when it finished.
  for cell, n in finished_at.items():
    assert _attempts(out, cell) == n, cell
  resumed = sum(1 for cell in _cells(out)
                for line in open(os.path.join(out, "cells", cell, "attempts.jsonl"))
                if json.loads(line)["event"] == "resume")
  assert resumed >= 1  # at least one kill landed after a checkpoint: a real resume
