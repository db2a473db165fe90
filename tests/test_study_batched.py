"""Seed-batched cells (precision.study._batched): K seeds of a recipe in one compiled
program, on the task files written outside the package (tests/study_tasks/).

What is shown: a seed's numbers depend only on (recipe, seed, K, devices) - not on the
seeds that share its group, the shard that runs it or the study's seed count (groups are
padded to K); a batched group killed and rerun ends bit-exactly as an uninterrupted
one, with cells resumed from different checkpoints; a seed that diverges stops alone;
NNX, Linen and param-pytree models train batched under fp32, bf16, stochastic-rounding,
loss-scaled and fp8 recipes; a seeds="auto" study runs its rounds batched with the bits
and summary of one-seed cells, killed 10 times at random and rerun too; a failed cell is
retried in a group of its own with its group's numbers; a fault of the environment in a
group stops the run in one line and leaves its cell unfinished; and bad input (K below 1
or above the seeds or max_seeds, batches that cannot be stacked) is one ValueError (exit
2 from the CLI) that touches nothing saved. Measured and stated (printed, and asserted small): how far a
seed's numbers move with K (1, 4, 8) and with the seed axis sharded over 8 devices.
"""

import contextlib
import errno
import hashlib
import json
from unittest import mock
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precision import get_recipe
from precision import study
from precision.study import _batched
from precision.study import _cells
from precision.study import _models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(os.path.dirname(__file__), "study_tasks")
SMALL = dict(seeds=2, steps=6, eval_every=3, save_every=2, timing_rounds=0, progress=False)


@contextlib.contextmanager
def user_code():
  # The task files are written as users write them: JAX's default promotion rules.
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def task(name="params_mlp.py:task"):
  return study.load_task(os.path.join(TASKS, name))


def _run(t, out, recipes=("fp32", "bf16_mixed"), **kw):
  with user_code():
    return study.run(t, list(recipes), out=str(out), **{**SMALL, **kw})


def _fingerprints(out, recipes=("fp32", "bf16_mixed"), seeds=2, steps=6):
  return {c.name: _cells.read_done(str(out), c)["fingerprint"]
          for c in study.make_config(list(recipes), seeds, steps).grid()}


def _tree_digest(folder):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(folder)):
    for name in sorted(files):
      path = os.path.join(root, name)
      h.update(path.encode())
      h.update(open(path, "rb").read())
  return h.hexdigest()


def test_default_rule_and_identity():
  # On CPU (these tests' 8 forced host devices included): one program per cell. On an
  # accelerator one seed per local device (at most 8), one program per cell on one.
  assert _batched.default_seed_batch(20, 8)[:2] == (1, 1)
  with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    assert _batched.default_seed_batch(3, 1)[:2] == (1, 1)
    assert _batched.default_seed_batch(20, 8) == (8, 8, "vmap")
    assert _batched.default_seed_batch(2, 8)[:2] == (2, 2)
  # An explicit K: the most local devices that divide it; seeds sharing a forced CPU
  # device run in a loop inside the program; on a CPU of one device, the one-seed
  # executable on host threads.
  assert _batched.check_seed_batch(6, 8, 4) == (6, 3, "loop")
  assert _batched.check_seed_batch(8, 8, 1) == (8, 1, "threads")
  assert _batched.default_how("cpu") == "threads" and _batched.default_how("cpu", 2) == "loop"
  assert _batched.default_how("gpu") == "vmap"
  assert _batched.identity_items(_batched.SeedBatch(1, 1)) == {}  # one-seed: as before
  # Threads run one-seed cells' executable: their numbers, their identity.
  assert _batched.identity_items(_batched.SeedBatch(8, 1, "threads")) == {}
  assert _batched.identity_items(_batched.SeedBatch(2, 2)) == {
      "seed_batch": {"k": 2, "devices": 2}}
  assert _batched.identity_items(_batched.SeedBatch(4, 2, "vmap")) == {
      "seed_batch": {"k": 4, "devices": 2, "how": "vmap"}}


