"""python -m experiments.train meets a failing environment (issue 40): a disk that fills at
the first save, at a save with --keep 1, or under the --out log, and an unreadable newest
checkpoint step, each end in one line (no traceback, no Orbax log), nothing lost: the
last good step stays, and a resume once the disk is grown ends as an uninterrupted run.

The fast tests check the CLI's one line for each kind of fault; the slow ones train the
tiny GPT (about 15 s a run) on a tmpfs that is full, then grown.
"""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import pytest

import _tmpfs

from experiments import train as train_cli
from experiments import trainlib
from precision import checkpoint
from test_checkpoint_unreadable import _lock_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--model", "tiny", "--steps", "4", "--batch", "2", "--seq", "16", "--lr", "3e-3",
        "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--save-every", "2"]


def _run(capsys, argv):
  try:
    summary = train_cli.main(BASE + argv)
    code = 0
  except SystemExit as e:
    summary, code = None, e.code
  out, err = capsys.readouterr()
  return code, summary, [l for l in err.strip().splitlines() if l]


# ------------------------------------------------------------------ fast: the one line


def _raising(monkeypatch, exc):
  def train(cfg):
    raise exc
  monkeypatch.setattr(trainlib, "train", train)


@pytest.mark.parametrize("exc, words", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/mnt/run/ckpt/x"),
     "No space left on device (ENOSPC) at /mnt/run/ckpt/x; free space there, then rerun "
     "with --resume-or-start"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/mnt/run/ckpt"),
     "Permission denied (EACCES) at /mnt/run/ckpt; give this user permission there"),
    (MemoryError(), "out of host memory (MemoryError)"),
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                "allocate 8589934592 bytes.\nBufferAssignment ..."),
     "out of device memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
     "8589934592 bytes.)"),
    (checkpoint.CheckpointWriteError("Checkpoint /c step 2: the save failed: No space left "
                                     "on device (ENOSPC) at /c/.tmp-2/state"),
     "Checkpoint /c step 2: the save failed: No space left on device (ENOSPC)"),
])
def test_a_fault_of_the_machine_is_one_line(capsys, monkeypatch, tmp_path, exc, words):
  _raising(monkeypatch, exc)
  code, _, err = _run(capsys, ["--ckpt-dir", str(tmp_path / "c")])
  assert code == 1 and len(err) == 1, err
  assert err[0].startswith("python -m experiments.train: error: ") and words in err[0], err


def test_debug_adds_the_traceback(capsys, monkeypatch, tmp_path):
  _raising(monkeypatch, OSError(errno.EIO, os.strerror(errno.EIO), "/x"))
  code, _, err = _run(capsys, ["--debug"])
  assert code == 1 and err[0] == "Traceback (most recent call last):"
  assert err[-1] == ("python -m experiments.train: error: Input/output error (EIO) at /x; "
                     "fix it, then rerun")


def test_other_errors_still_raise(capsys, monkeypatch):
  _raising(monkeypatch, jax.errors.JaxRuntimeError("INVALID_ARGUMENT: a bug"))
  with pytest.raises(jax.errors.JaxRuntimeError):
    train_cli.main(BASE)


# ------------------------------------------------------------------ slow: a real full disk


