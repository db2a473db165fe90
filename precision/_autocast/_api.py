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

A recipe with fp8 GEMMs runs the traced function's forward dot_generals through fp8 (see
precision._autocast._fp8 for which ones); delayed scaling carries its state explicitly
(`fp8_state=True`).

The spec it runs under (`precision._autocast_spec.AutocastSpec`) is decided by the Plan
(`precision._plan.autocast_spec`); the run/trace/write-back here is the one entry point
every front end calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from precision import _deprecation
from precision import _trace_state
from precision._policy import cast_floating
from precision._autocast import _fp8
from precision import _overrides
from precision import _plan
from precision._autocast_spec import AutocastSpec
from precision._autocast import _interpret
from precision._autocast import _rules as R


# ----------------------------------------------------------------------------- tracing


@dataclasses.dataclass(frozen=True)
class ActiveTrace:
  """One autocast tracing now: its spec and the interpreter's scope tables, which module
  scopes opened inside the trace (precision.flax) fill."""
  spec: AutocastSpec
  module_at: dict       # scope -> module (type override keys)
  module_policy: dict   # scope -> Policy of a module marked on its own


# Registered once per process (at import), read by every thread: not thread-local.
_SCOPE_HOOKS: list[Callable] = []


def tracing() -> bool:
  """True while autocast traces a function (code that applies autocast itself, such as
  a module marked by precision.flax.apply_policy, then runs as written: the enclosing
  autocast governs it)."""
  return bool(_trace_state.AUTOCAST.get())


def active_spec() -> AutocastSpec | None:
  """The spec of the innermost autocast tracing now (None outside any). Code that wraps
  part of a traced function in a custom VJP of its own (ZeRO-3's gathered layers) applies
  it inside, since autocast runs custom_vjp bodies as written."""
  traces = _trace_state.AUTOCAST.get()
  return traces[-1].spec if traces else None


def active_trace() -> ActiveTrace | None:
  """The innermost autocast tracing now (None outside any)."""
  traces = _trace_state.AUTOCAST.get()
  return traces[-1] if traces else None


@contextlib.contextmanager
def _tracing_scope(spec: AutocastSpec, module_at: dict, module_policy: dict):
  traces = _trace_state.AUTOCAST.get() + (ActiveTrace(spec, module_at, module_policy),)
  with _trace_state.setting(_trace_state.AUTOCAST, traces):
    yield


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
  (flat, in tree_leaves order), the interpreter's record, and with fp8 GEMMs each site's
  decision and, when the state is explicit (`spec.fp8_state`), the new scaling state
  ({site key: Fp8DotState})."""
  outputs: Any
  traced_dtypes: list
  env: _interpret.Env
  fp8_state: dict | None = None
  fp8_decisions: list | None = None

  def outputs_in_traced_dtypes(self):
    """The outputs with every floating leaf cast back to its traced dtype."""
    leaves, tree = jax.tree_util.tree_flatten(self.outputs)
    return jax.tree_util.tree_unflatten(tree, _interpret.cast_all(leaves, self.traced_dtypes))


def run(spec: AutocastSpec, fn: Callable, args: tuple, kwargs: dict, *,
        check_overrides: bool = True, root_scope: str = "",
        module_at: dict | None = None, fp8_state: Any = None,
        evaluate: bool = True) -> Traced:
  """Traces `fn(*args, **kwargs)` and evaluates it under `spec`; NNX graph nodes among the
  arguments are split out, and the variables the call changed are written back after it
  (`_changed_state`).

  Returns the raw outputs (dtypes as the policy left them; `autocast` casts them to the
  output dtype) and the interpreter's record. `fp8_state`: the scaling state read by the
  fp8 sites when `spec.fp8_state` (checked against the sites). `evaluate=False` traces and
  chooses the fp8 sites only (outputs None; `precision.fp8.init_state`).
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
  decisions = None
  if spec.fp8 is not None:
    env.fp8, decisions = _fp8.prepare(env, closed.jaxpr, spec.fp8, spec.fp8_state,
                                      fp8_state, check_state=evaluate)
  elif spec.grouped_fp8 is not None:
    # An fp8 plan's own spec (a model marked by apply_recipe, data_parallel's step): the
    # model's fp8 layers run its dense fp8 GEMMs; its grouped GEMMs run fp8 here.
    env.fp8, decisions = _fp8.prepare_grouped(env, closed.jaxpr, spec.grouped_fp8)
  if not evaluate:
    return Traced(None, [], env, None, decisions)
  in_flat = jax.tree_util.tree_leaves((node_state, arrays))
  outs = _interpret.eval_jaxpr(env, closed.jaxpr, closed.consts, in_flat)
  # An output that is a constant of the traced program (a literal or a captured constant:
  # `jnp.array(False)`, a counter reset to 0) is a jax.Array, as in a plain call.
  outs = [x if isinstance(x, jax.Array) or not hasattr(v.aval, "dtype")
          else jnp.asarray(x, v.aval.dtype)
          for x, v in zip(outs, closed.jaxpr.outvars)]
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
    check_overrides_matched(spec, env)
  new_fp8 = None
  if env.fp8 is not None and spec.fp8_state:
    # Every site is evaluated (a jaxpr holding one is never bound as traced); a key the
    # evaluation did not reach would keep its state.
    new_fp8 = {k: env.fp8.state_out.get(k, v) for k, v in env.fp8.state_in.items()}
  return Traced(result, traced_dtypes[:n_result], env, new_fp8, decisions)


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


