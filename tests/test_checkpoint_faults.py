"""precision.checkpoint under hostile paths, planted links, future formats and disk faults.

Each test is one fault class of issue 27: glob characters in the path (Orbax reads paths
as patterns), manifest names and links that point outside the directory (sentinel files
outside must be neither read nor written), files of a newer format, steps without
checksums, and write errors (ENOSPC / EACCES / EROFS / EIO) during a save or its rotation.
"""

import builtins
import errno
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import precision as mp
import precision.optim  # noqa: F401
from precision import checkpoint
from precision.checkpoint import _files
from precision.checkpoint import _integrity
from precision.checkpoint import _orbax
from _asserts import bit_identical

RECIPE = mp.get_recipe("bf16_master")
TX = mp.optim.build_optimizer(RECIPE, optax.adam(1e-2), seed=1)
MODEL = {"d": 4}


def _state(step):
  params = RECIPE.policy.cast_to_param(
      {"w": jax.random.normal(jax.random.key(step), (4, 3)), "b": jnp.full((3,), float(step))})
  opt = TX.init(params)
  updates, opt = TX.update(jax.tree.map(lambda x: jnp.full_like(x, 0.1), params), opt, params)
  return checkpoint.TrainState(mp.optim.apply_updates(params, updates), opt, {},
                               jax.random.key_data(jax.random.key(step)))


def _target():
  return _state(0)


@pytest.fixture(scope="module")
def states():
  return {1: _state(1), 2: _state(2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, states):
  d = tmp_path_factory.mktemp("faults") / "ckpt"
  with checkpoint.Checkpointer(d) as ckpt:
    for s in (1, 2):
      ckpt.save(s, states[s], recipe=RECIPE, model_config=MODEL, seed=0)
  return d


def _copy(src, dst):
  shutil.copytree(src, dst, symlinks=True)
  return dst


def _save(d, step, state, keep=3):
  checkpoint.save(d, step, state, recipe=RECIPE, model_config=MODEL, seed=0, keep=keep)


def _restore(d, **kw):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = checkpoint.restore(d, _target(), **kw)
  return r, [str(w.message) for w in caught if issubclass(w.category, checkpoint.CheckpointWarning)]


def _rewrite_manifest(step_dir, change):
  """Applies change(manifest) and re-signs it, as someone editing it on purpose would."""
  path = os.path.join(step_dir, _integrity.MANIFEST)
  m = json.load(open(path))
  change(m)
  body = {k: v for k, v in m.items() if k != "sha256"}
  m["sha256"] = _files.json_digest(body)
  with open(path, "w") as f:
    json.dump(m, f)


def _rewrite_meta(step_dir, change):
  """Edits the step's metadata and updates its entry in the manifest to match."""
  path = os.path.join(step_dir, "meta", "metadata")
  meta = json.load(open(path))
  change(meta)
  with open(path, "w") as f:
    json.dump(meta, f)

  def fix(m):
    m["files"]["meta/metadata"] = {"bytes": os.path.getsize(path),
                                   "sha256": _integrity.file_digest(path)}
  _rewrite_manifest(step_dir, fix)


class _Opens:
  """Records the file each os.open / open() call actually opened (by its fd) while active."""

  def __init__(self, monkeypatch):
    self.paths = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(*a, **k):
      fd = real_os_open(*a, **k)
      self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
      return fd

    def py_open(*a, **k):
      f = real_open(*a, **k)
      if hasattr(f, "fileno"):
        self.paths.append(os.readlink(f"/proc/self/fd/{f.fileno()}"))
      return f

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)

  def touched(self, folder):
    folder = os.path.realpath(folder)
    return [p for p in self.paths if p.startswith(folder + os.sep)]


# ------------------------------------------------------------------ 1. glob characters


