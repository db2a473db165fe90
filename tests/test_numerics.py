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


MODES = ("on", "off", "late", "excess_only", "off_avx2", "excess_only_avx2")


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
  """Each mode in its own interpreter, all started at once (each mostly imports JAX)."""
  tmp = str(tmp_path_factory.mktemp("faithful"))
  started = {mode: _start(mode, tmp) for mode in MODES}
  return {mode: _result(*run) for mode, run in started.items()}


def _native_in_codegen(mode):
  """Whether XLA:CPU's code generator emits native f16 arithmetic in `mode`, from the
  library's own reading of this CPU: only without the ISA ceiling (the "_avx2" modes and
  "on" set it where the CPU has AVX-512 FP16)."""
  return _numerics.native_f16_cpu() and not mode.endswith("_avx2") and mode != "on"


def test_switch_changes_what_xla_computes(probes):
  """With the switch XLA rounds every bf16 op (the f32 sum of bf16 exponentials equals
  the exact sum of the rounded values in every row); without it, it sums the unrounded
  f32 exponentials in some rows, and a bf16 softmax changes. f16 keeps every rounding
  without the switch too (XLA:CPU computes each f16 op in f32 and rounds it, and does not
  fold those roundings away), on either kind of CPU."""
  on, off = probes["on"], probes["off"]
  assert on["exp_sum_bf16"] == 0.0 and on["exp_sum_f16"] == 0.0
  changed = np.mean(on["softmax_bits"] != off["softmax_bits"])
  for mode in ("off", "off_avx2"):
    m = probes[mode]
    print(f"{mode}: exp-sum rows differing bf16 {m['exp_sum_bf16']:.3f} f16 "
          f"{m['exp_sum_f16']:.3f}; softmax against per-op bf16 {m['softmax_bf16']:.4f} "
          f"f16 {min(m['softmax_f16'], m['softmax_recip_f16']):.4f}; elementwise chain "
          f"bf16 {m['chain_bf16']} f16 {m['chain_f16']}; f16 multiply-add "
          f"{m['ops_f16']['muladd']:.3f}")
    assert m["exp_sum_bf16"] > 0.0 and m["softmax_bf16"] > 0.0
    assert m["exp_sum_f16"] == 0.0
  print(f"bf16 softmax elements changed by the switch {changed:.4f}")
  assert changed > 0.0


def test_faithful_matches_per_op_reference(probes):
  """With the switch every bf16/f16 op (+, -, *, /, a multiply-add, an elementwise chain,
  an exp-then-sum, a softmax) is bit for bit the per-op ml_dtypes rounding (the semantics
  the switch promises), on whatever CPU runs this: with native f16 arithmetic too (its ISA
  ceiling). One rewrite stays, which no XLA flag turns off: XLA's algebraic simplifier
  computes a division by a broadcast operand as a multiplication by its reciprocal, the
  reciprocal rounded to the dtype XLA computes it in (f16 itself; f32 for bf16, which
  XLA:CPU computes in f32, so the bf16 quotient was not changed here). The division by a
  broadcast (and the softmax, which divides by its broadcast row sum) is therefore checked
  against both readings: it is exactly one of them."""
  on = probes["on"]
  for name in ("bf16", "f16"):
    assert on[f"chain_{name}"] == 0.0 and on[f"exp_sum_{name}"] == 0.0
    assert on[f"ops_{name}"] == dict.fromkeys(("add", "sub", "mul", "div", "muladd"), 0.0), (
        name, on[f"ops_{name}"])
    print(f"{name}: division by a broadcast against the per-op division "
          f"{on[f'div_bcast_{name}']:.3f}, against a * (1 / b) {on[f'div_bcast_recip_{name}']:.3f}; "
          f"softmax {on[f'softmax_{name}']:.3f} / {on[f'softmax_recip_{name}']:.3f}")
    assert min(on[f"div_bcast_{name}"], on[f"div_bcast_recip_{name}"]) == 0.0
    assert min(on[f"softmax_{name}"], on[f"softmax_recip_{name}"]) == 0.0
  assert on["status"] == {"bfloat16": True, "float16": True}


@pytest.mark.parametrize("mode", MODES)
def test_status_equals_the_measurement(probes, mode):
  """faithful_rounding_status() in each mode is the direct measurement of the same
  interpreter: per dtype, whether every op above rounds per op."""
  m = probes[mode]
  assert m["status"] == m["measured"], (mode, {k: v for k, v in m.items()
                                               if k != "softmax_bits"})
  assert m["faithful"] is all(m["measured"].values())


@pytest.mark.parametrize("mode", ("off", "excess_only", "off_avx2", "excess_only_avx2"))
def test_without_the_switch_the_status_follows_the_cpu(probes, mode):
  """Without the full switch: bf16 is unfaithful exactly when the excess-precision flag is
  missing (on every CPU); f16 exactly when the code generator has native f16 (an x86 CPU
  with AVX-512 FP16 and no ISA ceiling), which contracts its multiply-adds. The "_avx2"
  modes are a CPU without AVX-512 FP16: run on one that has it, they take the other
  CPU's branch."""
  native = _native_in_codegen(mode)
  excess_flag = mode.startswith("excess_only")
  assert probes[mode]["status"] == {"bfloat16": excess_flag, "float16": not native}
  assert (probes[mode]["ops_f16"]["muladd"] > 0.05) == native
  assert probes[mode]["ops_bf16"]["muladd"] == 0.0 and probes[mode]["ops_f16"]["mul"] == 0.0


@pytest.mark.parametrize("mode", ("excess_only", "excess_only_avx2"))
def test_native_f16_without_the_ceiling_is_detected(probes, mode):
  """The excess-precision flag alone: where the code generator has native f16, a late
  switch cannot add the ceiling any more and says so, naming f16; elsewhere it returns."""
  native = _native_in_codegen(mode)
  print(f"{mode}: native f16 in code generation: {native}; f16 multiply-add differing: "
        f"{probes[mode]['ops_f16']['muladd']:.3f}")
  err = probes[mode]["late_enable_error"]
  assert (err is not None and "float16" in err and "--xla_cpu_max_isa=AVX2" in err) == native
  if not native:
    assert err is None


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
  # Without the switch bf16 is unfaithful on every CPU; f16 only where the code generator
  # has native f16 (test_without_the_switch_the_status_follows_the_cpu).
  assert probes["off"]["status"] == {"bfloat16": False,
                                     "float16": not _native_in_codegen("off")}
  # The flag put in XLA_FLAGS after JAX started: the variable says on, XLA never saw it,
  # and the status says off.
  late = probes["late"]
  assert late["env_flag"] is True
  assert late["exp_sum_bf16"] > 0.0
  assert late["faithful"] is False
  assert late["status"] == late["measured"]


def test_late_enable_raises_with_instructions(probes):
  for mode in ("off", "late", "off_avx2"):
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
