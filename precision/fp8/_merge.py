"""The one fp8 gradient-state merge: the scaling state after a differentiated step.

The gradient operand of an fp8 GEMM exists only in the backward pass, so its new scaling
state leaves the step as a cotangent (Flax's OVERWRITE_WITH_GRADIENT trick, see
precision.fp8._nnx): differentiate with respect to the state too, then store the
cotangent's gradient-operand fields in place of the old ones. A GEMM (or one layer of a
stack, one scan iteration) that took no part in the differentiated value gets a zero
cotangent, scale 0, never a real scale: it keeps its old state. `merge_grad_state` does
this for every form the state takes: an NNX `nnx.State`, a Linen ``fp8_grad_state``
collection, and the explicit state of `precision.autocast(..., fp8_state=True)`.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
from flax import nnx

from precision.fp8 import _scaling as sc
from precision.fp8._dot import Fp8DotState
from precision.fp8._nnx import Fp8GradState


def _autocast_state(state: Any) -> bool:
  return isinstance(state, Mapping) and bool(state) and all(
      isinstance(v, Fp8DotState) for v in state.values())


def _merge_nnx(state: nnx.State, state_grads: nnx.State) -> nnx.State:
  flat = [(tuple(path), var) for path, var in nnx.to_flat_state(state)]
  cts = {tuple(path): var[...] for path, var in nnx.to_flat_state(state_grads)}
  gemms: dict[tuple, dict[str, Any]] = {}   # GEMM path -> its grad-state leaf names
  for path, var in flat:
    if isinstance(var, Fp8GradState):
      gemms.setdefault(path[:-1], {})[path[-1]] = var[...]
  merged = {}
  for gemm, old in gemms.items():
    missing = [gemm + (name,) for name in old if gemm + (name,) not in cts]
    if missing:
      raise ValueError(
          f"merge_grad_state: no cotangent for {'/'.join(map(str, missing[0]))}; accepted: "
          "state_grads = the gradient with respect to the fp8 state passed in (same "
          "variables as state)")
    new = {name: cts[gemm + (name,)] for name in old}
    for name, value in sc.keep_unused_grad_state(old, new, "grad_scale").items():
      merged[gemm + (name,)] = value
  return nnx.from_flat_state(
      [(path, var.replace(merged[path]) if path in merged else var) for path, var in flat])


def _merge_autocast(state: Mapping[str, Fp8DotState],
                    state_grads: Any) -> dict[str, Fp8DotState]:
  if not isinstance(state_grads, Mapping) or set(state) != set(state_grads):
    raise ValueError(
        "merge_grad_state: state and state_grads must be dicts with the same keys "
        f"(got {sorted(state)} and "
        f"{sorted(state_grads) if isinstance(state_grads, Mapping) else state_grads!r:.80}); "
        "accepted: the new_state an autocast function returned and the gradient with "
        "respect to the state it was given")
  out = {}
  for key, st in state.items():
    ct = state_grads[key].grad
    # Per GEMM (per scan iteration for a GEMM in a scan body: the leading axes).
    used = ct.scale > 0
    pick = lambda new, old: jnp.where(
        used.reshape(used.shape + (1,) * (jnp.ndim(old) - used.ndim)), new, old)
    out[key] = st._replace(grad=sc.OperandState(*map(pick, ct, st.grad)))
  return out


def _merge_linen(old: Mapping[str, Any], new: Any) -> dict[str, Any]:
  out = {}
  for key, value in old.items():
    if not isinstance(new, Mapping) or key not in new:
      raise ValueError(f"merge_grad_state: no cotangent for {key!r}; accepted: state_grads "
                       "= the gradient with respect to the 'fp8_grad_state' collection")
    if isinstance(value, Mapping) and "grad_scale" not in value:
      out[key] = _merge_linen(value, new[key])
    elif isinstance(value, Mapping):
      out[key] = sc.keep_unused_grad_state(value, new[key], "grad_scale")
    else:
      raise ValueError(f"merge_grad_state: {key!r} is not a module's fp8 grad state; "
                       "accepted: the 'fp8_grad_state' collection of a Linen model")
  return out


def merge_grad_state(state: Any, state_grads: Any) -> Any:
  """The fp8 scaling state after a differentiated step, from the state and its cotangent.

  Args:
    state: the fp8 scaling state after the forward pass, in one of three forms:
      * an `nnx.State`, e.g. ``nnx.state(model, precision.fp8.Fp8State)`` read back after
        the forward pass (forward operands new, `Fp8GradState` still old); other
        variables in it pass through;
      * the dict {site key: Fp8DotState} an autocast function with ``fp8_state=True``
        returned as its new state (forward operands new, ``grad`` still old);
      * a Linen ``fp8_grad_state`` collection (``variables["fp8_grad_state"]``).
    state_grads: the gradient of the loss with respect to the fp8 state passed in (the
      same structure): its gradient-operand fields carry each GEMM's new state.

  Returns:
    `state`, of the same form, with every gradient-operand field taken from
    `state_grads`, except for GEMMs (or layers of a stack, scan iterations of one) that
    took no part in the differentiated value (zero cotangent, scale 0): they keep theirs.

  Raises:
    ValueError: `state_grads` does not match `state`, or `state` is none of the three.

  Examples:
    >>> (l, new), (g, g_state) = jax.value_and_grad(loss, (0, 1), has_aux=True)(p, s, x)
    >>> s = precision.fp8.merge_grad_state(new, g_state)
  """
  if isinstance(state, nnx.State):
    return _merge_nnx(state, state_grads)
  if _autocast_state(state):
    return _merge_autocast(state, state_grads)
  if isinstance(state, Mapping):
    return _merge_linen(state, state_grads)
  raise ValueError(
      f"merge_grad_state: state is a {type(state).__name__}; accepted: an nnx.State of fp8 "
      "variables, the {key: Fp8DotState} state of an autocast function, or a Linen "
      "'fp8_grad_state' collection")


__all__ = ["merge_grad_state"]
