"""experiments.bench --quick has every promised field, and every derived figure (ratios,
FLOPs per token) agrees with the measurements it is derived from; gpu_check runs end to
end (dry run) with the Pallas kernels bit-identical to their references."""

import json
import math

import pytest

from experiments import bench
from experiments import bench_host
from experiments import gpu_check
from models import gpt


def _ratio(num, den):
  """num / den, after checking both are finite positive measurements."""
  assert math.isfinite(num) and num > 0 and math.isfinite(den) and den > 0, (num, den)
  return num / den


def _same(got, want):
  assert got == pytest.approx(want, rel=1e-12), (got, want)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  assert bench.main(["--quick", "--out", str(out)]) == 0
  with open(out / "bench.json") as f:
    return json.load(f), (out / "bench.md").read_text()


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_every_section_and_field(quick):
  res, md = quick
  for section in bench.SECTIONS:
    assert section in res, section
  for name in ("attention_block", "gpt_stack"):
    p = res["policy"][name]
    _same(p["time_ratio"], _ratio(p["policy"]["median_ms"], p["hand"]["median_ms"]))
    assert p["policy"]["dots"] == p["hand"]["dots"] > 0
    assert p["policy"]["dot_flops"] == p["hand"]["dot_flops"]
    assert {"converts", "dots", "dot_flops", "median_ms"} <= set(p["policy"])
  rec = res["recipes"]
  rows = rec["rows"]
  assert set(rows) >= {"fp32", "bf16_mixed", "bf16_master"}
  cfg = gpt.get_config(rec["model"])
  for name, r in rows.items():
    assert set(r["memory"]) >= {"argument", "output", "alias", "temp"}
    # Donation: the step's params/state outputs alias its inputs.
    assert r["memory"]["alias"] > 0
    assert abs(r["ledger_rel_err"]) < 0.01, (name, r["ledger_rel_err"])
    _same(r["ledger_rel_err"], r["persistent_bytes_measured"] / r["persistent_bytes_ledger"] - 1)
    # llm.c's 6N + 6LCT, from the model config and the measured parameter count.
    assert r["flops_per_token"] == 6 * r["params"] + 6 * cfg.n_layers * cfg.d_model * rec["seq"]
    _same(r["tokens_per_s_vs_fp32"], _ratio(r["tokens_per_s"], rows["fp32"]["tokens_per_s"]))
    assert "mfu" in r and r["mfu"] is None  # CPU: no known peak
  assert rows["fp32"]["activation_vs_fp32"] == 1.0
  _same(rows["bf16_mixed"]["activation_vs_fp32"],
        _ratio(rows["bf16_mixed"]["activation_bytes_per_seq"],
               rows["fp32"]["activation_bytes_per_seq"]))
  assert rows["bf16_mixed"]["activation_vs_fp32"] < 1.0
  opt = res["optimizer"]
  for size in map(str, opt["sizes"]):
    secs, ratio = opt["seconds"][size], opt["ratio"][size]
    temps = opt["temp_bytes_per_param"][size]
    assert set(ratio) == set(secs) == set(temps) and ratio[opt["baseline"]] == 1.0
    # Ratios are medians of per-round ratios (interleaved rounds), not ratios of medians.
    assert all(v > 0 for v in ratio.values()) and all(v >= 0 for v in temps.values())
    # The hand-written update and a guarded recipe optimizer update in place.
    assert temps[opt["baseline"]] <= 1.0 and temps["build_optimizer bf16_master"] <= 1.0
  rnd = res["rounding"]
  _same(rnd["sr_over_astype"], _ratio(rnd["sr_xla_s"], rnd["astype_s"]))
  _same(rnd["fused_over_unfused"], _ratio(rnd["fused_adamw_s"], rnd["unfused_adamw_s"]))
  f8 = res["fp8"]
  _same(f8["step_fp8_over_bf16"],
        _ratio(f8["step_seconds"]["bf16_mixed"], f8["step_seconds"]["fp8_hybrid"]))
  assert set(f8["gemm_fp8_over_bf16"]) == set(f8["gemm_seconds"]) - {"bf16"}
  for k, v in f8["gemm_fp8_over_bf16"].items():
    _same(v, _ratio(f8["gemm_seconds"]["bf16"], f8["gemm_seconds"][k]))
  stages = {(r["recipe"], r["stage"]) for r in res["zero"]["rows"]}
  assert stages == {(rc, s) for rc in ("fp32", "bf16_master") for s in (0, 1, 2, 3, "3L")}
  temps = {(r["recipe"], r["stage"]): r["temp_KiB"] for r in res["zero"]["rows"]}
  assert temps["bf16_master", "3L"] < temps["bf16_master", 3]   # layer by layer holds less
  host = res["host"]
  assert host["variables"][str(host["layers"][-1])] > host["variables"][str(host["layers"][0])]
  for n in map(str, host["layers"]):
    secs = host["seconds"][n]
    assert set(secs) == set(bench_host.PATTERNS) | {bench_host.PROGRAM}
    for p in bench_host.PATTERNS:
      _same(host["host_seconds"][n][p], secs[p] - secs[bench_host.PROGRAM])
    _same(host["helper_over_split"][n], _ratio(secs["jit_train_step"], secs["split + jax.jit"]))
    _same(host["nnx_over_split"][n], _ratio(secs["nnx.jit"], secs["split + jax.jit"]))
  assert "## ZeRO stages" in md and "## Policy wrapper" in md and "## Host time per step" in md


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_gpu_check_dry_run(tmp_path):
  assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
  with open(tmp_path / "gpu_check.json") as f:
    res = json.load(f)
  # Every kernel, the fused AdamW with a master copy included, equals its reference bit
  # for bit (fraction of equal elements 1.0).
  assert res["pallas_bit_identity"] == {
      **{f"float32->{t}": 1.0 for t in ("bf16", "f16", "e4m3", "e5m2")},
      **{f"bfloat16->{t}": 1.0 for t in ("e4m3", "e5m2")},
      "fused_adamw_sr_master=False": 1.0, "fused_adamw_sr_master=True": 1.0}
  tr, bw = res["train"], res["bandwidth"]
  _same(tr["bf16_over_fp32"], _ratio(tr["tokens_per_s"]["bf16_mixed"], tr["tokens_per_s"]["fp32"]))
  # On a CPU "block_scaled" runs the emulation (the platform switch's default branch).
  assert res["micro"]["auto_picks"] == "emulated"
  for name in ("mxfp8", "nvfp4"):
    assert res["micro"][name]["max_rel_diff"] == 0.0
  _same(bw["pallas_sr_vs_copy"], _ratio(bw["pallas_sr_bytes_per_s"], bw["copy_bytes_per_s"]))


def test_gpu_check_refuses_cpu_without_dry_run(tmp_path):
  assert gpu_check.main(["--out", str(tmp_path)]) == 2
