"""precision.checkpoint integrity and ownership: damaged steps are named and passed over,
folders that are not complete saves are never read, one writer per directory, one run per
directory, failed saves leave the last good step intact.

`damage_matrix` is the fault sweep behind test_every_damaged_file_falls_back; run it
alone to print the table:
  PYTHONPATH=. python -c "import sys; sys.path.insert(0, 'tests'); \
import test_checkpoint_integrity as t; t.print_damage_table()"
"""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import precision as mp
import precision.optim  # noqa: F401
from precision import checkpoint
from _asserts import bit_identical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = mp.get_recipe("bf16_master")
TX = mp.optim.build_optimizer(RECIPE, optax.adamw(1e-2), seed=3)
MODEL = {"d": 8}
DATA = {1: {"seed": 0, "step": 1}, 2: {"seed": 0, "step": 2}}


def _state(step):
  """A bf16_master state whose every leaf depends on `step` (params, master, moments)."""
  k = jax.random.key(step)
  p32 = {"w": jax.random.normal(k, (8, 4), jnp.float32), "b": jnp.full((4,), step, jnp.float32)}
  params = RECIPE.policy.cast_to_param(p32)
  opt = TX.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1 * step), params)
  updates, opt = TX.update(grads, opt, params)
  params = mp.optim.apply_updates(params, updates)
  return checkpoint.TrainState(params, opt, {}, jax.random.key_data(jax.random.key(step)))


