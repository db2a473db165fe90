"""The faithful-rounding switch: each case in a fresh interpreter, since XLA reads XLA_FLAGS
once, when its backend starts (tests/_faithful_probe.py)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import precision
from precision import _numerics

PROBE = os.path.join(os.path.dirname(__file__), "_faithful_probe.py")


def _start(mode, tmp_dir):
  env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=os.path.dirname(os.path.dirname(PROBE)))
  path = os.path.join(tmp_dir, f"softmax_{mode}.npy")
  proc = subprocess.Popen([sys.executable, PROBE, mode, path], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  return proc, path


def _result(proc, path):
  stdout, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 0, stderr[-3000:]
  out = json.loads(stdout.strip().splitlines()[-1])
  out["softmax_bits"] = np.load(path)
  return out


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
  """Each mode in its own interpreter, all started at once (each mostly imports JAX)."""
  tmp = str(tmp_path_factory.mktemp("faithful"))
  started = {mode: _start(mode, tmp) for mode in ("on", "off", "late", "excess_only")}
  return {mode: _result(*run) for mode, run in started.items()}


def test_switch_changes_what_xla_computes(probes):
  """With the switch XLA rounds every bf16 op (the f32 sum of bf16 exponentials equals
  the exact sum of the rounded values in every row); without it, it sums the unrounded
  f32 exponentials in some rows, and a bf16 softmax changes."""
  on, off = probes["on"], probes["off"]
  assert on["exp_sum_mismatch"] == 0.0
  assert off["exp_sum_mismatch"] > 0.0
  changed = np.mean(on["softmax_bits"] != off["softmax_bits"])
  print(f"without the switch: exp-sum rows differing {off['exp_sum_mismatch']:.3f}, "
        f"bf16 softmax elements changed {changed:.4f}, elementwise chain bf16 "
        f"{off['chain_bf16']} f16 {off['chain_f16']}")
  assert changed > 0.0


def test_faithful_matches_per_op_reference(probes):
  """With the switch every bf16/f16 op (+, -, *, /, a multiply-add, an elementwise chain)
  is bit for bit the per-op ml_dtypes rounding (the semantics the switch promises), on
  whatever CPU runs this: with native f16 arithmetic too (its ISA ceiling)."""
  on = probes["on"]
  assert on["chain_bf16"] == 0.0 and on["chain_f16"] == 0.0
  assert on["ops_bf16"] == on["ops_f16"] == dict.fromkeys(
      ("add", "sub", "mul", "div", "muladd"), 0.0), (on["ops_bf16"], on["ops_f16"])
  assert on["status"] == {"bfloat16": True, "float16": True}


def test_native_f16_without_the_ceiling_is_detected(probes):
  """The excess-precision flag alone: on a CPU with AVX-512 FP16 (this project's machines
  have it) XLA:CPU contracts f16 multiply-adds into one FMA, and the status names f16
  unfaithful while bf16 stays faithful; on a CPU without it, both are faithful."""
  ex = probes["excess_only"]
  native = _numerics.native_f16_cpu()
  print(f"native f16: {native}; f16 multiply-add differing without the ceiling: "
        f"{ex['ops_f16']['muladd']:.3f}")
  assert ex["status"] == {"bfloat16": True, "float16": not native}
  assert (ex["ops_f16"]["muladd"] > 0.05) == native
  assert ex["ops_bf16"]["muladd"] == 0.0 and ex["ops_f16"]["mul"] == 0.0
  # A late switch cannot add the ceiling any more: it says so, naming f16.
  err = ex["late_enable_error"]
  assert (err is not None and "float16" in err and "--xla_cpu_max_isa=AVX2" in err) == native


def test_flags_needed_follow_the_cpu():
  """The ISA ceiling is added only on a CPU with AVX-512 FP16, and a ceiling already in
  XLA_FLAGS is kept."""
  fp16 = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 avx512_fp16 amx_tile\n"
  plain = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
  excess, ceiling = "--xla_allow_excess_precision=false", "--xla_cpu_max_isa=AVX2"
  assert _numerics.flags_needed(fp16, []) == [excess, ceiling]
  assert _numerics.flags_needed(plain, []) == [excess]
  assert _numerics.flags_needed(fp16, [excess, "--xla_cpu_max_isa=avx512"]) == []
  assert _numerics.flags_needed(fp16, [excess, ceiling]) == []
  assert not _numerics.native_f16_cpu("flags : avx512fp16_not_this\n")


def test_status_is_what_the_backend_does(probes):
  assert probes["on"]["faithful"] is True
  assert probes["off"]["faithful"] is False
  assert probes["off"]["status"] == {"bfloat16": False, "float16": False}
  # The flag put in XLA_FLAGS after JAX started: the variable says on, XLA never saw it,
  # and the status says off.
  late = probes["late"]
  assert late["env_flag"] is True
  assert late["exp_sum_mismatch"] > 0.0
  assert late["faithful"] is False


def test_late_enable_raises_with_instructions(probes):
  for mode in ("off", "late"):
    msg = probes[mode]["late_enable_error"]
    assert msg is not None, mode
    assert "before the first JAX computation" in msg and "XLA_FLAGS" in msg


def test_enable_is_idempotent_when_on(probes):
  assert probes["on"]["late_enable_error"] is None


def test_this_process_probe():
  """tests/conftest.py set the flag before JAX started: the probe agrees, from inside a
  trace too, and the status is cached."""
  jax.numpy.zeros(()).block_until_ready()  # a backend has started
  both = {"bfloat16": True, "float16": True}
  assert _numerics.probe_faithful_rounding() == both
  assert jax.jit(lambda x: x + int(all(_numerics.probe_faithful_rounding().values())))(1) == 2
  assert precision.faithful_rounding_enabled() is True
  assert precision.faithful_rounding_status() == both
  assert _numerics._PROBED == {  # pylint: disable=protected-access
      d: {"excess": True, "muladd": True} for d in both}
  precision.enable_faithful_rounding()  # on already: returns
