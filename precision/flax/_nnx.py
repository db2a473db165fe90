"""apply_policy: one Policy governs a whole Flax NNX model, in place, whatever its code.

The model's params are cast to the param dtype, and the model is marked: each call
`model(...)` then runs under `precision.autocast`, which traces the call and evaluates it
again op by op under the policy, so every GEMM the model computes - Flax layers,
`x @ w`, `jnp.einsum` attention, Flax's own MultiHeadAttention - runs compute x compute ->
f32 forward and backward, the recipe's fp32 ops (softmax, norm statistics, exp/log/tanh,
...) run in f32 wherever they are written, and the result leaves in the output dtype.

No layer is replaced and no class is modified: the user's class and every other instance
of it stay as written (`type(x).__call__` is the user's function). The marked instance
alone takes a subclass of its class (same name, module and qualname; one per class, so
`isinstance`, graphdefs and jit caches behave as before) whose `__call__` runs the
user's `__call__` under autocast outside an autocast trace, and as written inside one.

| what                          | under apply_policy(model, "p=f32,c=bf16,o=f32")            |
|-------------------------------|------------------------------------------------------------|
| nnx.Param                     | cast to param_dtype (f32 here) in place                     |
| every GEMM / convolution      | bf16 x bf16 -> f32 accumulation, forward and backward       |
| GEMM results                  | bf16; gradients in each operand's own dtype (f32 kernels)   |
| softmax, norms, exp/log/tanh  | f32                                                         |
| bias add, residual add        | at the wider operand dtype (f32 bias: an f32 add and an f32 |
|                               | bias gradient)                                              |
| the model's result            | output_dtype (f32 here)                                     |
"""

from __future__ import annotations

import copyreg
import threading
import types
import warnings
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision import _dtypes
from precision import _intercept
from precision._policy import Policy, cast_floating
from precision import _plan
from precision._autocast import _api
from precision import _keypath
from precision import _overrides
from precision.flax import _scopes

_api.register_scope_hook(_scopes.module_scopes)
# {user class: the subclass its marked instances take}; made under _LOCK, once a class.
# Not weak: the subclass holds its base (and flax's graph-node registry holds both).
_MARKED: dict[type, type] = {}
_LOCK = threading.Lock()


def _cast_variable(var: nnx.Variable, dtype: np.dtype) -> None:
  value = var.get_value()
  if _dtypes.is_float(value) and value.dtype != dtype:
    var.set_value(value.astype(dtype))


def call_under_spec(spec: _api.AutocastSpec, method, module, args, kwargs):
  """`method(module, *args, **kwargs)` under autocast with `spec`; floating results in the
  root policy's output dtype."""
  traced = _api.run(spec, lambda m, *a, **k: method(m, *a, **k), (module, *args), kwargs,
                    check_overrides=False)
  # Patterns that name no module path name jax.named_scope scopes of the model's code: one
  # that matched no scope of this call either is a typo.
  _api.check_overrides_matched(spec, traced.env, scope_patterns(module, spec))
  return cast_floating(traced.outputs, spec.policy.output_dtype)


def _marked_class(cls: type) -> type:
  """The class a marked instance of `cls` takes: a subclass of `cls` (same name, module
  and qualname) whose `__call__` runs the instance under its autocast spec. One per user
  class, made once: graphdefs of two marked models of a class compare equal."""
  if cls.__dict__.get("precision_marked_base") is not None:
    return cls  # already a marked class (a model marked again)
  with _LOCK:
    sub = _MARKED.get(cls)
    if sub is None:
      sub = _MARKED[cls] = _make_marked_class(cls)
  return sub


