"""Killing `python -m precision.study` at random points and rerunning the same command
ends with the summary an uninterrupted run writes; finished cells are never rerun.

The task is tests/study_tasks/params_mlp.py (a param pytree). Each attempt is SIGKILLed
after a random delay (importing, compiling, training, evaluating or in the middle of a
checkpoint save alike); after at least 10 kills the command runs to its end.
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
          "--seeds", "2", "--steps", "60", "--eval-every", "10", "--save-every", "4",
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


def _attempts(out, cell):
  path = os.path.join(out, "cells", cell, "attempts.jsonl")
  return sum(1 for line in open(path) if line.strip()) if os.path.exists(path) else 0


@pytest.mark.slow  # ~1.5 min alone, 6 under load: CI runs it (python -m pytest -m slow)
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
  for _ in range(4 * KILLS):
    if kills == KILLS:
      break
    proc = subprocess.Popen(_cmd(out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
      proc.wait(timeout=rng.uniform(0.2, 1.0) * duration)
    except subprocess.TimeoutExpired:
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
