"""precision.study in-process: shards and their merge, Slurm slices, the A/A arm and
time-to-target, StudyResult, and bad input, on a task file written outside the package
(tests/study_tasks/params_mlp.py: a param pytree and a loss function, no Flax)."""

import contextlib
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import pytest

from precision import study
from precision.study import _cells

TASKS = os.path.join(os.path.dirname(__file__), "study_tasks")
RECIPES = ["fp32", "bf16_mixed", "f16_mixed"]
SMALL = dict(seeds=2, steps=12, eval_every=4, save_every=4, timing_rounds=0, progress=False)


@contextlib.contextmanager
def user_code():
  # The task files are written as users write them: JAX's default promotion rules, not
  # the strict ones this test session sets for the library itself.
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def task(name="params_mlp.py:task"):
  return study.load_task(os.path.join(TASKS, name))


def _run(out, recipes=RECIPES, **kw):
  with user_code():
    return study.run(task(), recipes, out=str(out), **{**SMALL, **kw})


def _steps_without_time(out):
  with open(os.path.join(out, "results.jsonl")) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  for r in recs:
    r.pop("step_time_s", None)
    if "outcome" in r:
      r["outcome"].pop("timing", None)
  return recs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  out = tmp_path_factory.mktemp("ref")
  result = _run(out, margin=0.05)
  return str(out), result


def test_whole_run_has_a_verdict_for_every_recipe(reference):
  out, result = reference
  assert set(result.rows) == set(RECIPES)
  for name in RECIPES[1:]:
    row = result.rows[name]
    assert row["verdict_code"] in ("worse", "better", "no_difference"), row["verdict"]
    assert len(row["deltas"]) == 2 and row["ci"][0] <= row["mean_delta"] <= row["ci"][1]
    assert isinstance(row["equivalent"], bool)
  summary = json.load(open(os.path.join(out, "summary.json")))
  for name in RECIPES[1:]:
    assert {"verdict", "mean_delta", "ci", "equivalent", "deltas"} <= set(
        summary["recipes"][name])
  assert result.verdict("fp32") == "control"
  assert "| bf16_mixed |" in result.table()
  recs = result.runs("bf16_mixed", 1)
  assert [r["step"] for r in recs] == list(range(13))  # the evaluation at 0, then 12 steps
  assert [r["step"] for r in recs if "eval" in r] == [0, 4, 8, 12]
  with pytest.raises(ValueError, match="no such cell"):
    result.runs("pure_bf16", 0)
  assert result.plot() is not None


def test_two_shards_and_report_only_equal_the_whole_run(reference, tmp_path):
  ref_out, ref = reference
  out = tmp_path / "sharded"
  assert _run(out, shard="1/2", margin=0.05) is None  # the other half is still to run
  with pytest.raises(ValueError, match="not finished"):
    study.report_only(str(out), margin=0.05)
  _run(out, shard="2/2", margin=0.05)
  merged = study.report_only(str(out), margin=0.05)
  assert study.comparable(merged.summary) == study.comparable(ref.summary)
  assert _steps_without_time(out) == _steps_without_time(ref_out)
  for cell in study.make_config(RECIPES, 2, 12).grid():
    assert (_cells.read_done(str(out), cell)["fingerprint"]
            == _cells.read_done(ref_out, cell)["fingerprint"])


def test_rerun_of_a_finished_study_trains_nothing(reference):
  out, ref = reference
  cells = study.make_config(RECIPES, 2, 12).grid()
  before = {c.name: len(_cells.read_jsonl(os.path.join(out, "cells", c.name,
                                                       "attempts.jsonl"))) for c in cells}
  again = _run(out, margin=0.05)
  after = {c.name: len(_cells.read_jsonl(os.path.join(out, "cells", c.name,
                                                      "attempts.jsonl"))) for c in cells}
  assert before == after
  assert study.comparable(again.summary) == study.comparable(ref.summary)


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"}, (2, 3)),
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "4",
      "SLURM_ARRAY_TASK_COUNT": "2"}, (1, 2)),
    ({}, (1, 1)),
])
def test_slurm_array_environment_picks_the_slice(monkeypatch, env, expected):
  for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT"):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert study.parse_shard(None) == expected