def _make_marked_class(cls: type) -> type:
  def __call__(self, *args, **kwargs):
    # The user's __call__, looked up at each call (as an unmarked instance would).
    def user_call(module, *a, **k):
      return super(sub, module).__call__(*a, **k)
    spec = getattr(self, _scopes.SPEC_ATTR, None)
    if spec is None:
      return user_call(self, *args, **kwargs)
    if not _api.tracing():
      return call_under_spec(spec, user_call, self, args, kwargs)
    return _call_in_trace(spec, user_call, self, args, kwargs)

  def __reduce_ex__(self, protocol):
    # Pickled by the user's class (the only name pickle can find) and remade marked.
    reduced = super(sub, self).__reduce_ex__(protocol)
    if (isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[0] is copyreg.__newobj__
        and reduced[1] and reduced[1][0] is sub):
      return (_new_marked, (cls, *reduced[1][1:]), *reduced[2:])
    return reduced

  user = _intercept.original(cls, "__call__")
  __call__.__doc__ = user.__doc__
  __call__.__wrapped__ = user
  namespace = {"__call__": __call__, "__reduce_ex__": __reduce_ex__,
               "__module__": cls.__module__,
               "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
               "precision_marked_base": cls}
  # nnx.Object subclasses take `pytree=` at class creation; the user's class's own choice
  # is kept (the default would follow flax's config instead).
  kwds = {}
  if hasattr(cls, "_pytree__is_pytree"):
    kwds["pytree"] = cls._pytree__is_pytree
  sub = types.new_class(cls.__name__, (cls,), kwds, lambda ns: ns.update(namespace))
  return sub


def _new_marked(cls: type, *args):
  """An empty marked instance of `cls` (unpickling: the state is set after)."""
  sub = _marked_class(cls)
  return sub.__new__(sub, *args)


def _call_in_trace(spec: _api.AutocastSpec, original, module, args, kwargs):
  """A marked module called while an autocast traces: the enclosing trace governs.

  A module the trace's module scopes cover below the root (a submodule marked on its
  own) contributes its policy for its scope (see _scopes). Otherwise - the root of the
  traced call, or a model the traced function merged or closed over (data_parallel's
  loss_fn) - its mark must agree with the trace's spec; a model the trace does not cover
  gets its module scopes here, and its overrides (when the trace brings none) the
  policies they give its submodules, so GEMMs fall as they do in the model's own calls.
  """
  path = _scopes.tracked_path(module)
  if path:
    return original(module, *args, **kwargs)
  trace = _api.active_trace()
  adopt = _check_agrees(spec, trace.spec)
  if path is not None:
    return original(module, *args, **kwargs)
  policies = {}
  if adopt and _overrides.is_directional(spec.rules):
    # Adopted overrides become one Policy per module (trace.module_policy): no direction.
    raise ValueError(
        f"The model was marked with {spec.describe()}, whose direction-specific overrides "
        f"a trace of {trace.spec.describe()} cannot adopt per module; accepted: the same "
        "plan for both (precision.bind(recipe, overrides=...) given to the model and to "
        "autocast / data_parallel)")
  if adopt:
    by_path = policy_paths(module, spec)
    policies = {id(node): by_path[tuple(p)] for p, node in nnx.iter_graph(module)
                if p and isinstance(node, nnx.Module)}
  with _scopes.module_scopes([module], trace.module_at, trace.module_policy, policies):
    # Through the class's (now scope-opening) __call__: this call is back here, covered.
    return type(module).__call__(module, *args, **kwargs)


def _check_agrees(mark: _api.AutocastSpec, active: _api.AutocastSpec) -> bool:
  """Raises unless a model marked with `mark` may run under the trace of `active`; returns
  whether the mark's overrides are to be applied (the trace brings none of its own)."""
  if mark is active or mark == active:
    return False
  same = (mark.policy == active.policy and mark.fp32_ops == active.fp32_ops
          and (mark.recipe is None or active.recipe is None or mark.recipe == active.recipe)
          and (not active.rules or active.rules == mark.rules))
  if not same:
    raise ValueError(
        f"The model was marked with {mark.describe()} but runs inside a trace of "
        f"{active.describe()}; accepted: one plan for both, e.g. plan = "
        "precision.bind(recipe, overrides=...) given to apply_recipe(model, plan) and to "
        "data_parallel(..., recipe=plan)")
  return bool(mark.rules) and not active.rules