def _target():
  params = RECIPE.policy.cast_to_param({"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))})
  return checkpoint.TrainState(params, TX.init(params), {},
                               jax.random.key_data(jax.random.key(0)))


@pytest.fixture(scope="module")
def states():
  return {1: _state(1), 2: _state(2)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, states):
  """A directory with intact steps 1 and 2 (copied by each test before it damages it)."""
  d = tmp_path_factory.mktemp("saved") / "ckpt"
  with checkpoint.Checkpointer(d) as ckpt:
    for step in (1, 2):
      ckpt.save(step, states[step], recipe=RECIPE, model_config=MODEL, seed=0,
                data=DATA[step])
  return d


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _files(step_dir):
  return sorted(os.path.relpath(os.path.join(r, f), step_dir)
                for r, _, fs in os.walk(step_dir) for f in fs)


def _flip(path, where):
  b = bytearray(open(path, "rb").read())
  b[where(len(b))] ^= 0x01
  open(path, "wb").write(bytes(b))


DAMAGE = {
    "flip one byte (middle)": lambda p: _flip(p, lambda n: n // 2),
    "flip one byte (last)": lambda p: _flip(p, lambda n: n - 1),
    "truncate to half": lambda p: os.truncate(p, os.path.getsize(p) // 2),
    "empty the file": lambda p: os.truncate(p, 0),
    "delete the file": os.remove,
    "append a byte": lambda p: open(p, "ab").write(b"\0"),
}


def _restore(d, **kw):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    r = checkpoint.restore(d, _target(), model_config=MODEL, **kw)
  return r, [str(w.message) for w in caught
             if issubclass(w.category, checkpoint.CheckpointFallbackWarning)]


def damage_matrix(saved_dir, states, work):
  """Every file of the newest step x every damage kind: (kind, file, outcome) rows."""
  rows = []
  for kind, damage in DAMAGE.items():
    for rel in _files(os.path.join(saved_dir, "2")):
      d = _copy(saved_dir, os.path.join(work, f"case{len(rows)}"))
      damage(os.path.join(d, "2", rel))
      try:
        r, warned = _restore(d)
      except Exception as e:  # pylint: disable=broad-except
        rows.append((kind, rel, f"raised {type(e).__name__}: {str(e)[:120]}"))
        continue
      named = bool(warned) and ("step 2 is damaged" in warned[0] or "folder '2' is not a "
                                "checkpoint" in warned[0]) and (
          rel in warned[0] or "integrity.json" in warned[0])
      if (r.step == 1 and named and len(r.skipped) == 1 and r.data == DATA[1]
          and bit_identical(r.state, states[1])):
        rows.append((kind, rel, "fell back to step 1, damaged file named"))
      else:
        rows.append((kind, rel, f"restored step {r.step}, warnings {warned}"))
      shutil.rmtree(d)
  return rows


def print_damage_table():
  with tempfile.TemporaryDirectory() as tmp:
    st = {1: _state(1), 2: _state(2)}
    d = os.path.join(tmp, "ckpt")
    with checkpoint.Checkpointer(d) as ckpt:
      for step in (1, 2):
        ckpt.save(step, st[step], recipe=RECIPE, model_config=MODEL, seed=0, data=DATA[step])
    rows = damage_matrix(d, st, tmp)
  counts = collections.Counter((k, o) for k, _, o in rows)
  print(f"{len(rows)} cases over {len({f for _, f, _ in rows})} files of the newest step")
  for (kind, outcome), n in sorted(counts.items()):
    print(f"| {kind} | {n} | {outcome} |")


def test_every_damaged_file_falls_back(saved, states, tmp_path):
  """Each damage kind on each file of the newest step: named, and the previous step is
  restored exactly (params, master, moments, counters, data position)."""
  rows = damage_matrix(saved, states, tmp_path)
  bad = [row for row in rows if row[2] != "fell back to step 1, damaged file named"]
  assert not bad, bad
  assert len(rows) >= 6 * 10


def test_intact_directory_restores_newest_exactly(saved, states):
  r, warned = _restore(saved)
  assert r.step == 2 and r.verified and r.skipped == () and not warned
  assert bit_identical(r.state, states[2]) and r.data == DATA[2] and r.seed == 0 and r.run_id


def test_damaged_explicit_step_and_no_intact_step_raise(saved, tmp_path):
  d = _copy(saved, tmp_path / "c")
  meta = d / "2" / "meta" / "metadata"
  meta.write_text(meta.read_text().replace('"step": 2', '"step": 3'))  # an edited position
  with pytest.raises(checkpoint.CheckpointDamagedError,
                     match=r"step 2 is damaged: file meta/metadata has changed"):
    checkpoint.restore(d, _target(), step=2)
  os.remove(d / "1" / "integrity.json")
  (d / "1" / "integrity.json").write_text("{}")
  with pytest.raises(checkpoint.CheckpointDamagedError, match=r"No intact checkpoint.*"
                     r"step 2 is damaged.*step 1 is damaged: its integrity.json does not match"):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", checkpoint.CheckpointFallbackWarning)
      checkpoint.restore(d, _target())


def test_restored_arrays_are_checked_too(saved, states, tmp_path):
  """A step whose files pass but whose restored bytes differ from the saved ones (here: the
  array checksum of one leaf changed, the manifest re-signed) is damaged too."""
  import hashlib
  d = _copy(saved, tmp_path / "c")
  path = d / "2" / "integrity.json"
  m = json.loads(path.read_text())
  leaf = sorted(m["arrays"])[0]
  m["arrays"][leaf]["sha256"] = "0" * 64
  body = {k: v for k, v in m.items() if k != "sha256"}
  m["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
  path.write_text(json.dumps(m))
  r, warned = _restore(d)
  assert r.step == 1 and bit_identical(r.state, states[1])
  assert f"array '{leaf}' restored with other bytes" in warned[0]


def test_typed_key_digests_cover_the_key_data_and_its_impl(tmp_path):
  """A typed PRNG key leaf is checked like every array: its digest covers its key data and
  its dtype (the impl), and a restored key whose data differs is damaged."""
  import hashlib
  from precision.checkpoint import _integrity

  key = jax.random.key(3)
  entry = _integrity.array_digests({"k": key})["k"]
  assert {k: entry[k] for k in ("dtype", "shape", "key_impl")} == {
      "dtype": "key<fry>", "shape": [], "key_impl": "threefry2x32"}
  data = jax.random.key_data(key)
  assert entry["sha256"] != _integrity.array_digest(data)          # not the bare uint32
  assert entry["sha256"] == _integrity.array_digest(jax.random.wrap_key_data(data))
  assert entry["sha256"] != _integrity.array_digest(jax.random.key(4))
  rbg = jax.random.key(3, impl="rbg")
  assert _integrity.array_digests({"k": rbg})["k"]["key_impl"] == "rbg"

  state = _state(1)._replace(rng=key)
  checkpoint.save(tmp_path, 1, state, recipe=RECIPE, model_config=MODEL)
  path = tmp_path / "1" / "integrity.json"
  m = json.loads(path.read_text())
  m["arrays"]["rng"]["sha256"] = _integrity.array_digest(jax.random.key(4))
  body = {k: v for k, v in m.items() if k != "sha256"}
  m["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
  path.write_text(json.dumps(m))
  with pytest.raises(checkpoint.CheckpointDamagedError,
                     match="array 'rng' restored with other bytes"):
    checkpoint.restore(tmp_path, _target()._replace(rng=jax.random.key(0)), step=1)


def test_partial_empty_and_stray_folders_are_never_checkpoints(saved, tmp_path):
  d = _copy(saved, tmp_path / "c")
  (d / "5").mkdir()                                          # empty
  (d / "6").mkdir()
  (d / "6" / "junk.txt").write_text("x")                     # stray content
  (d / "7").write_text("a file")                             # a file with a step name
  (d / "008").mkdir()                                        # not a step name we write
  shutil.copytree(d / "2" / "state", d / "9" / "state")      # arrays without a manifest
  (d / ".tmp-10-0123abcd").mkdir()                           # an unfinished save
  (d / "11.orbax-checkpoint-tmp-1700000000").mkdir()         # Orbax's unfinished save
  ckpt = checkpoint.Checkpointer(d)
  assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
  problems = " ".join(ckpt.problems())
  for name in ("'5' (empty)", "'6' (no integrity.json", "'7' (a file", "'008'", "'9' (no"):
    assert name in problems
  r, warned = _restore(d)  # step 2, each newer non-checkpoint folder reported
  assert r.step == 2 and len(warned) == len(r.skipped) == 5
  assert all("is not a checkpoint" in w and "restored step 2" in w for w in warned)
  with pytest.raises(ValueError, match=r"step=5 has no checkpoint.*folder '5' \(empty\)"):
    checkpoint.restore(d, _target(), step=5)
  # Only such folders: nothing to restore, each one named.
  for name in ("1", "2"):
    shutil.rmtree(d / name)
  with pytest.raises(checkpoint.NoCheckpointError,
                     match=r"No complete checkpoint.*'5' \(empty\).*'\.tmp-10-0123abcd' "
                           r"\(an unfinished save\)"):
    checkpoint.restore(d, _target())


def test_missing_directory_is_reported_and_not_created(tmp_path):
  missing = tmp_path / "nothing" / "here"
  with pytest.raises(checkpoint.NoCheckpointError, match="the directory does not exist"):
    checkpoint.restore(missing, _target())
  assert checkpoint.Checkpointer(missing).steps() == []
  with pytest.raises(FileNotFoundError):
    checkpoint.Checkpointer(missing).metadata()
  assert not missing.exists() and not missing.parent.exists()


def test_failed_save_leaves_the_last_good_step(saved, states, tmp_path, monkeypatch):
  d = _copy(saved, tmp_path / "c")
  from precision.checkpoint import _integrity

  def boom(*a, **k):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(_integrity, "write_manifest", boom)
  with checkpoint.Checkpointer(d) as ckpt:
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left.*ENOSPC"):
      ckpt.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    with pytest.raises(OSError, match="No space left"):  # replacing step 2: it survives
      ckpt.save(2, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
  assert sorted(os.listdir(d)) == ["1", "2", "precision.lock", "precision_run.json"]
  r, warned = _restore(d)
  assert r.step == 2 and bit_identical(r.state, states[2]) and not warned


def test_replaced_step_moved_aside_is_put_back(saved, states, tmp_path):
  """A writer killed between moving the old step aside and renaming the new one in: the
  next writer puts the old step back, and removes the unfinished save."""
  d = _copy(saved, tmp_path / "c")
  os.rename(d / "2", d / ".old-2-0123abcd")
  shutil.copytree(d / "1", d / ".tmp-2-89abcdef")
  assert checkpoint.Checkpointer(d).steps() == [1]
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.acquire()
    assert ckpt.cleaned == [".tmp-2-89abcdef"]
  assert sorted(os.listdir(d)) == ["1", "2", "precision.lock", "precision_run.json"]
  r, _ = _restore(d)
  assert r.step == 2 and bit_identical(r.state, states[2])


def test_keep_and_abandoned_future(saved, states, tmp_path):
  """keep=2 drops the oldest; saving step 1 again drops the newer step 2 (the abandoned
  future of a run resumed from step 1)."""
  d = _copy(saved, tmp_path / "c")
  with checkpoint.Checkpointer(d, keep=2) as ckpt:
    ckpt.save(3, states[2], recipe=RECIPE, model_config=MODEL, seed=0)
    assert ckpt.steps() == [2, 3]
    ckpt.save(2, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
    assert ckpt.steps() == [2]
  r, _ = _restore(d)
  assert r.step == 2 and bit_identical(r.state, states[1])
  assert not [n for n in os.listdir(d) if n.startswith(".")]


# ------------------------------------------------------------------ ownership and lock


def test_directory_belongs_to_one_run(saved, states, tmp_path):
  d = _copy(saved, tmp_path / "c")
  record = checkpoint.Checkpointer(d).run_record()
  assert record.recipe == RECIPE and record.seed == 0 and record.model_config == MODEL
  cases = [(dict(recipe=RECIPE, model_config=MODEL, seed=1),
            r"belongs to run .* seed: the directory's run uses 0, this one 1"),
           (dict(recipe=mp.get_recipe("fp32"), model_config=MODEL, seed=0),
            r"recipe: the directory's run uses 'bf16_master', this one 'fp32'"),
           (dict(recipe=RECIPE.replace(rounding="stochastic"), model_config=MODEL, seed=0),
            r"recipe 'bf16_master' field rounding: the directory's run has 'nearest'"),
           (dict(recipe=RECIPE, model_config={"d": 9}, seed=0),
            r"model config field 'd': the directory's run 8, this one 9")]
  for kw, match in cases:
    with checkpoint.Checkpointer(d) as ckpt:
      with pytest.raises(checkpoint.CheckpointOwnershipError, match=match):
        ckpt.save(3, states[1], **kw)
  assert checkpoint.Checkpointer(d).steps() == [1, 2]
  # An explicit adoption (after a deliberate conversion) makes the new run the owner.
  with checkpoint.Checkpointer(d) as ckpt:
    ckpt.adopt(recipe=RECIPE, model_config=MODEL, seed=1, reason="test: new seed")
    ckpt.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=1)
  record2 = checkpoint.Checkpointer(d).run_record()
  assert record2.seed == 1 and record2.run_id == record.run_id
  assert record2.history[0]["seed"] == 0 and record2.history[0]["reason"] == "test: new seed"
  # A damaged record is reported, never silently replaced.
  rec = d / "precision_run.json"
  rec.write_text(rec.read_text().replace('"seed": 1', '"seed": 2'))
  with checkpoint.Checkpointer(d) as ckpt:
    with pytest.raises(checkpoint.CheckpointDamagedError, match="precision_run.json is damaged"):
      ckpt.save(4, states[1], recipe=RECIPE, model_config=MODEL, seed=2)


def test_second_writer_is_refused_in_process(saved, states, tmp_path):
  d = _copy(saved, tmp_path / "c")
  first, second = checkpoint.Checkpointer(d), checkpoint.Checkpointer(d)
  first.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
  with pytest.raises(checkpoint.CheckpointLockedError,
                     match=rf"being written by another process \(pid {os.getpid()} on host"):
    second.save(4, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
  assert checkpoint.Checkpointer(d).steps() == [1, 2, 3]
  first.close()
  second.save(4, states[2], recipe=RECIPE, model_config=MODEL, seed=0)
  second.close()
  assert checkpoint.Checkpointer(d).steps() == [2, 3, 4]


_HOLDER = r"""
import sys, time
from precision import checkpoint
ckpt = checkpoint.Checkpointer(sys.argv[1])
ckpt.acquire()
open(sys.argv[2], "w").close()
time.sleep(600)
"""


def test_lock_of_a_live_process_refuses_and_of_a_killed_one_is_taken_over(saved, tmp_path):
  d = _copy(saved, tmp_path / "c")
  sentinel = tmp_path / "locked"
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d), str(sentinel)], env=env,
                           stderr=subprocess.PIPE)
  try:
    deadline = time.time() + 120
    while not sentinel.exists() and child.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    assert sentinel.exists(), child.stderr.read()[-2000:]
    with pytest.raises(checkpoint.CheckpointLockedError, match=rf"pid {child.pid} on host"):
      checkpoint.Checkpointer(d).acquire()
  finally:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
  ckpt = checkpoint.Checkpointer(d)
  with pytest.warns(checkpoint.CheckpointWarning,
                    match=rf"took over the writer lock of pid {child.pid} .*ended without "
                          "releasing it"):
    ckpt.acquire()
  ckpt.close()
  assert open(d / "precision.lock").read() == ""  # released: no holder recorded


# ------------------------------------------------------------------ earlier format


def _write_format1(directory, step, state, recipe, model_config, data):
  """A step as earlier versions wrote it: an Orbax CheckpointManager with a 'state' and a
  'meta' item, no checksums."""
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=3, create=True,
                                         enable_async_checkpointing=False)
  handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
  mgr = ocp.CheckpointManager(os.fspath(directory), options=options, item_handlers=handlers)
  recipe_dict = {k: v for k, v in recipe.to_dict().items() if k != "schema"}
  meta = {"format": 1, "step": step, "recipe": recipe_dict, "model_config": model_config,
          "data": data, "extra": None}
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         meta=ocp.args.JsonSave(meta)), force=True)
  mgr.wait_until_finished()
  mgr.close()


def test_checkpoints_of_the_earlier_format_still_restore(states, tmp_path):
  d = tmp_path / "old"
  _write_format1(d, 1, states[1], RECIPE, MODEL, DATA[1])
  _write_format1(d, 2, states[2], RECIPE, MODEL, DATA[2])
  assert checkpoint.Checkpointer(d).steps() == [1, 2]
  # Steps without checksums are restored only when asked, and with a warning.
  with pytest.raises(checkpoint.CheckpointDamagedError, match="step 2 carries no checksums.*"
                     "step 1 carries no checksums.*allow_unverified=True"):
    _restore(d)
  with pytest.warns(checkpoint.CheckpointUnverifiedWarning, match="step 2 carries no checksums"):
    checkpoint.restore(d, _target(), allow_unverified=True)
  r, warned = _restore(d, allow_unverified=True)
  assert r.step == 2 and not r.verified and bit_identical(r.state, states[2]) and not warned
  # Damage Orbax notices is passed over like any other.
  big = max((os.path.join(root, f) for root, _, fs in os.walk(d / "2" / "state") for f in fs),
            key=os.path.getsize)
  os.truncate(big, 10)
  r, warned = _restore(d, allow_unverified=True)
  assert r.step == 1 and bit_identical(r.state, states[1])
  assert "step 2: Orbax cannot read" in warned[0]
  # Such a directory is claimed only by the run its newest step belongs to.
  with checkpoint.Checkpointer(d) as ckpt:
    with pytest.raises(checkpoint.CheckpointOwnershipError, match="holds the checkpoints of "
                       "another run .*this one 'fp32'"):
      ckpt.claim(recipe=mp.get_recipe("fp32"), model_config=MODEL)
    ckpt.save(3, states[1], recipe=RECIPE, model_config=MODEL, seed=0)
  assert checkpoint.Checkpointer(d).steps() == [1, 2, 3]


def test_failed_orbax_reads_leave_no_event_loop_noise(tmp_path, capfd, monkeypatch):
  """An Orbax read that fails (a truncated data file of an unverified step) raises one
  error; none of its other TensorStore reads report into a closed event loop afterwards
  ("RuntimeError: Event loop is closed", "Exception ignored in <coroutine>"). Without the
  drain, 10 such failures print both dozens of times on this machine."""
  arrays = {f"p{i}": jax.random.normal(jax.random.key(i), (32, 32)) for i in range(20)}
  state = checkpoint.TrainState(arrays, {}, {}, jnp.zeros((2,), jnp.uint32))
  _write_format1(tmp_path, 1, state, mp.get_recipe("fp32"), None, None)
  data = tmp_path / "1" / "state" / "ocdbt.process_0" / "d"
  os.truncate(max(data.iterdir(), key=os.path.getsize), 50)
  import threading
  late = []  # what would print after the error: unraisable and thread exceptions
  monkeypatch.setattr(sys, "unraisablehook", lambda u: late.append(repr(u.exc_value)))
  monkeypatch.setattr(threading, "excepthook", lambda a: late.append(repr(a.exc_value)))
  capfd.readouterr()
  for _ in range(10):
    with pytest.raises(checkpoint.CheckpointDamagedError, match="Orbax cannot read the arrays"):
      checkpoint.restore(tmp_path, state, step=1, allow_unverified=True)
  time.sleep(0.5)  # late reports would arrive from TensorStore's threads
  import gc
  gc.collect()
  noise = capfd.readouterr().err
  assert not late, late[:5]
  assert "Event loop is closed" not in noise and "Exception ignored" not in noise, noise[-2000:]
