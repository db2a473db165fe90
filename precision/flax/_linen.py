"""linen_policy: the same Policy for Flax Linen models, as a context manager.

Inside the context every `init` / `apply` of a Linen model runs its root method under
`precision.autocast`, lifted over the module's variables the way Flax lifts `nn.remat`
(`flax.core.lift.pack`): the call is traced with its variables and RNG streams as inputs and
evaluated op by op under the policy, so every GEMM of the model - Dense, Conv, Einsum,
attention written in the module, Flax's MultiHeadDotProductAttention - runs compute x
compute -> f32 forward and backward, the fp32 ops (softmax, BatchNorm/LayerNorm statistics,
exp/log/tanh, ...) run in f32, mutable collections (batch_stats) update as in a plain call
and keep their dtypes, and the root returns `output_dtype`.

`init` creates every param with the initializer's own dtype (f32 unless the module says
otherwise) and then rounds it to the policy's `param_dtype` for its path: a bf16 init equals
the f32 init of the same seed rounded to bf16. Module fields are never modified.

Linen names each module in JAX's name stack ("Model/block_0/Dense_0"); override patterns
are matched against the path below the root ("block_0/Dense_0").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax
from flax.core import lift

from precision import _trace_state
from precision._policy import Policy, cast_floating
from precision import _plan
from precision._autocast import _api
from precision import _keypath
from precision import _overrides


def _module_path(module: nn.Module) -> tuple:
  try:
    return tuple(module.path)
  except (ValueError, AttributeError):
    return ()


def _cast_params(variables: Any, spec: _api.AutocastSpec, matched: set) -> Any:
  """Each leaf of a "params" collection in `variables` (any nesting of Flax's variable
  groups) rounded to the param dtype of its module path's policy."""

  def cast(path, leaf):
    names = [_keypath.key_name(k) for k in path]
    if "params" not in names:
      return leaf
    names = names[names.index("params") + 1:-1]
    rule = _overrides.match_scope(spec.rules, "/".join(names), _trace().module_at)
    if rule is not None:
      matched.add(rule.key)
    pol = spec.policy if rule is None else rule.policy
    return cast_floating(leaf, pol.param_dtype)

  return jax.tree_util.tree_map_with_path(cast, variables)


def _autocast_transform(spec: _api.AutocastSpec, matched: set, seen: set):
  """A lifted transform (fn(scope, *args) -> fn under autocast), as lift.checkpoint."""

  def transform(fn, scope, *args, **kwargs):
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
      def pure(variable_groups, rng_groups, *args, **kwargs):
        inner_scope = scope_fn(variable_groups, rng_groups)
        y = fn(inner_scope, *args, **kwargs)
        return y, repack_fn(inner_scope)

      trace = _trace()
      traced = _api.run(spec, pure, (variable_groups, rng_groups, *args), kwargs,
                        check_overrides=False, root_scope=trace.root_name,
                        module_at=trace.module_at)
      matched.update(traced.env.matched)
      seen.update(traced.env.seen_scopes)
      y, _ = traced.outputs
      # Variables written back keep the dtypes the traced program gave them (batch
      # statistics stay f32); then new params are rounded to their param dtype.
      _, repacked = traced.outputs_in_traced_dtypes()
      repacked = _cast_params(repacked, spec, matched)
      return cast_floating(y, spec.policy.output_dtype), repacked

    # enable_kwargs: without it lift.pack drops every keyword argument with a warning
    # (``apply(v, x, train=False)`` would run the module's default, train=True).
    return lift.pack(inner, (True,), (True,), (True,), name="autocast",
                     enable_kwargs=True)(scope, *args, **kwargs)

  return transform


def _trace() -> _trace_state.LinenTrace:
  """The Linen root call this context traces (a blank one outside any: nothing reads it
  there)."""
  return _trace_state.LINEN.get() or _trace_state.LinenTrace("", {})


@contextlib.contextmanager
def linen_policy(policy: Any, overrides: Mapping[Any, Policy | str] | None = None,
                 *, fp32_ops=None) -> Iterator[Policy]:
  """Runs Linen `init`/`apply` calls inside the context under a precision Policy.

  Every positional and keyword argument of `init`/`apply` and its `mutable=` / `rngs=`
  reach the module as in a plain call (``model.apply(v, x, train=False)``).

  Args:
    policy: a Policy or a policy string ("p=f32,c=bf16,o=f32"); a Recipe or preset name
      ("bf16_mixed": its policy and fp32_ops; fp8 recipes are refused); or a Plan
      (`precision.bind`: its policy, overrides and fp32_ops).
    overrides: {path pattern or module type: policy}; patterns are fnmatch'ed against the
      "/"-joined path below the root ("block_0/Dense_0", "*head*"); the deepest matching
      module decides. Type keys match Linen module classes. Not with a Plan.
    fp32_ops: op names kept in f32 (default: the recipe's, else
      precision.DEFAULT_FP32_OPS).

  Yields:
    The Policy in force outside the overrides.

  Raises:
    ValueError: for a bad policy, preset name or override on entry; on a clean exit, for
      an override pattern that matched no module called inside the context.

  Examples:
    >>> with linen_policy("p=f32,c=bf16,o=f32"):
    ...   variables = model.init(key, x)
    ...   logits = model.apply(variables, x, train=False)
    >>> with linen_policy(precision.bind("bf16_mixed", overrides={"head": "f32"})):
    ...   logits = model.apply(variables, x)
  """
  _plan.refuse_fp8_recipe(policy, "linen_policy")
  spec = _plan.autocast_spec(policy, overrides, fp32_ops, module_base=nn.Module)
  matched: set = set()
  seen: set = set()
  transform = _autocast_transform(spec, matched, seen)

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    path = _module_path(module)
    if _api.tracing() or path or context.method_name == "setup":
      trace = _trace_state.LINEN.get()
      if _api.tracing() and path and trace is not None:
        trace.module_at.setdefault(_keypath.path_str(path), module)
      return next_fun(*args, **kwargs)
    method = context.orig_method  # functools.partial(function, module) in Flax
    method = method.func if isinstance(method, functools.partial) else method
    with _trace_state.setting(_trace_state.LINEN,
                              _trace_state.LinenTrace(type(module).__name__, {})):
      return nn.transforms.lift_direct_transform(transform, (method,), module, *args,
                                                 **kwargs)

  with nn.intercept_methods(interceptor):
    yield spec.policy
  _overrides.check_all_matched(spec.rules, matched, sorted(seen))