def test_a_seed_does_not_depend_on_its_group_or_shard(tmp_path):
  # Seed 0 trained beside seed 1 (whole run) and alone in a padded group (shard 1/2 of
  # a one-recipe grid holds fp32__s0 only): the same bits, K = 2 both times.
  t = task()
  ref = tmp_path / "whole"
  _run(t, ref, recipes=("fp32",), seed_batch=2)
  ident = json.load(open(ref / "study.json"))["identity"]
  assert ident["seed_batch"]["k"] == 2
  sharded = tmp_path / "sharded"
  assert _run(t, sharded, recipes=("fp32",), seed_batch=2, shard="1/2") is None
  _run(t, sharded, recipes=("fp32",), seed_batch=2, shard="2/2")
  assert (_fingerprints(sharded, ("fp32",)) == _fingerprints(ref, ("fp32",)))
  # A rerun without seed_batch continues with the study's own K (the identity matches).
  _run(t, ref, recipes=("fp32",))
  with pytest.raises(ValueError, match="another configuration.*seed_batch"):
    _run(t, ref, recipes=("fp32",), seed_batch=1)


def _unstackable_task():
  base = task()

  def batches(seed):
    rng = np.random.default_rng(seed)
    n = 16 + seed % 2  # another batch size per seed (held-out seeds are large numbers)
    while True:
      x = rng.standard_normal((n, 8)).astype(np.float32)
      yield {"x": x, "y": np.sin(x[:, :1]).astype(np.float32)}

  return study.Task(init=base.init, loss=base.loss, batches=batches,
                    optimizer=optax.adam(1e-2), name="ragged")


def test_bad_seed_batch_is_a_value_error_that_touches_nothing(tmp_path):
  t = task()
  for bad in (0, 3, True, 1.5):
    with pytest.raises(ValueError, match=f"seed_batch={bad!r}; accepted: an integer "
                       "from 1 to the seeds per recipe \\(2\\)"):
      _run(t, tmp_path / "a", seed_batch=bad)
  assert not (tmp_path / "a").exists()
  with pytest.raises(ValueError, match="seeds 0 and 1 cannot be stacked.*float32\\[16, 8\\]"
                     ".*float32\\[17, 8\\]"):
    _run(_unstackable_task(), tmp_path / "b", seed_batch=2)
  assert not (tmp_path / "b").exists()
  # One program per cell takes the same task (its batches are never stacked).
  _run(_unstackable_task(), tmp_path / "c", recipes=("fp32",), seed_batch=1, steps=1,
       eval_every=0)


