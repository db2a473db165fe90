"""experiments/gpu_check.py off a GPU: its arguments, and its CPU dry path run the way a GPU
machine runs it (``PYTHONPATH=. python -m experiments.gpu_check``) with nothing of this
checkout installed."""

import argparse
import json
import os
import site
import subprocess
import sys

import pytest

from experiments import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_arguments():
  ap = gpu_check.parser()
  assert ap.parse_args([]).only == gpu_check.CHECKS
  args = ap.parse_args(["--dry-run", "--only", "train, kernels", "--out", "x"])
  assert args.dry_run and args.only == ("kernels", "train") and args.out == "x"
  for bad in ("bogus", "kernels,gemm", ","):
    with pytest.raises(argparse.ArgumentTypeError, match="accepted"):
      gpu_check.parse_checks(bad)
    with pytest.raises(SystemExit) as e:
      ap.parse_args(["--only", bad])
    assert e.value.code == 2


def test_versions_name_every_package():
  v = gpu_check.versions()
  assert set(v) == {"python", *gpu_check.PACKAGES}
  assert v["jax"] == __import__("jax").__version__
  assert "not installed" not in v.values()


@pytest.mark.slow
def test_dry_run_from_a_bare_checkout(tmp_path):
  """`python -S` skips site-packages' .pth files, so the editable install of `precision`
  (if any) is not on the path; the packages JAX needs are added as plain directories.
  The script must then import everything from the checkout, print the versions first,
  and its kernels must match their references bit for bit."""
  paths = [ROOT] + site.getsitepackages()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), XLA_FLAGS="",
             JAX_PLATFORMS="cpu")
  res = subprocess.run(
      [sys.executable, "-S", "-m", "experiments.gpu_check", "--dry-run", "--only",
       "kernels", "--out", str(tmp_path)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  first = res.stdout.splitlines()[0]
  assert first.startswith("gpu_check on python ") and "jax " in first and "flax " in first
  out = json.load(open(tmp_path / "gpu_check.json"))
  assert out["precision_from"] == os.path.join(ROOT, "precision")
  assert out["checks"] == ["kernels"] and out["faithful_rounding"] is True
  assert out["pallas_bit_identity"] and set(out["pallas_bit_identity"].values()) == {1.0}
