"""experiments.sweep, the README's main job, as a thin CLI over precision.study: both
tasks (the library's GPT and a plain LM written with no dtype in mind) run through the
study, the combined summary holds both tables and the GPT's numeric gate."""

import contextlib
import json
import os

import jax
import pytest

from experiments import gates
from experiments import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def user_code():
  # models/plain_lm.py is written as users write models: JAX's default promotion rules
  # (rank broadcasting of the position table), not this test session's strict ones.
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sweep"))
  cfg = sweep.SweepConfig.quick(recipes=("fp32", "f16_mixed"), steps=6, eval_every=3,
                                timing_rounds=0)
  with user_code():
    return cfg, out, sweep.run_sweep(cfg, out, progress=False)


@pytest.mark.slow  # the quick sweep: about 2 minutes of this machine
def test_both_tasks_are_sequential_studies_with_every_output(quick):
  cfg, out, result = quick
  assert cfg.seeds == "auto" and cfg.max_seeds == 3
  assert set(result["results"]) == {"gpt", "plain_lm"}
  for task in ("gpt", "plain_lm"):
    for name in ("summary.md", "summary.json", "results.jsonl", "loss_curves.png"):
      assert os.path.getsize(os.path.join(out, task, name)) > 0, (task, name)
    summary = json.load(open(os.path.join(out, task, "summary.json")))
    rows = summary["recipes"]
    assert list(rows) == [*cfg.recipes, "fp32-floor"]
    for r in cfg.recipes[1:]:
      assert rows[r]["verdict_code"] in ("worse", "better", "holds_up", "undecided"), rows[r]
      assert rows[r]["seeds_used"] == 3 and isinstance(rows[r]["decided"], bool)
      assert rows[r]["decided"] == (rows[r]["verdict_code"] != "undecided")
    assert len(summary["floor"]["deltas"]) == 3 and summary["floor"]["rms"] >= 0
  md = open(os.path.join(out, "summary.md")).read()
  assert "## Decisions" in md and "## gpt:" in md and "## plain_lm:" in md
  assert "## Numeric gate (gpt)" in md
  # The decisions table, two study tables and the gate.
  assert md.count("| f16_mixed |") == 4
  decisions = md[md.index("## Decisions"):md.index("## gpt:")]
  row = next(line for line in decisions.splitlines() if line.startswith("| f16_mixed |"))
  assert row.count(", 3 seeds") == 2, row
  assert decisions.count("chaos floor rms") == 2
  assert "CPU-minutes" in md and "load average" in md


