"""The main job end to end at --quick size: outputs, verdicts, numeric gate, loss-scale
events, and 2 slices (--shard K/2 + --report-only) against one whole run."""

import dataclasses
import json
import math
import os
import re
import shutil

import pytest

from experiments import gates
from experiments import report
from experiments import stats
from experiments import sweep


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sweep"))
  return out, sweep.run_sweep(sweep.SweepConfig.quick(out=out, progress=False))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
  """The quick sweep again, as slices 1/2 and 2/2 into one directory, merged after."""
  out = str(tmp_path_factory.mktemp("sharded"))
  for k in (1, 2):
    part = sweep.run_sweep(sweep.SweepConfig.quick(out=out, progress=False, shard=(k, 2)))
    assert part["markdown"] is None  # a slice does not report; --report-only does
  return out, sweep.report_only(out)


def _is_png(path):
  with open(path, "rb") as f:
    return f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000


def _section(md, title):
  """The markdown from `## title` up to the next `## `."""
  start = md.index(f"## {title}")
  end = md.find("\n## ", start + 1)
  return md[start:end if end >= 0 else None]


def test_outputs_exist_and_pngs_valid(quick):
  out, res = quick
  for name in ("results.jsonl", "summary.md", "summary.json", "loss_curves.png",
               "loss_scale.png", "parts/results-1-of-1.jsonl", "parts/part-1-of-1.json"):
    assert os.path.exists(os.path.join(out, name)), name
  assert _is_png(os.path.join(out, "loss_curves.png"))
  assert _is_png(os.path.join(out, "loss_scale.png"))  # f16_mixed scales its loss
  from matplotlib import image
  assert image.imread(os.path.join(out, "loss_curves.png")).ndim == 3


def test_results_jsonl_has_every_step_of_every_run(quick):
  out, _ = quick
  cfg = sweep.SweepConfig.quick()
  recs = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
  for recipe in cfg.recipes:
    for seed in range(cfg.seeds):
      steps = {r["step"] for r in recs if r["recipe"] == recipe and r["seed"] == seed
               and "step" in r}
      assert steps >= set(range(1, cfg.steps + 1)), (recipe, seed)
      final = [r for r in recs if r["recipe"] == recipe and r["seed"] == seed and "status" in r]
      assert final and final[-1]["status"] == "ok"
      assert final[-1]["summary"]["load_1m"] >= 0 and final[-1]["summary"]["cpu_count"] >= 1
  assert all("loss" in r for r in recs if r.get("step", 0) > 0)


def test_summary_rows_and_gates(quick):
  _, res = quick
  rows = {r["recipe"]: r for r in res["rows"]}
  assert set(rows) == set(sweep.QUICK_RECIPES)
  assert rows["fp32"]["verdict"] == "control"
  # 2 seeds, 2 recipes against fp32: the sign-flip test cannot reach 0.05 / 2.
  need = stats.seeds_needed(2)
  for name in ("bf16_master", "f16_mixed"):
    assert rows[name]["verdict"] == f"undecided: needs >= {need} seeds"
    assert rows[name]["p_sign_flip"] >= 0.5 and len(rows[name]["diff_per_seed"]) == 2
    lo, hi = rows[name]["diff_ci"]
    assert lo <= rows[name]["diff_mean"] <= hi
  for r in rows.values():
    assert math.isfinite(r["val_bpb_mean"]) and r["val_bpb_mean"] < 8.5
    assert r["step_memory_bytes"] > 0 and r["bytes_per_param"] == 16.0
    assert r["loaded"] == (r["load_1m"] > r["cpu_count"])
  assert rows["fp32"]["nonfinite"] == rows["bf16_master"]["nonfinite"] == 0
  g = {g["recipe"]: g for g in res["gates"]}
  assert g["fp32"]["loss_rel_err"] == 0.0 and g["fp32"]["logits_mean_rel_err"] == 0.0
  assert all(row["passed"] for row in g.values()), [row["failures"] for row in g.values()]
  # bf16's logits limit is the project's bf16 acceptance limit (1e-2), in units of u.
  assert g["bf16_master"]["limits"]["logits_mean_rel_err"] == pytest.approx(2.5 * 2**-8)
  assert g["f16_mixed"]["logits_mean_rel_err"] <= 2e-3  # 3 more mantissa bits


