"""Reading an optimizer state: loss scale, metrics (non-finite and spike guards), master
params (no host sync)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precision.optim import _guard
from precision.optim import _master
from precision.optim import _remainder
from precision.optim import _spike
from precision.optim import _tree
from precision.optim._find import find_state  # here too: _guard calls _query.find_state
from precision.rounding import FusedAdamWState


def loss_scale_of(opt_state: Any) -> jax.Array:
  """f32 scalar to multiply the loss by: the current loss scale, 1.0 when there is none.

  Reading it marks the calling thread: the next update of a loss-scaling optimizer takes
  the mark; one traced without it warns (`UnscaledGradientsWarning`, once per process).
  `precision.value_and_grad` and `precision.train_step` call it for you.

  Examples:
    >>> scale = loss_scale_of(opt_state)
    >>> loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(params)
  """
  _guard.note_scale_read()
  guard = find_state(opt_state, _guard.GuardState)
  if guard is None:
    return jnp.ones((), jnp.float32)
  return jnp.asarray(guard.loss_scale.loss_scale, jnp.float32)


def step_skipped(old_opt_state: Any, new_opt_state: Any) -> jax.Array:
  """bool scalar: the optimizer skipped the step that took `old_opt_state` to
  `new_opt_state`: the non-finite guard's `skipped_steps` counter grew, or the spike
  guard's (`spike_guard`). False when there is neither.

  Use it to roll back state the optimizer does not own along with the skipped step, e.g.
  `precision.fp8.rollback_fp8_state`. No host sync.

  Examples:
    >>> updates, new_opt_state = tx.update(grads, opt_state, params)
    >>> skipped = step_skipped(opt_state, new_opt_state)
  """
  grew = []
  for kind in (_guard.GuardState, _spike.SpikeGuardState):
    old = find_state(old_opt_state, kind)
    new = find_state(new_opt_state, kind)
    if (old is None) != (new is None):
      raise ValueError(f"step_skipped: only one of the two optimizer states holds a "
                       f"{kind.__name__}; accepted: the states before and after one update "
                       "of one optimizer")
    if old is not None:
      grew.append(new.skipped_steps > old.skipped_steps)
  if not grew:
    return jnp.asarray(False)
  return grew[0] if len(grew) == 1 else jnp.logical_or(grew[0], grew[1])


def optimizer_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Device scalars: loss_scale (f32), skipped_steps, nonfinite_steps, consecutive_finite,
  consecutive_nonfinite (int32), grad_norm (f32, of the last step's unscaled grads).

  Without a guard in the state the counters read 0 and grad_norm NaN (not measured). With
  a spike guard (`spike_guard`, ``Recipe.spike_guard``) skipped_steps counts the spike
  skips too, grad_norm is the last step's even when it was a skipped spike, and the keys
  of `spike_metrics` are added.
  """
  guard = find_state(opt_state, _guard.GuardState)
  if guard is None:
    z = jnp.zeros((), jnp.int32)
    m = {"loss_scale": jnp.ones((), jnp.float32), "skipped_steps": z, "nonfinite_steps": z,
         "consecutive_finite": z, "consecutive_nonfinite": z,
         "grad_norm": jnp.full((), jnp.nan, jnp.float32)}
  else:
    m = {"loss_scale": jnp.asarray(guard.loss_scale.loss_scale, jnp.float32),
         "skipped_steps": guard.skipped_steps, "nonfinite_steps": guard.nonfinite_steps,
         "consecutive_finite": guard.consecutive_finite,
         "consecutive_nonfinite": guard.consecutive_nonfinite, "grad_norm": guard.grad_norm}
  spike = find_state(opt_state, _spike.SpikeGuardState)
  if spike is not None:
    m.update(spike_metrics(opt_state))
    m["skipped_steps"] = m["skipped_steps"] + spike.skipped_steps
    m["grad_norm"] = spike.grad_norm
  return m


def spike_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Device scalars of the spike guard (`spike_guard`) in `opt_state`, no host sync:
  spike_skipped_steps, consecutive_spike_skips, spike_window (values in its window)
  (int32), loss_z and grad_norm_z (f32, the last step's z-scores; NaN when none was
  computed: warm-up or a non-finite step).

  Without a spike guard the counters read 0 and the z-scores NaN.

  Examples:
    >>> m = spike_metrics(opt_state)
    >>> int(m["spike_skipped_steps"]), float(m["loss_z"])
  """
  s = find_state(opt_state, _spike.SpikeGuardState)
  if s is None:
    z = jnp.zeros((), jnp.int32)
    nan = jnp.full((), jnp.nan, jnp.float32)
    return {"spike_skipped_steps": z, "consecutive_spike_skips": z, "spike_window": z,
            "loss_z": nan, "grad_norm_z": nan}
  return {"spike_skipped_steps": s.skipped_steps,
          "consecutive_spike_skips": s.consecutive_skipped, "spike_window": s.filled,
          "loss_z": s.loss_z, "grad_norm_z": s.grad_norm_z}


def master_params(opt_state: Any, params: Any) -> Any:
  """The f32 (master dtype) params: the master copy where the state keeps one (exactly
  rebuilt from remainders for `remainder_master_weights`), else `params` upcast to f32."""
  master = find_state(opt_state, _master.MasterState)
  if master is not None:
    return master.master
  fused = find_state(opt_state, FusedAdamWState)
  if fused is not None and fused.master is not None:
    return fused.master
  rem = find_state(opt_state, _remainder.RemainderState)
  if rem is not None:
    return jax.tree.map(_remainder.merge_master, params, rem.remainder)
  return _tree.cast(params, jnp.float32)
