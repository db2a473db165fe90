"""experiments.bench --quick has every promised field; gpu_check runs end to end (dry run)."""

import json
import math

import pytest

from experiments import bench
from experiments import gpu_check


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  assert bench.main(["--quick", "--out", str(out)]) == 0
  with open(out / "bench.json") as f:
    return json.load(f), (out / "bench.md").read_text()


def test_every_section_and_field(quick):
  res, md = quick
  for section in bench.SECTIONS:
    assert section in res, section
  for name in ("attention_block", "gpt_stack"):
    p = res["policy"][name]
    assert p["time_ratio"] > 0 and p["policy"]["dots"] == p["hand"]["dots"]
    assert p["policy"]["dot_flops"] == p["hand"]["dot_flops"]
    assert {"converts", "dots", "dot_flops", "median_ms"} <= set(p["policy"])
  rows = res["recipes"]["rows"]
  assert set(rows) >= {"fp32", "bf16_mixed", "bf16_master"}
  for name, r in rows.items():
    assert set(r["memory"]) >= {"argument", "output", "alias", "temp"}
    # Donation: the step's params/state outputs alias its inputs.
    assert r["memory"]["alias"] > 0
    assert abs(r["ledger_rel_err"]) < 0.01, (name, r["ledger_rel_err"])
    assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0
    assert "mfu" in r and r["mfu"] is None  # CPU: no known peak
  assert rows["fp32"]["activation_vs_fp32"] == 1.0
  assert rows["bf16_mixed"]["activation_vs_fp32"] < 1.0
  opt = res["optimizer"]
  assert all(math.isfinite(v) for v in opt["ratio"][str(opt["sizes"][0])].values())
  assert res["rounding"]["sr_over_astype"] > 0 and res["rounding"]["fused_over_unfused"] > 0
  assert res["fp8"]["step_fp8_over_bf16"] > 0
  stages = {(r["recipe"], r["stage"]) for r in res["zero"]["rows"]}
  assert stages == {(rc, s) for rc in ("fp32", "bf16_master") for s in (0, 1, 2, 3, "3L")}
  temps = {(r["recipe"], r["stage"]): r["temp_KiB"] for r in res["zero"]["rows"]}
  assert temps["bf16_master", "3L"] < temps["bf16_master", 3]   # layer by layer holds less
  assert "## ZeRO stages" in md and "## Policy wrapper" in md


def test_gpu_check_dry_run(tmp_path):
  assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
  with open(tmp_path / "gpu_check.json") as f:
    res = json.load(f)
  assert all(v == 1.0 for k, v in res["pallas_bit_identity"].items() if "master=True" not in k)
  assert res["train"]["bf16_over_fp32"] > 0 and res["bandwidth"]["pallas_sr_vs_copy"] > 0


def test_gpu_check_refuses_cpu_without_dry_run(tmp_path):
  assert gpu_check.main(["--out", str(tmp_path)]) == 2
