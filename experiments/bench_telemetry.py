"""Cost of the study's numerics telemetry: the sweep's GPT task under bf16_mixed, the
cell's step against the telemetry program (every GEMM tensor's statistics, monitors, the
update's parameter monitors), interleaved, with and without the what-if columns.

The telemetry runs as its own compiled program on the state before a step, every N steps,
so a loop of N steps with telemetry costs N steps plus one telemetry call:
overhead(N) = t_telemetry / (N * t_step). The statistics cost a fixed number of passes
over every GEMM operand and result, against a step whose GEMMs cost ~d_model
multiply-adds per element: the ratio falls as the model widens (tiny: d_model 64, small:
128). The first call of each program (compilation) is not timed; the telemetry
program's compile time is reported beside it.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

import precision as mp
from precision.study import _models


def _figures(model: str, batch: int, seq: int, repeats: int) -> dict:
  from experiments import sweep  # pylint: disable=g-import-not-at-top
  cfg = sweep.SweepConfig(model=model, batch=batch, seq=seq)
  task = sweep.make_task("gpt", cfg)
  tokens = jnp.asarray(next(iter(task.batches(0))))
  prog = _models.build(task, mp.get_recipe("bf16_mixed"), 0)
  step = prog.step.lower(prog.state, tokens, jnp.int32(0)).compile()
  compile_s = {}
  for whatif in (True, False):
    t = time.perf_counter()
    jax.block_until_ready(prog.telemetry(prog.state, tokens, jnp.int32(0), whatif).stats)
    compile_s[whatif] = time.perf_counter() - t
  state = prog.state
  times = {"step": [], True: [], False: []}
  for rep in range(repeats + 1):
    for whatif in (True, False):
      t = time.perf_counter()
      rec = prog.telemetry(state, tokens, jnp.int32(rep), whatif)
      jax.block_until_ready((rec.stats, rec.values))
      if rep:
        times[whatif].append(time.perf_counter() - t)
    t = time.perf_counter()
    state, metrics = step(state, tokens, jnp.int32(rep))
    jax.block_until_ready(metrics)
    if rep:
      times["step"].append(time.perf_counter() - t)
  ts = statistics.median(times["step"])
  row = {"params": prog.n_params, "tensors": len(rec.infos), "step_s": ts}
  for whatif, key in ((True, "whatif"), (False, "no_whatif")):
    tt = statistics.median(times[whatif])
    row[key] = {"telemetry_s": tt, "telemetry_over_step": tt / ts,
                "overhead_every_100": tt / (100 * ts), "overhead_every_10": tt / (10 * ts),
                "compile_s": compile_s[whatif]}
  return row


def run(quick: bool = False) -> dict:
  batch, seq = (4, 32) if quick else (8, 128)
  repeats = 5 if quick else 15
  models = ("tiny",) if quick else ("tiny", "small")
  return {"recipe": "bf16_mixed", "batch": batch, "seq": seq, "repeats": repeats,
          "rows": {m: _figures(m, batch, seq, repeats) for m in models}}
