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


def _probe(mode, tmp_dir):
  env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=os.path.dirname(os.path.dirname(PROBE)))
  path = os.path.join(tmp_dir, f"softmax_{mode}.npy")
  res = subprocess.run([sys.executable, PROBE, mode, path], capture_output=True, text=True,
                       env=env, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  out = json.loads(res.stdout.strip().splitlines()[-1])
  out["softmax_bits"] = np.load(path)
  return out


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
  tmp = str(tmp_path_factory.mktemp("faithful"))
  return {mode: _probe(mode, tmp) for mode in ("on", "off", "late")}


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
  """With the switch an elementwise bf16/f16 chain is bit for bit the per-op ml_dtypes
  rounding (the semantics the switch promises)."""
  on = probes["on"]
  assert on["chain_bf16"] == 0.0 and on["chain_f16"] == 0.0


def test_status_is_what_the_backend_does(probes):
  assert probes["on"]["faithful"] is True
  assert probes["off"]["faithful"] is False
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
  assert _numerics.probe_faithful_rounding() is True
  assert jax.jit(lambda x: x + int(_numerics.probe_faithful_rounding()))(1) == 2
  assert precision.faithful_rounding_enabled() is True
  assert _numerics._PROBED is True  # pylint: disable=protected-access
  precision.enable_faithful_rounding()  # on already: returns
