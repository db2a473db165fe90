"""Deprecated value_and_grad entry points of `precision.fp8` and `precision.optim`.

Each is a thin alias of ``precision.value_and_grad`` (same bits) that warns
(DeprecationWarning) with the call replacing it. They call `precision._grad`, which sits
above both packages (it carries fp8 state and the optimizer's loss scale), so they live
here, above it, under their old names, and `precision/__init__.py` attaches them where
they were (``precision.fp8.value_and_grad``, ``precision.fp8.autocast_value_and_grad``,
``precision.optim.scaled_value_and_grad``): neither package imports upward for them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from precision import _deprecation
from precision import _grad
from precision._autocast import _api


def value_and_grad(fn: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
  """Deprecated: ``precision.value_and_grad(fn)`` (no optimizer state: the loss is not
  scaled), which carries an NNX model's fp8 gradient-operand state the same way."""
  _deprecation.warn("precision.fp8.value_and_grad(fn)", "precision.value_and_grad(fn)")
  return _grad.value_and_grad(fn, None, has_aux=has_aux)


def autocast_value_and_grad(fn: Callable, recipe: Any, argnums: int | Sequence[int] = 0,
                            *, has_aux: bool = False,
                            overrides: Mapping[Any, Any] | None = None,
                            fp32_ops=None) -> Callable:
  """Deprecated: ``precision.value_and_grad(precision.autocast(fn, recipe, overrides,
  fp32_ops=fp32_ops, fp8_state=True), argnums=argnums, has_aux=has_aux)``, which returns
  ``vg(state, *args) -> (value, grads, new_state)`` the same way (and scales the loss when
  given an optimizer state)."""
  _deprecation.warn(
      "precision.fp8.autocast_value_and_grad(fn, recipe)",
      "precision.value_and_grad(precision.autocast(fn, recipe, fp8_state=True))")
  g = _api.autocast(fn, recipe, overrides, fp32_ops=fp32_ops, fp8_state=True)
  step = _grad.value_and_grad(g, None, has_aux=has_aux, argnums=argnums)
  step.autocast_spec = g.autocast_spec
  step.init_state = g.init_state
  return step


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


__all__ = ["autocast_value_and_grad", "scaled_value_and_grad", "value_and_grad"]