def check_overrides_matched(spec: AutocastSpec, env: _interpret.Env, keys=None) -> None:
  """Raises ValueError naming every override rule of `spec` (those with a key in `keys`,
  default all) that matched no scope of the program `env` evaluated."""
  unmatched = [r.key for r in spec.rules
               if r.key not in env.matched and (keys is None or r.key in keys)]
  if unmatched:
    scopes = sorted(env.seen_scopes)
    counts = _overrides.match_counts(spec.rules, scopes, env.module_at)
    raise ValueError(_overrides.unmatched_message(
        unmatched, scopes, "matched no scope of the traced program", "its scopes",
        counts))


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


def _refuse_f64_without_x64(spec: AutocastSpec) -> None:
  """Raises for an f64 dtype in the policy or an override while jax_enable_x64 is off:
  JAX would then make every f64 value f32, and the function would silently compute in
  f32 under a policy that says f64."""
  if jax.config.jax_enable_x64:
    return
  for where, pol in [("policy", spec.policy)] + [
      (f"override {_overrides.key_name(r.key)}", r.policy) for r in spec.rules]:
    for part in ("param_dtype", "compute_dtype", "output_dtype"):
      if np.dtype(getattr(pol, part)) == np.dtype(np.float64):
        raise ValueError(
            f"{where}={str(pol)!r}: its {part} is f64, but jax_enable_x64 is off, so JAX "
            "computes f64 values in f32; accepted: f32, bf16, f16 or fp8 dtypes, or f64 "
            "after jax.config.update('jax_enable_x64', True)")


def _state_positions(state_outputs: Any) -> tuple[int, ...] | None:
  """`state_outputs` of autocast as a sorted tuple of result positions (None: found per
  call, `_new_values_of_arguments`)."""
  if state_outputs is None:
    return None
  given = (state_outputs,) if isinstance(state_outputs, int) else state_outputs
  try:
    positions = tuple(given)
  except TypeError:
    positions = None
  if positions is None or not all(
      isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in positions):
    raise ValueError(
        f"state_outputs={state_outputs!r}; accepted: the position (int >= 0) or positions "
        "(a tuple of them) of the function's tuple result that are state, e.g. 1 for "
        "Haiku's apply(params, state, rng, x) -> (out, new_state)")
  return tuple(sorted(set(positions)))


