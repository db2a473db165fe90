"""The step guard: unscale, all-finite check, skip by select, loss-scale adjustment, counters.

`loss_scaling(inner, loss_scale)` and `skip_nonfinite(inner)` share one implementation.
A skipped step returns updates of -0.0 (``x + -0.0 == x`` bit for bit for every x, +0.0 and
-0.0 included, where ``-0.0 + +0.0`` would flip a sign bit) and selects the previous inner
state leaf by leaf with `jnp.where`, never `lax.cond` (optax issue 377: cond breaks on
bf16 trees; on a GPU a cond reads its predicate on the host), so params and inner state
stay bit-identical. Each select is placed where the inner update computes that leaf
(`precision.optim._select`; the fused AdamW kernel skips inside its own pass), and the
grad norm and the all-finite check are one reduction (`_clip.norm_and_finite`): the
guarded update then reads each donated state buffer only to write its new value, and
XLA updates it in place, as it does the unguarded update.

Unscaled gradients are detectable: the guard of a loss-scaling optimizer divides the grads
by the scale whatever they are, so grads computed WITHOUT multiplying the loss by it come
out `scale` times too small (SGD stalls; Adam, scale-invariant, hides it). Reading the
scale (`precision.optim.loss_scale_of`, which `precision.value_and_grad`,
`precision.train_step` and `precision.parallel` call) marks the calling thread; the
loss-scaling update takes the mark, and warns once per process
(`UnscaledGradientsWarning`) when it is traced without one since the previous update.

A non-finite LOSS with finite gradients (an f16 mean that overflowed, an inf term under
stop_gradient) is a non-finite step too, when the guard can see it: either pass the loss
to the update (``tx.update(grads, opt_state, params, value=loss)``, optax's keyword for
the objective value) or compute the grads of ``nonfinite_loss_guard(loss)``, the loss
unchanged whose gradient is NaN when the loss is not finite, so the all-finite check on
the grads catches it. On a finite loss neither changes a bit.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision import _dtypes
from precision import _trace_state
from precision.optim import _clip
from precision.optim import _loss_scale
from precision.optim import _compat
from precision.optim import _tree
from precision.optim import _find
from precision.optim import _fused
from precision.optim import _select


class UnscaledGradientsWarning(UserWarning):
  """A loss-scaling optimizer was updated with grads computed without reading its scale."""


_warned = False  # the warning is shown once per process


def note_scale_read() -> None:
  """Marks this thread: the loss scale was read to scale a loss (`loss_scale_of`)."""
  _trace_state.SCALE_READ.set(True)


def _trivial_scale(loss_scale: Any) -> bool:
  """True when unscaling cannot change the grads: no loss scale, or one known to be 1."""
  if isinstance(loss_scale, _loss_scale.NoOpLossScale):
    return True
  value = getattr(loss_scale, "loss_scale", None)
  if isinstance(value, jax.core.Tracer) or value is None:
    return False  # traced: its value is unknown here, so it counts as a real scale
  try:
    return float(np.asarray(value, np.float64)) == 1.0
  except (TypeError, ValueError):
    return False


def _take_scale_read(loss_scale: Any) -> None:
  """Called by a loss-scaling update while it is traced: consumes this thread's mark, or
  warns (once per process) that the grads were computed without reading the scale."""
  global _warned
  if _trivial_scale(loss_scale):
    return
  read = _trace_state.SCALE_READ.get()
  _trace_state.SCALE_READ.set(False)
  if read or _warned:
    return
  _warned = True
  warnings.warn(
      f"precision.optim: tx.update of a loss-scaling optimizer ({type(loss_scale).__name__}) "
      "got gradients computed without reading the loss scale since its previous update. "
      "The optimizer divides them by the scale (2**15 by default), so unless the loss was "
      "multiplied by it they are that many times too small and training stalls (SGD) or "
      "is silently mis-scaled. Compute them with precision.value_and_grad(loss_fn, "
      "opt_state) or precision.train_step, or multiply the loss by "
      "precision.optim.loss_scale_of(opt_state) before differentiating. (Shown once per "
      "process; with two loss-scaled optimizers, read each scale after the other's "
      "update.)", UnscaledGradientsWarning, stacklevel=3)


class GuardState(NamedTuple):
  """State of `loss_scaling` / `skip_nonfinite`; every counter is a device scalar.

  inner_state: the wrapped transformation's state.
  loss_scale: a LossScale, e.g. NoOp/Static/DynamicLossScale (the scale to multiply the loss by).
  skipped_steps: int32, steps whose update was skipped.
  nonfinite_steps: int32, steps whose (unscaled) grads held an inf or NaN.
  consecutive_finite: int32, finite steps since the last non-finite one.
  consecutive_nonfinite: int32, non-finite steps since the last finite one.
  grad_norm: f32, global norm of the last step's unscaled grads (NaN when non-finite).
  """

  inner_state: Any
  loss_scale: Any
  skipped_steps: jax.Array
  nonfinite_steps: jax.Array
  consecutive_finite: jax.Array
  consecutive_nonfinite: jax.Array
  grad_norm: jax.Array


@jax.custom_vjp
def nonfinite_loss_guard(loss: jax.Array) -> jax.Array:
  """The loss unchanged; its gradient is NaN where the loss is inf or NaN.

  The guard checks gradients only; a loss that is not finite while its gradients are
  (an f16 mean that overflowed, a stop_gradient term) would be applied as a normal step.
  Differentiating ``nonfinite_loss_guard(loss)`` instead of ``loss`` makes every
  gradient NaN on such a step, so the guard skips it and counts it non-finite. On a
  finite loss the cotangent passes through by a select, bit for bit.

  Examples:
    >>> grads = jax.grad(lambda p: nonfinite_loss_guard(loss_fn(p, batch)))(params)
  """
  return loss


def _loss_guard_fwd(loss):
  return loss, jnp.all(jnp.isfinite(loss))


def _loss_guard_bwd(finite, ct):
  return (jnp.where(finite, ct, jnp.full_like(ct, jnp.nan)),)


nonfinite_loss_guard.defvjp(_loss_guard_fwd, _loss_guard_bwd)


def _guard(inner, loss_scale, axis_name, skip):
  inner = _compat.compat(inner)

  def init_fn(params):
    z = jnp.zeros((), jnp.int32)
    return GuardState(inner.init(params), loss_scale, z, z, z, z, jnp.zeros((), jnp.float32))

  def update_fn(grads, state, params=None, *, value=None, veto=None):
    # value: the step's loss (scaled or not), when the caller passes it: a non-finite
    # loss is a non-finite step even when every gradient is finite.
    # veto: a wrapping guard's ``norm -> bool scalar`` (`spike_guard`): True skips this
    # step as if nothing happened, this guard's own counters and loss scale included,
    # with the skip's selects placed like this guard's own (see `_select`).
    if not isinstance(state, GuardState):
      raise ValueError(f"state is a {type(state).__name__}; accepted: the state this "
                       "optimizer's init returned (a precision.optim GuardState)")
    _take_scale_read(state.loss_scale)
    # The norm and the all-finite check in one reduction (`norm_and_finite`; psum-ed over
    # `axis_name`, so every rank skips alike). It reads the grads and the scale through an
    # optimization barrier: without it XLA shares their upcast or unscaled values (or the
    # broadcast reciprocal) between this reduction and the update, and keeps them as a
    # temporary the size of the grads.
    measured = [jnp.asarray(x) for x in jax.tree.leaves(grads)
                if _dtypes.is_float(x) or isinstance(x, float)]
    measured, scale = jax.lax.optimization_barrier((measured, state.loss_scale))
    norm, finite = _clip.norm_and_finite(scale.unscale(measured), axis_name)
    if value is not None:
      finite = jnp.logical_and(finite, jnp.all(jnp.isfinite(jnp.asarray(value))))
    grads = state.loss_scale.unscale(grads)
    vetoed = None if veto is None else _tree.bool_scalar(veto(norm), "veto(norm)")
    apply = finite if skip else None
    if vetoed is not None:
      not_vetoed = jnp.logical_not(vetoed)
      apply = not_vetoed if apply is None else jnp.logical_and(apply, not_vetoed)
    if apply is not None and _fused.takes_apply(inner):
      # The fused AdamW kernel skips inside its own pass (its selects are in the kernel).
      updates, inner_state = inner.update(grads, state.inner_state, params, apply=apply)
    elif apply is not None:
      # Each state leaf selected where the update computes it (`_select`): the donated
      # state is then updated in place, with no copy of the old values kept for a select.
      updates, inner_state = _select.skip_unless(apply, inner.update, grads,
                                                 state.inner_state, params)
    else:
      updates, inner_state = inner.update(grads, state.inner_state, params)
    one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
    bad = jnp.where(finite, zero, one)
    new = GuardState(
        inner_state=inner_state,
        loss_scale=state.loss_scale.adjust(finite),
        skipped_steps=state.skipped_steps + (bad if skip else zero),
        nonfinite_steps=state.nonfinite_steps + bad,
        consecutive_finite=jnp.where(finite, state.consecutive_finite + 1, zero),
        consecutive_nonfinite=jnp.where(finite, zero, state.consecutive_nonfinite + 1),
        grad_norm=norm)
    if vetoed is not None:  # the counters and the scale as they were (scalars)
      own = lambda g: (g.loss_scale, g.skipped_steps, g.nonfinite_steps,
                       g.consecutive_finite, g.consecutive_nonfinite, g.grad_norm)
      new = GuardState(inner_state, *_tree.select(vetoed, own(state), own(new)))
    return updates, new

  return Guard(init_fn, update_fn)


class Guard(_compat.Own):
  """A guard of this module (`loss_scaling`, `skip_nonfinite`): its update also takes
  ``veto=``, a bool scalar with which a spike guard outside it skips the step (see
  update_fn). The capability is the type, as optax's `GradientTransformationExtraArgs`."""
  __slots__ = ()


