"""precision.numerics.inspect: the numerics of every GEMM operand and cotangent of a call."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from precision import _deprecation
from precision import _intercept
from precision import _keypath
from precision._autocast import autocast
from precision.numerics import _interpret
from precision.numerics import _report
from precision.numerics import _stats
from precision._plan import Plan, as_plan, is_recipe
from precision.flax import _nnx

class Captured(NamedTuple):
  """One GEMM operand or result as `capture` hands it over."""
  info: _interpret.TensorInfo
  value: np.ndarray     # f32: the value before the program rounds it (see TensorStats)
  dtype: np.dtype       # the format it is rounded to (TensorStats.dtype)


def _is_node(x) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - flax is a dependency
    return False
  return nnx.graph.is_graph_node(x)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


@contextlib.contextmanager
def _module_scopes(nodes):
  """NNX module paths as name scopes while the call is traced, found from the object
  graph at call time: a module called from inside another's method gets the path from
  that module to it ("blocks/0/mlp"). Unlike autocast's own NNX scopes (which know the
  module objects passed in), this also names the fresh module objects that nnx.grad or
  jax.grad merge inside the traced function. The classes are intercepted for this
  context only (precision._intercept, shared with autocast's scopes): other threads'
  calls run as written, and no class is changed after the trace."""
  if not nodes:
    yield
    return
  from flax import nnx  # pylint: disable=g-import-not-at-top
  classes = {type(obj): None for node in nodes for _, obj in nnx.iter_graph(node)
             if isinstance(obj, nnx.Module)}
  stack: list = []   # this trace's module calls in progress (one context: not shared)
  paths: dict = {}

  def path_in(parent, child) -> str:
    key = (id(parent), id(child))
    if key not in paths:
      paths[key] = next((_keypath.path_str(path)
                         for path, obj in nnx.iter_graph(parent) if obj is child), "")
    return paths[key]

  def open_scope(module, call, args, kwargs):
    if stack and stack[-1] is module:   # a module calling its own method
      return call(*args, **kwargs)
    name = path_in(stack[-1], module) if stack else ""
    stack.append(module)
    try:
      with jax.named_scope(name) if name else contextlib.nullcontext():
        return call(*args, **kwargs)
    finally:
      stack.pop()

  with _intercept.intercepting(classes, ("__call__", "attend"), open_scope):
    yield


class AsWritten(NamedTuple):
  """In place of a recipe: `fn` already runs under its recipe (it calls an autocast'ed
  function itself, e.g. one with explicit fp8 scaling state), so it is traced as written;
  `policy` names that recipe's policy in the report."""
  policy: str


def _fp8_mark(plan: Plan | None, modules):
  """The mark of an NNX model among `modules` prepared by apply_recipe with this fp8
  plan's recipe (its fp8 layers hold the scaling state, delayed scaling's amax histories
  included), to trace under in place of the plan; None otherwise (None: a policy)."""
  if plan is None or plan.fp8 is None:
    return None
  for x in modules:
    spec = _nnx.spec_of(x)
    if spec is not None and spec.recipe is not None and spec.recipe == plan.recipe:
      return spec
  return None


def _run(fn, recipe_or_policy, args, kwargs, on_tensor, recorder=None) -> tuple:
  """Traces fn(*args, **kwargs) under autocast (as written for an AsWritten) and
  evaluates it with the recorder; returns the policy string, the higher-order primitives
  whose GEMMs went unseen and the outputs of the evaluation (autocast's: floating results
  in the output dtype). `recorder(on_tensor)` makes the evaluator (default:
  _interpret.Recorder)."""
  if not callable(fn):
    raise ValueError(f"fn must be callable (a loss, a forward or a value_and_grad "
                     f"function); got {fn!r} of type {type(fn).__name__}")
  # A model marked by precision.flax.apply_recipe / apply_policy gets its module scopes
  # from autocast itself (naming it twice would give "fc1/fc1").
  modules = [x for x in jax.tree_util.tree_leaves((args, kwargs), is_leaf=_is_node)
             if _is_node(x)]
  nodes = [x for x in modules if _nnx.spec_of(x) is None]
  # NNX modules are pytrees: flattened to their arrays, rebuilt inside the trace (so the
  # caller's model is never modified: BatchNorm statistics, RNG counters stay as they are).
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  is_arr = [_is_array(x) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_arr) if a]

  def flat_fn(*arrs):
    it = iter(arrs)
    a, kw = jax.tree_util.tree_unflatten(treedef, [next(it) if t else x
                                                   for x, t in zip(leaves, is_arr)])
    return fn(*a, **kw)

  if isinstance(recipe_or_policy, AsWritten):
    wrapped, policy = flat_fn, recipe_or_policy.policy
  else:
    # A recipe, a preset name or a Plan is bound once; a policy goes to autocast as is.
    plan = (as_plan(recipe_or_policy) if isinstance(recipe_or_policy, Plan)
            or is_recipe(recipe_or_policy) else None)
    wrapped = autocast(flat_fn, _fp8_mark(plan, modules) or plan or recipe_or_policy)
    policy = str(wrapped.autocast_spec.policy)
  with _module_scopes(nodes):
    closed, out_shape = jax.make_jaxpr(wrapped, return_shape=True)(*arrays)
  recorder = (recorder or _interpret.Recorder)(on_tensor)
  outs = recorder.run(closed, arrays)
  outputs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
  return policy, tuple(recorder.unvisited), outputs