@pytest.mark.slow  # the quick sweep: about 2 minutes of this machine
def test_dynamic_loss_scale_growth_interval_is_the_sweeps(quick):
  cfg, out, _ = quick
  study = json.load(open(os.path.join(out, "gpt", "study.json")))
  f16 = next(r for r in study["identity"]["recipes"] if r["name"] == "f16_mixed")
  assert f16["loss_scale"]["growth_interval"] == max(1, cfg.steps // 15)
  assert study["settings"]["save_every"] == cfg.steps // 2  # the sweep's, not steps // 10
  assert "study setting `growth_interval`" in open(os.path.join(out, "gpt",
                                                                "summary.md")).read()


@pytest.mark.slow  # the quick sweep: about 2 minutes of this machine
def test_report_only_rebuilds_the_same_summaries(quick):
  cfg, out, result = quick
  with user_code():
    again = sweep.run_sweep(cfg, out, report_only=True, progress=False)
  from precision import study
  for task in ("gpt", "plain_lm"):
    assert (study.comparable(again["results"][task].summary)
            == study.comparable(result["results"][task].summary))


@pytest.mark.slow  # 2 slices of a fixed-seeds plain LM sweep: about a minute
def test_fixed_seeds_run_in_slices_and_merge(tmp_path):
  cfg = sweep.SweepConfig.quick(recipes=("fp32", "bf16_master"), seeds=2, steps=4,
                                eval_every=2, timing_rounds=0, tasks=("plain_lm",),
                                gate_batch=0)
  out = str(tmp_path)
  with user_code():
    assert sweep.run_sweep(cfg, out, shard="1/2", progress=False)["markdown"] is None
    sweep.run_sweep(cfg, out, shard="2/2", progress=False)
    merged = sweep.run_sweep(cfg, out, report_only=True, progress=False)
  rows = merged["results"]["plain_lm"].summary["recipes"]
  assert rows["bf16_master"]["seeds_used"] == 2 and len(rows["fp32-floor"]["deltas"]) == 2
  assert "| bf16_master |" in merged["markdown"] and "2 seeds per recipe" in merged["markdown"]


@pytest.mark.parametrize("argv, words", [
    (["--shard", "1/2"], "shard='1/2' with seeds='auto'"),
    (["--max-seeds", "1"], "--max-seeds 1; accepted"),
    (["--seeds", "1"], "--seeds 1; accepted"),
    (["--seeds", "two"], "--seeds 'two'; accepted"),
    (["--seeds", "3", "--max-seeds", "6"], "--max-seeds 6 with --seeds 3"),
    (["--seed-batch", "0", "--tasks", "plain_lm", "--quick"], "seed_batch=0; accepted"),
    (["--seed-batch", "4", "--tasks", "plain_lm", "--quick"],
     "seed_batch=4; accepted: an integer from 1 to max_seeds (3)"),
])
def test_bad_seed_options_are_one_line_and_touch_nothing(tmp_path, capsys, argv, words):
  out = tmp_path / "out"
  try:
    rc = sweep.main([*argv, "--out", str(out), "--no-progress"])
  except SystemExit as e:  # argparse's own errors
    rc = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and words in err[-1], err
  assert not out.exists()


def test_seed_batch_groups_each_rounds_seeds_on_a_one_device_cpu(monkeypatch):
  # On a CPU of one device the sweep's studies run each arm's seeds of a round as one
  # group ("threads": one program per cell's numbers); elsewhere the library's default.
  assert sweep.SweepConfig(seed_batch=1).study_seed_batch() == 1
  monkeypatch.setattr(jax, "local_device_count", lambda: 1)
  assert sweep.SweepConfig().study_seed_batch() == 6       # max_seeds
  assert sweep.SweepConfig(seeds=4).study_seed_batch() == 4
  assert sweep.SweepConfig(seeds=20).study_seed_batch() == 8
  monkeypatch.setattr(jax, "local_device_count", lambda: 8)
  assert sweep.SweepConfig().study_seed_batch() is None


def test_sweep_optimizer_is_experiments_train_s():
  # The sweep's own copy of experiments.train's inner optimizer: the same updates.
  import jax.numpy as jnp
  import numpy as np
  from experiments import trainlib
  cfg = sweep.SweepConfig(steps=40, lr=2e-3)
  ours = sweep._optimizer(cfg, cfg.lr)
  theirs = trainlib.inner_optimizer(trainlib.TrainConfig(steps=40, lr=2e-3))
  params = {"w": jnp.ones((3, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}
  a, b = ours.init(params), theirs.init(params)
  rng = np.random.default_rng(0)
  with user_code():  # optax's schedules mix Python floats with int32 step counts
    for _ in range(6):
      g = {k: jnp.asarray(rng.normal(size=v.shape) * 3, jnp.float32)
           for k, v in params.items()}
      ua, a = ours.update(g, a, params)
      ub, b = theirs.update(g, b, params)
      for k in params:
        np.testing.assert_array_equal(np.asarray(ua[k]), np.asarray(ub[k]))
  assert np.all(np.asarray(ua["w"]) != 0)  # the warmup's first step is 0; the 6th is not


def test_short_verdicts_name_the_decision_and_its_seeds():
  margin = 0.05
  row = lambda **kw: {"seeds_used": 6, "mean_delta": 0.012, "relative_delta": 0.004, **kw}
  assert sweep._short_verdict(row(verdict_code="holds_up"), margin) == \
      "holds up within ±0.05; Δ +0.0120 (+0.4%), 6 seeds"
  assert sweep._short_verdict(row(verdict_code="worse"), margin).startswith("worse; Δ +0.0120")
  small = sweep._short_verdict(
      row(verdict_code="better", practically_equivalent="smaller than the margin ±0.05"),
      margin)
  assert small.startswith("better (practically equivalent: smaller than the margin")
  both = sweep._short_verdict(row(verdict_code="worse", equivalent=True,
                                  practically_equivalent="smaller than the margin ±0.05"),
                              margin)
  assert both.startswith("worse and holds up within ±0.05 (practically equivalent")
  assert sweep._short_verdict(row(verdict_code="undecided"), margin).startswith(
      "undecided after 6 seeds")
  assert sweep._short_verdict(row(verdict_code="diverged", verdict="diverged on 2 of 6 seeds"),
                              margin).startswith("diverged on 2 of 6 seeds")


def test_plain_lm_knows_nothing_of_precision():
  text = open(os.path.join(ROOT, "models", "plain_lm.py")).read()
  assert "import precision" not in text and "from precision" not in text


def test_unknown_recipe_fails_fast(tmp_path):
  cfg = sweep.SweepConfig.quick(recipes=("fp32", "bf17"))
  with pytest.raises(ValueError, match="does not exist"):
    sweep.run_sweep(cfg, str(tmp_path), progress=False)
  assert sweep.main(["--quick", "--recipes", "fp32,bf17", "--out", str(tmp_path / "x"),
                     "--no-progress"]) == 2


def test_gate_judge_fails_beyond_its_limits():
  row = {"recipe": "bf16_master", "loss_rel_err": 7e-5, "logits_mean_rel_err": 4.9e-3,
         "logits_p99_rel_err": 1.7e-2, "grad_worst_scaled_mean_err": 1.2e-2, "nonfinite": 0}
  assert gates.judge(row)["passed"]
  bad = gates.judge({**row, "grad_worst_scaled_mean_err": 0.04, "nonfinite": 3})
  assert not bad["passed"] and len(bad["failures"]) == 2
  fwd, bwd, _ = gates.unit_roundoffs("fp8_hybrid")
  assert (fwd, bwd) == (2.0**-4, 2.0**-3)