def _match_paths(module: nnx.Module, spec: _api.AutocastSpec) -> tuple[dict, set, dict]:
  """({module path: the policy its params take}, the rule keys some module path matched,
  {module path: module})."""
  modules = {tuple(p): n for p, n in nnx.iter_graph(module) if isinstance(n, nnx.Module)}
  matched: set = set()
  out: dict[tuple, Policy] = {}
  for path, node in modules.items():
    at = {_keypath.path_str(path[:i]): modules.get(path[:i])
          for i in range(1, len(path) + 1)}
    # Params take the forward policy's dtype; a backward-only rule still matches a path.
    rule, back = (_overrides.match_scope(spec.rules, _keypath.path_str(path), at, d)
                  for d in _overrides.DIRECTIONS)
    matched.update(r.key for r in (rule, back) if r is not None)
    out[path] = spec.policy if rule is None else rule.policy
  return out, matched, modules


def policy_paths(module: nnx.Module, spec: _api.AutocastSpec) -> dict[tuple, Policy]:
  """{module path: the policy its params take}; raises for a module type key that matches
  no module. A path pattern that matches no module path may name a `jax.named_scope` in
  the model's code (an f32 head written inline): it is checked against the scopes of
  each call (`scope_patterns`)."""
  out, matched, modules = _match_paths(module, spec)
  types = [r for r in spec.rules if not isinstance(r.key, str)]
  _overrides.check_all_matched(types, matched,
                               [_keypath.path_str(p) for p in modules if p])
  return out


def scope_patterns(module: nnx.Module, spec: _api.AutocastSpec) -> tuple:
  """The override patterns of `spec` that match no module path of `module`: they must
  match a scope of the traced call."""
  if not spec.rules:
    return ()
  _, matched, _ = _match_paths(module, spec)
  return tuple(r.key for r in spec.rules if isinstance(r.key, str) and r.key not in matched)


def _warn_unmatched(module: nnx.Module, spec: _api.AutocastSpec) -> None:
  """Warns (UnmatchedOverrideWarning) naming each path pattern that matches no module
  path of `module`, the paths closest to it and every rule's count.

  A warning, not an error: such a pattern may name a `jax.named_scope` of the model's
  code, which exists only when the model runs; the first call raises for a pattern that
  matches no scope there either, so a typo never goes unreported past that call."""
  unmatched = scope_patterns(module, spec)
  if not unmatched:
    return
  modules = {_keypath.path_str(p): n for p, n in nnx.iter_graph(module)
             if p and isinstance(n, nnx.Module)}
  counts = _overrides.match_counts(spec.rules, modules, modules)
  warnings.warn(_overrides.UnmatchedOverrideWarning(_overrides.unmatched_message(
      unmatched, list(modules), "matched no module path of the model (a jax.named_scope "
      "of its code may still match: checked at its first call, an error there if none "
      "does)", "module paths", counts)), stacklevel=4)


