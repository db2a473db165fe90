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
  cfg = sweep.SweepConfig.quick(recipes=("fp32", "f16_mixed"), seeds=2, steps=6,
                                eval_every=3, timing_rounds=0)
  with user_code():
    return cfg, out, sweep.run_sweep(cfg, out, progress=False)


@pytest.mark.slow  # the quick sweep: about 2 minutes of this machine
def test_both_tasks_are_studies_with_every_output(quick):
  cfg, out, result = quick
  assert set(result["results"]) == {"gpt", "plain_lm"}
  for task in ("gpt", "plain_lm"):
    for name in ("summary.md", "summary.json", "results.jsonl", "loss_curves.png"):
      assert os.path.getsize(os.path.join(out, task, name)) > 0, (task, name)
    rows = json.load(open(os.path.join(out, task, "summary.json")))["recipes"]
    assert list(rows) == list(cfg.recipes)
    for r in cfg.recipes[1:]:
      assert rows[r]["verdict_code"] in ("worse", "better", "no_difference"), rows[r]
      assert isinstance(rows[r]["equivalent"], bool)  # the sweep's margin
  md = open(os.path.join(out, "summary.md")).read()
  assert "## gpt:" in md and "## plain_lm:" in md and "## Numeric gate (gpt)" in md
  assert md.count("| f16_mixed |") == 3  # two study tables and the gate
  assert "holds up within ±0.02" in md or "not shown within ±0.02" in md


@pytest.mark.slow  # the quick sweep: about 2 minutes of this machine
def test_dynamic_loss_scale_growth_interval_is_the_sweeps(quick):
  cfg, out, _ = quick
  study = json.load(open(os.path.join(out, "gpt", "study.json")))
  f16 = next(r for r in study["identity"]["recipes"] if r["name"] == "f16_mixed")
  assert f16["loss_scale"]["growth_interval"] == max(1, cfg.steps // 15)
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