def _cli_refuses(tmp_path, args, line):
  """`python -m precision.study` on the params MLP with `args` exits 2 with the one error
  line `line`, and writes no --out."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = tmp_path / "cli"
  p = subprocess.run([sys.executable, "-m", "precision.study",
                      os.path.join(TASKS, "params_mlp.py:task"), *args,
                      "--out", str(out), "--no-progress"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
  assert lines == [line], p.stderr[-2000:]
  assert not out.exists()


def test_cli_bad_seed_batch_exits_2_with_one_line(tmp_path):
  _cli_refuses(tmp_path, ["--seeds", "2", "--seed-batch", "0"],
               "error: seed_batch=0; accepted: an integer from 1 to the seeds per "
               "recipe (2), or None for the library's choice")


class _Interrupt(Exception):
  pass


@pytest.mark.parametrize("name,recipes", [
    ("nnx_mlp.py:task", ("bf16_mixed", "bf16_sr")),
    pytest.param("nnx_mlp.py:task", ("fp8_hybrid",), marks=pytest.mark.slow),
    pytest.param("params_mlp.py:task", ("fp32", "bf16_sr", "f16_mixed", "fp8_hybrid"),
                 marks=pytest.mark.slow),
    pytest.param("linen_cnn.py:make_task", ("bf16_master",), marks=pytest.mark.slow),
])
def test_threads_give_every_cell_its_one_seed_bits(tmp_path, name, recipes):
  # "threads" (a CPU's seed batching on one device) steps each seed with the group's one
  # compiled one-seed step: every record, evaluation, fingerprint and the memory column
  # are one-seed cells' bit for bit, stochastic rounding's seeded program included.
  t = task(name)
  cfg = study.make_config(list(recipes), 2, 4, eval_every=2, save_every=2)
  settings = _cells.CellSettings(4, 2, 2, 50, ())
  sb = _batched.SeedBatch(2, 1, "threads")
  for d in ("one", "threads"):
    os.makedirs(tmp_path / d)
  strip = lambda recs: [{k: v for k, v in r.items() if k != "step_time_s"} for r in recs]
  with user_code():
    for arm in (r for r in cfg.arms() if r[0] in recipes):
      cells = [c for c in cfg.grid() if c.arm == arm[0]]
      for c in cells:
        _cells.run_cell(t, c, settings, str(tmp_path / "one"))
      _batched.run_group(t, cells, settings, str(tmp_path / "threads"), sb)
      for c in cells:
        a, b = (_cells.read_done(str(tmp_path / d), c) for d in ("one", "threads"))
        assert a["status"] == b["status"] == "ok", (c.name, a.get("error"), b.get("error"))
        for key in ("fingerprint", "eval_curve", "final_loss", "step_memory_bytes",
                    "skipped_steps", "final_loss_scale"):
          assert a[key] == b[key], (c.name, key)
        assert strip(_cells.read_steps(str(tmp_path / "one"), c)) == strip(
            _cells.read_steps(str(tmp_path / "threads"), c))


@pytest.mark.slow
@pytest.mark.parametrize("sb", [_batched.SeedBatch(2, 2), _batched.SeedBatch(2, 1, "loop"),
                                _batched.SeedBatch(2, 1, "vmap"),
                                _batched.SeedBatch(2, 1, "threads")], ids=str)
def test_killed_group_resumes_bit_exactly(tmp_path, sb):
  # A group interrupted after 13 of its 2 x 10 steps (a KeyboardInterrupt, as a kill at
  # that point), one cell's newest checkpoint then removed (it resumes from an older one
  # than its neighbour's), and rerun: the same cells as an uninterrupted run of the same
  # program (one seed per device, both seeds looped on one, vmapped on one, or the
  # one-seed step on host threads).
  t = task()
  ref = tmp_path / "ref"
  out = tmp_path / "killed"
  cfg = study.make_config(["fp32", "bf16_mixed"], 2, 10, eval_every=5, save_every=2)
  cells = [c for c in cfg.grid() if c.arm == "bf16_mixed"]
  settings = _cells.CellSettings(10, 5, 2, 50, ())
  os.makedirs(ref)
  with user_code():
    _batched.run_group(t, cells, settings, str(ref), sb)
  assert all(_cells.read_done(str(ref), c)["status"] == "ok" for c in cells)
  seen = []

  def on_step(_):
    seen.append(1)
    if len(seen) == 13:
      raise KeyboardInterrupt
  os.makedirs(out)
  with user_code(), pytest.raises(KeyboardInterrupt):
    _batched.run_group(t, cells, settings, str(out), sb, on_step)
  assert all(_cells.read_done(str(out), c) is None for c in cells)
  ckpt_dir = os.path.join(_cells.cell_dir(str(out), cells[1]), "ckpt")
  steps = sorted((n for n in os.listdir(ckpt_dir) if n.isdigit()), key=int)
  assert steps == ["4", "6"], steps
  shutil.rmtree(os.path.join(ckpt_dir, steps[-1]))  # cell 1 resumes at 4, cell 0 at 6
  with user_code():
    _batched.run_group(t, cells, settings, str(out), sb)
  for c in cells:
    a, b = _cells.read_done(str(out), c), _cells.read_done(str(ref), c)
    assert a["fingerprint"] == b["fingerprint"], c.name
    assert a["eval_curve"] == b["eval_curve"]
    events = [r["event"] for r in _cells.read_jsonl(
        os.path.join(_cells.cell_dir(str(out), c), "attempts.jsonl"))]
    assert events == ["start", "resume"], events
  strip = lambda recs: [{k: v for k, v in r.items() if k != "step_time_s"} for r in recs]
  for c in cells:
    assert strip(_cells.read_steps(str(out), c)) == strip(_cells.read_steps(str(ref), c))


def _nan_task(bad_seed, from_step):
  base = task()

  def batches(seed):
    for i, b in enumerate(base.batches(seed)):
      if seed == bad_seed and i >= from_step:
        b = {**b, "x": np.full_like(b["x"], np.nan)}
      yield b

  return study.Task(init=base.init, loss=base.loss, batches=batches,
                    optimizer=base.optimizer, name="nan-seed")


@pytest.mark.slow
def test_a_diverging_seed_stops_alone(tmp_path):
  # Seed 1 gets NaN inputs from its 3rd batch: it stops as diverged after max_nonfinite
  # steps; seed 0, in the same program, ends with the bits of a run where seed 1 is sane.
  kw = dict(recipes=("fp32",), seed_batch=2, max_nonfinite=2, steps=8, eval_every=4)
  _run(_nan_task(1, 2), tmp_path / "nan", **kw)
  _run(task(), tmp_path / "ok", **kw)
  cfg = study.make_config(["fp32"], 2, 8)
  s0, s1 = cfg.grid()
  bad = _cells.read_done(str(tmp_path / "nan"), s1)
  assert bad["status"] == "diverged" and bad["steps_done"] == 4, bad
  assert "2 consecutive steps with non-finite gradients at step 4" in bad["error"]
  assert bad["nonfinite_steps"] == 2
  assert (_cells.read_done(str(tmp_path / "nan"), s0)["fingerprint"]
          == _cells.read_done(str(tmp_path / "ok"), s0)["fingerprint"])


@pytest.mark.slow
@pytest.mark.parametrize("name,recipes", [
    ("params_mlp.py:task", ("fp32", "bf16_sr", "f16_mixed", "fp8_hybrid")),
    ("nnx_mlp.py:task", ("fp32", "bf16_sr", "f16_mixed", "fp8_hybrid")),
    ("linen_cnn.py:make_task", ("fp32", "fp8_hybrid")),
])
def test_every_kind_and_recipe_trains_batched_close_to_one_seed_cells(tmp_path, name,
                                                                       recipes):
  # The stated difference of the final metric, K = 2 (sharded over 2 devices) against
  # one-seed cells, after 6 steps: printed; asserted below 1e-3 of the metric.
  t = task(name)
  one = _run(t, tmp_path / "one", recipes=recipes, seed_batch=1)
  two = _run(t, tmp_path / "two", recipes=recipes, seed_batch=2)
  cfg = study.make_config(list(recipes), 2, 6)
  worst = 0.0
  for c in cfg.grid():
    a, b = (_cells.read_done(str(d), c) for d in (tmp_path / "one", tmp_path / "two"))
    assert a["status"] == b["status"] == "ok", (c.name, a.get("error"), b.get("error"))
    assert a["steps_done"] == b["steps_done"] == 6
    assert a["skipped_steps"] == b["skipped_steps"]
    assert a["step_memory_bytes"] == b["step_memory_bytes"]  # one seed's step either way
    rel = abs(a["final_metric"] - b["final_metric"]) / abs(a["final_metric"])
    worst = max(worst, rel)
  print(f"\n{name}: final metric, K=2 on 2 devices vs one-seed cells: max relative "
        f"difference {worst:.2e} over {len(cfg.grid())} cells")
  assert worst < 1e-3
  assert set(one.rows) == set(two.rows)


def _train_k(t, recipe, k, steps, devices=1, how="loop"):
  """Per-seed (losses, final state) of seeds 0..k-1 trained by one K-seed program."""
  progs = [_models.build(t, recipe, s) for s in range(k)]
  state = _batched._stack([p.state for p in progs])  # pylint: disable=protected-access
  seeds = jnp.arange(k, dtype=jnp.uint32)
  active = jnp.ones((k,), bool)
  put, mesh = (lambda x: x), None
  if devices > 1:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.asarray(jax.devices()[:devices]), ("seed",))
    sh = NamedSharding(mesh, PartitionSpec("seed"))
    put = lambda x: jax.device_put(x, sh)
  # The core the study runs in each slot (the one-seed step's own trace; stochastic
  # rounding's traced with the seed an argument).
  _, core = _batched.one_seed_step(progs[0], progs[0].state, next(iter(t.batches(0))))
  step = _batched.batched_step(core, mesh, how)
  state, seeds, active = put(state), put(seeds), put(active)
  fn = jax.jit(step)
  its = [iter(t.batches(s)) for s in range(k)]
  losses = []
  for i in range(steps):
    b = put(_batched._stack([next(it) for it in its]))  # pylint: disable=protected-access
    state, m = fn(state, b, jnp.int32(i), seeds, active)
    losses.append(np.asarray(m["loss"]))
  return np.stack(losses, 1), state


def _train_one(t, recipe, seed, steps):
  p = _models.build(t, recipe, seed)
  state, it, losses = p.state, iter(t.batches(seed)), []
  for i in range(steps):
    state, m = p.step(state, next(it), jnp.int32(i))
    losses.append(np.asarray(m["loss"]))
  return np.asarray(losses), state


def _max_diff(a, b):
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
              if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)), default=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["params_mlp.py:task", "nnx_mlp.py:task"])
@pytest.mark.parametrize("recipe", ["fp32", "bf16_mixed"])
def test_how_far_a_seed_moves_with_k_and_sharding(name, recipe):
  # Seeds 0-3 after 6 steps: one-seed programs against the batched program at K = 1
  # (the one-seed step, its seed axis squeezed off), K = 4 and 8 on one device (looped,
  # the CPU default, and vmapped), K = 8 over 8 devices (one seed each) and K = 8 over 2
  # (4 per device, both ways). The figures are printed. Measured on XLA:CPU (AVX-512
  # without FP16): the one-per-device programs equal bits on these tasks, the looped one
  # on the params MLP and within 1.2e-7 on the NNX MLP; vmapped GEMMs and reductions
  # round in another order (up to 2.4e-7 in f32 params, 1.5e-5 with bf16 compute, after
  # 6 steps). Asserted below 1e-4 (the params' scale is ~0.3), equal bits being the
  # other honest outcome.
  t = task(name)
  r = get_recipe(recipe)
  steps, seeds = 6, 4
  with user_code():
    ones = [_train_one(t, r, s, steps) for s in range(seeds)]
    runs = {f"K={k} {how}": _train_k(t, r, k, steps, how=how)
            for k in (1, 4, 8) for how in (("loop",) if k == 1 else ("loop", "vmap"))}
    runs["K=8 on 8 devices"] = _train_k(t, r, 8, steps, devices=8)
    for how in ("loop", "vmap"):
      runs[f"K=8 on 2 devices {how}"] = _train_k(t, r, 8, steps, devices=2, how=how)
  lines = []
  for label, (losses, state) in runs.items():
    d_loss = max(float(np.max(np.abs(losses[s] - ones[s][0]))) for s in range(min(seeds,
                                                                                  len(losses))))
    d_param = max(_max_diff(jax.tree.map(lambda x: x[s], state), ones[s][1])
                  for s in range(min(seeds, losses.shape[0])))
    lines.append(f"{label}: max |loss diff| {d_loss:.2e}, max |state diff| {d_param:.2e}")
    assert d_loss < 1e-4 and d_param < 1e-4, (label, d_loss, d_param)
  print(f"\n{name} {recipe} vs one-seed programs, seeds 0-3, {steps} steps:\n  "
        + "\n  ".join(lines))


# ------------------------------------------------------------ with seeds="auto", retries

AUTO = dict(seeds="auto", max_seeds=3, margin=0.0004, steps=3, eval_every=3, save_every=3)


def _without_batching(summary):
  """summary.json less what names the batching (its identity's "seed_batch")."""
  if isinstance(summary, dict):
    return {k: _without_batching(v) for k, v in summary.items() if k != "seed_batch"}
  if isinstance(summary, list):
    return [_without_batching(v) for v in summary]
  return summary


def _done_fingerprints(out):
  cells = os.path.join(str(out), "cells")
  return {c: json.load(open(os.path.join(cells, c, "done.json")))["fingerprint"]
          for c in sorted(os.listdir(cells))}


def test_sequential_rounds_run_batched_with_one_seed_cells_numbers(tmp_path):
  # One round of 3 seeds (fp32, bf16_mixed and the floor arm): K = 2 groups them 2 + 1
  # (the second padded to 2). Each cell's bits are the one-seed cell's (the looped or
  # one-per-device step is bit-equal on this task), so the summaries are the same.
  t = task()
  one = _run(t, tmp_path / "one", seed_batch=1, **AUTO)
  two = _run(t, tmp_path / "two", seed_batch=2, **AUTO)
  ident = json.load(open(tmp_path / "two" / "study.json"))["identity"]
  assert ident["seed_batch"] == {"k": 2, "devices": 2}
  assert "seed_batch" not in json.load(open(tmp_path / "one" / "study.json"))["identity"]
  fp = _done_fingerprints(tmp_path / "one")
  assert sorted(fp) == sorted(f"{a}__s{i}" for a in ("bf16_mixed", "fp32", "fp32-floor")
                               for i in range(3))
  assert _done_fingerprints(tmp_path / "two") == fp
  from precision.study import _report
  assert (_without_batching(_report.comparable(two.summary))
          == _without_batching(_report.comparable(one.summary)))


def _broken_task(broken):
  """params_mlp whose seed 1 raises at its 3rd batch while `broken["on"]`."""
  base = task()

  def batches(seed):
    for i, b in enumerate(base.batches(seed)):
      if broken["on"] and seed == 1 and i == 2:
        raise RuntimeError("seed 1's data went missing")
      yield b

  return study.Task(init=base.init, loss=base.loss, batches=batches,
                    optimizer=base.optimizer, name="params_mlp")


def test_retry_failed_in_a_batched_group_gives_the_groups_numbers(tmp_path):
  # Seed 1 fails at its 3rd step inside a K = 2 group (seed 0 finishes beside it); the
  # retry trains it alone from its step-2 checkpoint in a group padded to 2: the cells
  # end with the bits of an uninterrupted K = 2 study, the failed record kept aside.
  broken = {"on": True}
  kw = dict(recipes=("fp32",), seed_batch=2)
  ref = tmp_path / "ref"
  broken["on"] = False
  _run(_broken_task(broken), ref, **kw)
  out = tmp_path / "out"
  broken["on"] = True
  assert _run(_broken_task(broken), out, **kw) is not None   # a finished (failed) study
  s1 = os.path.join(str(out), "cells", "fp32__s1")
  failed = json.load(open(os.path.join(s1, "done.json")))
  assert failed["status"] == "failed" and "seed 1's data went missing" in failed["error"]
  assert json.load(open(out / "cells" / "fp32__s0" / "done.json"))["status"] == "ok"
  broken["on"] = False
  _run(_broken_task(broken), out, **kw)    # a rerun keeps the failed cell
  assert json.load(open(os.path.join(s1, "done.json")))["status"] == "failed"
  _run(_broken_task(broken), out, retry_failed=True, **kw)
  assert _done_fingerprints(out) == _done_fingerprints(ref)
  assert os.path.exists(os.path.join(s1, "done.failed.json"))
  assert os.path.exists(os.path.join(s1, "error.failed.txt"))
  events = [(r["event"], r["step"]) for r in _cells.read_jsonl(
      os.path.join(s1, "attempts.jsonl"))]
  assert events == [("start", 0), ("resume", 2)], events


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed_batch=-1), r"seed_batch=-1; accepted: an integer from 1 to the seeds per "
     r"recipe \(2\)"),
    (dict(**{**AUTO, "max_seeds": 4}, seed_batch=5), r"seed_batch=5; accepted: an integer "
     r"from 1 to max_seeds \(4\), or None"),
    (dict(**AUTO, seed_batch=0), r"seed_batch=0; accepted: an integer from 1 to max_seeds "
     r"\(3\)"),
])
def test_bad_seed_batch_leaves_a_saved_study_as_it_was(tmp_path, kwargs, match):
  # A study exists in `out`; a rerun with a bad seed_batch is refused before anything
  # of it is read for writing: every file keeps its bytes.
  t = task()
  out = tmp_path / "s"
  first = {k: v for k, v in kwargs.items() if k != "seed_batch"}
  _run(t, out, recipes=("fp32",), **{**first, "steps": 2, "eval_every": 2,
                                     "save_every": 2})
  before = _tree_digest(out)
  with pytest.raises(ValueError, match=match):
    _run(t, out, recipes=("fp32",), **{**kwargs, "steps": 2, "eval_every": 2,
                                       "save_every": 2})
  assert _tree_digest(out) == before