def test_slurm_slice_runs_only_its_cells(monkeypatch, tmp_path):
  monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
  monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
  monkeypatch.delenv("SLURM_ARRAY_TASK_MIN", raising=False)
  out = tmp_path / "slurm"
  assert _run(out, recipes=["fp32", "bf16_mixed"], steps=3, eval_every=0) is None
  grid = study.make_config(["fp32", "bf16_mixed"], 2, 3).grid()
  done = [c.name for c in grid if _cells.read_done(str(out), c) is not None]
  assert done == [c.name for c in grid[1::2]]  # slice 2 of 2: cells 1, 3


def test_aa_arm_and_time_to_target(tmp_path):
  result = _run(tmp_path / "aa", recipes=["fp32", "bf16_mixed"], aa=True, target=0.9)
  aa = result.rows["fp32-aa"]
  assert aa["recipe"] == "fp32" and aa["verdict_code"] in ("no_difference", "worse",
                                                           "better")
  seeds = [c.seed for c in study.make_config(["fp32"], 2, 12, aa=True).grid()
           if c.arm == "fp32-aa"]
  assert seeds == [study._config.AA_SEED_OFFSET, study._config.AA_SEED_OFFSET + 1]
  ttt = result.rows["bf16_mixed"]["time_to_target"]
  assert len(ttt["steps"]) == 2 and "verdict" in ttt
  assert "Time to target" in result.markdown and "fp32-aa" in result.markdown


def _tree_digest(folder):
  h = hashlib.sha256()
  for root, _, files in sorted(os.walk(folder)):
    for name in sorted(files):
      path = os.path.join(root, name)
      h.update(path.encode())
      h.update(open(path, "rb").read())
  return h.hexdigest()


def test_bad_input_is_a_value_error_naming_it(reference, tmp_path):
  out, _ = reference
  with pytest.raises(ValueError, match="does not exist"):
    _run(tmp_path / "a", recipes=["fp32", "bf16_mixd"])
  with pytest.raises(ValueError, match="seeds=1"):
    _run(tmp_path / "b", seeds=1)
  with pytest.raises(ValueError, match="shard 3/2"):
    _run(tmp_path / "c", shard="3/2")
  with pytest.raises(ValueError, match="floating scalar"):
    with user_code():
      study.run(task("nnx_mlp.py:bad_loss_task"), RECIPES, out=str(tmp_path / "d"), **SMALL)
  with pytest.raises(ValueError, match="margin"):
    _run(tmp_path / "e", margin=-1.0)
  before = _tree_digest(out)
  with pytest.raises(ValueError, match="another configuration.*steps"):
    _run(out, steps=13)
  assert _tree_digest(out) == before  # nothing already saved is touched
  (tmp_path / "f").mkdir()
  (tmp_path / "f" / "mine.txt").write_text("not a study")
  with pytest.raises(ValueError, match="holds no study"):
    _run(tmp_path / "f")
  with pytest.raises(ValueError, match="defines no 'nope'"):
    study.load_task(os.path.join(TASKS, "params_mlp.py:nope"))
  with pytest.raises(ValueError, match="FILE.py:NAME"):
    study.load_task("no_colon")
  with pytest.raises(ValueError, match="Task.optimizer"):
    study.Task(init=len, loss=len, batches=len, optimizer="adam")


