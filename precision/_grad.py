"""The one value_and_grad: the loss, its gradients in the units the recipe optimizer
expects, and the fp8 scaling state carried out of the backward pass.

`precision.value_and_grad` (precision._train adds its telemetry option) is this function;
the older entry points (`precision.optim.scaled_value_and_grad`,
`precision.fp8.value_and_grad`, `precision.fp8.autocast_value_and_grad`) are deprecated
aliases that call it. What it differentiates is decided by its arguments:

* the loss is scaled when an optimizer state is given: cast to f32, guarded (a
  non-finite loss makes every gradient NaN so the optimizer's guard skips the step) and
  multiplied by ``loss_scale_of(opt_state)``; the loss returned is the unscaled f32
  value. Without one (``opt_state=None``) `fn` is differentiated as written and its loss
  returned as it is;
* an `nnx.Module` first argument: differentiated w.r.t. its `nnx.Param`, the new
  gradient-operand state of its fp8 GEMMs written into the model;
* `fn` an autocast function with explicit fp8 state (``precision.autocast(f, recipe,
  fp8_state=True)``, ``fn(state, *args) -> (loss, new_state)``): the result also holds
  the new state (`precision.fp8.merge_grad_state`), gradients w.r.t. `argnums` of the
  arguments after the state;
* anything else: ``jax.value_and_grad`` w.r.t. `argnums`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision.fp8 import _merge
from precision.fp8 import _nnx as fp8_nnx
from precision.optim import _guard
from precision.optim import _query


def _argnums(argnums: Any) -> tuple[int, ...]:
  nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else (
      tuple(argnums) if isinstance(argnums, (tuple, list)) else ())
  if not nums or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0
                         for a in nums):
    raise ValueError(f"argnums={argnums!r}; accepted: an int >= 0 or a non-empty tuple of "
                     "them (positions among fn's own arguments)")
  return nums


def _split(out: Any, has_aux: bool) -> tuple[Any, Any]:
  if not has_aux:
    return out, None
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise ValueError(f"value_and_grad(has_aux=True): fn returned {type(out).__name__}; "
                     "accepted: a pair (scalar loss, aux)")
  return out[0], out[1]


def _scaled(loss: Any, scale: jax.Array, has_aux: bool) -> tuple[jax.Array, jax.Array]:
  """(loss_f32 * scale, loss_f32), checking the loss is a floating scalar."""
  if not hasattr(loss, "dtype") or np.shape(loss) != () or not jnp.issubdtype(
      loss.dtype, jnp.floating):
    raise ValueError(
        f"value_and_grad: fn's loss is {getattr(loss, 'dtype', type(loss).__name__)}"
        f"{list(np.shape(loss)) if hasattr(loss, 'shape') else ''}; accepted: a floating "
        "scalar array (e.g. a mean over the batch)" + (
            "; with has_aux=True, the first of (loss, aux)" if has_aux else ""))
  # The loss is scaled in f32: an f16 or bf16 loss times 2**15 could overflow its own
  # dtype, and f32 holds every f16/bf16 value exactly, so the unscaled loss returned is
  # fn's own value, widened.
  loss = loss.astype(jnp.float32)
  # A non-finite loss with finite gradients (an overflowed f16 mean, a stop_gradient
  # term) makes every gradient NaN here, so the optimizer's guard skips and counts the
  # step; a finite loss passes its cotangent through by a select, bit for bit.
  return _guard.nonfinite_loss_guard(loss) * scale, loss


def _objective(fn: Callable[..., Any], scale: jax.Array | None, has_aux: bool):
  """``f(*args) -> (differentiated value, (loss returned, aux))``."""

  def f(*args):
    loss, aux = _split(fn(*args), has_aux)
    if scale is None:
      return loss, (loss, aux)
    diff, loss = _scaled(loss, scale, has_aux)
    return diff, (loss, aux)

  return f


def value_and_grad(fn: Callable[..., Any], opt_state: Any = None, *, has_aux: bool = False,
                   argnums: int | Sequence[int] = 0) -> Callable[..., Any]:
  """The loss and gradients of `fn`, scaled for `opt_state`'s optimizer, fp8 state carried.

  See `precision.value_and_grad` (this function, plus its `telemetry` option).

  Returns:
    ``g(*args, **kwargs) -> (loss, grads)``, or ``((loss, aux), grads)`` with `has_aux`;
    for an autocast function with explicit fp8 state ``g(state, *args, **kwargs) ->
    (loss, grads, new_state)``. Keyword arguments are passed to `fn`, never
    differentiated. `grads` has one entry per `argnums` when it is a tuple.
  """
  if not callable(fn):
    raise ValueError(f"value_and_grad: fn={fn!r}; accepted: a callable returning the loss")
  if not isinstance(has_aux, bool):
    raise ValueError(f"value_and_grad: has_aux={has_aux!r}; accepted: True or False")
  nums = _argnums(argnums)
  single = not isinstance(argnums, (tuple, list))
  spec = getattr(fn, "autocast_spec", None)
  explicit = spec is not None and bool(getattr(spec, "fp8_state", False))

  def wrapped(*args, **kwargs):
    # Read here, at call time: `loss_scale_of` also marks this thread as having scaled
    # the loss, which the next loss-scaling update takes (precision.optim._guard).
    scale = None if opt_state is None else _query.loss_scale_of(opt_state)
    # Keyword arguments are bound here, never differentiated: nnx's transforms cannot map
    # keywords of a function taking *args to positions.
    bound = functools.partial(fn, **kwargs) if kwargs else fn
    if explicit:
      return _explicit_state(bound, scale, has_aux, nums, single, args)
    if args and isinstance(args[0], nnx.Module):
      if nums != (0,):
        raise ValueError(f"value_and_grad: argnums={argnums!r} with an nnx.Module first "
                         "argument; accepted: 0 (the model's nnx.Param are differentiated)")
      return _module(bound, scale, has_aux, args)
    if len(args) <= max(nums):
      raise ValueError(f"value_and_grad: argnums={argnums!r} with {len(args)} positional "
                       "arguments; accepted: positions of the arguments given")
    vg = jax.value_and_grad(_objective(bound, scale, has_aux), argnums=argnums if single
                            else nums, has_aux=True)
    (_, (loss, aux)), grads = vg(*args)
    return ((loss, aux) if has_aux else loss), grads

  return wrapped


def _module(fn, scale, has_aux, args):
  """An NNX model: grads w.r.t. its nnx.Param; its fp8 gradient state stored in it."""
  objective = _objective(fn, scale, has_aux)

  def watched(model, *rest):
    # Inside nnx.value_and_grad `model` is the copy being differentiated: its fp8 modules
    # are the ones whose calls are watched.
    with fp8_nnx._watch_grad_state(model):  # pylint: disable=protected-access
      return objective(model, *rest)

  vg = nnx.value_and_grad(
      watched, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, fp8_nnx.Fp8GradState)),
      has_aux=True)
  model = args[0]
  (_, (loss, aux)), grads = vg(*args)
  grad_state = nnx.state(model, fp8_nnx.Fp8GradState)
  if grad_state:
    nnx.update(model, _merge.merge_grad_state(
        grad_state, nnx.filter_state(grads, fp8_nnx.Fp8GradState)))
    grads = nnx.filter_state(grads, nnx.Not(fp8_nnx.Fp8GradState))
  return ((loss, aux) if has_aux else loss), grads


def _explicit_state(fn, scale, has_aux, nums, single, args):
  """An autocast function ``fn(state, *args) -> (loss, new_state)``: also the new state,
  forward operands as `fn` returned them, gradient operand from its cotangent."""
  if not args:
    raise ValueError("value_and_grad: an autocast function with fp8_state=True takes its "
                     "fp8 state first; accepted: g(state, *args) with state from "
                     "precision.fp8.init_state")
  if len(args) - 1 <= max(nums):
    raise ValueError(f"value_and_grad: argnums={nums if not single else nums[0]!r} with "
                     f"{len(args) - 1} arguments after the fp8 state; accepted: positions "
                     "among fn's own arguments")

  def inner(state, *rest):
    out, new = fn(state, *rest)
    diff, (loss, aux) = _objective(lambda: out, scale, has_aux)()
    return diff, (loss, aux, new)

  vg = jax.value_and_grad(inner, argnums=(0,) + tuple(a + 1 for a in nums), has_aux=True)
  (_, (loss, aux, new)), grads = vg(*args)
  new = _merge.merge_grad_state(new, grads[0])
  arg_grads = grads[1] if single else tuple(grads[1:])
  return ((loss, aux) if has_aux else loss), arg_grads, new


__all__ = ["value_and_grad"]