def test_unstackable_batches_with_seeds_auto_touch_nothing(tmp_path):
  # The check covers every seed the budget may reach, before the first round.
  with pytest.raises(ValueError, match="seeds 0 and 1 cannot be stacked"):
    _run(_unstackable_task(), tmp_path / "b", seed_batch=2, **AUTO)
  assert not (tmp_path / "b").exists()


def test_cli_seed_batch_above_max_seeds_exits_2_with_one_line(tmp_path):
  _cli_refuses(tmp_path, ["--seeds", "auto", "--max-seeds", "6", "--margin", "0.01",
                          "--seed-batch", "7"],
               "error: seed_batch=7; accepted: an integer from 1 to max_seeds (6), or "
               "None for the library's choice")


def _step_records(out):
  cells = os.path.join(str(out), "cells")
  if not os.path.isdir(cells):
    return 0
  return sum(len(_cells.read_jsonl(os.path.join(cells, c, "steps.jsonl")))
             for c in os.listdir(cells))


@pytest.mark.slow  # a few minutes: 11 processes and two in-process studies
@pytest.mark.parametrize("devices", [8, 1])
def test_sequential_batched_study_killed_at_random_ends_as_one_seed_cells(tmp_path,
                                                                          devices):
  # A seeds="auto" study (two rounds: 6 seeds of fp32, bf16_mixed and the floor arm)
  # with K = 2 is SIGKILLed 10 times at random points (while starting, or after a random
  # number of new step records: mid-step of a batched group, mid-evaluation or
  # mid-save), then rerun: its summary.json and every cell's bits are those of the same
  # study of one-seed cells, run uninterrupted. On 8 forced host devices K = 2 is one
  # seed per device; on one CPU device, the one-seed step on host threads.
  args = dict(seeds="auto", max_seeds=6, margin=0.0004, steps=12, eval_every=6,
              save_every=2, timing_rounds=0, progress=False)
  ref = _run(task(), tmp_path / "ref", seed_batch=1, **args)
  assert ref.summary["recipes"]["bf16_mixed"]["seeds_used"] == 6   # two rounds
  out = tmp_path / "killed"
  script = (
      "import jax, precision; precision.enable_faithful_rounding()\n"
      "from precision import study\n"
      f"t = study.load_task({os.path.join(TASKS, 'params_mlp.py:task')!r})\n"
      "with jax.numpy_rank_promotion('allow'), jax.numpy_dtype_promotion('standard'):\n"
      f"  study.run(t, ['fp32', 'bf16_mixed'], out={str(out)!r}, seed_batch=2, "
      f"**{args!r})\n")
  # 8: the same forced host devices as this process (conftest's XLA_FLAGS): K = 2 runs
  # one seed per device, the identity the final in-process run checks. 1: XLA_FLAGS
  # without the device count.
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  if devices == 1:
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device"))
  rng = random.Random(20261205)
  for kill in range(10):
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = _step_records(out)
    wanted = rng.choice([0, rng.randint(1, 10), rng.randint(1, 10)])
    deadline = time.time() + (rng.uniform(0.5, 6.0) if wanted == 0 else 600)
    while proc.poll() is None and time.time() < deadline and (
        _step_records(out) - start < max(wanted, 1)):
      time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.01))
    assert proc.poll() is None, f"the study ended before kill {kill + 1}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  from precision.study import _report
  if devices == 8:
    final = _run(task(), out, seed_batch=2, **args).summary
  else:   # the last run on one device too; "threads" leaves the identity as it was
    assert "seed_batch" not in json.load(open(out / "study.json"))["identity"]
    subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    final = json.load(open(out / "summary.json"))
    ref_summary = json.load(open(tmp_path / "ref" / "summary.json"))
  assert (_without_batching(_report.comparable(final))
          == _without_batching(_report.comparable(ref_summary if devices == 1
                                                  else ref.summary)))
  assert _done_fingerprints(out) == _done_fingerprints(tmp_path / "ref")
  resumed = [(c, r["step"]) for c in os.listdir(out / "cells")
             for r in _cells.read_jsonl(os.path.join(out, "cells", c, "attempts.jsonl"))
             if r["event"] == "resume"]
  assert resumed, "no kill landed after a checkpoint of a batched group"
  print(f"\nresumed from a checkpoint: {sorted(resumed)}")


