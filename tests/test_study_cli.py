"""`python -m precision.study` on task files written outside the package, as a researcher
runs it: an NNX MLP with biases and LayerNorm, and a Linen CNN with BatchNorm and Dropout
driven by a `train` keyword, each under fp32, bf16_mixed, bf16_master, f16_mixed and
fp8_hybrid x 3 seeds (slow: 30 cells; CI runs them), a small run of each task in the fast
set, and the CLI's one-line errors with exit status 2."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "study_tasks")
RECIPES = "fp32,bf16_mixed,bf16_master,f16_mixed,fp8_hybrid"


def cli(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the CLI sets faithful rounding itself; one CPU device
  return subprocess.run([sys.executable, "-m", "precision.study", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", params=["nnx_mlp.py:task", "linen_cnn.py:make_task"])
def studied(request, tmp_path_factory):
  out = tmp_path_factory.mktemp("cli")
  p = cli(os.path.join(TASKS, request.param), "--recipes", RECIPES, "--seeds", "3",
          "--steps", "6", "--eval-every", "3", "--save-every", "3", "--timing-rounds", "1",
          "--margin", "0.05", "--out", str(out), "--no-progress")
  assert p.returncode == 0, p.stderr[-3000:]
  return request.param, str(out), p


@pytest.mark.slow  # the 5-recipe x 3-seed study of each task
def test_every_output_is_written(studied):
  _, out, p = studied
  for name in ("summary.md", "summary.json", "results.jsonl", "loss_curves.png",
               "loss_scale.png", "study.json", "costs.json"):
    assert os.path.getsize(os.path.join(out, name)) > 0, name
  for name in ("loss_curves.png", "loss_scale.png"):
    with open(os.path.join(out, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert "# Study:" in p.stdout


@pytest.mark.slow  # the 5-recipe x 3-seed study of each task
def test_every_recipe_gets_a_verdict(studied):
  ref, out, _ = studied
  summary = json.load(open(os.path.join(out, "summary.json")))
  rows = summary["recipes"]
  assert list(rows) == RECIPES.split(",")
  for name in RECIPES.split(",")[1:]:
    row = rows[name]
    assert row["verdict_code"] in ("worse", "better", "no_difference"), (ref, name,
                                                                         row["verdict"])
    assert len(row["deltas"]) == 3 and len(row["ci"]) == 2
    assert isinstance(row["equivalent"], bool)
    assert row["health"]["ok"] == 3
    assert row["costs"]["bytes_per_param"] > 0 and row["costs"]["step_memory_bytes"] > 0
  assert summary["timing"]["ratio_to_control"]["fp32"] == 1.0
  md = open(os.path.join(out, "summary.md")).read()
  assert "fp8: the first and last GEMM" in md
  # fp8 really ran (its middle GEMM in E4M3/E5M2): other numbers than bf16_mixed's.
  assert rows["fp8_hybrid"]["deltas"] != rows["bf16_mixed"]["deltas"]


@pytest.mark.slow  # the 5-recipe x 3-seed study of each task
def test_results_hold_every_step_of_every_cell(studied):
  _, out, _ = studied
  recs = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
  outcomes = [r for r in recs if "outcome" in r]
  assert len(outcomes) == 15
  for o in outcomes:
    steps = [r["step"] for r in recs if r["arm"] == o["arm"] and r["index"] == o["index"]
             and "outcome" not in r]
    assert steps == list(range(7)), (o["arm"], o["index"])


@pytest.mark.slow
@pytest.mark.parametrize("ref", ["nnx_mlp.py:task", "linen_cnn.py:make_task"])
def test_small_study_of_each_task_kind(tmp_path, ref):
  out = tmp_path / "small"
  p = cli(os.path.join(TASKS, ref), "--recipes", "fp32,fp8_hybrid", "--seeds", "2",
          "--steps", "3", "--eval-every", "3", "--timing-rounds", "0", "--out", str(out),
          "--no-progress")
  assert p.returncode == 0, p.stderr[-3000:]
  rows = json.load(open(out / "summary.json"))["recipes"]
  assert rows["fp8_hybrid"]["verdict_code"] in ("worse", "better", "no_difference")
  assert rows["fp8_hybrid"]["health"]["ok"] == 2 and len(rows["fp8_hybrid"]["deltas"]) == 2
  assert (out / "loss_curves.png").stat().st_size > 0


def test_fp8_keeps_first_and_last_gemm_by_role():
  # NNX: the paths are found by tracing (layers named fc1 ... out, none called "head").
  import precision as mp
  from precision import study
  from precision.study import _models
  task = study.load_task(os.path.join(TASKS, "nnx_mlp.py:task"))
  batch = next(iter(task.batches(0)))
  keeps = _models.fp8_role_keeps(task, task.init(0), batch)
  assert keeps == ("fc1", "out")
  recipe = _models.with_fp8_keeps(mp.get_recipe("fp8_hybrid"), keeps)
  model = mp.flax.apply_recipe(task.init(0), recipe)
  fp8_layers = [name for name, _ in mp.fp8.fp8_modules(model)]
  assert fp8_layers == ["fc2"]


@pytest.mark.parametrize("args,message", [
    (["nnx_mlp.py:bad_loss_task"], "Task.loss returned float32[32]"),
    (["nnx_mlp.py:task", "--recipes", "fp32,bf16_mixd"], "recipe 'bf16_mixd' does not exist"),
    (["nnx_mlp.py:task", "--seeds", "1"], "seeds=1"),
    (["nnx_mlp.py:task", "--shard", "3/2"], "shard 3/2"),
    (["nnx_mlp.py:nope"], "defines no 'nope'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
  p = cli(os.path.join(TASKS, args[0]), *args[1:], "--out", str(tmp_path / "o"),
          "--steps", "2", "--no-progress")
  assert p.returncode == 2, p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.slow  # the 5-recipe x 3-seed study of each task
def test_an_out_of_another_study_is_refused_and_kept(studied):
  ref, out, _ = studied
  before = open(os.path.join(out, "summary.json")).read()
  p = cli(os.path.join(TASKS, ref), "--recipes", RECIPES, "--seeds", "3", "--steps", "7",
          "--eval-every", "3", "--out", out, "--no-progress")
  assert p.returncode == 2
  line, = p.stderr.strip().splitlines()
  assert line.startswith("error: ") and "another configuration (differs in: steps)" in line
  assert open(os.path.join(out, "summary.json")).read() == before