@pytest.mark.parametrize("component", ["lr[3e-3]", "a*b", "q?x", "sp ace", "[x] *?y"])
def test_glob_characters_in_the_path_round_trip_bit_exact(tmp_path, states, component):
  d = tmp_path / component / "ck[1]"
  with checkpoint.Checkpointer(d, keep=1) as ckpt:
    ckpt.save(1, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    ckpt.save(2, states[2], recipe=RECIPE, model_config=MODEL, seed=0)  # rotates 1 away
    assert ckpt.steps() == [2]
  r, warned = _restore(d)
  assert r.step == 2 and r.verified and bit_identical(r.state, states[2]) and not warned
  r = checkpoint.restore(d, _target(), step=2)
  assert bit_identical(r.state, states[2])


def test_a_save_that_cannot_be_read_back_fails_before_rotation(tmp_path, states, monkeypatch):
  d = tmp_path / "c"
  _save(d, 1, states[1], keep=1)
  real = _orbax.item_tree

  def lossy(path, what):  # what Orbax returned for a glob path: leaves missing
    tree = real(path, what)
    tree["opt_state"] = {}
    return tree

  monkeypatch.setattr(_orbax, "item_tree", lossy)
  with pytest.raises(checkpoint.CheckpointError, match=r"step 2 \(just written\): the save "
                     r"cannot be read back \(array 'opt_state/.*is not in both"):
    _save(d, 2, states[2], keep=1)
  monkeypatch.undo()
  assert checkpoint.Checkpointer(d).steps() == [1]
  assert not [n for n in os.listdir(d) if n.startswith(".")]
  assert bit_identical(checkpoint.restore(d, _target()).state, states[1])


# ------------------------------------------------------------------ 2. outside the directory


@pytest.mark.parametrize("name", ["../../../sentinel", "ABS", "state/../../sentinel",
                                  "./meta/metadata", ""])
def test_manifest_names_outside_the_step_are_never_opened(saved, states, tmp_path,
                                                          monkeypatch, name):
  outside = tmp_path / "outside"
  outside.mkdir()
  sentinel = outside / "sentinel"
  sentinel.write_bytes(b"secret")
  d = _copy(saved, tmp_path / "a" / "b" / "c")
  entry = str(sentinel) if name == "ABS" else name
  _rewrite_manifest(d / "2", lambda m: m["files"].__setitem__(
      entry, {"bytes": 6, "sha256": _integrity.file_digest(sentinel)}))
  opens = _Opens(monkeypatch)
  r, warned = _restore(d)
  assert r.step == 1 and bit_identical(r.state, states[1])
  assert "lists a file outside the step" in warned[0]
  assert not opens.touched(outside)


def test_linked_step_folder_and_linked_files_are_not_followed(saved, states, tmp_path,
                                                              monkeypatch):
  outside = tmp_path / "outside"
  shutil.copytree(saved / "2", outside / "2")
  d = _copy(saved, tmp_path / "c")
  os.symlink(outside / "2", d / "3")                      # a step folder linking elsewhere
  opens = _Opens(monkeypatch)
  r, warned = _restore(d)
  assert r.step == 2 and "'3' is not a checkpoint (a symbolic link" in warned[0]
  with pytest.raises(ValueError, match="folder '3' \\(a symbolic link"):
    checkpoint.restore(d, _target(), step=3)
  # A file inside a step replaced by a link to an identical copy outside: damage.
  os.remove(d / "2" / "meta" / "metadata")
  os.symlink(outside / "2" / "meta" / "metadata", d / "2" / "meta" / "metadata")
  r, warned = _restore(d)
  assert r.step == 1 and "'meta/metadata' is, or lies under, a symbolic link" in warned[0]
  os.remove(d / "1" / "integrity.json")                   # a linked manifest
  os.symlink(outside / "2" / "integrity.json", d / "1" / "integrity.json")
  with pytest.raises(checkpoint.CheckpointDamagedError, match="step 1 is damaged: its "
                     "integrity.json cannot be read"):
    checkpoint.restore(d, _target(), step=1)
  assert not opens.touched(outside)


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_planted_lock_is_refused_and_its_target_untouched(saved, states, tmp_path, kind):
  sentinel = tmp_path / "victim"
  sentinel.write_bytes(b"precious")
  d = _copy(saved, tmp_path / "c")
  os.remove(d / "precision.lock")
  (os.symlink if kind == "symlink" else os.link)(sentinel, d / "precision.lock")
  with pytest.raises(checkpoint.CheckpointLockedError, match="precision.lock: it is "
                     + ("a symbolic link" if kind == "symlink" else "a file with 2 hard links")):
    _save(d, 3, states[1])
  assert sentinel.read_bytes() == b"precious"


def test_run_record_temp_names_are_random_and_never_written_through(saved, states, tmp_path):
  sentinel = tmp_path / "victim"
  sentinel.write_bytes(b"precious")
  d = _copy(saved, tmp_path / "c")
  for name in (f"precision_run.json.tmp-{os.getpid()}", ".precision_run.json.tmp-"):
    os.symlink(sentinel, d / name)  # the old predictable name, and the new prefix
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    ckpt.adopt(recipe=RECIPE, model_config=MODEL, seed=0, reason="rewrite the record")
  assert sentinel.read_bytes() == b"precious"
  assert not os.path.islink(d / "precision_run.json")
  assert not os.path.lexists(d / ".precision_run.json.tmp-")  # removed by the writer
  # A run record that is a link is refused, not followed.
  shutil.move(d / "precision_run.json", tmp_path / "record.json")
  os.symlink(tmp_path / "record.json", d / "precision_run.json")
  with pytest.raises(checkpoint.CheckpointDamagedError, match="symbolic link, never followed"):
    checkpoint.Checkpointer(d).run_record()


# ------------------------------------------------------------------ 3. formats


def test_every_file_written_carries_its_format_and_version(saved):
  with checkpoint.Checkpointer(saved) as ckpt:
    ckpt.acquire()
    files = [saved / "2" / "integrity.json", saved / "2" / "meta" / "metadata",
             saved / "precision_run.json", saved / "precision.lock"]
    for path in files:
      d = json.loads(open(path).read())
      assert isinstance(d["format"], int) and d["precision_version"] == mp.__version__, path


def test_newer_formats_are_refused_in_one_line(saved, tmp_path):
  newer = "written by a newer version of precision \\(9.9\\); this one \\(.*\\) reads formats <= "
  d = _copy(saved, tmp_path / "m")
  _rewrite_manifest(d / "2", lambda m: m.update(format=99, precision_version="9.9"))
  with pytest.raises(checkpoint.CheckpointFormatError, match="integrity.json has format 99, "
                     + newer + "1"):
    checkpoint.restore(d, _target())  # no silent fallback to an older step
  d = _copy(saved, tmp_path / "meta")
  _rewrite_meta(d / "2", lambda m: m.update(format=3, precision_version="9.9"))
  with pytest.raises(checkpoint.CheckpointFormatError, match="metadata has format 3, "
                     + newer + "2"):
    checkpoint.restore(d, _target())
  d = _copy(saved, tmp_path / "rec")
  rec = json.load(open(d / "precision_run.json"))
  rec.update(format=2, precision_version="9.9")
  json.dump(rec, open(d / "precision_run.json", "w"))
  with pytest.raises(checkpoint.CheckpointFormatError, match="run record .* has format 2, "
                     + newer + "1"):
    _save(d, 3, _state(3))
  d = _copy(saved, tmp_path / "recipe")
  _rewrite_meta(d / "2", lambda m: m["recipe"].update(sparsity="2:4"))
  with pytest.raises(checkpoint.CheckpointFormatError) as e:
    checkpoint.restore(d, _target())
  assert "unknown field(s) sparsity" in str(e.value) and "\n" not in str(e.value)


def test_step_made_to_look_unverified_restores_only_when_asked(saved, states, tmp_path):
  d = _copy(saved, tmp_path / "c")
  os.remove(d / "2" / "integrity.json")
  (d / "2" / "_CHECKPOINT_METADATA").write_text("{}")
  meta = json.load(open(d / "2" / "meta" / "metadata"))
  meta["format"] = 1
  json.dump(meta, open(d / "2" / "meta" / "metadata", "w"))
  assert checkpoint.Checkpointer(d).steps() == [1, 2]
  r, warned = _restore(d)
  assert r.step == 1 and "step 2 carries no checksums" in warned[0]
  with pytest.raises(checkpoint.CheckpointDamagedError, match="allow_unverified=True"):
    checkpoint.restore(d, _target(), step=2)
  r, warned = _restore(d, allow_unverified=True)
  assert r.step == 2 and not r.verified and bit_identical(r.state, states[2])
  assert any("restored unverified" in w for w in warned)


# ------------------------------------------------------------------ 6. disk faults


def _only_on(real, pred, err):
  def fn(*a, **k):
    if pred(*a):
      raise OSError(err, os.strerror(err), os.fspath(a[-1]) if a else None)
    return real(*a, **k)
  return fn


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_write_errors_at_the_first_save_are_one_line(tmp_path, states, monkeypatch, err):
  d = tmp_path / "c"
  real = _orbax.save_item
  monkeypatch.setattr(_orbax, "save_item", lambda path, tree: (_ for _ in ()).throw(
      OSError(err, os.strerror(err), os.fspath(path))))
  with pytest.raises(checkpoint.CheckpointWriteError) as e:
    _save(d, 1, states[1])
  msg = str(e.value)
  assert "\n" not in msg and errno.errorcode[err] in msg and str(d) in msg, msg
  assert e.value.errno == err and "no earlier step exists" in msg
  assert not [n for n in os.listdir(d) if n.startswith(".tmp")]
  monkeypatch.setattr(_orbax, "save_item", real)
  # As TensorStore reports it: a ValueError holding the system's message.
  import orbax.checkpoint as ocp
  monkeypatch.setattr(ocp.Checkpointer, "save", lambda self, path, args: (_ for _ in ()).throw(
      ValueError(f"UNKNOWN: Error writing local file \"{path}/d/x\": {os.strerror(err)} "
                 "[tensorstore_spec='{...}']")))
  with pytest.raises(checkpoint.CheckpointWriteError, match=errno.errorcode[err] + ".*/state"):
    _save(d, 1, states[1])
  monkeypatch.undo()
  monkeypatch.setattr(os, "mkdir", _only_on(os.mkdir, lambda p, *a: ".tmp-" in os.fspath(p), err))
  with pytest.raises(checkpoint.CheckpointWriteError, match=errno.errorcode[err]):
    _save(d, 1, states[1])


def test_a_failed_rotation_keeps_the_new_step_and_says_so(tmp_path, states, monkeypatch):
  d = tmp_path / "c"
  _save(d, 1, states[1], keep=1)
  monkeypatch.setattr(os, "rename", _only_on(os.rename, lambda s, t: ".del-" in os.fspath(t),
                                             errno.EACCES))
  with pytest.raises(checkpoint.CheckpointWriteError, match="step 2 is saved, but removing old "
                     "step 1 failed: Permission denied \\(EACCES\\) at .*/1"):
    _save(d, 2, states[2], keep=1)
  monkeypatch.undo()
  r, _ = _restore(d)
  assert r.step == 2 and bit_identical(r.state, states[2])


def _eio(fd):
  raise OSError(errno.EIO, "I/O error")


def test_keep_1_deletes_the_only_good_step_only_after_the_new_one_is_durable(
    tmp_path, states, monkeypatch):
  d = tmp_path / "c"
  _save(d, 1, states[1], keep=1)
  events = []
  real_fsync, real_rename = os.fsync, os.rename
  monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(
      f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])
  monkeypatch.setattr(os, "rename", lambda s, t: (events.append(("rename", os.fspath(s),
                                                                 os.fspath(t))),
                                                  real_rename(s, t))[1])
  _save(d, 2, states[2], keep=1)
  monkeypatch.undo()
  deleted = next(i for i, e in enumerate(events) if e[0] == "rename" and ".del-1-" in e[2])
  synced = {e[1] for e in events[:deleted] if e[0] == "fsync"}
  tmp = next(e[1] for e in events if e[0] == "rename" and e[2] == str(d / "2"))
  files = [os.path.join(root, f) for root, _, fs in os.walk(d / "2") for f in fs]
  assert files and all(f.replace(str(d / "2"), tmp) in synced for f in files)
  assert str(d) in synced  # the rename of the new step itself is durable
  # An fsync failing (EIO) while the new step is written leaves the only good step; at the
  # lock (the first thing a writer writes) it is one line too.
  monkeypatch.setattr(os, "fsync", _eio)
  with pytest.raises(checkpoint.CheckpointWriteError, match="the writer lock cannot be written: "
                     "I/O error \\(EIO\\)"):
    _save(d, 3, states[1], keep=1)
  with checkpoint.Checkpointer(d, keep=1) as ckpt:
    monkeypatch.undo()
    ckpt.acquire()
    monkeypatch.setattr(os, "fsync", _eio)
    with pytest.raises(checkpoint.CheckpointWriteError, match="EIO.*the last good step 2 is "
                       "intact"):
      ckpt.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    monkeypatch.undo()
  assert checkpoint.Checkpointer(d).steps() == [2]


