"""Cost of the study's numerics telemetry: the sweep's GPT task, one recipe, the cell's step
against the telemetry program (every GEMM tensor's statistics, monitors), interleaved.

The telemetry runs as its own compiled program on the state before a step, every N steps,
so with telemetry every N steps a loop of N steps costs N steps plus one telemetry call:
overhead(N) = t_telemetry / (N * t_step). The first call of each program (compilation) is
not timed; the telemetry program's compile time is reported beside it.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import precision as mp
from precision.study import _models


def run(quick: bool = False) -> dict:
  from experiments import sweep  # pylint: disable=g-import-not-at-top
  cfg = sweep.SweepConfig.quick() if quick else sweep.SweepConfig(model="tiny", batch=8,
                                                                  seq=128)
  task = sweep.make_task("gpt", cfg)
  repeats = 5 if quick else 15
  out = {"model": cfg.model, "batch": cfg.batch, "seq": cfg.seq, "repeats": repeats,
         "rows": {}}
  batch = jnp.asarray(next(iter(task.batches(0))))
  for name in ("bf16_mixed", "f16_mixed"):
    prog = _models.build(task, mp.get_recipe(name), 0)
    step = prog.step.lower(prog.state, batch, jnp.int32(0)).compile()
    t = time.perf_counter()
    jax.block_until_ready(prog.telemetry(prog.state, batch, jnp.int32(0), True).stats)
    compile_s = time.perf_counter() - t
    state = prog.state
    step_t, tele_t = [], []
    for rep in range(repeats + 1):
      t = time.perf_counter()
      rec = prog.telemetry(state, batch, jnp.int32(rep), True)
      jax.block_until_ready((rec.stats, rec.values))
      if rep:
        tele_t.append(time.perf_counter() - t)
      t = time.perf_counter()
      state, metrics = step(state, batch, jnp.int32(rep))
      jax.block_until_ready(metrics)
      if rep:
        step_t.append(time.perf_counter() - t)
    ts, tt = statistics.median(step_t), statistics.median(tele_t)
    out["rows"][name] = {
        "step_s": ts, "telemetry_s": tt, "telemetry_over_step": tt / ts,
        "overhead_every_100": tt / (100 * ts), "overhead_every_10": tt / (10 * ts),
        "telemetry_compile_s": compile_s, "tensors": len(rec.infos),
        "monitors": len(rec.monitor_keys), "params": prog.n_params,
        "step_spread": [float(np.min(step_t)), float(np.max(step_t))]}
  return out
