"""A reader restoring in a loop beside a writer that rotates its steps away (keep=1).

An evaluator process reading a trainer's checkpoint directory is normal. Each restore
must give the newest complete step, bit for bit the state saved as that step, or, before
the first save, NoCheckpointError: never a FileNotFoundError or a CheckpointError about a
step that was merely deleted by the writer's rotation while it was being read.
"""

import threading
import time

import jax.numpy as jnp
import optax
import pytest

import precision as mp
from precision import checkpoint
from precision.checkpoint import _orbax
from _asserts import bit_identical

RECIPE = mp.get_recipe("fp32")
TX = mp.optim.build_optimizer(RECIPE, optax.sgd(0.1))


def _state(step: int) -> checkpoint.TrainState:
  params = {"w": jnp.full((4, 3), float(step), jnp.float32)}
  return checkpoint.TrainState(params, TX.init(params), {}, jnp.zeros((2,), jnp.uint32))


def test_reader_beside_a_rotating_writer(tmp_path):
  d = tmp_path / "ckpt"
  states = {s: _state(s) for s in range(1, 101)}
  reads = 8  # the writer saves until the reader has restored this many times
  done = threading.Event()
  failures, restored = [], []

  def write():
    try:
      with checkpoint.Checkpointer(d, keep=1) as ckpt:
        for s, state in states.items():
          ckpt.save(s, state, recipe=RECIPE)
          if len(restored) >= reads and s >= 3:
            break
    except BaseException as e:  # pylint: disable=broad-except  (reported by the test)
      failures.append(e)
    finally:
      done.set()

  writer = threading.Thread(target=write)
  writer.start()
  target, last = _state(0), 0
  deadline = time.monotonic() + 120
  while not done.is_set() and time.monotonic() < deadline:
    try:
      r = checkpoint.restore(d, target)
    except checkpoint.NoCheckpointError as e:
      # Only before the first step is complete: afterwards one step is always on disk.
      assert last == 0, f"after step {last}: {e}"
      continue
    assert r.step >= last and not r.skipped, (r.step, last, r.skipped)
    assert bit_identical(r.state, states[r.step]), f"step {r.step} restored wrong"
    last = r.step
    restored.append(r.step)
  writer.join()
  assert not failures, failures
  assert done.is_set() and len(restored) >= reads, restored
  final = checkpoint.restore(d, target)
  assert final.step >= 3 and bit_identical(final.state, states[final.step])


def _rotate_while_reading(monkeypatch, writer, step, state):
  """The first array read of a restore saves `step` first (keep=1: the step being read
  is rotated away, or replaced when it is the same step), then reads on."""
  original, calls = _orbax.restore_item, []

  def restore_item(*args, **kwargs):
    if not calls:
      writer.save(step, state, recipe=RECIPE)
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(_orbax, "restore_item", restore_item)
  return calls


@pytest.mark.parametrize("new_step", [2, 1])  # 2: rotated away; 1: replaced in place
def test_a_step_rotated_away_while_read_gives_the_newest(tmp_path, monkeypatch, new_step):
  new = _state(7)
  with checkpoint.Checkpointer(tmp_path / "ckpt", keep=1) as writer:
    writer.save(1, _state(1), recipe=RECIPE)
    calls = _rotate_while_reading(monkeypatch, writer, new_step, new)
    r = checkpoint.restore(tmp_path / "ckpt", _state(0))
  assert len(calls) == 2 and r.step == new_step and not r.skipped
  assert bit_identical(r.state, new)


def test_an_explicit_step_rotated_away_while_read_is_one_error(tmp_path, monkeypatch):
  with checkpoint.Checkpointer(tmp_path / "ckpt", keep=1) as writer:
    writer.save(1, _state(1), recipe=RECIPE)
    _rotate_while_reading(monkeypatch, writer, 2, _state(2))
    with pytest.raises(ValueError, match=r"step=1 of .* was deleted or replaced while it "
                                         "was being read"):
      checkpoint.restore(tmp_path / "ckpt", _state(0), step=1)
