"""Deprecated fp8 entry points, each a thin alias of its replacement (same bits).

`precision.value_and_grad` is the one value_and_grad (loss scaling, NNX fp8 state,
explicit autocast state) and `precision.fp8.merge_grad_state` the one merge of the
gradient-operand scaling state (NNX, Linen, autocast). The names below keep existing
code working and warn (DeprecationWarning) with the call that replaces them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from flax import nnx

from precision import _deprecation
from precision import _grad
from precision.fp8 import _merge
from precision.fp8._dot import Fp8DotState
from precision.fp8._nnx import Fp8GradState


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
  from precision._autocast import _api  # pylint: disable=g-import-not-at-top
  g = _api.autocast(fn, recipe, overrides, fp32_ops=fp32_ops, fp8_state=True)
  step = _grad.value_and_grad(g, None, has_aux=has_aux, argnums=argnums)
  step.autocast_spec = g.autocast_spec
  step.init_state = g.init_state
  return step


def merge_state_grads(new_state: Mapping[str, Fp8DotState],
                      state_grads: Mapping[str, Fp8DotState]) -> dict[str, Fp8DotState]:
  """Deprecated: ``precision.fp8.merge_grad_state(new_state, state_grads)``."""
  _deprecation.warn("precision.fp8.merge_state_grads",
                    "precision.fp8.merge_grad_state(new_state, state_grads)")
  return _merge.merge_grad_state(new_state, state_grads)


def merge_fp8_grad_state(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
  """Deprecated: ``precision.fp8.merge_grad_state(old, new)`` (a Linen collection)."""
  _deprecation.warn("precision.fp8.merge_fp8_grad_state",
                    "precision.fp8.merge_grad_state(old, new)")
  return _merge.merge_grad_state(old, new)


def update_fp8_grad_state(module: nnx.Module, grads: nnx.State) -> nnx.State:
  """Deprecated: ``nnx.update(module, precision.fp8.merge_grad_state(nnx.state(module,
  Fp8GradState), grads))`` (`precision.value_and_grad` does it for you). Stores the
  gradient-operand state found in `grads` into `module` and returns the other grads."""
  _deprecation.warn(
      "precision.fp8.update_fp8_grad_state(module, grads)",
      "nnx.update(module, precision.fp8.merge_grad_state(nnx.state(module, "
      "precision.fp8.Fp8GradState), grads))")
  cts = {tuple(path) for path, _ in nnx.to_flat_state(grads)}
  # GEMMs whose gradient state `grads` does not carry (not differentiated) keep theirs.
  have = [(path, var) for path, var in nnx.to_flat_state(nnx.state(module, Fp8GradState))
          if tuple(path) in cts]
  if have:
    nnx.update(module, _merge.merge_grad_state(nnx.from_flat_state(have), grads))
  return nnx.filter_state(grads, nnx.Not(Fp8GradState))


__all__ = ["autocast_value_and_grad", "merge_fp8_grad_state", "merge_state_grads",
           "update_fp8_grad_state", "value_and_grad"]
