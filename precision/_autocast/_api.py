"""precision.autocast: a precision policy applied to any JAX function, unmodified.

The function is traced once to a jaxpr at its arguments' shapes and dtypes (nothing runs)
and the jaxpr is evaluated again equation by equation under the policy (see _rules for
what each primitive does). The result is an ordinary JAX computation: differentiate it,
jit it, vmap it, shard it; the backward pass of every GEMM is compute x compute -> f32
too (the policy GEMMs are custom VJPs) and gradients come back in the dtype of the value
differentiated (f32 for f32 params, accumulated in f32).

Flax NNX modules may be passed as arguments (their state is split out and traced, and the
variables the call changed are written back, so BatchNorm statistics, fp8 scaling state
and RNG counters update as in a plain call and untouched variables are never set),
and their module paths become name scopes, which `overrides` patterns and
`precision.audit` read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Mapping

import jax
import numpy as np

from precision import _fp32_ops
from precision._policy import Policy, cast_floating, dtype_name, get_policy
from precision._recipe import DEFAULT_FP32_OPS, PRESETS, Recipe, get_recipe
from precision._autocast import _overrides
from precision._autocast import _interpret


@dataclasses.dataclass(frozen=True)
class AutocastSpec:
  """A policy, its overrides and the ops kept in f32: everything autocast applies.

  Frozen and hashable (NNX keeps it in a module's static graph definition). `recipe` is
  the Recipe the spec was made from (None for a bare policy): a model marked with one
  recipe and traced under another is refused (see precision.flax.apply_recipe).
  """

  policy: Policy
  rules: tuple = ()
  fp32_ops: tuple[str, ...] = DEFAULT_FP32_OPS
  recompute_f32: bool = True
  recipe: Recipe | None = None

  def describe(self) -> str:
    """One line for error messages: recipe (or policy), overrides, fp32 ops if not default.

    Examples:
      >>> AutocastSpec.make("bf16_mixed", {"head": "f32"}).describe()
      "recipe 'bf16_mixed' (p=f32,c=bf16,o=f32), overrides {'head': 'p=f32,c=f32,o=f32'}"
    """
    text = (f"recipe {self.recipe.name!r} ({self.policy})" if self.recipe is not None
            else f"policy {str(self.policy)!r}")
    if self.rules:
      shown = ", ".join(f"{_overrides.key_name(r.key)}: {str(r.policy)!r}"
                        for r in self.rules)
      text += f", overrides {{{shown}}}"
    else:
      text += ", no overrides"
    if self.fp32_ops != (self.recipe.fp32_ops if self.recipe is not None
                         else DEFAULT_FP32_OPS):
      text += f", fp32_ops {list(self.fp32_ops)}"
    return text

  @functools.cached_property
  def fp32_primitives(self) -> frozenset:
    return _fp32_ops.primitives_of(self.fp32_ops)

  @classmethod
  def make(cls, policy: Policy | Recipe | str, overrides: Mapping[Any, Any] | None = None,
           fp32_ops=None, *, module_base: type = object,
           recompute_f32: bool = True) -> AutocastSpec:
    """Validates and builds a spec.

    Args:
      policy: a Policy, a policy string ("p=f32,c=bf16,o=f32"), a Recipe, a preset
        recipe name ("bf16_mixed") or a Plan (`precision.bind`): a recipe contributes its
        policy and fp32_ops, a plan its whole spec (overrides included; it takes no
        further `overrides` or `fp32_ops`).
      overrides: {path pattern or module type: policy} (see precision.autocast).
      fp32_ops: op names kept in f32 (default: the recipe's, else DEFAULT_FP32_OPS).
      recompute_f32: recompute the f32 glue between GEMMs (norms, softmax) in the backward
        pass instead of saving its f32 intermediates (see precision._autocast._regions).
    Raises:
      ValueError: a bad policy, override or op name; an fp8 compute dtype (fp8 GEMMs need
        scaling: an fp8 recipe); a recipe with fp8 GEMMs passed to plain autocast (their
        scaling state lives in layers: precision.flax.apply_recipe).
    """
    # In the function: _plan imports this module (a Plan holds an AutocastSpec).
    from precision import _plan  # pylint: disable=g-import-not-at-top
    if isinstance(policy, _plan.Plan):
      plan = _plan.as_plan(policy, overrides, fp32_ops)
      _refuse_fp8(plan.recipe)
      return plan.autocast_spec
    recipe = None
    if isinstance(policy, Recipe) or (isinstance(policy, str) and "=" not in policy
                                      and policy in PRESETS):
      recipe = get_recipe(policy)
      _refuse_fp8(recipe)
      policy = recipe.policy
      fp32_ops = recipe.fp32_ops if fp32_ops is None else fp32_ops
    if isinstance(policy, str) and "=" not in policy:
      try:
        get_policy(policy)
      except ValueError as e:
        raise ValueError(
            f"{policy!r} is neither a dtype nor a preset recipe; accepted: a policy string "
            f"such as 'p=f32,c=bf16,o=f32', a dtype ({e}), or a preset: "
            f"{', '.join(PRESETS)}") from e
    return cls.build(policy, overrides, fp32_ops, module_base=module_base,
                     recompute_f32=recompute_f32, recipe=recipe)

  @classmethod
  def build(cls, policy: Policy | str, overrides: Mapping[Any, Any] | None = None,
            fp32_ops=None, *, module_base: type = object, recompute_f32: bool = True,
            recipe: Recipe | None = None) -> AutocastSpec:
    """`make` for a policy (never a recipe name), recording `recipe` as the spec's origin;
    fp8 recipes are accepted (precision.bind: their fp8 layers come from apply_recipe)."""
    base = get_policy(policy)
    rules = _overrides.parse_overrides(overrides, module_base)
    for where, pol in [("policy", base)] + [(f"override {r.key!r}", r.policy) for r in rules]:
      c = np.dtype(pol.compute_dtype)
      if c.itemsize == 1:
        raise ValueError(
            f"{where}: compute dtype {dtype_name(c)} is an fp8 format; fp8 GEMMs need "
            "scaling (an unscaled cast turns 500 into NaN in E4M3): use an fp8 recipe "
            "(precision.get_recipe('fp8_hybrid') with precision.flax.apply_recipe)")
    fp32 = _fp32_ops.check_names(DEFAULT_FP32_OPS if fp32_ops is None else fp32_ops)
    if not isinstance(recompute_f32, bool):
      raise ValueError(f"recompute_f32={recompute_f32!r}; accepted: True or False")
    return cls(base, rules, fp32, recompute_f32, recipe)


def _refuse_fp8(recipe: Recipe) -> None:
  if recipe.fp8 is not None:
    raise ValueError(
        f"Recipe {recipe.name!r} has fp8 GEMMs, whose scaling state (amax history, "
        "scales) lives in layers: use precision.flax.apply_recipe(model, recipe) on an "
        "NNX model (its nnx.Linear/Einsum layers get the fp8 GEMMs, every other GEMM the "
        "recipe's policy), or autocast(fn, recipe.policy) for the policy alone")


# ----------------------------------------------------------------------------- tracing


@dataclasses.dataclass(frozen=True)
class ActiveTrace:
  """One autocast tracing now: its spec and the interpreter's scope tables, which module
  scopes opened inside the trace (precision.flax) fill."""
  spec: AutocastSpec
  module_at: dict       # scope -> module (type override keys)
  module_policy: dict   # scope -> Policy of a module marked on its own


class _State(threading.local):
  def __init__(self):
    self.traces: list[ActiveTrace] = []   # the autocasts tracing now, innermost last


_STATE = _State()
# Registered once per process (at import), read by every thread: not thread-local.
_SCOPE_HOOKS: list[Callable] = []


def tracing() -> bool:
  """True while autocast traces a function (code that applies autocast itself, such as
  a module marked by precision.flax.apply_policy, then runs as written: the enclosing
  autocast governs it)."""
  return bool(_STATE.traces)


def active_spec() -> AutocastSpec | None:
  """The spec of the innermost autocast tracing now (None outside any). Code that wraps
  part of a traced function in a custom VJP of its own (ZeRO-3's gathered layers) applies
  it inside, since autocast runs custom_vjp bodies as written."""
  return _STATE.traces[-1].spec if _STATE.traces else None


def active_trace() -> ActiveTrace | None:
  """The innermost autocast tracing now (None outside any)."""
  return _STATE.traces[-1] if _STATE.traces else None


@contextlib.contextmanager
def _tracing_scope(spec: AutocastSpec, module_at: dict, module_policy: dict):
  _STATE.traces.append(ActiveTrace(spec, module_at, module_policy))
  try:
    yield
  finally:
    _STATE.traces.pop()


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _graph_node_check():
  """flax.nnx's graph-node predicate when flax is importable (else: nothing is one)."""
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - flax is a dependency
    return lambda x: False
  return nnx.graph.is_graph_node


@dataclasses.dataclass
class Traced:
  """What one autocast call saw: the outputs, the dtypes the traced program gave them
  (flat, in tree_leaves order) and the interpreter's record."""
  outputs: Any
  traced_dtypes: list
  env: _interpret.Env

  def outputs_in_traced_dtypes(self):
    """The outputs with every floating leaf cast back to its traced dtype."""
    leaves, tree = jax.tree_util.tree_flatten(self.outputs)
    return jax.tree_util.tree_unflatten(tree, _interpret.cast_all(leaves, self.traced_dtypes))


def run(spec: AutocastSpec, fn: Callable, args: tuple, kwargs: dict, *,
        check_overrides: bool = True, root_scope: str = "",
        module_at: dict | None = None) -> Traced:
  """Traces `fn(*args, **kwargs)` and evaluates it under `spec`; NNX graph nodes among the
  arguments are split out, and the variables the call changed are written back after it
  (`_changed_state`).

  Returns the raw outputs (dtypes as the policy left them; `autocast` casts them to the
  output dtype) and the interpreter's record.
  """
  is_node = _graph_node_check()
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
  kinds = ["node" if is_node(x) else "array" if _is_array(x) else "static" for x in leaves]
  nodes = [x for x, k in zip(leaves, kinds) if k == "node"]
  arrays = [x for x, k in zip(leaves, kinds) if k == "array"]
  graph = None
  if nodes:
    from flax import nnx  # pylint: disable=g-import-not-at-top
    graph, node_state = nnx.split(tuple(nodes))
  else:
    node_state = None
  module_at = {} if module_at is None else module_at   # scope -> module (for type keys)
  module_policy: dict = {}

  def flat_fn(node_state, arrays):
    it_nodes = iter(nnx.merge(graph, node_state, copy=True)) if nodes else iter(())
    it_arrays = iter(arrays)
    rebuilt = [next(it_nodes) if k == "node" else next(it_arrays) if k == "array" else x
               for x, k in zip(leaves, kinds)]
    a, kw = jax.tree_util.tree_unflatten(treedef, rebuilt)
    # Standard promotion while tracing: a p=bf16 recipe's bf16 params meet the f32 values
    # of a model written for f32 (nnx.Embed returns f32 by default); JAX's default
    # promotes them and the policy then decides. A program valid under strict promotion
    # means the same under standard.
    with _tracing_scope(spec, module_at, module_policy), \
        jax.numpy_dtype_promotion("standard"), \
        _module_scopes(rebuilt, kinds, module_at, module_policy):
      out = fn(*a, **kw)
    new_state = _changed_state(
        node_state, nnx.state(tuple(x for x, k in zip(rebuilt, kinds) if k == "node"))) \
        if nodes else None
    return out, new_state

  closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(node_state, arrays)
  env = _interpret.Env(spec.policy, spec.rules, spec.fp32_primitives, module_at,
                       module_policy, root=root_scope, recompute_f32=spec.recompute_f32)
  in_flat = jax.tree_util.tree_leaves((node_state, arrays))
  outs = _interpret.eval_jaxpr(env, closed.jaxpr, closed.consts, in_flat)
  out_tree = jax.tree_util.tree_structure(out_shape)
  # Every output keeps its traced dtype except the function's floating results, which
  # the caller casts; NNX state written back keeps each variable's own dtype.
  traced_dtypes = _interpret.traced_dtypes(closed.jaxpr.outvars)
  result, new_state = jax.tree_util.tree_unflatten(out_tree, outs)
  n_result = len(jax.tree_util.tree_leaves(result))
  if nodes and jax.tree_util.tree_leaves(new_state):
    state_leaves, state_tree = jax.tree_util.tree_flatten(new_state)
    new_state = jax.tree_util.tree_unflatten(
        state_tree, _interpret.cast_all(state_leaves, traced_dtypes[n_result:]))
    nnx.update(tuple(nodes), new_state)
  if check_overrides:
    _check_overrides(spec, env)
  return Traced(result, traced_dtypes[:n_result], env)


def _changed_state(before: Any, after: Any) -> Any:
  """The variables of `after` (the nodes' state after the traced call) whose value is not
  the very tracer `before` (the state traced in) held at that path: only those are
  written back. A variable the call left alone (an nnx.Rngs it did not draw from, a
  Dropout called with deterministic=True, every param) is not set again: setting it would
  be a no-op, and an error where the variable belongs to an outer trace (a model merged
  inside jax.grad from state closed over: flax refuses mutation across trace levels).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  old = {tuple(path): jax.tree_util.tree_leaves(var) for path, var in nnx.to_flat_state(before)}

  def unchanged(path, var) -> bool:
    was, now = old.get(tuple(path)), jax.tree_util.tree_leaves(var)
    return was is not None and len(was) == len(now) and all(
        a is b for a, b in zip(was, now))

  return nnx.from_flat_state([(path, var) for path, var in nnx.to_flat_state(after)
                              if not unchanged(path, var)])


def _check_overrides(spec: AutocastSpec, env: _interpret.Env) -> None:
  unmatched = [r.key for r in spec.rules if r.key not in env.matched]
  if unmatched:
    scopes = sorted(env.seen_scopes)
    shown = ", ".join(repr(s) for s in scopes[:16]) + (", ..." if len(scopes) > 16 else "")
    names = ", ".join(_overrides.key_name(k) for k in unmatched)
    raise ValueError(
        f"Override(s) {names} matched no scope of the traced program; its scopes are: "
        f"{shown or '(none: the function opens no named scope or module)'}")


@contextlib.contextmanager
def _module_scopes(leaves, kinds, module_at, module_policy):
  """Runs the registered scope hooks (precision.flax's NNX module paths) around a call."""
  nodes = [x for x, k in zip(leaves, kinds) if k == "node"]
  with contextlib.ExitStack() as stack:
    if nodes:
      for hook in _SCOPE_HOOKS:
        stack.enter_context(hook(nodes, module_at, module_policy))
    yield


def register_scope_hook(hook: Callable) -> None:
  """`hook(nodes, module_at, module_policy)` -> context manager, entered while autocast
  traces a call that received graph nodes (precision.flax registers NNX's)."""
  if hook not in _SCOPE_HOOKS:
    _SCOPE_HOOKS.append(hook)


# ----------------------------------------------------------------------------- public


def autocast(fn: Callable, policy: Any,
             overrides: Mapping[Any, Any] | None = None, *,
             fp32_ops=None) -> Callable:
  """`fn` under a precision policy: a function with the same signature whose GEMMs run
  on compute-dtype operands with f32 accumulation, forward and backward, whose fp32 ops
  run in f32, and whose floating results are returned in the policy's output dtype.

  What each op does (see precision._autocast._rules):
    * dot_general / conv_general_dilated (jnp.matmul, @, einsum, Flax layers, attention
      written by hand): operands cast to the compute dtype, f32 accumulation
      (`preferred_element_type=float32`), result in the compute dtype; their backward
      GEMMs round the cotangent once to the compute dtype and accumulate in f32 too; the
      gradient of each operand comes back in that operand's own dtype (f32 params: f32
      gradients, never rounded to bf16).
    * the primitives of `fp32_ops` (softmax's max/exp/sum/div, norms' squares, means and
      rsqrt, exp/log/tanh/logistic, RoPE's sin/cos, ...): operands below f32 are upcast
      and the op computes and returns f32;
    * elementwise ops on mixed float dtypes run in the wider one (a bf16 GEMM result plus
      an f32 bias is an f32 add: the bias gradient is summed in f32);
    * explicit casts in `fn` are kept; custom_vjp functions and Pallas kernels run as
      written (their operands in the dtypes they were traced with); jit, scan, while,
      cond, remat and custom_jvp are recursed into (loop carries keep their dtypes).
  Params are not cast (their storage dtype is the caller's:
  `precision.flax.apply_policy` casts an NNX model's params to the param dtype).

  Args:
    fn: any JAX-traceable function. Arguments that are arrays are traced; NNX modules
      are split and their state written back after the call; other arguments (Python
      numbers, strings, flags) are static.
    policy: Policy, policy string ("p=f32,c=bf16,o=f32"), Recipe, preset name, or a
      Plan (`precision.bind(recipe, overrides=...)`, which then brings the overrides
      and fp32_ops: pass neither besides).
    overrides: {pattern or module type: policy}: fnmatch patterns on the scope an op was
      traced in ("blocks/0/mlp", "*lm_head*"; NNX module paths and jax.named_scope names);
      the deepest matching scope decides. A pattern that matches no scope raises.
    fp32_ops: op names kept in f32 (precision.DEFAULT_FP32_OPS, the recipe's by default).
  Returns:
    The wrapped function.

  Examples:
    >>> def loss_fn(params, x, y):           # written with no dtype in mind
    ...   h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    ...   return jnp.mean((h @ params["w2"] - y) ** 2)
    >>> loss, grads = jax.value_and_grad(mp.autocast(loss_fn, "bf16_mixed"))(params, x, y)
  """
  spec = AutocastSpec.make(policy, overrides, fp32_ops)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    out = run(spec, fn, args, kwargs).outputs
    return cast_floating(out, spec.policy.output_dtype)

  wrapped.autocast_spec = spec
  return wrapped
