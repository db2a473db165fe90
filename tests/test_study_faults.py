"""A study survives its environment (issue 40): a full disk, an I/O error, memory
exhausted or an unreadable cell folder stops the run with one line naming the cell, the
path and the cause, records nothing as the model's result, and the same command, rerun
once the fault is fixed, ends with the summary an uninterrupted run writes. An exception
of the user's own code is still a failed cell, listed in summary.md with its error.

The fast tests run the study in-process on tests/study_tasks/params_mlp.py (2 recipes x
2 seeds x 4 steps) with faults injected at the library's I/O and in the task's code. The
slow ones run `python -m precision.study` on a tmpfs that fills at a chosen point (the
first save, mid-grid, the report) and is then grown, and on a cell folder made
unreadable with chmod 000 by a process without DAC capabilities.
"""

import builtins
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _tmpfs

from precision import study
from precision.checkpoint import _orbax
from precision.study import _cells
from precision.study import _faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "study_tasks")
RECIPES = ["fp32", "bf16_mixed"]
TINY = dict(seeds=2, steps=4, eval_every=2, save_every=2, timing_rounds=0, progress=False)
CLI_ARGS = ["--recipes", "fp32,bf16_mixed", "--seeds", "2", "--steps", "8", "--eval-every",
            "4", "--save-every", "4", "--timing-rounds", "0", "--no-progress"]


@contextlib.contextmanager
def user_code():
  # The task files are written as users write them: JAX's default promotion rules.
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


class Switch:
  """A fault the test turns on and off (the environment failing, then fixed)."""

  def __init__(self):
    self.on = False


def faulty_task(batches_fault=None, evaluate_fault=None):
  """params_mlp's task with its own evaluate (the mean loss over 2 fixed batches), and
  faults raised from the user's code: `batches_fault` (exception, Switch) at seed 1's
  third batch, `evaluate_fault` (exception, Switch) at every evaluation."""
  base = study.load_task(os.path.join(TASKS, "params_mlp.py:task"))
  held = [jax.tree.map(jnp.asarray, b) for b, _ in zip(base.batches(99), range(2))]

  def batches(seed):
    for i, b in enumerate(base.batches(seed)):
      if batches_fault and batches_fault[1].on and seed == 1 and i == 2:
        raise batches_fault[0]
      yield b

  def evaluate(params):
    if evaluate_fault and evaluate_fault[1].on:
      raise evaluate_fault[0]
    return float(np.mean([float(base.loss(params, b)) for b in held]))

  return study.Task(init=base.init, loss=base.loss, batches=batches,
                    optimizer=base.optimizer, evaluate=evaluate, name="params-mlp")


def _run(out, task=None, **kw):
  with user_code():
    return study.run(task or faulty_task(), RECIPES, out=str(out), **{**TINY, **kw})


def comparable(out):
  """What two runs of one study must share: summary.json without its timing, every
  cell's step records without their step times, and every cell's outcome."""
  with open(os.path.join(out, "summary.json")) as f:
    summary = study.comparable(json.load(f))
  with open(os.path.join(out, "results.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  for r in records:
    r.pop("step_time_s", None)
    if "outcome" in r:
      r["outcome"] = study.comparable(r["outcome"])
  return summary, records


def _statuses(out):
  root = os.path.join(out, "cells")
  found = {}
  for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
    path = os.path.join(root, name, "done.json")
    if os.path.exists(path):
      with open(path) as f:
        found[name] = json.load(f)["status"]
  return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ref"))
  _run(out)
  assert set(_statuses(out).values()) == {"ok"}
  return comparable(out)


def _one_line(e):
  msg = str(e)
  assert "\n" not in msg, msg
  return msg


def test_an_eio_of_a_checkpoint_save_stops_the_run_and_the_rerun_ends_as_uninterrupted(
    reference, tmp_path, monkeypatch):
  out = str(tmp_path / "o")
  real, calls = _orbax.save_item, []

  def save_item(path, tree):
    calls.append(path)
    if len(calls) == 3:   # the third save of the grid (one per cell): mid-grid
      raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(path, "d", "x"))
    return real(path, tree)

  monkeypatch.setattr(_orbax, "save_item", save_item)
  with pytest.raises(study.StudyEnvironmentError) as e:
    _run(out)
  msg = _one_line(e.value)
  cell = "bf16_mixed__s0"
  assert f"cell {cell}" in msg and "(EIO)" in msg and "saving its checkpoint of step 2" in msg
  assert os.path.join(out, "cells", cell, "ckpt") in msg, msg
  assert e.value.errno == errno.EIO and e.value.cell == cell
  assert _statuses(out) == {"fp32__s0": "ok", "fp32__s1": "ok"}   # nothing for the cell
  monkeypatch.undo()
  _run(out)
  assert comparable(out) == reference


def test_memory_exhausted_in_the_users_code_is_no_result(reference, tmp_path):
  out = str(tmp_path / "o")
  host = Switch()
  task = faulty_task(batches_fault=(MemoryError(), host))
  host.on = True
  with pytest.raises(study.StudyEnvironmentError) as e:
    _run(out, task)
  msg = _one_line(e.value)
  assert "cell fp32__s1" in msg and "out of host memory (MemoryError)" in msg, msg
  assert _statuses(out) == {"fp32__s0": "ok"}
  host.on = False
  _run(out, task)
  assert comparable(out) == reference


@pytest.mark.slow  # two more runs of the grid
def test_a_device_out_of_memory_in_the_users_evaluate_is_no_result(reference, tmp_path):
  out = str(tmp_path / "o")
  device = Switch()
  oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                   "allocate 1073741824 bytes.")
  task = faulty_task(evaluate_fault=(oom, device))
  device.on = True
  with pytest.raises(study.StudyEnvironmentError) as e:
    _run(out, task)
  msg = _one_line(e.value)
  assert "cell fp32__s0" in msg and "out of device memory (RESOURCE_EXHAUSTED" in msg, msg
  assert not _statuses(out)
  device.on = False
  _run(out, task)
  assert comparable(out) == reference


