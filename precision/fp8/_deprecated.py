"""Deprecated fp8 merge entry points, each a thin alias of its replacement (same bits).

`precision.fp8.merge_grad_state` is the one merge of the gradient-operand scaling state
(NNX, Linen, autocast). The names below keep existing code working and warn
(DeprecationWarning) with the call that replaces them. (The deprecated fp8
value_and_grads call `precision.value_and_grad`, above this package: they live in
`precision/_deprecated_grads.py`.)
"""

from __future__ import annotations

from typing import Any, Mapping

from flax import nnx

from precision import _deprecation
from precision.fp8 import _merge
from precision.fp8._dot import Fp8DotState
from precision.fp8._nnx import Fp8GradState


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


__all__ = ["merge_fp8_grad_state", "merge_state_grads", "update_fp8_grad_state"]