@pytest.fixture()
def fs(tmp_path):
  path = _tmpfs.mount(str(tmp_path / "fs"), 16384)
  yield path
  subprocess.run(["umount", "-l", path], check=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  d = tmp_path_factory.mktemp("ref")
  return train_cli.main(BASE + ["--ckpt-dir", str(d / "c")])


def _no_orbax_errors_logged(caplog):
  noisy = [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname
           and r.levelno >= logging.ERROR]
  assert not noisy, noisy[0].getMessage()[:500]


@pytest.mark.slow  # trains the tiny GPT once
def test_no_room_for_the_first_save(capsys, caplog, fs):
  _tmpfs.remount(fs, 600)   # the run record fits, the first step (~1.3 MB) does not
  d = os.path.join(fs, "c")
  code, _, err = _run(capsys, ["--ckpt-dir", d])
  assert code == 1 and len(err) == 1, err
  assert f"Checkpoint {d} step 2: the save failed: No space left on device (ENOSPC) at " \
         f"{d}/.tmp-2-" in err[0] and "no earlier step exists" in err[0], err
  _no_orbax_errors_logged(caplog)
  assert sorted(os.listdir(d)) == ["precision.lock", "precision_run.json"]


@pytest.mark.slow  # trains the tiny GPT three times
def test_a_full_disk_at_a_save_with_keep_1_keeps_the_last_step_and_resumes(
    capsys, caplog, fs, uninterrupted):
  d = os.path.join(fs, "c")
  code, _, _ = _run(capsys, ["--ckpt-dir", d, "--keep", "1", "--stop-after", "2"])
  assert code == 0
  _tmpfs.remount(fs, _tmpfs.used_kb(fs) + 600)   # room for half a step: step 4's save fails
  code, _, err = _run(capsys, ["--ckpt-dir", d, "--keep", "1", "--resume"])
  assert code == 1 and len(err) == 1, err
  assert f"Checkpoint {d} step 4: the save failed: No space left on device (ENOSPC)" in err[0]
  assert "the last good step 2 is intact and nothing was deleted" in err[0], err
  _no_orbax_errors_logged(caplog)
  assert checkpoint.Checkpointer(d).steps() == [2]
  _tmpfs.remount(fs, 16384)
  code, summary, err = _run(capsys, ["--ckpt-dir", d, "--keep", "1", "--resume"])
  assert code == 0, err
  assert summary["fingerprint"] == uninterrupted["fingerprint"]
  assert summary["final_loss"] == uninterrupted["final_loss"]


@pytest.mark.slow  # trains the tiny GPT once
def test_a_full_disk_under_the_out_log(capsys, fs):
  _tmpfs.remount(fs, 4)
  with open(os.path.join(fs, "ballast"), "wb") as f:
    f.write(b"\0" * 4096)      # the tmpfs is full; --out still opens (an empty file)
  log = os.path.join(fs, "log.jsonl")
  code, _, err = _run(capsys, ["--out", log])
  assert code == 1 and len(err) == 1, err
  assert err[0] == (f"python -m experiments.train: error: --out {log}: writing the record "
                    "of step 1 failed: No space left on device (ENOSPC); fix it, then rerun")


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
  """A run stopped after step 4 of 6 with checkpoints at 2 and 4."""
  d = tmp_path_factory.mktemp("two") / "c"
  train_cli.main(BASE[:2] + ["--steps", "6"] + BASE[4:] + ["--ckpt-dir", str(d),
                                                           "--stop-after", "4"])
  return str(d)


@pytest.mark.slow  # trains the tiny GPT once
def test_an_unreadable_newest_step_resumes_the_newest_readable(capsys, monkeypatch,
                                                               two_steps, tmp_path):
  d = str(tmp_path / "c")
  shutil.copytree(two_steps, d)
  _lock_out(monkeypatch, os.path.join(d, "4"))   # chmod 000, as a process without DAC
  with pytest.warns(checkpoint.CheckpointFallbackWarning, match="restored step 2"):
    code, summary, err = _run(capsys, ["--steps", "6", "--ckpt-dir", d, "--resume"])
  assert code == 0 and not err, err
  assert summary["start_step"] == 2
  assert [s.split(" folder ")[1] for s in summary["skipped_checkpoints"]] == [
      "'4' is not a checkpoint (cannot be read: Permission denied (EACCES))"]


@pytest.mark.slow  # a subprocess without DAC capabilities trains the tiny GPT
def test_chmod_000_on_the_newest_step_for_real(two_steps, tmp_path):
  capsh = shutil.which("capsh")
  if capsh is None or os.geteuid() != 0:
    pytest.skip("needs root and capsh (to drop cap_dac_override, cap_dac_read_search: "
                "root reads a chmod 000 folder otherwise)")
  d = str(tmp_path / "c")
  shutil.copytree(two_steps, d)
  os.chmod(os.path.join(d, "4"), 0)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  argv = BASE[:2] + ["--steps", "6"] + BASE[4:] + ["--ckpt-dir", d, "--resume"]
  cmd = " ".join([sys.executable, "-m", "experiments.train", *argv])
  try:
    p = subprocess.run([capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
                        cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  finally:
    for name in os.listdir(d):   # "4", or the name a save moved it aside to
      if name.endswith("4") or name.startswith(".old-4-"):
        os.chmod(os.path.join(d, name), 0o755)
  err = [l for l in p.stderr.splitlines() if l.strip()]
  assert p.returncode == 0, p.stderr[-3000:]
  assert len(err) == 1 and "cannot be read: Permission denied (EACCES)" in err[0], err
  assert json.loads(p.stdout.strip().splitlines()[-1])["start_step"] == 2


# ------------------------------------------------------------------ experiments.sweep


@pytest.mark.parametrize("exc, words", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/o/summary.md"),
     "error: sweep stopped, writing its files in OUT failed at /o/summary.md: No space left "
     "on device (ENOSPC); every finished cell is kept; fix it, then rerun the same command"),
    (MemoryError(), "error: sweep stopped: out of host memory (MemoryError)"),
])
def test_the_sweep_ends_a_fault_in_one_line(capsys, monkeypatch, exc, words):
  from experiments import sweep
  def run_sweep(*a, **k):
    raise exc
  monkeypatch.setattr(sweep, "run_sweep", run_sweep)
  assert sweep.main(["--quick", "--out", "OUT"]) == 1
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith(words), err


def test_the_sweep_passes_the_studys_line_on(capsys, monkeypatch):
  from experiments import sweep
  from precision import study
  from precision.study import _faults
  fault = _faults.fault("fp32__s0", "saving its checkpoint of step 10", "/o/gpt/cells/x",
                        OSError(errno.EIO, os.strerror(errno.EIO)))
  monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: (_ for _ in ()).throw(fault))
  assert sweep.main(["--quick", "--debug"]) == 1
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert err[0] == "Traceback (most recent call last):"
  assert err[-1] == f"error: {fault}" and isinstance(fault, study.StudyEnvironmentError)
  assert "cell fp32__s0: saving its checkpoint of step 10 failed at /o/gpt/cells/x: " \
         "Input/output error (EIO)" in err[-1]
