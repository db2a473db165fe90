"""The one training-step core: from (loss, grads, optimizer, state) to the new state.

Every training loop of the package ends its step here: `precision.train_step` and
`jit_train_step` (an NNX model updated in place), the study's programs (an explicit
TrainState, one seed or a batch of seeds under `jax.vmap`) and `precision.parallel`'s
per-device step (param shards, its own `apply_updates` hook and a loss averaged over the
ranks). What they share, and what used to be written in each:

* the loss handed to a transformation that takes extra arguments (optax's
  `GradientTransformationExtraArgs`, e.g. a spike guard) as ``value``: the unscaled f32
  loss, so that its decision does not depend on the loss scale;
* ``tx.update``, ``apply_updates`` (exact rounding into 16-bit params) and `order_after`
  (the narrow state leaves written after the params, so donated buffers update in place);
* a step the optimizer skipped (non-finite gradients, a loss spike) leaves the fp8
  scaling state as it was, like the params and the moments: the amax histories of a
  skipped step are exactly what made it non-finite.

`apply_gradients` is a pure function of its arguments (no Python state, no host sync),
so a caller may jit, vmap or shard_map it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import optax

from precision import fp8
from precision import optim
from precision.optim import _inplace


class StepResult(NamedTuple):
  """What one step leaves: the new params and optimizer state, the new fp8 scaling state
  (None without one), and whether the optimizer skipped the step (a bool scalar)."""
  params: Any
  opt_state: Any
  fp8_state: Any
  skipped: jax.Array


def apply_gradients(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
                    params: Any, *, loss: jax.Array, fp8_before: Any = None,
                    fp8_after: Any = None,
                    apply_updates: Callable[[Any, Any], Any] | None = None) -> StepResult:
  """One optimizer step and its fp8 rollback.

  Args:
    tx: the optimizer (`precision.optim.build_optimizer`'s, or plain optax).
    grads, opt_state, params: ``tx.update``'s arguments (grads already unscaled: the
      recipe's loss-scaling transform unscales them inside ``tx.update``).
    loss: the step's unscaled f32 loss, passed as ``value`` to a transformation that
      takes extra arguments.
    fp8_before, fp8_after: the fp8 scaling state before the step and as the forward and
      backward pass left it; the result's fp8_state is `fp8_after`, or `fp8_before` where
      the optimizer skipped the step. Both None without fp8.
    apply_updates: how updates are added to params (`precision.optim.apply_updates` when
      None; the data-parallel step passes its hook, which adds them to param shards).

  Returns:
    A StepResult.
  """
  extra = {"value": loss} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}
  if apply_updates is None:
    new_params, new_opt_state = _inplace.update_and_apply(tx, grads, opt_state, params,
                                                          **extra)
  else:
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra)
    new_params = apply_updates(params, updates)
    new_opt_state = _inplace.order_after(new_opt_state, new_params)
  skipped = optim.step_skipped(opt_state, new_opt_state)
  fp8_state = None
  if fp8_after is not None:
    fp8_state = fp8.rollback_fp8_state(fp8_after, fp8_before, skipped)
  return StepResult(new_params, new_opt_state, fp8_state, skipped)
