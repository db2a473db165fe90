"""Shared model and data of tests/test_parallel.py, and its multi-process worker.

Imported by the test for the tiny MLP, its data and the single-device reference. Run as a
script, it is one process of a `jax.distributed` job on localhost:

  python tests/_parallel_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS OUT.npz

Each process trains `data_parallel` stage 1 (fp32 recipe) for STEPS_MP steps on a mesh over
every device of the job, feeding only its own slice of each global batch, and writes the
losses and final params (process 0) to OUT.npz.
"""

from __future__ import annotations

import os
import sys

import numpy as np

IN, HIDDEN, OUT = 32, 125, 5      # 4000 + 125 + 625 + 5 = 4755 params: divisible by nothing
GLOBAL_BATCH = 32                 # 4 rows per device on 8 devices
STEPS, STEPS_MP = 20, 5
LR = 1e-3


def make_params(seed: int = 0) -> dict[str, np.ndarray]:
  r = np.random.default_rng(seed)
  return {
      "w1": (r.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
      "b1": (0.1 * r.normal(size=(HIDDEN,))).astype(np.float32),
      "w2": (r.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
      "b2": np.zeros((OUT,), np.float32),
  }


def make_batches(steps: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
  r = np.random.default_rng(seed)
  return [{"x": r.normal(size=(GLOBAL_BATCH, IN)).astype(np.float32),
           "y": r.normal(size=(GLOBAL_BATCH, OUT)).astype(np.float32)} for _ in range(steps)]


def loss_fn(params, batch):
  """Mean squared error of a tanh MLP; GEMMs in the params' dtype with f32 accumulation."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  f32 = jnp.float32
  dt = params["w1"].dtype
  h = jnp.dot(batch["x"].astype(dt), params["w1"], preferred_element_type=f32)
  h = jnp.tanh(h + params["b1"].astype(f32)[None, :])
  y = jnp.dot(h.astype(dt), params["w2"], preferred_element_type=f32)
  y = y + params["b2"].astype(f32)[None, :]
  return jnp.mean(jnp.square(y - batch["y"]))


def main(argv: list[str]) -> None:
  pid, nproc, port, per_process, out = (int(argv[1]), int(argv[2]), int(argv[3]),
                                        int(argv[4]), argv[5])
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={per_process}"
  import precision  # pylint: disable=g-import-not-at-top
  precision.enable_faithful_rounding()  # the flags the test process runs with
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)
  import optax  # pylint: disable=g-import-not-at-top

  from precision import parallel  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=1, recipe="fp32")
  state = dp.init(make_params())
  rows = GLOBAL_BATCH // nproc
  losses = []
  for batch in make_batches(STEPS_MP):
    local = {k: v[pid * rows:(pid + 1) * rows] for k, v in batch.items()}
    state, metrics = dp.step(state, dp.shard_batch(local))
    losses.append(np.asarray(metrics["loss"].addressable_shards[0].data))
  params = {k: np.asarray(v.addressable_shards[0].data) for k, v in dp.params(state).items()}
  if pid == 0:
    np.savez(out, losses=np.stack(losses), **params)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