def test_overrides_reach_every_gemm_of_the_cell_and_the_identity(tmp_path):
  # One bound plan per cell: an override given to the study is what the trained model's
  # GEMMs run in (audited on the cell's own program), and part of the study's identity.
  from flax import nnx
  from precision.audit import audit
  from precision.study import _models
  import precision as mp
  nnx_task = task("nnx_mlp.py:task")
  prog = _models.build(nnx_task, mp.get_recipe("bf16_mixed"), 0, overrides={"out": "f32"})
  model = nnx.merge(prog.graphdef, prog.state.params, prog.state.model_state)
  batch = next(iter(nnx_task.batches(0)))
  with user_code():
    gemms = audit(nnx.grad(nnx_task.loss), model, batch).gemms
  by_scope = {(g.scope, g.direction): (g.lhs_dtype, g.rhs_dtype) for g in gemms}
  assert by_scope[("out", "fwd")] == ("float32", "float32")
  assert by_scope[("fc2", "fwd")] == ("bfloat16", "bfloat16")
  assert by_scope[("out", "bwd")] == ("float32", "float32")
  out = tmp_path / "ov"
  _run(out, recipes=["fp32", "bf16_mixed"], steps=2, eval_every=0,
       overrides={"*w2*": "f32"})
  ident = json.load(open(out / "study.json"))["identity"]
  assert ident["overrides"] == [["*w2*", "p=f32,c=f32,o=f32"]]
  with pytest.raises(ValueError, match="another configuration.*overrides"):
    _run(out, recipes=["fp32", "bf16_mixed"], steps=2, eval_every=0)


def test_more_seeds_grow_a_study_and_keep_its_cells(tmp_path):
  out = tmp_path / "grow"
  _run(out, recipes=["fp32", "bf16_mixed"], steps=3, eval_every=0)
  cfg2 = study.make_config(["fp32", "bf16_mixed"], 2, 3)
  first = {c.name: _cells.read_done(str(out), c)["fingerprint"] for c in cfg2.grid()}
  grown = _run(out, recipes=["fp32", "bf16_mixed"], steps=3, eval_every=0, seeds=3)
  assert len(grown.rows["bf16_mixed"]["deltas"]) == 3
  for c in cfg2.grid():  # the two first seeds were not trained again
    assert _cells.read_done(str(out), c)["fingerprint"] == first[c.name]
    assert len(_cells.read_jsonl(os.path.join(str(out), "cells", c.name,
                                              "attempts.jsonl"))) == 1
  with pytest.raises(ValueError, match="holds a study of 3 seeds"):
    _run(out, recipes=["fp32", "bf16_mixed"], steps=3, eval_every=0, seeds=2)


def test_linen_model_without_collections_returns_the_output():
  """A Linen module with params only (no BatchNorm statistics): training calls give the
  module's output, not flax's (output, {}) pair."""
  import flax.linen as nn
  from precision.study import _models

  module = nn.Dense(3)
  x = jnp.ones((2, 4), jnp.float32)
  params = module.init(jax.random.key(0), x)["params"]
  m = _models.LinenModel(module, params, {}, jax.random.key(1), training=True)
  out = m(x)
  assert isinstance(out, jax.Array) and out.shape == (2, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(control=["fp32"]), "control="),
    (dict(overrides={"*": "f33"}), "overrides="),
])
def test_make_config_names_the_bad_argument(kwargs, match):
  from precision.study import _config
  with pytest.raises(ValueError, match=match):
    _config.make_config(["fp32", "bf16_mixed"], 2, 4, **kwargs)


def test_task_rng_streams_none_is_refused():
  import optax
  with pytest.raises(ValueError, match="rng_streams"):
    study.Task(init=lambda s: {"w": jnp.ones(2)}, loss=lambda p, b: jnp.sum(p["w"]),
               batches=lambda s: iter([]), optimizer=optax.sgd(0.1), rng_streams=None)


def test_slices_started_at_once_may_find_the_study_being_created(tmp_path):
  """A Slurm array's tasks start together: one may see another's study.json temporary
  file, or study.json and cells/ just made, and must join that study, not refuse the
  folder; a folder holding anything else is still refused."""
  from precision.study import _run  # pylint: disable=g-import-not-at-top
  ident = {"format": 1, "task": "t", "seeds": 2}
  out = tmp_path / "racing"
  out.mkdir()
  (out / ".slurm").mkdir()
  (out / "study.json.tmp-4242").write_text("{")      # another slice, mid-write
  _run._check_out(str(out), ident, {})
  assert json.loads((out / "study.json").read_text())["identity"] == ident
  (out / "cells").mkdir()                            # the other slice went on
  _run._check_out(str(out), ident, {})
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match="holds no study"):
    _run._check_out(str(other), ident, {})