@_deprecation.renamed_keyword("recipe_or_policy", "recipe", "precision.numerics.inspect")
def inspect(fn: Callable, recipe: Any, *args, **kwargs) -> _report.NumericsReport:
  """The numerics of every GEMM operand, cotangent and result of `fn(*args, **kwargs)`
  run under `precision.autocast(fn, recipe)`.

  `fn` is traced under autocast to a jaxpr and the jaxpr is run once, op by op, on the
  arguments. Every dot_general and conv_general_dilated (inside jit, custom_vjp/jvp,
  remat, cond; inside scan and while once per iteration, `row.iteration` saying which)
  contributes a row for its lhs, its rhs and its result, each with the statistics of
  TensorStats (see there for every definition and for which value is measured). In a
  backward GEMM the operand produced by the backward pass has role "cotangent" (the
  other is a forward residual: casts, transposes, flips and slices of a forward value
  stay forward). GEMMs inside shard_map or a Pallas kernel are not entered;
  `report.unvisited` names such primitives.

  Works on a forward function, a loss, or a gradient function (`jax.value_and_grad(loss)`,
  `nnx.grad(loss)`, a jitted train step), on NNX modules (module paths become scopes; the
  module passed in is not modified), Linen `apply` functions and plain JAX. Ops run
  eagerly one at a time, so every value is what its stated dtype computes (no excess
  precision across fusions). Cost: one eager run (the first call compiles each distinct
  op once, seconds for a small model; later calls reuse them) plus host-side numpy
  statistics of every GEMM tensor.

  Args:
    fn: the function to inspect.
    recipe: what precision.autocast accepts: a Policy, a policy string
      ("p=f32,c=f16,o=f32"), a Recipe, a preset name ("bf16_mixed") or a Plan
      (`precision.bind`, with its overrides). Loss scaling is
      not applied (it belongs to the optimizer): scale the loss in `fn` to see its effect.
      An fp8 recipe on an NNX model that precision.flax.apply_recipe prepared with it
      runs under the model's mark: its fp8 layers quantise with their own scaling state
      (delayed scaling's amax history and scale included, not modified), and each fp8
      operand's row measures the value its cast rounds (the operand over its scale).
    *args, **kwargs: the arguments; arrays (and NNX modules' arrays) are traced, other
      leaves (Python numbers, strings) are static.
  Returns:
    A NumericsReport: `.rows`, `.to_records()`, `.table(worst=20)`, `.worst(n, by)`,
    `.first_anomaly(thresholds)`.
  Raises:
    ValueError: `fn` is not callable; a bad policy or recipe (from autocast).

  Examples:
    An f16 recipe without loss scaling on a tiny loss: the backward GEMM's cotangent
    (d loss / d (x @ w) = 2.5e-9, below f16's smallest subnormal) flushes to zero.

    >>> import jax, jax.numpy as jnp
    >>> import precision as mp
    >>> def loss(w, x):
    ...   return 1e-8 * jnp.mean((x @ w) ** 2)
    >>> w, x = jnp.ones((8, 4)), jnp.ones((16, 8))
    >>> report = mp.numerics.inspect(jax.grad(loss), "p=f32,c=f16,o=f32", w, x)
    >>> row = report.first_anomaly({"underflow": 0.5})
    >>> (row.direction, row.role, row.shape, row.dtype, row.underflow)
    ('bwd', 'cotangent', (16, 4), 'float16', 1.0)
    >>> report.worst(1, by="whatif_bf16_underflow")[0].whatif_bf16_underflow  # bf16 keeps it
    0.0
    >>> print(report.table(worst=3))  # doctest: +SKIP
  """
  rows = []

  def on_tensor(info, value, dtype):
    rows.append(_report.TensorStats(
        **vars(info), **_stats.tensor_stats(value, dtype, info.block_axes)))

  policy, unvisited, _ = _run(fn, recipe, args, kwargs, on_tensor)
  order = {"lhs": 0, "rhs": 1, "out": 2}
  rows.sort(key=lambda r: (r.index, -1 if r.group is None else r.group, order[r.operand]))
  name = getattr(fn, "__name__", None) or type(fn).__name__
  return _report.NumericsReport(name, policy, tuple(rows), unvisited)


@_deprecation.renamed_keyword("recipe_or_policy", "recipe", "precision.numerics.capture")
def capture(fn: Callable, recipe: Any, *args, **kwargs) -> tuple:
  """The tensors `inspect` takes its statistics from, as f32 numpy arrays.

  Same arguments as `inspect`. Holds every GEMM tensor of the call in host memory: for
  small programs (tests, offline references).

  Returns:
    A tuple of Captured(info, value, dtype) in the order of `inspect`'s rows.
  """
  out = []

  def on_tensor(info, value, dtype):
    out.append(Captured(info, np.asarray(value).astype(np.float32), np.dtype(dtype)))

  _run(fn, recipe, args, kwargs, on_tensor)
  order = {"lhs": 0, "rhs": 1, "out": 2}
  out.sort(key=lambda c: (c.info.index, -1 if c.info.group is None else c.info.group,
                          order[c.info.operand]))
  return tuple(out)