def takes_veto(tx: optax.GradientTransformation) -> bool:
  """Whether `tx` is a guard of this module, whose update takes ``veto=``."""
  return isinstance(tx, Guard)


def loss_scaling(inner: optax.GradientTransformation, loss_scale: Any,
                 axis_name: str | None = None) -> optax.GradientTransformation:
  """Unscales grads in f32, checks they are all finite, skips the step if not, adjusts the
  loss scale and keeps counters (see `GuardState`).

  Args:
    inner: the optimizer run on the unscaled f32 grads (e.g. `master_weights(adamw)`).
    loss_scale: NoOpLossScale(), StaticLossScale(s), DynamicLossScale(...), or any pytree
      implementing the `LossScale` protocol.
    axis_name: when `update` runs inside shard_map/pmap on shards of the grads, the
      all-finite check and grad norm are reduced (pmin / psum) over this axis.

  Multiply the loss by `precision.optim.loss_scale_of(opt_state)` before differentiating
  (`precision.value_and_grad` and `precision.train_step` do). ``update(grads, state,
  params, value=loss)`` also treats a non-finite loss as a non-finite step (see
  `nonfinite_loss_guard` for a caller that cannot pass it). An update traced without the
  scale read since the previous update warns once per process (`UnscaledGradientsWarning`):
  its grads would be divided by a scale they were never multiplied by.

  Examples:
    >>> tx = loss_scaling(master_weights(optax.adamw(1e-3)), DynamicLossScale(2.0 ** 15))
  """
  if not isinstance(loss_scale, _loss_scale.LossScale):
    raise ValueError(f"loss_scale={loss_scale!r}; accepted: NoOpLossScale(), "
                     "StaticLossScale(s), DynamicLossScale(...) or another LossScale")
  return _guard(inner, loss_scale, axis_name, skip=True)