def _signature(tree: Any, dtypes=None):
  """(tree structure, ((shape, dtype) per leaf)) of a container of arrays (`dtypes`: the
  leaves' dtypes, default their own); None for a bare array (an activation shaped like
  an input is no state), a leaf that is not an array, or no floating leaf with at least
  one dimension."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not leaves or jax.tree_util.treedef_is_leaf(treedef) or not all(
      hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
    return None
  dtypes = [np.dtype(x.dtype) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x.dtype for x in leaves] if dtypes is None else dtypes
  if not any(np.ndim(x) and R.is_float(d) for x, d in zip(leaves, dtypes)):
    return None
  return treedef, tuple((tuple(np.shape(x)), d) for x, d in zip(leaves, dtypes))


def _new_values_of_arguments(traced: Traced, args: tuple, kwargs: dict) -> list[bool]:
  """Per output leaf (tree_leaves order): whether it belongs to a new value of an
  argument - the whole result, or an element of a tuple/list result, that is a
  container (dict, tuple, list, dataclass or other pytree node, not a bare array) with
  the tree structure, shapes and traced dtypes of a whole positional or keyword argument
  (a Haiku/Equinox state, a KV cache of per-layer arrays, a loop carry)."""
  wanted = {sig for sig in map(_signature, [*args, *kwargs.values()]) if sig is not None}
  out = traced.outputs
  n = len(jax.tree_util.tree_leaves(out))
  dtypes = list(traced.traced_dtypes)
  mask = [False] * n
  if not wanted:
    return mask
  if _signature(out, dtypes) in wanted:
    return [True] * n
  if isinstance(out, (tuple, list)):
    start = 0
    for item in out:
      k = len(jax.tree_util.tree_leaves(item))
      if _signature(item, dtypes[start:start + k]) in wanted:
        mask[start:start + k] = [True] * k
      start += k
  return mask


def _results(traced: Traced, spec: AutocastSpec, state: tuple[int, ...] | None,
             args: tuple = (), kwargs: dict | None = None) -> Any:
  """The wrapped function's result: floating leaves in the output dtype, except state,
  whose leaves keep their traced dtypes: the `state` positions of a tuple result, or
  (`state` None) the new values of arguments (`_new_values_of_arguments`)."""
  if state is None:
    mask = _new_values_of_arguments(traced, args, kwargs or {})
    leaves, tree = jax.tree_util.tree_flatten(traced.outputs)
    kept = jax.tree_util.tree_leaves(traced.outputs_in_traced_dtypes())
    return jax.tree_util.tree_unflatten(tree, [
        k if m else cast_floating(x, spec.policy.output_dtype)
        for x, k, m in zip(leaves, kept, mask)])
  if not state:
    return cast_floating(traced.outputs, spec.policy.output_dtype)
  out = traced.outputs
  if not isinstance(out, (tuple, list)) or len(out) <= state[-1]:
    got = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list))
           else f"a {type(out).__name__}, not a tuple")
    raise ValueError(
        f"state_outputs={state!r} names positions of the function's tuple result, but the "
        f"function returned {got}")
  kept = traced.outputs_in_traced_dtypes()
  items = [kept[i] if i in state else cast_floating(x, spec.policy.output_dtype)
           for i, x in enumerate(out)]
  return out._make(items) if hasattr(out, "_make") else type(out)(items)


@_deprecation.renamed_keyword("policy", "recipe", "precision.autocast")
def autocast(fn: Callable, recipe: Any,
             overrides: Mapping[Any, Any] | None = None, *,
             fp32_ops=None, fp8_state: bool = False,
             state_outputs: int | tuple[int, ...] | None = None) -> Callable:
  """`fn` under a precision policy: a function with the same signature whose GEMMs run
  on compute-dtype operands with f32 accumulation, forward and backward, whose fp32 ops
  run in f32, and whose floating results are returned in the policy's output dtype -
  except state: a result that is a new value of an argument (a cache, running
  statistics, a loop carry; see `state_outputs`) comes back in the dtype the unmodified
  function gives it, under every recipe, so loops over the step compile.

  What each op does (see precision._autocast._rules):
    * dot_general / conv_general_dilated / ragged_dot_general (jnp.matmul, @, einsum,
      Flax layers, attention written by hand or jax.nn.dot_product_attention's XLA
      implementation, an MoE layer's `lax.ragged_dot` expert GEMMs): operands cast to
      the compute dtype, f32 accumulation
      (`preferred_element_type=float32`), result in the compute dtype; their backward
      GEMMs round the cotangent once to the compute dtype and accumulate in f32 too; the
      gradient of each operand comes back in that operand's own dtype (f32 params: f32
      gradients, never rounded to bf16).
    * the primitives of `fp32_ops` (softmax's max/exp/sum/div, norms' squares, means and
      rsqrt, exp/log/tanh/logistic, RoPE's sin/cos, ...): operands below f32 are upcast
      and the op computes and returns f32;
    * elementwise ops on mixed float dtypes run in the wider one (a bf16 GEMM result plus
      an f32 bias is an f32 add: the bias gradient is summed in f32);
    * under an f32 (or wider) compute dtype - the `fp32` recipe, an f32 override - every
      op runs as written (the code's own bf16 casts, precision and dot algorithms: the
      `fp32` recipe is bit-identical to `fn`); an override giving a scope "f32" is the
      opt-out for code that means its own casts. Below f32 a GEMM's `precision=` is
      re-derived for its compute-dtype operands, a GEMM that asked for a wider result
      (`preferred_element_type=f32` on bf16 operands, precision HIGHEST on f32 operands)
      returns it, and a narrow value broadcast over a batch (a bias the code cast to
      bf16) is broadcast through f32 so that its gradient is summed in f32;
    * explicit casts in `fn` are kept; custom_vjp functions and Pallas kernels run as
      written (their operands in the dtypes they were traced with); jit, scan, while,
      cond, remat and custom_jvp are recursed into (loop carries keep their dtypes).
    * with a recipe that has fp8 GEMMs (`recipe.fp8`, e.g. "fp8_hybrid"): the forward
      dot_generals go through `precision.fp8.fp8_dot_general` (operands in E4M3 with
      their scales, f32 accumulation, result in the compute dtype; backward: the
      cotangent in E5M2, both gradient GEMMs on fp8 operands, f32 accumulation), except
      the first and the last GEMM of `fn` (`Fp8Config.keep_first_last`, default on), the
      scopes matching `Fp8Config.keep_high_precision`, scopes an override gives its own
      policy, and GEMMs of two activations (attention's q.k and p.v): those run the
      policy GEMM. Grouped GEMMs (`lax.ragged_dot`) scale per expert group, from each
      step's amaxes (no state). Convolutions stay in the compute dtype (fp8
      convolutions and fp8 attention are not supported). A function that takes its own
      gradient is refused under fp8 (its backward GEMMs could not get E5M2 gradients):
      differentiate the autocast function instead, `jax.grad(autocast(f, recipe))`. Current, per-channel and block scaling need
      no state; delayed scaling needs `fp8_state=True`. Which GEMM does what:
      `precision.fp8.autocast_gemms(fn, recipe, *args)`; the rules in detail:
      precision._autocast._fp8.
  Params are not cast (their storage dtype is the caller's:
  `precision.flax.apply_policy` casts an NNX model's params to the param dtype).

  Args:
    fn: any JAX-traceable function. Arguments that are arrays are traced; NNX modules
      are split and their state written back after the call; other arguments (Python
      numbers, strings, flags) are static.
    recipe: Policy, policy string ("p=f32,c=bf16,o=f32"), Recipe, preset name, or a
      Plan (`precision.bind(recipe, overrides=...)`, which then brings the overrides
      and fp32_ops: pass neither besides).
    overrides: {pattern or module type: policy}: fnmatch patterns on the scope an op was
      traced in ("blocks/0/mlp", "*lm_head*"; NNX module paths and jax.named_scope names);
      the deepest matching scope decides. A pattern that matches no scope raises. A value
      {"fwd": policy, "bwd": policy} (either key optional) is direction-specific: "bwd"
      sets the compute dtype of the scope's backward GEMMs (the gradient GEMMs of its
      GEMMs, and GEMMs of a traced program's own backward pass), "fwd" the policy of
      every other op there; a key left out falls through to the enclosing rule or the
      base policy. E.g. {"l0": {"bwd": "p=f32,c=f32,o=f32"}} under "f16_mixed": l0's
      forward GEMM is f16 x f16 -> f32, its two gradient GEMMs f32 x f32 -> f32 (on the
      f32 cotangent and the operands themselves, not their f16 roundings).
    fp32_ops: op names kept in f32 (precision.DEFAULT_FP32_OPS, the recipe's by default).
    fp8_state: for a recipe with fp8 GEMMs: the scaling state is an explicit argument and
      result. The wrapped function is then ``g(state, *args, **kwargs) -> (out,
      new_state)``, `state` a dict {site key: precision.fp8.Fp8DotState} from
      `precision.fp8.init_state(fn, recipe, *args)` or ``g.init_state(*args)``.
      `new_state` holds the forward operands' new amax histories, scales and counters;
      its gradient-operand fields pass `state`'s through, and their new values are the
      cotangent of `state`: differentiate with respect to `state` too and combine with
      `precision.fp8.merge_grad_state` (``precision.value_and_grad(g)`` does
      both). Required for delayed scaling; allowed for every scaling (the state then
      records each GEMM's last amax, scale, saturation and underflow counts).
    state_outputs: which results are state, whose floating leaves keep the dtypes the
      unmodified function gives them under every recipe (a bf16 cache stays bf16, f32
      running statistics stay f32), so that state round-trips through
      `lax.scan`/`fori_loop` carries and the next call; every other floating result is
      cast to the output dtype. Default (None): the new values of arguments are state -
      the whole result, or an element of a tuple/list result, whose tree structure,
      shapes and dtypes are those of a whole argument, when both are containers (Haiku's
      `apply(params, state, rng, x) -> (out, new_state)`, an Equinox step returning
      `(out, state)`, a decoding step returning `(logits, cache)` with a dict or list
      cache, a loop body returning its tuple carry). A bare array is never recognised (an
      activation often has an input's shape): name it by position. Positions (an int or
      a tuple: 1 for Haiku's apply) name the state elements of a tuple result
      explicitly; () declares no state (every floating result in the output dtype).
  Returns:
    The wrapped function. Results that are constants of the traced program (a flag
    `jnp.array(False)`, a counter reset to 0) are returned as jax.Arrays, as a plain
    call returns them.

  Examples:
    >>> def loss_fn(params, x, y):           # written with no dtype in mind
    ...   h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    ...   return jnp.mean((h @ params["w2"] - y) ** 2)
    >>> loss, grads = jax.value_and_grad(mp.autocast(loss_fn, "bf16_mixed"))(params, x, y)
    >>> fp8 = mp.Recipe("fp8_current", "p=f32,c=bf16,o=f32",
    ...                 fp8=mp.Fp8Config(scaling="current"))
    >>> loss, grads = jax.value_and_grad(mp.autocast(loss_fn, fp8))(params, x, y)
    >>> g = mp.autocast(loss_fn, "fp8_hybrid", fp8_state=True)   # delayed scaling
    >>> state = g.init_state(params, x, y)
    >>> (loss, new), (grads, cts) = jax.value_and_grad(g, (1, 0), has_aux=True)(
    ...     state, params, x, y)
    >>> state = mp.fp8.merge_grad_state(new, cts)
  """
  if not callable(fn):
    raise ValueError(f"autocast: fn={fn!r}; accepted: a callable (the function to run "
                     "under the policy)")
  spec = _plan.autocast_spec(recipe, overrides, fp32_ops, fp8_state=fp8_state)
  _refuse_f64_without_x64(spec)
  state = _state_positions(state_outputs)

  def init_state(*args, **kwargs):
    """{site key: Fp8DotState}, fresh (zero histories, unit scales), for the fp8 GEMMs
    `fn(*args, **kwargs)` has at these arguments' shapes and dtypes (nothing runs)."""
    decisions = run(spec, fn, args, kwargs, evaluate=False).fp8_decisions
    return _fp8.init_states(spec.fp8, decisions)

  if spec.fp8_state:
    @functools.wraps(fn)
    def with_state(fp8, *args, **kwargs):
      traced = run(spec, fn, args, kwargs, fp8_state=fp8)
      return _results(traced, spec, state, args, kwargs), traced.fp8_state

    with_state.autocast_spec = spec
    with_state.init_state = init_state
    try:  # the signature shown is fn's with the state first (functools.wraps shows fn's)
      sig = inspect.signature(fn)
      state_param = inspect.Parameter("fp8_state", inspect.Parameter.POSITIONAL_ONLY)
      with_state.__signature__ = sig.replace(
          parameters=[state_param, *sig.parameters.values()])
    except (TypeError, ValueError):  # no signature, or fn has a parameter of that name
      pass
    return with_state

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    return _results(run(spec, fn, args, kwargs), spec, state, args, kwargs)

  wrapped.autocast_spec = spec
  return wrapped
