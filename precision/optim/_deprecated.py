"""Deprecated optimizer-side entry points, thin aliases of their replacement (same bits).

`precision.value_and_grad(loss_fn, opt_state)` is the one value_and_grad: the loss scaled
by the optimizer's loss scale, fp8 scaling state carried. `scaled_value_and_grad` below
keeps existing code working and warns (DeprecationWarning) with the call replacing it.
"""

from __future__ import annotations

from typing import Any, Callable

from precision import _deprecation
from precision import _grad


def scaled_value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False
                          ) -> Callable[..., Any]:
  """Deprecated: ``precision.value_and_grad(loss_fn, opt_state)(params, *args)``.

  Returns ``fn(opt_state, params, *args, **kwargs) -> (loss, grads)`` (``((loss, aux),
  grads)`` with `has_aux`): `loss` is `loss_fn`'s own unscaled value (in its own dtype,
  where `precision.value_and_grad` returns it in f32: the same number), `grads` are the
  SCALED grads that the optimizer's guard unscales and checks. As with
  `precision.value_and_grad`, a non-finite loss makes every gradient NaN, so the guard
  skips the step.
  """
  _deprecation.warn("precision.optim.scaled_value_and_grad(loss_fn)(opt_state, params, ...)",
                    "precision.value_and_grad(loss_fn, opt_state)(params, ...)")

  def with_own_loss(*args, **kwargs):
    out = loss_fn(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return loss, (loss, aux)   # the loss as loss_fn returned it, handed back as aux

  def fn(opt_state, params, *args, **kwargs):
    (_, (loss, aux)), grads = _grad.value_and_grad(with_own_loss, opt_state, has_aux=True)(
        params, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return fn


__all__ = ["scaled_value_and_grad"]
