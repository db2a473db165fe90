"""fp8 GEMMs for Flax NNX: the state Variables, the dot_general module, apply_fp8.

State flow (no host sync; everything is an output of the jitted step):

* forward operands (lhs, rhs): `Fp8DotGeneral.__call__` writes their new amax history,
  scale and counters into its `Fp8State` Variables; nnx.jit / nnx.grad / split-merge
  carry the mutation out of the step like any other NNX state (BatchStat-style).
* the incoming gradient exists only in the backward pass, and the only way out of a
  backward pass is a cotangent. As Flax's `fp8_ops` does (its OVERWRITE_WITH_GRADIENT
  collection), the gradient operand's state is an *input* of the custom VJP whose
  "gradient" is its new value. Those Variables have the type `Fp8GradState`; differentiate
  with respect to them and store the result instead of stepping it with the optimizer:
  `precision.value_and_grad` does both. We keep the forward state out of that trick
  (unlike Flax, which routes all six arrays through gradients) so that an ordinary forward
  pass -- evaluation, or a caller that forgets the gradient state -- still updates it.
* a module called several times in one differentiated step (tied weights, a recurrence,
  micro-batches): each call writes the gradient state back unchanged, as a token that the
  next call reads, and whose cotangent carries the later calls' new state back to the
  earlier ones. The state stored is that of one use of the concatenated gradient operand
  (amax history and scale by max, counts summed); without the token autodiff would add
  the calls' states and double the scale each step.
* a step the optimizer guard skips: `rollback_fp8_state` restores the fp8 state of the
  model from before the step (the guard only sees the optimizer's state).

Examples:
  >>> import jax.numpy as jnp, precision as mp
  >>> from flax import nnx
  >>> layer = nnx.Linear(8, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  >>> _ = mp.fp8.apply_fp8(layer, mp.Fp8Config(scaling="current"), mp.get_policy("p=f32,c=bf16"))
  >>> loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
  >>> value, grads = mp.value_and_grad(loss)(layer, jnp.ones((2, 8)))
  >>> m = mp.fp8.fp8_metrics(layer)  # a root layer: keys without a path prefix
  >>> int(m["fp8/gemms"]), float(m["grad_amax"]) > 0, float(m["fp8/saturated"])
  (1, True, 0.0)

Size: the fp8 state Variables, the NNX dot_general/einsum modules and the state flow
between them (grad state, rollback) are one mechanism.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import opt_einsum
from flax import nnx

from precision import _trace_state
from precision._policy import Policy
from precision._recipe import Fp8Config
from precision import _deprecation
from precision._keypath import path_str as _path_name
from precision.optim._tree import select_tree
from precision.fp8 import _scaling as sc
from precision.fp8._dot import OPERANDS, Fp8DotState, Fp8Spec, fp8_dot_general

STATE_FIELDS = sc.OperandState._fields  # amax_history, scale, saturated, underflowed


class _GradTrace:
  """What `precision.value_and_grad` watches while it differentiates: each fp8 GEMM's gradient-state
  token must be read once, by the next call of that GEMM. A token read twice means two
  calls started from one state (a module merged twice from one state, a clone): autodiff
  would add their gradient states, so this raises instead, naming the layer."""

  def __init__(self, names: dict[int, str]):
    self.names = names  # id(Fp8DotGeneral) -> layer path, for the error message
    # id(token) -> (token, path of the GEMM that read it); the token is kept alive so that
    # ids stay unique while the trace runs.
    self.read: dict[int, tuple[Any, str | None]] = {}

  def consume(self, module: Fp8DotGeneral, token: Any) -> None:
    name = self.names.get(id(module))
    seen = self.read.get(id(token))
    if seen is not None and seen[0] is token:
      name = name or seen[1] or "an fp8 GEMM inside a transform"
      raise ValueError(
          f"fp8 GEMM {name!r}: two calls read the same gradient-scaling state in one "
          "differentiated function, so autodiff would add their gradient states (the scale "
          "would double). Call the layer through the model itself, whose every call passes "
          "the state on to the next (tied weights, recurrences, micro-batch loops, nnx.scan "
          "with the model as carry all do), not through copies merged or cloned from one "
          "state.")
    self.read[id(token)] = (token, name)


_GRAD_TRACE = _trace_state.FP8_GRAD  # the trace state lives in precision._trace_state


@contextlib.contextmanager
def _watch_grad_state(model: Any):
  trace = _GradTrace({id(m): name or "<root>" for name, m in fp8_modules(model)})
  token = _GRAD_TRACE.set(trace)
  try:
    yield
  finally:
    _GRAD_TRACE.reset(token)


class Fp8State(nnx.Variable):
  """fp8 scaling state of a forward GEMM operand (amax history, scale, counters), f32.

  Saved with the model (``nnx.state(model, Fp8State)`` also selects `Fp8GradState`).
  """


class Fp8GradState(Fp8State):
  """fp8 scaling state of the gradient operand; updated through its cotangent (see module
  docstring and `precision.value_and_grad`), never by an optimizer."""


class Fp8DotGeneral(nnx.Module):
  """A `lax.dot_general`-compatible fp8 GEMM holding its scaling state.

  Assign it to a layer's `dot_general` (`apply_fp8` does). Variables: for op in lhs, rhs
  (`Fp8State`) and grad (`Fp8GradState`): ``{op}_amax_history`` [L], ``{op}_scale``,
  ``{op}_saturated``, ``{op}_underflowed`` (f32 scalars).

  Args:
    config: formats, scaling recipe, history, margin, blocks (`precision.Fp8Config`).
    policy: its compute dtype is the output dtype (default: the lhs dtype); a
      `preferred_element_type` passed by the layer wins.
    scaling: per-operand override of `config.scaling` (see `Fp8Spec.from_config`).
    stack: leading axes of every state variable (the layer axes of a layer created
      under `nnx.vmap`, applied under `nnx.scan`); default none.
  """

  def __init__(self, config: Fp8Config, policy: Policy | None = None, *,
               scaling: str | Mapping[str, str] | None = None, stack: tuple[int, ...] = ()):
    self.config = config
    self.spec = Fp8Spec.from_config(config, scaling)
    self.out_dtype = None if policy is None else policy.compute_dtype
    init = self.spec.init_state()
    for op in OPERANDS:
      kind = Fp8GradState if op == "grad" else Fp8State
      for field, value in zip(STATE_FIELDS, getattr(init, op)):
        # A layer stacked by nnx.vmap (scan over layers) has leading layer axes on its
        # params: its scaling state gets them too, one state per layer, so that nnx.scan
        # slices both alike.
        setattr(self, f"{op}_{field}",
                kind(jnp.broadcast_to(value, tuple(stack) + jnp.shape(value))))

  def _operand_state(self, op: str) -> sc.OperandState:
    return sc.OperandState(*(getattr(self, f"{op}_{f}")[...] for f in STATE_FIELDS))

  def _store(self, op: str, st: sc.OperandState) -> None:
    for field, value in zip(STATE_FIELDS, st):
      getattr(self, f"{op}_{field}")[...] = value

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers,
               precision: Any = None, preferred_element_type: Any = None,
               out_sharding: Any = None) -> jax.Array:
    # `precision` does not apply: the operands are fp8 and the accumulation f32.
    # `out_sharding` is left to the partitioner (the result keeps the operands' sharding).
    del precision, out_sharding
    out_dtype = preferred_element_type or self.out_dtype
    # An autocast tracing now (`precision._autocast._api.tracing`, read from the trace state).
    if preferred_element_type is None and _trace_state.AUTOCAST.get():
      # Under autocast (apply_recipe) the model is traced as the plain program it is: the
      # GEMM returns what a plain dot of these operands would (its f32 accumulator for
      # f32 inputs), so the layer's own code (bias add, promotion) traces unchanged.
      out_dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    state = Fp8DotState(*(self._operand_state(op) for op in OPERANDS))
    trace = _GRAD_TRACE.get()
    if trace is not None:
      trace.consume(self, state.grad.scale)
    out, new = fp8_dot_general(lhs, rhs, dimension_numbers, state, self.spec,
                               out_dtype=out_dtype)
    self._store("lhs", new.lhs)
    self._store("rhs", new.rhs)
    # The gradient state's token (same values): the next call of this module in the same
    # differentiated function reads it, so the uses' gradient states combine by max
    # (`fp8_dot_general`) instead of being added by autodiff.
    self._store("grad", new.grad)
    return out

  def update_grad_state(self, new: Mapping[str, jax.Array]) -> None:
    """Stores the gradient-operand state found in `new` (field name -> array, as the
    cotangents of this module's `Fp8GradState` Variables). A module that took no part in
    the differentiated computation gets zero cotangents (scale 0, never a real scale):
    its state is kept.

    Deprecated: `precision.fp8.merge_grad_state` merges the state of every GEMM of a
    model at once (``nnx.update(model, merge_grad_state(nnx.state(model,
    Fp8GradState), grads))``), and `precision.value_and_grad` does it for you."""
    _deprecation.warn("Fp8DotGeneral.update_grad_state",
                      "precision.fp8.merge_grad_state(state, state_grads)")
    old = {field: getattr(self, f"grad_{field}")[...] for field in STATE_FIELDS}
    for field, value in sc.keep_unused_grad_state(old, new, "scale").items():
      getattr(self, f"grad_{field}")[...] = value


def einsum_dimension_numbers(eqn: str, lhs_shape, rhs_shape):
  """Parses a two-operand einsum into dot_general terms.

  Returns (dimension_numbers, lhs_sum_axes, rhs_sum_axes, out_perm): sum the lhs/rhs over
  the given axes (letters in one operand only and absent from the output), dot_general,
  then transpose by out_perm. Raises ValueError for a letter repeated within one operand
  (a diagonal) or an output letter found in neither operand.
  """
  ins, out, _ = opt_einsum.parser.parse_einsum_input(
      (eqn, jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
       jax.ShapeDtypeStruct(rhs_shape, jnp.float32)))
  ls, rs = ins.split(",")
  for s in (ls, rs):
    if len(set(s)) != len(s):
      raise ValueError(f"fp8 einsum {eqn!r}: repeated index in operand {s!r}; accepted: "
                       "each index at most once per operand")
  if set(out) - set(ls) - set(rs):
    raise ValueError(f"fp8 einsum {eqn!r}: output indices {sorted(set(out) - set(ls) - set(rs))}"
                     " appear in no operand")
  lsum = tuple(i for i, c in enumerate(ls) if c not in rs and c not in out)
  rsum = tuple(i for i, c in enumerate(rs) if c not in ls and c not in out)
  ls = "".join(c for i, c in enumerate(ls) if i not in lsum)
  rs = "".join(c for i, c in enumerate(rs) if i not in rsum)
  batch = [c for c in ls if c in rs and c in out]
  contract = [c for c in ls if c in rs and c not in out]
  dn = ((tuple(ls.index(c) for c in contract), tuple(rs.index(c) for c in contract)),
        (tuple(ls.index(c) for c in batch), tuple(rs.index(c) for c in batch)))
  result = batch + [c for c in ls if c not in rs] + [c for c in rs if c not in ls]
  return dn, lsum, rsum, tuple(result.index(c) for c in out)


class Fp8Einsum(nnx.Module):
  """A `jnp.einsum`-compatible fp8 GEMM for `nnx.Einsum.einsum_op` (two operands, the
  second the kernel). Its state lives in the child `dot` (an `Fp8DotGeneral`)."""

  def __init__(self, config: Fp8Config, policy: Policy | None = None, *,
               scaling: str | Mapping[str, str] | None = None, stack: tuple[int, ...] = ()):
    self.dot = Fp8DotGeneral(config, policy, scaling=scaling, stack=stack)

  def __call__(self, eqn: str, lhs: jax.Array, rhs: jax.Array, precision: Any = None,
               preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:
    dn, lsum, rsum, perm = einsum_dimension_numbers(eqn, lhs.shape, rhs.shape)
    if lsum:  # summed-out indices are reduced in f32 and rounded back once
      lhs = jnp.sum(lhs, axis=lsum, dtype=jnp.float32).astype(lhs.dtype)
    if rsum:
      rhs = jnp.sum(rhs, axis=rsum, dtype=jnp.float32).astype(rhs.dtype)
    out = self.dot(lhs, rhs, dn, precision, preferred_element_type, out_sharding)
    return jnp.transpose(out, perm)


def apply_fp8(module: nnx.Module, config: Fp8Config, policy: Policy | None = None, *,
              scaling: str | Mapping[str, str] | None = None) -> nnx.Module:
  """Routes the GEMMs of `module` through fp8, in place; returns `module`.

  Every nnx.Linear / nnx.LinearGeneral gets an `Fp8DotGeneral` as its `dot_general`, every
  nnx.Einsum an `Fp8Einsum` as its `einsum_op`, unless its path ("blocks/0/attn/q")
  matches a pattern of `config.keep_high_precision` (fnmatch, case-sensitive; default
  "*lm_head*", "*embed*"), which keeps the layer's current GEMM (e.g. the policy's bf16
  dot_general set by `precision.flax.apply_policy`). Layers already in fp8 are left as
  they are, so applying twice changes nothing. A layer whose kernel has leading axes
  beyond its own shape (created under `nnx.vmap`, applied under `nnx.scan`: Flax's
  scan-over-layers) gets scaling state with those axes too, one state per layer.

  Args:
    module: an NNX module.
    config: the fp8 settings (`recipe.fp8`).
    policy: the recipe's policy; its compute dtype is the GEMMs' output dtype.
    scaling: per-operand scaling override (see `Fp8Spec.from_config`).
  """
  if not isinstance(config, Fp8Config):
    raise ValueError(f"apply_fp8 config={config!r}; accepted: a precision.Fp8Config")
  targets = []
  for path, layer in nnx.iter_modules(module):
    name = _path_name(path)
    if any(fnmatch.fnmatchcase(name, pat) for pat in config.keep_high_precision):
      continue
    if isinstance(layer, (nnx.Linear, nnx.LinearGeneral)):
      if not isinstance(layer.dot_general, Fp8DotGeneral):
        targets.append(("dot_general", layer))
    elif isinstance(layer, nnx.Einsum) and not isinstance(layer.einsum_op, Fp8Einsum):
      targets.append(("einsum_op", layer))
  for attr, layer in targets:
    stack = _layer_axes(layer)
    if attr == "dot_general":
      if isinstance(layer, nnx.LinearGeneral):
        layer.dot_general_cls = None  # it would take precedence over dot_general
      layer.dot_general = nnx.data(Fp8DotGeneral(config, policy, scaling=scaling,
                                                 stack=stack))
    else:
      layer.einsum_op = nnx.data(Fp8Einsum(config, policy, scaling=scaling, stack=stack))
  return module


def _layer_axes(layer: nnx.Module) -> tuple[int, ...]:
  """The leading axes a layer's kernel has beyond its own shape: the layer axes of a
  stack created under `nnx.vmap` (Flax's scan-over-layers); () for a plain layer."""
  if isinstance(layer, nnx.Linear):
    own = 2
  elif isinstance(layer, nnx.LinearGeneral):
    own = len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
  else:  # nnx.Einsum
    own = len(layer.kernel_shape)
  shape = jnp.shape(layer.kernel[...])
  return tuple(shape[:len(shape) - own])


def fp8_modules(module: nnx.Module) -> list[tuple[str, Fp8DotGeneral]]:
  """(layer path, Fp8DotGeneral) for every fp8 GEMM in `module`, in graph order. The path
  is the layer's ("blocks/0/mlp/up"), without the "/dot_general" or "/einsum_op/dot"."""
  out = []
  for path, m in nnx.iter_modules(module):
    if isinstance(m, Fp8DotGeneral):
      name = _path_name(path)
      for suffix in ("/einsum_op/dot", "/dot_general", "einsum_op/dot", "dot_general"):
        if name.endswith(suffix):
          name = name[: -len(suffix)]
          break
      out.append((name, m))
  return out


def rollback_fp8_state(new_state: Any, old_state: Any, skipped: Any) -> Any:
  """The fp8 scaling state after a step the optimizer guard may have skipped.

  A skipped step leaves params and optimizer state bit-identical (`precision.optim`'s
  guard); the fp8 scaling state lives in the model, out of the optimizer's reach, so the
  training step rolls it back here: where `skipped`, every `Fp8State` / `Fp8GradState`
  variable (forward and gradient operands: histories, scales, counters) is taken from
  `old_state`, bit for bit; other variables and unskipped steps keep `new_state`.

  Args:
    new_state: the model state after the step, an `nnx.State` (e.g. ``nnx.state(model,
      nnx.Not(nnx.Param))``), or a plain pytree holding fp8 state only (a Linen
      collection), whose every leaf is then selected.
    old_state: the same state's values before the step (same structure). Take it before
      `nnx.merge`: the merged model shares that State's Variables and its calls update
      them in place; ``jax.tree.map(lambda x: x, state)`` is a copy that stays as it was.
    skipped: bool scalar, e.g. ``precision.optim.step_skipped(opt_state, new_opt_state)``.

  Examples:
    >>> before = jax.tree.map(lambda x: x, model_state)
    >>> model = nnx.merge(graphdef, params, model_state)
    >>> loss, grads = precision.value_and_grad(loss_fn)(model, batch)
    >>> updates, new_opt_state = tx.update(grads, opt_state, params)
    >>> skipped = precision.optim.step_skipped(opt_state, new_opt_state)
    >>> model_state = rollback_fp8_state(nnx.state(model, nnx.Not(nnx.Param)), before,
    ...                                  skipped)
  """
  if not isinstance(new_state, nnx.State):
    return select_tree(skipped, old_state, new_state)
  old = {tuple(path): var for path, var in nnx.to_flat_state(old_state)}
  flat = list(nnx.to_flat_state(new_state))
  if set(old) != {tuple(path) for path, _ in flat}:
    raise ValueError("rollback_fp8_state: new_state and old_state hold different variables; "
                     "accepted: the same model state before and after one step")
  out = []
  for path, var in flat:
    if isinstance(var, Fp8State):
      prev = old[tuple(path)][...]
      var = var.replace(select_tree(skipped, prev, var[...]))
    out.append((path, var))
  return nnx.from_flat_state(out)
