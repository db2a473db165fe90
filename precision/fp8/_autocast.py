"""fp8 GEMMs for any JAX function, through `precision.autocast`: state, step, report.

`precision.autocast(fn, recipe)` with a recipe that has fp8 GEMMs runs the forward
dot_generals of `fn` through `fp8_dot_general` (which ones: `autocast_gemms`; the rules:
precision._autocast._fp8). Current, per-channel and block scaling need no state. Delayed
scaling (the `fp8_hybrid` preset's) keeps an amax history per GEMM operand, carried
explicitly: ``g = precision.autocast(fn, recipe, fp8_state=True)`` is
``g(state, *args) -> (out, new_state)``, `state` a dict {site key: Fp8DotState} from
`init_state`. The forward operands' new state is in `new_state`; the gradient operand's
exists only in the backward pass and comes back as the cotangent of `state` (as in the
NNX layers, see precision.fp8._nnx), which `merge_state_grads` stores.
`autocast_value_and_grad` does the whole step.

Examples:
  >>> import jax, jax.numpy as jnp, precision as mp
  >>> def loss(ws, x):
  ...   for w in ws:
  ...     x = jnp.tanh(x @ w)
  ...   return jnp.mean(x ** 2)
  >>> ws, x = [jnp.full((4, 4), 0.1)] * 4, jnp.ones((2, 4))
  >>> vg = mp.fp8.autocast_value_and_grad(loss, "fp8_hybrid")
  >>> state = mp.fp8.init_state(loss, "fp8_hybrid", ws, x)
  >>> sorted(state)                      # the first and last GEMM stay in bf16
  ['1', '2']
  >>> value, grads, state = vg(state, ws, x)
  >>> float(state["1"].grad.amax_history[0]) > 0
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from precision._autocast import _api
from precision._autocast import _fp8
from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision.fp8 import _scaling as sc
from precision.fp8._dot import Fp8DotState


class GemmSite(NamedTuple):
  """One forward dot_general of a function under an fp8 recipe (`autocast_gemms`).

  key: its key in the fp8 state dict ("position:scope", or "position" outside any
  scope); position: its index among the function's forward GEMMs, in program order;
  scope: the NNX/Linen module path or jax.named_scope stack it was traced in; lhs_shape,
  rhs_shape: its operands' shapes; fp8: whether it runs in fp8; reason: why not, or
  "fp8".
  """
  key: str
  position: int
  scope: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  fp8: bool
  reason: str


def _spec_and_fn(fn: Callable, recipe: Any, overrides, fp32_ops, fp8_state: bool | None):
  """(the AutocastSpec, the unwrapped function). fp8_state: True/False, or None: as the
  autocast function `fn` has it (recipe None), else True for delayed scaling only."""
  spec = getattr(fn, "autocast_spec", None)
  if recipe is None:
    if spec is None:
      raise ValueError(
          f"recipe=None with {fn!r}, which is not an autocast function; accepted: a Recipe "
          "or preset name, or recipe=None with fn = precision.autocast(f, recipe, ...)")
    if spec.fp8 is None:
      raise ValueError(f"{fn!r} runs under an autocast without fp8 GEMMs; accepted: an "
                       "autocast function of a recipe with an fp8 config")
    stateful = spec.fp8_state if fp8_state is None else fp8_state
    return dataclasses.replace(spec, fp8_state=stateful), fn.__wrapped__
  if not isinstance(recipe, (Plan, Recipe, str)):
    raise ValueError(f"recipe={recipe!r}; accepted: a precision.Recipe with an fp8 config, "
                     "a preset name ('fp8_hybrid') or a Plan of one (precision.bind)")
  plan = as_plan(recipe, overrides, fp32_ops)  # bound once
  if fp8_state is None:
    fp8_state = plan.fp8 is not None and plan.fp8.scaling == "delayed"
  return _api.AutocastSpec.make(plan, fp8_state=fp8_state), fn


def _decisions(fn, recipe, args, kwargs, overrides, fp32_ops, fp8_state):
  spec, inner = _spec_and_fn(fn, recipe, overrides, fp32_ops, fp8_state)
  return spec, _api.run(spec, inner, args, kwargs, evaluate=False).fp8_decisions


def autocast_gemms(fn: Callable, recipe: Recipe | str | Plan | None, *args,
                   overrides: Mapping[Any, Any] | None = None, fp32_ops=None,
                   fp8_state: bool | None = None, **kwargs) -> list[GemmSite]:
  """Every forward dot_general of `fn(*args, **kwargs)` under `recipe`: whether it runs in
  fp8 and why not (first/last GEMM, a keep_high_precision scope, an override, two
  activation operands, a while-loop body under explicit state). Traces `fn` at the
  arguments' shapes; nothing runs.

  Args:
    fn: the function given to `precision.autocast`, or the autocast function itself
      with `recipe=None` (its recipe and overrides are used).
    recipe: a Recipe with an fp8 config, a preset name ("fp8_hybrid"), or a Plan of
      one (`precision.bind`, which then brings the overrides and fp32_ops).
    overrides, fp32_ops: as `precision.autocast` (they decide scopes' policies).
    fp8_state: as `precision.autocast` (with explicit state, GEMMs in while-loop
      bodies stay in the compute dtype); default: True for delayed
      scaling, else False (or the autocast function's own).
  """
  _, decisions = _decisions(fn, recipe, args, kwargs, overrides, fp32_ops, fp8_state)
  return [GemmSite(d.site.key, d.site.position, d.site.scope, d.site.lhs_shape,
                   d.site.rhs_shape, d.fp8, d.reason) for d in decisions]


def init_state(fn: Callable, recipe: Recipe | str | Plan | None, *args,
               overrides: Mapping[Any, Any] | None = None, fp32_ops=None,
               **kwargs) -> dict[str, Fp8DotState]:
  """Fresh fp8 scaling state for `precision.autocast(fn, recipe, fp8_state=True)`: a dict
  {site key: Fp8DotState} with one entry per GEMM of `fn(*args, **kwargs)` that runs in
  fp8 (`autocast_gemms`), zero amax histories (length `amax_history_len` for delayed
  scaling, else 1), unit scales, zero counters; every leaf f32. Traces `fn` at the
  arguments' shapes; nothing runs. The keys depend on the program only, so the state
  can be saved and restored with the params.

  Args:
    fn: the function given to `precision.autocast`, or the autocast function itself
      with `recipe=None` (or call its `init_state(*args)`).
    recipe: a Recipe with an fp8 config, a preset name ("fp8_hybrid"), or a Plan of
      one (`precision.bind`, which then brings the overrides and fp32_ops).
    overrides, fp32_ops: as given to `precision.autocast` (overrides take GEMMs out of
      fp8, so the state must be made with the same ones).

  Raises:
    ValueError: a recipe without fp8 GEMMs, or a bad override.
  """
  spec, decisions = _decisions(fn, recipe, args, kwargs, overrides, fp32_ops, True)
  return _fp8.init_states(spec.fp8, decisions)


def merge_state_grads(new_state: Mapping[str, Fp8DotState],
                      state_grads: Mapping[str, Fp8DotState]) -> dict[str, Fp8DotState]:
  """The fp8 scaling state after a differentiated step of an autocast function.

  Args:
    new_state: the `new_state` the function returned: forward operands (lhs, rhs) new,
      gradient operand (grad) still the state passed in.
    state_grads: the gradient with respect to the `state` passed in (same structure):
      its `grad` fields carry each GEMM's new gradient-operand state.

  Returns:
    `new_state` with every `grad` field taken from `state_grads`, except for GEMMs (or
    scan iterations of one) that took no part in the differentiated value (zero
    cotangent, scale 0): they keep theirs.

  Raises:
    ValueError: the two dicts have different keys.
  """
  if not isinstance(new_state, Mapping) or not isinstance(state_grads, Mapping) or \
      set(new_state) != set(state_grads):
    raise ValueError(
        "merge_state_grads: new_state and state_grads must be dicts with the same keys "
        f"(got {sorted(new_state) if isinstance(new_state, Mapping) else new_state!r:.80} "
        f"and {sorted(state_grads) if isinstance(state_grads, Mapping) else state_grads!r:.80}); "
        "accepted: the new_state an autocast function returned and the gradient with "
        "respect to the state it was given")
  out = {}
  for key, st in new_state.items():
    ct = state_grads[key].grad
    # Per GEMM (per scan iteration for a GEMM in a scan body: the leading axes).
    used = ct.scale > 0
    pick = lambda new, old: jnp.where(
        used.reshape(used.shape + (1,) * (jnp.ndim(old) - used.ndim)), new, old)
    out[key] = st._replace(grad=sc.OperandState(*map(pick, ct, st.grad)))
  return out


def autocast_value_and_grad(fn: Callable, recipe: Recipe | str | Plan,
                            argnums: int | Sequence[int] = 0, *, has_aux: bool = False,
                            overrides: Mapping[Any, Any] | None = None,
                            fp32_ops=None) -> Callable:
  """`jax.value_and_grad` of `fn` under an fp8 recipe, carrying the fp8 scaling state.

  Returns ``vg(state, *args, **kwargs) -> (value, grads, new_state)``: `value` and `grads`
  as ``jax.value_and_grad(precision.autocast(fn, recipe), argnums, has_aux=has_aux)``
  would give them (argnums count `fn`'s own arguments); `new_state` the scaling state
  after the step, forward and gradient operands (`merge_state_grads`). `state` comes
  from `init_state(fn, recipe, *args)`, then from the previous step. Works for every
  scaling; delayed scaling needs it. The state is a plain pytree of f32 arrays: save it
  with the params, agree it across data-parallel ranks with `sync_fp8_state(state,
  axis)`, and undo a step the optimizer guard skipped with `rollback_fp8_state(new_state,
  state, skipped)`.

  Examples:
    >>> vg = jax.jit(mp.fp8.autocast_value_and_grad(loss, "fp8_hybrid"))
    >>> state = mp.fp8.init_state(loss, "fp8_hybrid", params, x, y)
    >>> for x, y in batches:
    ...   value, grads, state = vg(state, params, x, y)
    ...   params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  """
  plan = as_plan(recipe, overrides, fp32_ops)  # a recipe, preset name or Plan, bound once
  g = _api.autocast(fn, plan, fp8_state=True)
  single = isinstance(argnums, int)
  nums = (argnums,) if single else tuple(argnums)
  if not nums or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0
                         for a in nums):
    raise ValueError(f"argnums={argnums!r}; accepted: an int >= 0 or a non-empty tuple of "
                     "them (positions among fn's own arguments)")

  def inner(state, *args, **kwargs):
    out, new = g(state, *args, **kwargs)
    value, aux = out if has_aux else (out, None)
    return value, (new, aux)

  vg = jax.value_and_grad(inner, argnums=(0,) + tuple(a + 1 for a in nums), has_aux=True)

  def step(state, *args, **kwargs):
    (value, (new, aux)), grads = vg(state, *args, **kwargs)
    new = merge_state_grads(new, grads[0])
    arg_grads = grads[1] if single else tuple(grads[1:])
    return ((value, aux) if has_aux else value), arg_grads, new

  step.autocast_spec = g.autocast_spec
  step.init_state = g.init_state
  return step