def apply_policy(module: nnx.Module, policy: Any,
                 overrides: Mapping[Any, Policy | str] | None = None, *,
                 fp32_ops=None, replace: bool = False) -> nnx.Module:
  """Applies a precision Policy to an NNX model in place and returns it.

  Params (nnx.Param) are cast to `param_dtype`; each `module(...)` call then runs under
  `precision.autocast(policy, overrides, fp32_ops)`: every GEMM of the model's code -
  Flax layers, `@`, einsum attention, Flax's MultiHeadAttention - computes
  compute x compute -> f32 forward and backward, the fp32 ops run in f32, and floating
  results leave in `output_dtype`. Other state (BatchNorm statistics, RNG counters, fp8
  scaling state) updates as in a plain call. Subclasses and user layers keep their own
  code: nothing is replaced.

  Args:
    module: the NNX model (modified in place).
    policy: a Policy, a policy string ("p=f32,c=bf16,o=f32"), a Recipe or preset name
      (its policy and fp32_ops; an fp8 recipe is refused: its fp8 layers come from
      `apply_recipe`), or a Plan (`precision.bind`: its policy, overrides and fp32_ops).
    overrides: {path pattern or module type: Policy or string}; patterns are fnmatch'ed
      against "/"-joined module paths ("blocks/0/mlp/up") and the `jax.named_scope`
      names of the model's code below them ("head" for `with jax.named_scope("head")`
      in the root's __call__); the deepest scope a rule matches decides, submodules
      inherit. E.g. {"*lm_head*": "f32"}.
    fp32_ops: op names kept in f32 (default precision.DEFAULT_FP32_OPS).
    replace: replace the mark of a model already marked with another policy, overrides
      or fp32 ops (as `apply_recipe`'s `replace`): without it such a model is refused,
      the same mark again is a no-op.
  Returns:
    `module`.
  Raises:
    ValueError: a model marked with another spec (without ``replace=True``);
      for a bad policy string or preset name, a bad override key or policy, a
      module type that matches no module, an fp8 compute dtype or an fp8 recipe (use
      `apply_recipe`); at a call, for a pattern that matches neither a module path nor a
      `jax.named_scope` of the call (naming the closest scopes and each rule's count).
  Warns:
    UnmatchedOverrideWarning: a path pattern that matches no module path (naming the
      closest paths and each rule's count): a typo, or a `jax.named_scope` of the
      model's code, which only the first call can tell.

  Examples:
    >>> model = apply_policy(model, "p=f32,c=bf16,o=f32", {"*lm_head*": "f32"})
    >>> logits = model(tokens)          # GEMMs bf16 x bf16 -> f32; logits f32
  """
  if not isinstance(module, nnx.Module):
    raise ValueError(f"apply_policy expects an nnx.Module, got {type(module).__name__}")
  if not isinstance(replace, bool):
    raise ValueError(f"apply_policy replace={replace!r}; accepted: True or False")
  _plan.refuse_fp8_recipe(policy, "apply_policy")
  spec = _plan.autocast_spec(policy, overrides, fp32_ops, module_base=nnx.Module)
  old = spec_of(module)
  if old is not None and old != spec and not replace:
    raise ValueError(
        f"apply_policy: the model is already marked with {old.describe()}, not "
        f"{spec.describe()}: its params were cast to {old.policy.param_dtype.name} by that "
        "mark; accepted: the same policy again (a no-op), replace=True (the new mark, "
        "params cast again; rounded values stay rounded) or a model built again")
  return mark(module, spec)


def mark(module: nnx.Module, spec: _api.AutocastSpec) -> nnx.Module:
  """Casts params by path and marks `module` to run under `spec` (see apply_policy)."""
  by_path = policy_paths(module, spec)
  _warn_unmatched(module, spec)
  for path, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Param):
      owner = tuple(path)[:-1]
      while owner not in by_path:  # a Param held by a list or dict inside a module
        owner = owner[:-1]
      _cast_variable(node, by_path[owner].param_dtype)
  setattr(module, _scopes.SPEC_ATTR, spec)
  # The instance, not its class, takes the dispatching __call__: the user's class and
  # every other instance of it stay as written.
  module.__class__ = _marked_class(type(module))
  return module


def spec_of(module: nnx.Module) -> _api.AutocastSpec | None:
  """The autocast spec `apply_policy`/`apply_recipe` marked `module` with (policy,
  overrides, fp32 ops, the recipe it came from), or None.

  Examples:
    >>> spec_of(apply_recipe(model, "bf16_mixed")).recipe.name
    'bf16_mixed'
  """
  return getattr(module, _scopes.SPEC_ATTR, None)


def policy_of(module: nnx.Module) -> Policy | None:
  """The Policy `apply_policy`/`apply_recipe` marked `module` with (outside its
  overrides), or None; `spec_of` gives the whole spec.

  Examples:
    >>> str(policy_of(apply_policy(model, "bf16_mixed")))
    'p=f32,c=bf16,o=f32'
  """
  spec = spec_of(module)
  return None if spec is None else spec.policy
