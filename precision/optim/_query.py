"""Reading an optimizer state: loss scale, metrics, master params (no host sync)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from precision.optim import _guard
from precision.optim import _master
from precision.optim import _remainder
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
  """bool scalar: the optimizer guard skipped the step that took `old_opt_state` to
  `new_opt_state` (its `skipped_steps` counter grew). False when there is no guard.

  Use it to roll back state the optimizer does not own along with the skipped step, e.g.
  `precision.fp8.rollback_fp8_state`. No host sync.

  Examples:
    >>> updates, new_opt_state = tx.update(grads, opt_state, params)
    >>> skipped = step_skipped(opt_state, new_opt_state)
  """
  old = find_state(old_opt_state, _guard.GuardState)
  new = find_state(new_opt_state, _guard.GuardState)
  if (old is None) != (new is None):
    raise ValueError("step_skipped: only one of the two optimizer states holds a GuardState; "
                     "accepted: the states before and after one update of one optimizer")
  if old is None:
    return jnp.asarray(False)
  return new.skipped_steps > old.skipped_steps


def optimizer_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Device scalars: loss_scale (f32), skipped_steps, nonfinite_steps, consecutive_finite,
  consecutive_nonfinite (int32), grad_norm (f32, of the last step's unscaled grads).

  Without a guard in the state the counters read 0 and grad_norm NaN (not measured).
  """
  guard = find_state(opt_state, _guard.GuardState)
  if guard is None:
    z = jnp.zeros((), jnp.int32)
    return {"loss_scale": jnp.ones((), jnp.float32), "skipped_steps": z, "nonfinite_steps": z,
            "consecutive_finite": z, "consecutive_nonfinite": z,
            "grad_norm": jnp.full((), jnp.nan, jnp.float32)}
  return {"loss_scale": jnp.asarray(guard.loss_scale.loss_scale, jnp.float32),
          "skipped_steps": guard.skipped_steps, "nonfinite_steps": guard.nonfinite_steps,
          "consecutive_finite": guard.consecutive_finite,
          "consecutive_nonfinite": guard.consecutive_nonfinite, "grad_norm": guard.grad_norm}


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