def test_summary_states_every_rule_and_names_no_design_document(quick):
  _, res = quick
  md = res["markdown"]
  assert not re.search(r"seed 0\d\d", md, re.I), "a design-document name leaked"
  verdicts = _section(md, "Verdicts against fp32")
  for words in ("paired test", "sign-flip permutation test", "Holm", "fp32-spread rule",
                "Student's t interval", "needs >= 7 seeds", "2^(1-n)"):
    assert words in verdicts, words
  assert "| recipe |" in verdicts and "bf16_master" in verdicts
  gate = _section(md, "Numeric gate")
  assert "unit roundoff" in gate and "acceptance limit" in gate and "| gate |" in gate
  assert gate.count("| pass |") == 3
  cost = _section(md, "Health and cost")
  assert "os.getloadavg()" in cost and "load (1 min)" in cost
  assert "grows after 1 finite steps in this sweep, a sweep setting" in md


def test_dynamic_loss_scale_grows_and_backs_off(quick):
  out, res = quick
  f16 = {r["recipe"]: r for r in res["rows"]}["f16_mixed"]
  # Growth interval "auto" = max(1, 12 // 15) = 1 step: the scale climbs from 2^15 until
  # f16 gradients overflow, backs off, and climbs again.
  assert f16["loss_scale_growths"] > 0 and f16["loss_scale_backoffs"] > 0
  assert f16["skipped_steps"] == f16["loss_scale_backoffs"]  # hysteresis 1: one each
  runs = [r for r in sweep.load_runs(out) if r["recipe"] == "f16_mixed"]
  assert all(r["summary"]["growth_interval"] == 1 for r in runs)
  assert sweep.growth_interval(sweep.SweepConfig()) == 20  # default: 300 steps // 15
  assert sweep.sweep_recipe(sweep.SweepConfig(growth_interval="recipe"), "f16_mixed") == \
      sweep.mp.get_recipe("f16_mixed")
  assert sweep.sweep_recipe(sweep.SweepConfig(), "fp32") == sweep.mp.get_recipe("fp32")


def test_loss_scale_events_from_a_history():
  hist = [{"step": 1, "loss_scale": 4.0, "skipped_steps": 0},
          {"step": 2, "loss_scale": 8.0, "skipped_steps": 0},
          {"step": 3, "loss_scale": 4.0, "skipped_steps": 1},
          {"step": 4, "loss_scale": 4.0, "skipped_steps": 1, "val_bpb": 3.0},
          {"step": 5, "loss_scale": 2.0, "skipped_steps": 2}]
  ev = report.loss_scale_events(hist, initial_scale=2.0)
  assert (ev.growth, ev.backoff, ev.skipped) == ([1, 2], [3, 5], [3, 5])
  assert report.loss_scale_events(hist).growth == [2]  # without the initial scale