@pytest.mark.parametrize("fault", ["done.json", "checkpoint"])
def test_a_fault_of_the_environment_in_a_group_leaves_its_cell_unfinished(tmp_path,
                                                                          monkeypatch,
                                                                          fault):
  # The group's file operations are its cells' bookkeeping (`_cells.CellBook`), each
  # under `library_io` as a one-seed cell's: a full disk writing fp32__s1's done.json,
  # or an I/O error saving its checkpoint of step 4, stops the run with one line naming
  # the cell, the operation and the path; the cell stays unfinished and the same call
  # then ends with an uninterrupted run's bits.
  from precision import checkpoint as ckpt_lib
  from precision.study import _faults
  t = task()
  kw = dict(recipes=("fp32",), seed_batch=2)
  _run(t, tmp_path / "ref", **kw)
  out = tmp_path / "out"
  if fault == "done.json":
    real = _cells.write_atomic

    def write_atomic(path, text):
      if path.endswith(os.path.join("fp32__s1", "done.json")):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
      return real(path, text)
    monkeypatch.setattr(_cells, "write_atomic", write_atomic)
    want = (r"cell fp32__s1: writing done.json failed at .*fp32__s1/done.json: No space "
            r"left on device \(ENOSPC\)")
  else:
    real = ckpt_lib.Checkpointer.save

    def save(self, step, *a, **k):
      if step == 4 and "fp32__s1" in str(self.directory):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
      return real(self, step, *a, **k)
    monkeypatch.setattr(ckpt_lib.Checkpointer, "save", save)
    want = (r"cell fp32__s1: saving its checkpoint of step 4 failed at .*fp32__s1/ckpt: "
            r"Input/output error \(EIO\)")
  with pytest.raises(_faults.StudyEnvironmentError, match=want) as e:
    _run(t, out, **kw)
  assert "\n" not in str(e.value)
  assert _cells.read_done(str(out), study.make_config(["fp32"], 2, 6).grid()[1]) is None
  monkeypatch.undo()
  _run(t, out, **kw)
  assert _done_fingerprints(out) == _done_fingerprints(tmp_path / "ref")