def test_an_exception_of_the_users_code_is_a_failed_cell_listed_in_summary_md(
    reference, tmp_path):
  """A FileNotFoundError raised by the user's evaluate is the model's failure (an OSError
  of the user's code, not of the study's files); --retry-failed trains those cells again."""
  out = str(tmp_path / "o")
  broken = Switch()
  missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/val.npy")
  task = faulty_task(evaluate_fault=(missing, broken))
  broken.on = True
  result = _run(out, task)
  assert set(_statuses(out).values()) == {"failed"}
  assert result.rows["bf16_mixed"]["verdict_code"] == "failed"
  with open(os.path.join(out, "summary.md")) as f:
    md = f.read()
  assert "## Failed cells" in md
  for cell in ("fp32__s0", "fp32__s1", "bf16_mixed__s0", "bf16_mixed__s1"):
    assert f"- `{cell}` " in md and os.path.exists(os.path.join(out, "cells", cell,
                                                                   "error.txt"))
  listed = [l for l in md.splitlines() if l.startswith("- `")]
  assert len(listed) == 4 and all(l.endswith(
      "FileNotFoundError: [Errno 2] No such file or directory: '/data/val.npy'")
      for l in listed), listed
  broken.on = False
  _run(out, task)   # a rerun keeps finished cells, failed ones included
  assert set(_statuses(out).values()) == {"failed"}
  _run(out, task, retry_failed=True)
  assert comparable(out) == reference
  for kept in ("done.failed.json", "error.failed.txt"):
    assert os.path.exists(os.path.join(out, "cells", "fp32__s0", kept))
  assert not os.path.exists(os.path.join(out, "cells", "fp32__s0", "error.txt"))
  with open(os.path.join(out, "summary.md")) as f:
    assert "## Failed cells" not in f.read()


def test_an_unreadable_cell_folder_stops_the_run_and_is_continued_once_readable(
    reference, tmp_path, monkeypatch):
  out = str(tmp_path / "o")
  _run(out, seeds=2, shard="1/2")          # fp32__s0 and bf16_mixed__s0 finished
  assert _statuses(out) == {"bf16_mixed__s0": "ok", "fp32__s0": "ok"}
  locked = os.path.join(out, "cells", "bf16_mixed__s0")
  real_open = builtins.open

  def open_(file, *a, **k):   # what chmod 000 does to a process without DAC override
    if isinstance(file, str) and file.startswith(locked + os.sep):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), file)
    return real_open(file, *a, **k)

  monkeypatch.setattr(builtins, "open", open_)
  with pytest.raises(study.StudyEnvironmentError) as e:
    _run(out)
  msg = _one_line(e.value)
  assert "cell bf16_mixed__s0: reading done.json failed" in msg and "(EACCES)" in msg
  assert locked in msg and "read and write permission" in msg
  monkeypatch.undo()
  _run(out)
  assert comparable(out) == reference


@pytest.mark.slow  # two more runs of the grid
def test_a_failed_write_of_done_json_leaves_the_cell_unfinished(reference, tmp_path,
                                                                 monkeypatch):
  out = str(tmp_path / "o")
  real = _cells.write_atomic

  def write_atomic(path, text):
    if path.endswith(os.path.join("fp32__s1", "done.json")):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return real(path, text)

  monkeypatch.setattr(_cells, "write_atomic", write_atomic)
  with pytest.raises(study.StudyEnvironmentError, match=r"cell fp32__s1: writing done.json "
                     r"failed at .*fp32__s1/done.json: No space left on device \(ENOSPC\)"):
    _run(out)
  assert _statuses(out) == {"fp32__s0": "ok"}
  monkeypatch.undo()
  _run(out)
  assert comparable(out) == reference