def test_a_vanished_directory_stops_the_writer(tmp_path, states):
  d = tmp_path / "c"
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.save(1, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    shutil.rmtree(d)
    with pytest.raises(checkpoint.CheckpointError, match="vanished while this writer held"):
      ckpt.save(2, states[2], recipe=RECIPE, model_config=MODEL, seed=0)
    assert not d.exists()
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.save(1, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    os.rename(d, tmp_path / "moved")
    d.mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="was replaced by another folder"):
      ckpt.save(2, states[2], recipe=RECIPE, model_config=MODEL, seed=0)
    assert os.listdir(d) == []


def test_a_directory_reached_through_a_link_still_works(tmp_path, states):
  """Only links inside the directory are refused: the directory itself (or a parent) may
  be a link, as /tmp is on some systems or a run folder linked to a larger disk."""
  real = tmp_path / "disk" / "run"
  real.mkdir(parents=True)
  os.symlink(tmp_path / "disk", tmp_path / "linked")
  d = tmp_path / "linked" / "run"
  _save(d, 1, states[1])
  _save(d, 2, states[2])
  r, warned = _restore(d)
  assert r.step == 2 and bit_identical(r.state, states[2]) and not warned
  assert checkpoint.Checkpointer(real).steps() == [1, 2]


# ------------------------------------------------------------------ 7. optional HMAC

KEY = b"0123456789abcdef-secret"


def test_signed_steps_restore_only_with_their_key_and_unchanged(tmp_path, states):
  d = tmp_path / "c"
  checkpoint.save(d, 1, states[1], recipe=RECIPE, model_config=MODEL, seed=0, key=KEY)
  checkpoint.save(d, 2, states[2], recipe=RECIPE, model_config=MODEL, seed=0, key=KEY)
  r, warned = _restore(d, key=KEY)
  assert r.step == 2 and r.authenticated and bit_identical(r.state, states[2]) and not warned
  r, _ = _restore(d)  # without a key: the digests as before
  assert r.step == 2 and not r.authenticated
  # Step 2's metadata edited and its manifest re-digested by someone without the key:
  # the digests accept it, the HMAC does not.
  _rewrite_meta(d / "2", lambda m: m["data"].__setitem__("step", 7) if m.get("data")
                else m.update(extra={"forged": True}))
  assert _restore(d)[0].step == 2
  r, warned = _restore(d, key=KEY)
  assert r.step == 1 and "step 2 fails its HMAC" in warned[0]
  with pytest.raises(checkpoint.CheckpointAuthenticityError, match="signed with another key"):
    checkpoint.restore(d, _target(), step=1, key=b"another key of 16+ bytes")
  unsigned = tmp_path / "u"
  _save(unsigned, 1, states[1])
  with pytest.raises(checkpoint.CheckpointAuthenticityError, match="is not signed"):
    checkpoint.restore(unsigned, _target(), step=1, key=KEY)
  with pytest.raises(ValueError, match="key of type bytes and 5 bytes; accepted: None, or "
                     "bytes / str of at least 16 bytes"):
    checkpoint.Checkpointer(d, key=b"short")