def skip_nonfinite(inner: optax.GradientTransformation, axis_name: str | None = None,
                   skip: bool = True) -> optax.GradientTransformation:
  """Non-finite guard for unscaled recipes: counts steps whose grads hold inf/NaN and (when
  `skip`) skips them, params and inner state bit-identical. Grads pass through unchanged
  (no cast), so on finite grads this is bit-identical to `inner`.

  To stop a run after N non-finite steps in a row, call `check_nonfinite_streak(opt_state,
  N)` from the host (one device->host read of an int32) every few steps.
  """
  return _guard(inner, _loss_scale.NoOpLossScale(), axis_name, skip=skip)


class NonFiniteStreakError(FloatingPointError):
  """Raised by `check_nonfinite_streak` when too many steps in a row were non-finite."""


def check_nonfinite_streak(opt_state: Any, max_consecutive: int) -> int:
  """Host-side check: raises NonFiniteStreakError when the last `max_consecutive` (or more)
  steps all had non-finite grads; returns the current streak otherwise.

  This reads one int32 from the device, a host sync: call it outside the jitted step, e.g.
  every 10 steps (it sees the streak as of the state it is given). Doing it inside the
  step would need a host callback whose exception surfaces asynchronously, wrapped in a
  runtime error, at some later sync point; this explicit call fails where the user looks.

  Examples:
    >>> for step in range(n):
    ...   params, opt_state = train_step(params, opt_state, batch)
    ...   if step % 10 == 0:
    ...     precision.optim.check_nonfinite_streak(opt_state, max_consecutive=10)
  """
  if int(max_consecutive) < 1:
    raise ValueError(f"max_consecutive={max_consecutive!r}; must be >= 1")
  guard = _find.find_state(opt_state, GuardState)
  if guard is None:
    raise ValueError("opt_state holds no GuardState; build the optimizer with "
                     "build_optimizer, loss_scaling or skip_nonfinite")
  streak = int(np.asarray(guard.consecutive_nonfinite))
  if streak >= max_consecutive:
    raise NonFiniteStreakError(
        f"{streak} consecutive optimizer steps had non-finite gradients "
        f"(limit {max_consecutive}); {int(np.asarray(guard.nonfinite_steps))} in total")
  return streak
