"""`data_parallel_pmap`: ZeRO stages 0 and 1 under `jax.pmap`, for pmap codebases.

The per-device bodies are the ones `data_parallel` runs under shard_map, so both give the
same numbers. State leaves carry a leading device axis: replicated leaves hold n copies,
sharded optimizer-state leaves hold one shard per row.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from precision._plan import Plan
from precision._recipe import Recipe
from precision._state import TrainState
from precision.parallel._data_parallel import check_batch_rows, plan_of, step_config
from precision.parallel._layout import ParamLayout
from precision.parallel._step import local_init, local_step

PMAP_STAGES = (0, 1)


class PmapDataParallel:
  """ZeRO-0/1 trainer on `jax.pmap`; build it with `data_parallel_pmap`.

  `init(params) -> TrainState` (leaves with a leading device axis), `shard_batch(batch)`
  (global batch -> one row of slices per device), `step(state, batch) -> (state,
  metrics)` (metrics from device 0), `params(state)` the full params of device 0.
  """

  def __init__(self, cfg, devices, *, param_dtype, donate: bool):
    self.cfg, self.devices, self._param_dtype = cfg, list(devices), param_dtype
    self.zero_stage, self.axis_name = cfg.zero_stage, cfg.axis_name
    self._donate = donate
    self._steps: dict[ParamLayout, Callable] = {}

  def init(self, params) -> TrainState:
    cast = lambda tree: jax.tree.map(lambda x: x.astype(self._param_dtype or x.dtype), tree)
    params = jax.tree.map(np.asarray, params)
    layout = ParamLayout.of(jax.eval_shape(cast, params), self.cfg.devices)
    fn = jax.pmap(lambda p: local_init(self.cfg, layout, cast(p)), self.axis_name,
                  devices=self.devices)
    n = self.cfg.devices
    p, o = fn(jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), params))
    return TrainState(p, o, layout=layout)

  def _compiled(self, layout: ParamLayout):
    if layout not in self._steps:
      body = lambda p, o, b: _drop_fp8_state(local_step(self.cfg, layout, p, o, b))
      self._steps[layout] = jax.pmap(body, self.axis_name, devices=self.devices,
                                     donate_argnums=(0, 1) if self._donate else ())
    return self._steps[layout]

  def shard_batch(self, batch):
    """The global batch -> leaves of shape (devices, rows per device, ...), pmap's layout."""
    n = self.cfg.devices
    check_batch_rows(batch)

    def split(x):
      x = np.asarray(x)
      if x.shape[0] % n:
        raise ValueError(f"Global batch of {x.shape[0]} rows does not split over {n} "
                         f"devices; accepted: a multiple of {n}")
      return x.reshape((n, x.shape[0] // n) + x.shape[1:])

    return jax.tree.map(split, batch)

  def step(self, state: TrainState, batch):
    """One step on a batch from `shard_batch`; metrics are device 0's (all agree)."""
    params, opt_state, metrics = self._compiled(state.layout)(
        state.params, state.opt_state, batch)
    return (TrainState(params, opt_state, layout=state.layout),
            jax.tree.map(lambda m: m[0], metrics))

  def params(self, state: TrainState):
    return jax.tree.map(lambda x: x[0], state.params)


def _drop_fp8_state(out):
  params, opt_state, _, metrics = out   # pmap runs loss_fn(params, batch) only
  return params, opt_state, metrics


def data_parallel_pmap(loss_fn: Callable[[Any, Any], jax.Array],
                       tx: optax.GradientTransformation, *, zero_stage: int = 0,
                       recipe: Plan | Recipe | str | None = None, axis_name: str = "data",
                       devices: Sequence[jax.Device] | None = None, seed: int = 0,
                       donate: bool = True) -> PmapDataParallel:
  """`data_parallel` for codebases written with `jax.pmap` (stages 0 and 1 only).

  Same arguments and numerics as `data_parallel`, over `devices` (default: all local
  devices) instead of a Mesh.
  """
  if zero_stage not in PMAP_STAGES:
    raise ValueError(f"zero_stage={zero_stage!r} under pmap; accepted: 0, 1 (use "
                     "data_parallel on a Mesh for stages 2 and 3)")
  devices = list(devices) if devices is not None else jax.local_devices()
  plan = plan_of(recipe, None)
  cfg = step_config(loss_fn, tx, zero_stage=zero_stage, plan=plan, axis_name=axis_name,
                    devices=len(devices), seed=seed)
  param_dtype = None if plan is None else plan.param_dtype
  return PmapDataParallel(cfg, devices, param_dtype=param_dtype, donate=donate)
