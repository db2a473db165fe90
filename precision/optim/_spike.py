"""Loss-spike guard: skip a step whose loss or grad norm jumps far above its recent history.

`spike_guard(inner)` keeps the last `window` accepted steps' losses and global grad norms
in two f32 ring buffers. For each step it computes the one-sided z-score of the loss and
of the grad norm against them,

    z = (x - mean) / std,   mean and std (Bessel-corrected, ddof=1) of the window in f32,

(z = 0 when x equals the mean, so an all-equal window flags only increases) and skips the
step when either z exceeds `threshold`: the updates are -0.0 (the non-finite guard's
no-op: ``p + -0.0 == p`` bit for bit) and the inner state is the previous one, selected
leaf by leaf with `jnp.where`, never `lax.cond` (on GPU a cond reads its predicate on the
host, a sync per step). The selects are placed where each state leaf is computed
(precision.optim._select), so the donated state is still updated in place. The rejected
values do not enter the window.

Under the null hypothesis (the new value and the n window values i.i.d. Gaussian) ``z /
sqrt(1 + 1/n)`` is Student-t with n - 1 degrees of freedom, so a step is falsely skipped
with probability ``P(T_{n-1} > threshold / sqrt(1 + 1/n))`` per measurement (about 2e-8
for each of the two z-scores at the defaults n=100, threshold=6).

Composition with the non-finite guard (`loss_scaling` / `skip_nonfinite`, which
`build_optimizer` puts inside this one): the grad norm is the guard's own (of the
UNSCALED grads, reduced over its axis) when `inner` holds a `GuardState`, else the f32
global norm of the incoming updates. A step whose loss or grad norm is not finite is left
to that guard: it is neither a spike nor a window value, and its z-scores read NaN.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision._recipe import SpikeGuardConfig
from precision.optim import _clip
from precision.optim import _compat
from precision.optim import _find
from precision.optim import _guard
from precision.optim import _select
from precision.optim import _tree


class SpikeGuardState(NamedTuple):
  """State of `spike_guard`; arrays only, so checkpoints save and restore it exactly.

  inner_state: the wrapped transformation's state (as it was before a skipped step).
  losses, grad_norms: f32[window] ring buffers of the accepted steps' values; slots
    [0, filled) hold values, written in turn at `position`.
  filled: int32, values in the window (at most `window`).
  position: int32, the slot the next accepted value is written to.
  skipped_steps: int32, steps skipped as spikes.
  consecutive_skipped: int32, spike skips since the last step that entered the window.
  loss_z, grad_norm_z: f32, the last step's z-scores; NaN when none was computed (fewer
    than `min_history` values, or a non-finite loss or grad norm).
  grad_norm: f32, the last step's grad norm, skipped or not (a skipped step leaves the
    inner guard's own `grad_norm` at the previous step's value).
  """

  inner_state: Any
  losses: jax.Array
  grad_norms: jax.Array
  filled: jax.Array
  position: jax.Array
  skipped_steps: jax.Array
  consecutive_skipped: jax.Array
  loss_z: jax.Array
  grad_norm_z: jax.Array
  grad_norm: jax.Array


def window_z(x: jax.Array, window: jax.Array, filled: jax.Array) -> jax.Array:
  """f32 z-score of scalar `x` against the first `filled` values of `window` (f32[w]).

  mean = sum / n, std = sqrt(sum((v - mean)**2) / (n - 1)), both in f32 (the two-pass
  form: a sum of squares minus a squared mean would cancel catastrophically for a loss of
  8.0 varying by 1e-3); z = 0 where x == mean, +-inf where only the spread is 0.
  """
  mask = jnp.arange(window.shape[0], dtype=jnp.int32) < filled
  n = jnp.maximum(filled, 1).astype(jnp.float32)
  zero = jnp.zeros((), jnp.float32)
  mean = jnp.sum(jnp.where(mask, window, zero)) / n
  var = jnp.sum(jnp.where(mask, jnp.square(window - mean), zero)) / jnp.maximum(
      n - jnp.float32(1.0), jnp.float32(1.0))
  diff = x - mean
  return jnp.where(diff == zero, zero, diff / jnp.sqrt(var))


def _forwarded(inner: optax.GradientTransformation) -> str:
  """What `inner.update` takes besides (updates, state, params): "all" extra keywords
  (GradientTransformationExtraArgs or a **kwargs update), "value" only, or "none"."""
  if isinstance(inner, optax.GradientTransformationExtraArgs):
    return "all"
  try:
    params = inspect.signature(inner.update).parameters.values()
  except (TypeError, ValueError):
    return "none"
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return "all"
  return "value" if any(p.name == "value" for p in params) else "none"


def spike_guard(inner: optax.GradientTransformation, *, window: int = 100,
                threshold: float = 6.0, max_consecutive: int = 10,
                min_history: int | None = None, axis_name: str | None = None
                ) -> optax.GradientTransformationExtraArgs:
  """Skips steps whose loss or global grad norm spikes above the recent window.

  ``update(updates, state, params=None, *, value, **extra)`` takes the step's loss as
  `value` (optax's keyword for the objective; `precision.train_step`,
  `precision.parallel` and `precision.study` pass the unscaled f32 loss to any
  GradientTransformationExtraArgs). Per step, with n values in the window:

  * n < `min_history`: no z-score (warm-up); the step is applied and enters the window.
  * a non-finite loss or grad norm: not measured, not a spike, not a window value; the
    step is whatever `inner` (the non-finite guard) made of it.
  * otherwise the step is a spike when ``loss_z > threshold`` or ``grad_norm_z >
    threshold`` (see the module docstring for z). A spike is skipped (updates -0.0, inner
    state unchanged, window unchanged) unless `max_consecutive` spikes were skipped since
    the last step that entered the window: then it is applied and enters the window,
    so a lasting jump in the loss becomes the new baseline after at most
    `max_consecutive` skips in a row. Every measured step that is applied enters the
    window.

  Args:
    inner: the optimizer to guard, e.g. ``loss_scaling(...)`` (`build_optimizer` wraps its
      whole chain when ``Recipe.spike_guard`` is set). `value` and `extra` are passed on
      when `inner` takes them (GradientTransformationExtraArgs, a `value` keyword).
    window: steps kept, in [2, 65536]; the state holds 2 * window f32 values.
    threshold: z above which a step is a spike, > 0. At the default 6 a Gaussian-noise
      z-score fires with probability about 2e-8 (window 100); real loss noise is
      heavier-tailed, hence the margin.
    max_consecutive: spike skips in a row before a spike is applied anyway, >= 0 (0:
      measure z-scores, never skip).
    min_history: window values before the first z-score, in [2, window]; None:
      ``min(20, window)`` (at 20 values a threshold-6 z falsely fires with probability
      about 6e-6).
    axis_name: when `update` runs on shards of the grads (ZeRO) and `inner` holds no
      GuardState, the grad norm is psum-reduced over this axis. `value` must be the same
      on every rank (the global mean loss), so every rank skips alike.

  Examples:
    >>> tx = spike_guard(skip_nonfinite(optax.adamw(1e-3)), threshold=6.0)
    >>> updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    >>> int(precision.optim.spike_metrics(opt_state)["spike_skipped_steps"])
  """
  cfg = SpikeGuardConfig(window=window, threshold=threshold,
                         max_consecutive=max_consecutive, min_history=min_history)
  forwarded = _forwarded(inner)
  takes_veto = _guard.takes_veto(inner)
  inner = _compat.compat(inner)
  size, history = cfg.window, cfg.history
  limit, thresh = cfg.max_consecutive, np.float32(cfg.threshold)

  def init_fn(params):
    zi = jnp.zeros((), jnp.int32)
    nan = jnp.full((), jnp.nan, jnp.float32)
    losses, norms = jnp.zeros((size,), jnp.float32), jnp.zeros((size,), jnp.float32)
    return SpikeGuardState(inner.init(params), losses, norms, zi, zi, zi, zi, nan, nan,
                           jnp.zeros((), jnp.float32))

  def update_fn(updates, state, params=None, *, value=None, **extra):
    if value is None:
      raise ValueError(
          "spike_guard: update got no value; accepted: tx.update(grads, opt_state, params, "
          "value=loss) with the step's scalar loss (precision.train_step passes it; in "
          "precision.parallel set Recipe.spike_guard)")
    loss = jnp.asarray(value)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
      raise ValueError(f"spike_guard: value is {loss.dtype}{list(loss.shape)}; accepted: "
                       "a floating scalar (the step's loss)")
    # f32 holds every bf16/f16 loss exactly; the window and the z-scores are f32.
    loss = loss.astype(jnp.float32)
    kwargs = ({"value": value, **extra} if forwarded == "all" else
              {"value": value} if forwarded == "value" else {})
    decided: dict = {}

    def decide(norm):
      """Whether to skip, from the step's grad norm (and the loss and the window)."""
      norm = norm.astype(jnp.float32)
      measurable = jnp.logical_and(jnp.isfinite(loss), jnp.isfinite(norm))
      measured = jnp.logical_and(measurable, state.filled >= history)
      nan = jnp.full((), jnp.nan, jnp.float32)
      loss_z = jnp.where(measured, window_z(loss, state.losses, state.filled), nan)
      norm_z = jnp.where(measured, window_z(norm, state.grad_norms, state.filled), nan)
      # NaN compares False: an unmeasured step is never a spike.
      spike = jnp.logical_or(loss_z > thresh, norm_z > thresh)
      skip = jnp.logical_and(spike, state.consecutive_skipped < limit)
      decided.update(norm=norm, measurable=measurable, loss_z=loss_z, norm_z=norm_z,
                     skip=skip)
      return skip

    if takes_veto:
      # The guard inside decides with its own norm (of the unscaled grads) and places the
      # skip's selects where each state leaf is computed: in place, no copy of the state.
      new_updates, new_inner = inner.update(updates, state.inner_state, params,
                                            veto=decide, **kwargs)
    elif _find.find_state(state.inner_state, _guard.GuardState) is None:
      # No guard inside: the norm of the incoming updates is known first, so the skip is
      # decided before the update and its selects placed the same way.
      decide(_clip.global_norm(updates, axis_name))
      new_updates, new_inner = _select.skip_unless(
          jnp.logical_not(decided["skip"]),
          lambda u, s, p: inner.update(u, s, p, **kwargs), updates, state.inner_state,
          params)
    else:
      # A guard nested deeper (e.g. inside an optax.chain): its norm is known only after
      # the update, so the old state is selected afterwards (the state is copied).
      new_updates, new_inner = inner.update(updates, state.inner_state, params, **kwargs)
      decide(_find.find_state(new_inner, _guard.GuardState).grad_norm)
      new_inner = _tree.select(decided["skip"], state.inner_state, new_inner)
      new_updates = _tree.skip_updates(jnp.logical_not(decided["skip"]), new_updates)
    norm, measurable, loss_z, norm_z, skip = (
        decided[k] for k in ("norm", "measurable", "loss_z", "norm_z", "skip"))
    accept = jnp.logical_and(measurable, jnp.logical_not(skip))

    slot = jnp.logical_and(accept, jnp.arange(size, dtype=jnp.int32) == state.position)
    one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
    new = SpikeGuardState(
        inner_state=new_inner,
        losses=jnp.where(slot, loss, state.losses),
        grad_norms=jnp.where(slot, norm, state.grad_norms),
        filled=jnp.where(accept, jnp.minimum(state.filled + one, size), state.filled),
        position=jnp.where(accept, (state.position + one) % size, state.position),
        skipped_steps=state.skipped_steps + jnp.where(skip, one, zero),
        # A non-finite step neither extends nor ends a run of spike skips.
        consecutive_skipped=jnp.where(skip, state.consecutive_skipped + one,
                                      jnp.where(accept, zero, state.consecutive_skipped)),
        loss_z=loss_z, grad_norm_z=norm_z, grad_norm=norm)
    return new_updates, new

  return _compat.own(optax.GradientTransformationExtraArgs(init_fn, update_fn))