@pytest.mark.parametrize("debug", [False, True])
def test_the_cli_ends_a_fault_outside_a_cell_in_one_line(tmp_path, monkeypatch, capsys,
                                                         debug):
  from precision.study import _cli
  out = str(tmp_path / "o")
  real = _cells.write_atomic

  def write_atomic(path, text):
    if path.endswith("study.json"):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return real(path, text)

  monkeypatch.setattr(_cells, "write_atomic", write_atomic)
  with user_code():
    code = _cli.main([os.path.join(TASKS, "params_mlp.py:task"), *CLI_ARGS, "--out", out]
                     + ["--debug"] * debug)
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert code == 1
  assert err[-1] == (f"error: study stopped, writing the study's files in {out} failed at "
                     f"{out}/study.json: Read-only file system (EROFS); every finished cell "
                     "is kept; make that filesystem writable, or use another --out, then "
                     "rerun the same command to continue")
  assert (err[0] == "Traceback (most recent call last):") if debug else len(err) == 1, err


def test_what_counts_as_the_environment():
  env = _faults.is_environment
  assert env(MemoryError())
  assert env(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
  assert not env(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad shapes"))
  for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
    assert env(OSError(code, os.strerror(code), "/data/x"))
  # The user's own OSErrors that are about their program, not the machine.
  assert not env(FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"))
  assert not env(PermissionError(errno.EACCES, "Permission denied", "/x"))
  assert not env(ValueError("bad batch"))


# ------------------------------------------------------------------ the CLI, on a tmpfs


def _cli(out, *extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, "-m", "precision.study", os.path.join(TASKS, "params_mlp.py:task"),
         *CLI_ARGS, "--out", out, *extra]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
  """The comparable parts of an uninterrupted CLI run."""
  out = str(tmp_path_factory.mktemp("cliref") / "o")
  p = _cli(out)
  assert p.returncode == 0, p.stderr[-3000:]
  return comparable(out)


@pytest.mark.slow  # three fills, each a failed run and a rerun of the CLI: ~1 min
@pytest.mark.parametrize("point", ["first_save", "mid_grid", "report"])
def test_a_disk_that_fills_then_grows_ends_as_an_uninterrupted_run(cli_reference, tmp_path,
                                                                   point):
  """The fill points are set by the room left: 16 KiB (the first cell's logs and run
  record, not its checkpoint); half a cell after the first slice of the grid ran; 8 KiB
  after every cell ran as two slices (not the report's results.jsonl)."""
  with _tmpfs.tmpfs(str(tmp_path / "fs"), 16 if point == "first_save" else 16384) as fs:
    out = os.path.join(fs, "o")
    if point != "first_save":
      for k in ("1/2", "2/2") if point == "report" else ("1/2",):
        assert _cli(out, "--shard", k).returncode == 0
      _tmpfs.remount(fs, _tmpfs.used_kb(fs) + (8 if point == "report" else 48))
    p = _cli(out)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(lines) == 1, p.stderr[-3000:]       # no Orbax log, no traceback
    assert lines[0].startswith("error: study stopped") and "(ENOSPC)" in lines[0], lines
    assert f" at {out}" in lines[0], lines
    statuses = _statuses(out)
    assert "failed" not in statuses.values(), statuses
    if point == "report":
      assert len(statuses) == 4 and "writing the study's files" in lines[0], lines
    elif point == "first_save":
      assert not statuses and "cell fp32__s0" in lines[0], lines
    else:
      assert len(statuses) == 2 and "cell fp32__s1" in lines[0], lines
    _tmpfs.remount(fs, 16384)
    p = _cli(out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert comparable(out) == cli_reference


@pytest.mark.slow  # two CLI runs in a process without DAC capabilities
def test_a_cell_folder_unreadable_for_real_stops_with_one_line(cli_reference, tmp_path):
  capsh = shutil.which("capsh")
  if capsh is None or os.geteuid() != 0:
    pytest.skip("needs root and capsh (to drop cap_dac_override, cap_dac_read_search: "
                "root reads a chmod 000 folder otherwise)")
  ref = cli_reference
  out = str(tmp_path / "o")
  p = _cli(out, "--shard", "1/2")
  assert p.returncode == 0, p.stderr[-3000:]
  locked = os.path.join(out, "cells", "bf16_mixed__s0")
  os.chmod(locked, 0)
  try:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    cmd = " ".join([sys.executable, "-m", "precision.study",
                    os.path.join(TASKS, "params_mlp.py:task"), *CLI_ARGS, "--out", out])
    p = subprocess.run([capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
                        cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  finally:
    os.chmod(locked, 0o755)
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  assert p.returncode == 1 and len(lines) == 1, p.stderr[-3000:]
  assert "cell bf16_mixed__s0" in lines[0] and "(EACCES)" in lines[0] and locked in lines[0]
  p = _cli(out)
  assert p.returncode == 0, p.stderr[-3000:]
  assert comparable(out) == ref