def test_report_only_rebuilds_the_same_rows(quick, tmp_path):
  out, res = quick
  copy = tmp_path / "copy"
  shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".compile_cache"))
  os.remove(copy / "results.jsonl")  # rebuilt from the slices
  rebuilt = sweep.report_only(str(copy))
  assert json.dumps(rebuilt["rows"], sort_keys=True) == json.dumps(res["rows"], sort_keys=True)
  assert rebuilt["markdown"] == res["markdown"]
  assert _is_png(str(copy / "loss_curves.png"))
  assert sweep.main(["--report-only", "--out", str(copy)]) == 0


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_two_slices_merge_to_the_single_run(quick, sharded):
  out1, single = quick
  out2, merged = sharded
  strip = lambda rows: [{k: v for k, v in r.items() if k not in report.TIMING_FIELDS}
                        for r in rows]
  assert json.dumps(strip(merged["rows"]), sort_keys=True) == json.dumps(
      strip(single["rows"]), sort_keys=True)
  for title in ("Verdicts against fp32", "Numeric gate"):
    assert _section(merged["markdown"], title) == _section(single["markdown"], title)
  assert "Ran as 2 slices (`--shard K/2`)" in merged["markdown"]
  fingerprints = lambda out: {(r["recipe"], r["seed"]): r["summary"]["fingerprint"]
                              for r in sweep.load_runs(out)}
  assert fingerprints(out2) == fingerprints(out1)  # bit-identical final states
  # Each slice trained its share of the grid and no more.
  cfg = sweep.SweepConfig.quick()
  for k in (1, 2):
    with open(os.path.join(out2, "parts", f"part-{k}-of-2.json")) as f:
      part = json.load(f)
    assert [tuple(j) for j in part["jobs"]] == sweep.grid(cfg)[k - 1::2]


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_report_only_names_a_missing_or_mismatched_slice(sharded, tmp_path):
  out, _ = sharded
  copy = tmp_path / "partial"
  shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".compile_cache"))
  os.remove(copy / "parts" / "part-2-of-2.json")
  with pytest.raises(ValueError, match=r"slices \[2\] of 2 are not done"):
    sweep.report_only(str(copy))
  assert sweep.main(["--report-only", "--out", str(copy)]) == 2
  shutil.copy(os.path.join(out, "parts", "part-2-of-2.json"), copy / "parts")
  path = copy / "parts" / "part-1-of-2.json"
  part = json.loads(path.read_text())
  part["config"]["steps"] += 1
  path.write_text(json.dumps(part))
  with pytest.raises(ValueError, match="different settings.*steps"):
    sweep.report_only(str(copy))
  shutil.copy(copy / "parts" / "part-2-of-2.json", copy / "parts" / "part-1-of-3.json")
  with pytest.raises(ValueError, match=r"split \[2, 3\] ways"):
    sweep.report_only(str(copy))
  with pytest.raises(ValueError, match="no finished slice"):
    sweep.report_only(str(tmp_path / "empty"))


def test_slices_partition_the_grid():
  cfg = sweep.SweepConfig(recipes=("fp32", "bf16_master", "f16_mixed"), seeds=3)
  for n in range(1, 6):
    jobs = [j for k in range(1, n + 1)
            for j in sweep.shard_jobs(dataclasses.replace(cfg, shard=(k, n)))]
    assert sorted(jobs) == sorted(sweep.grid(cfg)) and len(jobs) == len(set(jobs))
  assert sweep.parse_shard("2/4") == (2, 4)
  for bad in ("0/2", "3/2", "2", "a/b", "1/0"):
    with pytest.raises(ValueError, match="K/N"):
      sweep.parse_shard(bad)
  with pytest.raises(ValueError, match="shard"):
    sweep.SweepConfig(shard=(3, 2))
  with pytest.raises(ValueError, match="growth_interval"):
    sweep.SweepConfig(growth_interval=0)


def _run(recipe, seed, bpb, status="ok", **summary):
  return {"recipe": recipe, "seed": seed, "status": status, "history": [],
          "summary": {"final_val_bpb": bpb, **summary}}


