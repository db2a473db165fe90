"""The experiment scripts set XLA flags in main(), not when imported: importing one (as
the tests and other scripts do) leaves XLA_FLAGS and JAX_PLATFORMS as they were
(bench_study imports sweep)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = ("bench", "bench_host", "bench_optim", "bench_parallel", "demo", "train", "gates",
           "gpu_check", "sweep", "bench_study")


def test_importing_an_experiment_sets_no_xla_flag():
  code = (
      "import os, importlib\n"
      "before = (os.environ.get('XLA_FLAGS'), os.environ.get('JAX_PLATFORMS'))\n"
      f"for m in {MODULES!r}:\n"
      "  importlib.import_module('experiments.' + m)\n"
      "  after = (os.environ.get('XLA_FLAGS'), os.environ.get('JAX_PLATFORMS'))\n"
      "  assert after == before, (m, before, after)\n"
      "print('ok')\n")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
