"""An unreadable step is damage (issue 40): a step folder or a file of it that raises
PermissionError / OSError when scanned or read is named, passed over, and the newest
readable step restored; an unreadable directory is one line.

Root reads a chmod 000 folder anyway (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so the fast
tests inject the PermissionError at the calls the library reads through (os.listdir,
os.stat, os.open); the slow one makes the folder unreadable for real and restores in a
process whose DAC capabilities capsh dropped.
"""

import errno
import os
import shutil
import subprocess
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision import checkpoint
from _asserts import bit_identical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = mp.get_recipe("fp32")


def _state(step):
  w = jnp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3) + step)
  return checkpoint.TrainState({"w": w}, {"count": jnp.int32(step)}, {}, jnp.zeros((2,),
                                                                                 jnp.uint32))


@pytest.fixture()
def saved(tmp_path):
  d = str(tmp_path / "ckpt")
  with checkpoint.Checkpointer(d, keep=3) as ckpt:
    for s in (1, 2, 3):
      ckpt.save(s, _state(s), recipe=RECIPE, seed=0)
  return d


def _denied(path):
  return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))


def _lock_out(monkeypatch, inside, folder_too=True):
  """What chmod 000 on `inside` does to a process without DAC override: nothing under it
  can be listed, stat'ed or opened (and, with `folder_too`, it cannot be listed)."""
  def under(p):
    p = os.path.abspath(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else ""
    return p.startswith(inside + os.sep) or (folder_too and p == inside)

  for name in ("listdir", "scandir"):
    real = getattr(os, name)
    monkeypatch.setattr(os, name, lambda p=".", _r=real: (_ for _ in ()).throw(_denied(p))
                        if under(p) else _r(p))
  for name in ("stat", "lstat"):
    real = getattr(os, name)
    def fn(p, *a, _r=real, **k):
      if under(p) and os.path.abspath(os.fspath(p)) != inside:
        raise _denied(p)
      return _r(p, *a, **k)
    monkeypatch.setattr(os, name, fn)
  real_open = os.open
  monkeypatch.setattr(os, "open", lambda p, *a, **k: (_ for _ in ()).throw(_denied(p))
                      if under(p) else real_open(p, *a, **k))


def _restore(d):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = checkpoint.restore(d, _state(0))
  return r, [str(w.message) for w in caught
             if issubclass(w.category, checkpoint.CheckpointFallbackWarning)]


def test_an_unreadable_newest_step_folder_is_passed_over(saved, monkeypatch):
  _lock_out(monkeypatch, os.path.join(saved, "3"))
  r, warned = _restore(saved)
  assert r.step == 2 and bit_identical(r.state, _state(2))
  assert len(r.skipped) == 1 and "folder '3'" in r.skipped[0]
  assert "cannot be read: Permission denied (EACCES)" in r.skipped[0]
  assert warned and "restored step 2" in warned[0]
  assert checkpoint.Checkpointer(saved).steps() == [1, 2]
  assert any("'3' (cannot be read" in p for p in checkpoint.Checkpointer(saved).problems())


def test_a_step_folder_listed_but_not_entered_is_passed_over(saved, monkeypatch):
  # mode r-- (no x): the folder lists, but nothing in it can be stat'ed or opened.
  _lock_out(monkeypatch, os.path.join(saved, "3"), folder_too=False)
  r, _ = _restore(saved)
  assert r.step == 2 and "cannot be read: Permission denied (EACCES)" in r.skipped[0]


@pytest.mark.parametrize("rel", ["integrity.json", os.path.join("meta", "metadata")])
def test_an_unreadable_file_of_the_newest_step_is_damage(saved, monkeypatch, rel):
  _lock_out(monkeypatch, os.path.join(saved, "3", rel))
  r, warned = _restore(saved)
  assert r.step == 2 and bit_identical(r.state, _state(2))
  assert "step 3" in r.skipped[0] and "Permission denied" in r.skipped[0], r.skipped
  assert "trying step 2" in warned[0]


def test_every_step_unreadable_is_one_damaged_error(saved, monkeypatch):
  for s in ("1", "2", "3"):
    _lock_out(monkeypatch, os.path.join(saved, s, "integrity.json"))
  with pytest.raises(checkpoint.CheckpointDamagedError) as e:
    _restore(saved)
  assert "No intact checkpoint" in str(e.value) and str(e.value).count("Permission") == 3


def test_an_unreadable_directory_is_one_line(saved, monkeypatch):
  real = os.listdir
  monkeypatch.setattr(os, "listdir", lambda p=".": (_ for _ in ()).throw(_denied(p))
                      if os.fspath(p) == saved else real(p))
  with pytest.raises(checkpoint.CheckpointError) as e:
    checkpoint.restore(saved, _state(0))
  assert str(e.value) == (f"Checkpoint directory {saved} cannot be read: Permission denied "
                          "(EACCES)")


_RESTORE_SCRIPT = """
import sys, warnings
sys.path.insert(0, {tests!r})
import test_checkpoint_unreadable as t
from precision import checkpoint
warnings.simplefilter("ignore")
r = checkpoint.restore({d!r}, t._state(0))
print(r.step, t.bit_identical(r.state, t._state(r.step)), "|".join(r.skipped))
"""


@pytest.mark.slow  # a subprocess that imports JAX
@pytest.mark.parametrize("locked", ["3", os.path.join("3", "integrity.json")])
def test_chmod_000_for_real_without_dac_capabilities(saved, locked):
  capsh = shutil.which("capsh")
  if capsh is None or os.geteuid() != 0:
    pytest.skip("needs root and capsh (to drop cap_dac_override, cap_dac_read_search: "
                "root reads a chmod 000 folder otherwise)")
  path = os.path.join(saved, locked)
  os.chmod(path, 0)
  try:
    script = _RESTORE_SCRIPT.format(tests=os.path.join(ROOT, "tests"), d=saved)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c",
                        f"{sys.executable} -c \"$SCRIPT\""], env={**env, "SCRIPT": script},
                       capture_output=True, text=True, timeout=300)
  finally:
    os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
  assert p.returncode == 0, p.stderr[-3000:]
  step, same, skipped = p.stdout.strip().split(" ", 2)
  assert (step, same) == ("2", "True"), p.stdout
  assert "Permission denied" in skipped, skipped