def test_verdicts_and_spread_rule_on_synthetic_runs():
  # 9 seeds: the paired test can decide with 3 recipes against fp32 (needs >= 7).
  base = [3.00, 3.20, 3.10, 3.05, 3.15, 2.95, 3.12, 3.08, 3.02]
  shift_p = [0.05, 0.06, 0.04, 0.05, 0.07, 0.05, 0.06, 0.04, 0.05]   # worse on every seed
  noise = [0.01, -0.02, 0.00, 0.02, -0.01, 0.01, -0.015, 0.005, -0.005]
  runs = ([_run("fp32", s, b) for s, b in enumerate(base)] +
          [_run("p", s, b + d) for s, (b, d) in enumerate(zip(base, shift_p))] +
          [_run("q", s, b + d) for s, (b, d) in enumerate(zip(base, noise))] +
          [_run("r", s, b - d) for s, (b, d) in enumerate(zip(base, shift_p))] +
          [_run("d", 0, float("nan"), "diverged")])
  rows = {r["recipe"]: r for r in report.summarize(runs)}
  assert rows["p"]["verdict"] == "worse than fp32" and rows["p"]["p_holm"] <= 0.05
  assert rows["p"]["spread_rule"] == "within fp32 range"  # range 0.25 hides +0.05
  assert rows["q"]["verdict"] == "no difference detected"
  assert rows["r"]["verdict"] == "better than fp32"
  assert rows["d"]["verdict"] == rows["d"]["spread_rule"] == "diverged"
  assert rows["fp32"]["verdict"] == "control"
  assert report.family_size(list(rows.values())) == 3  # the diverged recipe is not tested
  # 3 seeds: the same data cannot decide; the spread rule still reads the range.
  three = [r for r in runs if r["seed"] < 3 and r["recipe"] != "d"]
  rows3 = {r["recipe"]: r for r in report.summarize(three)}
  assert rows3["p"]["verdict"] == f"undecided: needs >= {stats.seeds_needed(3)} seeds"
  far = report.summarize([_run("fp32", 0, 3.0), _run("fp32", 1, 3.02), _run("b", 0, 3.10),
                          _run("b", 1, 3.12)])
  assert far[1]["spread_rule"] == "above fp32 range (worse)"
  one = report.summarize([_run("fp32", 0, 3.0), _run("a", 0, 3.5)])
  assert one[1]["spread_rule"].startswith("n/a")
  assert report.summarize([_run("a", 0, 3.5)])[0]["verdict"].startswith("no verdict")


def test_loaded_machine_is_flagged_beside_throughput():
  runs = [_run("fp32", s, 3.0 + s / 100, tokens_per_s=1000.0, load_1m=load, cpu_count=2)
          for s, load in enumerate((0.5, 3.5))]
  rows = report.summarize(runs)
  assert rows[0]["loaded"] and rows[0]["load_1m"] == 3.5
  md = report.summary_markdown(rows, seeds=2)
  assert "1000 (loaded)" in md and "measured on a loaded machine" in md
  calm = report.summarize([_run("fp32", 0, 3.0, tokens_per_s=1000.0, load_1m=0.5,
                                cpu_count=2)])
  assert not calm[0]["loaded"] and "(loaded)" not in report.summary_markdown(calm, seeds=1)


def test_gate_judge_fails_beyond_its_limits():
  row = {"recipe": "bf16_master", "loss_rel_err": 7e-5, "logits_mean_rel_err": 4.9e-3,
         "logits_p99_rel_err": 1.7e-2, "grad_worst_scaled_mean_err": 1.2e-2, "nonfinite": 0}
  assert gates.judge(row)["passed"]
  bad = gates.judge({**row, "grad_worst_scaled_mean_err": 0.04, "nonfinite": 3})
  assert not bad["passed"] and len(bad["failures"]) == 2
  md = report.summary_markdown([], [bad, {"recipe": "fp8_hybrid", "error": "boom"}])
  assert "FAIL: grad_worst_scaled_mean_err 4.00e-02 > 3.12e-02; nonfinite 3 > 0" in md
  assert "FAIL: gate raised boom" in md
  fwd, bwd, _ = gates.unit_roundoffs("fp8_hybrid")
  assert (fwd, bwd) == (2.0**-4, 2.0**-3)


def test_failed_run_is_recorded_and_sweep_goes_on(tmp_path, monkeypatch):
  def boom(cfg):
    raise FloatingPointError("synthetic failure")
  monkeypatch.setattr(sweep.trainlib, "train", boom)
  with open(tmp_path / "r.jsonl", "w") as f:
    run = sweep.run_one(sweep.SweepConfig.quick(), "fp32", 0, f)
  assert run["status"] == "failed" and "synthetic failure" in run["error"]
  assert json.loads(open(tmp_path / "r.jsonl").read())["status"] == "failed"


def test_unknown_recipe_fails_fast(tmp_path):
  with pytest.raises(ValueError, match="presets"):
    sweep.run_sweep(sweep.SweepConfig.quick(recipes=("fp32", "bf17"), out=str(tmp_path)))
