"""Evaluates a traced program (a jaxpr) equation by equation under a precision policy.

Each equation is bound again with the source line and name stack it was traced with (so
`precision.audit` and profiles attribute the new ops to the user's code and module paths),
after the rule of `_rules` for its primitive has decided the dtypes. An equation whose
operands arrive in their traced dtypes and whose rule changes nothing is bound exactly as
traced; a container (jit, scan, while, cond, remat, custom_jvp) in which nothing changes is
bound as one, unchanged: a policy that changes nothing reproduces the program bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax import lax

from precision import _compat
from precision._policy import Policy
from precision._autocast import _fp8
from precision import _dtypes
from precision import _overrides
from precision._autocast import _regions
from precision._autocast import _router
from precision._autocast import _rules as R
from precision import _fp32_ops
from precision import _gemm

_F32 = np.dtype(np.float32)


@dataclasses.dataclass
class Env:
  """What the interpreter needs besides the values: the policy per scope, the f32 ops,
  and what it has seen (scopes, matched override rules)."""

  policy: Policy
  rules: tuple                      # _overrides.Rule, in the order given
  fp32_primitives: frozenset
  module_at: dict = dataclasses.field(default_factory=dict)      # scope -> module
  module_policy: dict = dataclasses.field(default_factory=dict)  # scope -> Policy
  root: str = ""   # a leading scope every op carries (Linen: the root module's class name)
  recompute_f32: bool = True  # f32 glue regions recomputed in backward (see _regions)
  fp8: Any = None   # _fp8.Fp8Run: the dot_generals that run in fp8 (by path), their state
  routers: Any = None  # paths of the router GEMMs kept in f32 (the "router" f32 op)
  seen_scopes: set = dataclasses.field(default_factory=set)
  matched: set = dataclasses.field(default_factory=set)
  _policies: dict = dataclasses.field(default_factory=dict)
  _static: dict = dataclasses.field(default_factory=dict)

  def local(self, scope: str) -> str:
    """`scope` without the root's leading name."""
    if self.root and (scope == self.root or scope.startswith(self.root + "/")):
      return scope[len(self.root) + 1:]
    return scope

  def policy_at(self, scope: str, direction: str = "fwd") -> Policy:
    """The policy of the ops of `direction` in `scope`: "bwd" for backward GEMMs (its
    compute dtype is all they read), "fwd" for every other op (see _overrides)."""
    key = (scope, direction)
    if key not in self._policies:
      found = _overrides.governing(self.rules, scope, self.module_at, direction,
                                   self.module_policy)
      if found.rule is not None:
        self.matched.add(found.rule.key)
      self._policies[key] = self.policy if found.policy is None else found.policy
    return self._policies[key]

  def compute_at(self, scope: str, direction: str) -> np.dtype:
    return np.dtype(self.policy_at(scope, direction).compute_dtype)

  def overridden(self, scope: str) -> bool:
    """Whether an override (or a submodule's own policy) governs the forward ops of
    `scope`: then it, not the "router" f32 op, decides a router GEMM there."""
    return _overrides.governing(self.rules, scope, self.module_at, "fwd",
                                self.module_policy).policy is not None

  def record(self, scope: str) -> None:
    if scope and scope not in self.seen_scopes:
      self.seen_scopes.add(scope)
      for direction in _overrides.DIRECTIONS:  # marks the rules this scope uses as matched
        self.policy_at(scope, direction)


def _join(prefix: str, stack: str) -> str:
  return "/".join(s for s in (prefix, stack) if s)


def _read(env_vals: dict, v) -> Any:
  if isinstance(v, jax.extend.core.Literal):
    val = v.val
    dt = getattr(v.aval, "dtype", None)
    return np.asarray(val, dt) if dt is not None and _dtypes.is_float(dt) else val
  return env_vals[v]


def eval_jaxpr(env: Env, jaxpr, consts, args, prefix: str = "", path: tuple = ()) -> list:
  """The outputs of `jaxpr` on `args` with every equation under the policy.

  `path` locates `jaxpr` in the root program: equation indices, each container's followed
  by the index of its sub-jaxpr (`_fp8.sub_jaxprs`); fp8 sites are chosen by path."""
  vals: dict = {}
  if not path and env.routers is None:
    env.routers = (_router.router_gemms(jaxpr)
                   if _fp32_ops.ROUTER_GEMM in env.fp32_primitives else frozenset())
  for v, x in zip(jaxpr.constvars, consts):
    vals[v] = x
  for v, x in zip(jaxpr.invars, args):
    vals[v] = x
  regions = _regions.plan(jaxpr, env, lambda e: _below_f32_at(env, e, prefix)) \
      if env.recompute_f32 else []
  deferred = {i for r in regions for i in r.members}
  due: dict[int, list] = {}
  for r in regions:
    due.setdefault(r.at, []).append(r)
  for i, eqn in enumerate(jaxpr.eqns):
    for r in due.get(i, ()):
      _eval_region(env, jaxpr.eqns, r, vals, prefix, path)
    if i not in deferred:
      _eval_eqn(env, eqn, vals, prefix, path + (i,))
  for r in due.get(len(jaxpr.eqns), ()):
    _eval_region(env, jaxpr.eqns, r, vals, prefix, path)
  return [_read(vals, v) for v in jaxpr.outvars]


def _eval_eqn(env: Env, eqn, vals: dict, prefix: str, path: tuple) -> None:
  invals = [_read(vals, v) for v in eqn.invars]
  raw = str(eqn.source_info.name_stack)
  scope, backward = R.scope_of(_join(prefix, raw))
  scope = env.local(scope)
  env.record(scope)
  own = eqn.source_info.name_stack
  if env.root and not prefix:
    own = _compat.without_leading_scope(own, env.root)
  name_stack = _compat.current_name_stack() + own
  with _compat.user_context(eqn.source_info.traceback, name_stack), _compat.eqn_context(eqn):
    outs = _apply(env, eqn, invals, _join(prefix, raw), scope, backward, path)
  if not eqn.primitive.multiple_results:
    outs = [outs]
  for v, x in zip(eqn.outvars, outs):
    vals[v] = x


def _below_f32_at(env: Env, eqn, prefix: str) -> bool:
  scope = env.local(R.scope_of(_join(prefix, str(eqn.source_info.name_stack)))[0])
  return _dtypes.below_f32(env.policy_at(scope).compute_dtype)


def _eval_region(env: Env, eqns, region, vals: dict, prefix: str, path: tuple) -> None:
  """Evaluates a glue region (members of `eqns`) under jax.checkpoint: the backward pass
  keeps its inputs and recomputes the rest (see _regions)."""

  def fn(*inputs):
    local = dict(zip(region.inputs, inputs))
    for k in region.members:
      _eval_eqn(env, eqns[k], local, prefix, path + (k,))
    return [local[v] for v in region.outputs]

  outs = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)(
      *[vals[v] for v in region.inputs])
  for v, x in zip(region.outputs, outs):
    vals[v] = x


# ----------------------------------------------------------------------------- rules


def traced_dtypes(variables) -> list:
  """The dtypes jaxpr variables were traced with."""
  return [R.as_dtype(v.aval.dtype) for v in variables]


def cast_all(xs, dtypes) -> list:
  """Each floating value of `xs` cast to its floating entry of `dtypes`; others as they are."""
  return [R.cast(x, d) if _dtypes.is_float(d) and _dtypes.is_float(R.dtype_of(x)) else x
          for x, d in zip(xs, dtypes)]


def _verbatim(eqn, invals):
  """The equation bound as traced, its operands cast back to their traced dtypes."""
  return _compat.bind_eqn(eqn, cast_all(invals, traced_dtypes(eqn.invars)))


def _apply(env: Env, eqn, invals, prefix: str, scope: str, backward: bool, path: tuple):
  name = eqn.primitive.name
  dts = [R.dtype_of(x) for x in invals]
  if env.fp8 is not None and path in env.fp8.selected:
    return _fp8.dot(env, eqn, invals, path)
  if name == "dot_general" and path in (env.routers or ()) and _router_in_f32(env, scope):
    return _router_dot(eqn, invals)
  if name in R.GEMMS:
    plan = _gemm_plan_at(env, eqn, dts, scope, backward)
    if plan is None:
      return _verbatim(eqn, invals)
    p = eqn.params
    if R.as_written(plan.compute):
      # An f32 forward with a narrow backward: the forward GEMM on its traced operands.
      invals = cast_all(invals, traced_dtypes(eqn.invars))
    # The traced `precision` described the traced operands. A policy GEMM below f32 has
    # compute-dtype operands with f32 accumulation and runs at DEFAULT precision: a
    # DotAlgorithmPreset such as BF16_BF16_F32 (jax.nn.dot_product_attention's for bf16
    # inputs) kept on f16 operands would make XLA convert them back to bf16, and on
    # bf16/f16 operands with f32 accumulation every Precision computes the same products.
    # A direction computing in f32 keeps the traced precision, as JAX's own transpose does.
    fwd_prec = p.get("precision") if R.as_written(plan.compute) else None
    bwd_prec = p.get("precision") if R.as_written(plan.backward) else None
    if name == "dot_general":
      return _gemm.policy_dot_general(
          invals[0], invals[1], p["dimension_numbers"], plan.compute,
          precision=fwd_prec, out_sharding=p.get("out_sharding"), out_dtype=plan.out,
          backward_dtype=plan.backward, backward_precision=bwd_prec)
    if name == "ragged_dot_general":
      return _gemm.policy_ragged_dot_general(
          invals[0], invals[1], invals[2], p["ragged_dot_dimension_numbers"], plan.compute,
          precision=fwd_prec, out_dtype=plan.out, backward_dtype=plan.backward,
          backward_precision=bwd_prec)
    return _gemm.policy_conv(invals[0], invals[1],
                             _gemm.conv_params_of(p)._replace(precision=fwd_prec),
                             plan.compute, plan.out, out_sharding=p.get("out_sharding"),
                             backward_dtype=plan.backward, backward_precision=bwd_prec)
  if name in env.fp32_primitives and R.f32_plan(dts):
    if R.as_written(env.policy_at(scope).compute_dtype):
      return _verbatim(eqn, invals)  # f32 compute: the code's own narrow ops as written
    ups = [R.cast(x, _F32) if _dtypes.below_f32(d) else x for x, d in zip(invals, dts)]
    return _compat.bind_eqn(eqn, ups)
  if name in R.CONTAINERS:
    return _container(env, eqn, invals, prefix, path)
  if name in R.PROMOTING:
    ops = R.promote_operands(eqn, invals)
    if name in R.BROADCASTING and _sums_in_f32(env, scope):
      ops = [_broadcast_in_f32(x, eqn.outvars[0].aval.shape)
             if _repeats_narrow(v, x, eqn.outvars[0].aval.shape) else x
             for v, x in zip(eqn.invars, ops)]
    return _compat.bind_eqn(eqn, ops)
  if (name == "broadcast_in_dim" and _sums_in_f32(env, scope)
      and _repeats_narrow(eqn.invars[0], invals[0], eqn.outvars[0].aval.shape)):
    # The transpose of a broadcast is a sum (a bias's or a norm scale's gradient over the
    # batch): broadcast the narrow value upcast and round it back (exact: the values are
    # those of the narrow broadcast), so that the backward sum runs in f32, rounded once.
    up = _compat.bind_eqn(eqn, [R.cast(invals[0], _F32), *invals[1:]])
    return R.cast(up, dts[0])
  if name in R.POLYMORPHIC:
    return _compat.bind_eqn(eqn, invals)
  return _verbatim(eqn, invals)


def _router_in_f32(env: Env, scope: str) -> bool:
  """A router GEMM runs in f32 where the scope computes below f32 (in an f32 scope it runs
  as written) and no override governs the scope (an override on the router decides it)."""
  return not R.as_written(env.policy_at(scope).compute_dtype) and not env.overridden(scope)


def _router_dot(eqn, invals):
  """A router GEMM f32 x f32 -> f32 (wider operands stay wider), at its traced precision:
  JAX's own transpose gives f32 x f32 gradient GEMMs, as Megatron's moe_router_dtype=fp32."""
  ops = [R.cast(x, _F32) if R.below_f32(R.dtype_of(x)) else x for x in invals]
  out = _gemm.wider_float(_F32, R.as_dtype(eqn.outvars[0].aval.dtype))
  p = eqn.params
  return lax.dot_general(ops[0], ops[1], p["dimension_numbers"], precision=p.get("precision"),
                         preferred_element_type=out, out_sharding=p.get("out_sharding"))


def _gemm_plan_at(env: Env, eqn, dts, scope: str, backward: bool):
  """The GemmPlan of a GEMM traced in `scope`. A GEMM of the traced program's backward
  pass takes the scope's backward compute dtype (and so do its own gradient GEMMs);
  a forward GEMM takes the forward one, its gradient GEMMs the backward one."""
  if backward:
    return R.gemm_plan(eqn, dts[0], dts[1], env.compute_at(scope, "bwd"), True)
  return R.gemm_plan(eqn, dts[0], dts[1], env.compute_at(scope, "fwd"), False,
                     env.compute_at(scope, "bwd"))


def _sums_in_f32(env: Env, scope: str) -> bool:
  """A scope computing below f32 whose recipe keeps sums in f32: the backward sums that
  broadcasts turn into (below) run in f32 there too."""
  return ("reduce_sum" in env.fp32_primitives
          and not R.as_written(env.policy_at(scope).compute_dtype))


def _repeats_narrow(var, x, out_shape) -> bool:
  """`x` (the value of `var`, not a literal) is below f32 and repeated to `out_shape`: its
  gradient is a sum over the repeated elements (the code's own bf16 bias added to a GEMM
  result, a bf16 param broadcast over the batch)."""
  return (not isinstance(var, jax.extend.core.Literal) and _dtypes.below_f32(R.dtype_of(x))
          and tuple(np.shape(x)) != tuple(out_shape))


def _broadcast_in_f32(x, out_shape):
  """`x` broadcast to `out_shape` (same rank, size-1 dims repeated; or a scalar) through
  f32 and rounded back: the same values, and the transpose sums in f32."""
  dims = tuple(range(np.ndim(x))) if np.ndim(x) else ()
  return R.cast(lax.broadcast_in_dim(R.cast(x, _F32), tuple(out_shape), dims), R.dtype_of(x))


# ----------------------------------------------------------------------------- containers


def _closed(j):
  """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
  return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, [])


def _subjaxprs(eqn) -> list:
  out = []
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
        out.append(_closed(v)[0])
  return out


def changes(env: Env, jaxpr, prefix: str, jvp_rules: bool = True) -> bool:
  """Whether evaluating `jaxpr` on operands of its traced dtypes would change any
  equation. Exact: while nothing changes, every value keeps its traced dtype.

  A custom_jvp call changes when its primal or its JVP rule does; the rule's own jaxpr
  calls the primal again (`jvp_rules=False` there: its primal was already checked)."""
  key = (id(jaxpr), prefix, jvp_rules)
  if key not in env._static:
    env._static[key] = False  # recursion guard
    found = False
    for eqn in jaxpr.eqns:
      raw = _join(prefix, str(eqn.source_info.name_stack))
      scope, backward = R.scope_of(raw)
      scope = env.local(scope)
      env.record(scope)
      name = eqn.primitive.name
      dts = [R.as_dtype(v.aval.dtype) if hasattr(v.aval, "dtype") else None
             for v in eqn.invars]
      if name in R.GEMMS:
        found = _gemm_plan_at(env, eqn, dts, scope, backward) is not None
        # An fp8 site (chosen by path, which this memoised walk does not know): a jaxpr
        # holding any candidate is evaluated, not bound as traced, while some site is fp8.
        found = found or bool(env.fp8 is not None and env.fp8.selected
                              and _fp8.is_candidate(eqn))
      elif name in env.fp32_primitives:
        found = R.f32_plan(d for d in dts if d is not None) and not R.as_written(
            env.policy_at(scope).compute_dtype)
      elif name in R.CONTAINERS:
        found = any(changes(env, sub, raw) for sub in _subjaxprs(eqn))
        if name == "custom_jvp_call" and not found and jvp_rules:
          found = changes(env, _custom_jvp_rule(eqn)[0], raw, jvp_rules=False)
      if found:
        break
    env._static[key] = found
  return env._static[key]


def _same_dtypes(eqn, invals) -> bool:
  return all(R.dtype_of(x) == R.as_dtype(v.aval.dtype) for x, v in zip(invals, eqn.invars)
             if hasattr(v.aval, "dtype") and hasattr(x, "dtype"))


def _container(env: Env, eqn, invals, prefix: str, path: tuple):
  name, p = eqn.primitive.name, eqn.params
  if _same_dtypes(eqn, invals) and not any(changes(env, s, prefix) for s in _subjaxprs(eqn)):
    if name != "custom_jvp_call" or not changes(env, _custom_jvp_rule(eqn)[0], prefix,
                                                jvp_rules=False):
      return _compat.bind_eqn(eqn, invals)
  # Sub-jaxpr k is evaluated at path + (k,): the numbering of _fp8.sub_jaxprs.
  run = lambda j, args, k=0: eval_jaxpr(env, *_closed(j), args, prefix, path + (k,))
  if name in ("jit", "pjit", "closed_call", "core_call"):
    return run(p.get("jaxpr", p.get("call_jaxpr")), invals)
  if name == "scan":
    return _scan(env, eqn, invals, run, path)
  if name == "while":
    return _while(eqn, invals, run)
  if name == "cond":
    if p.get("branches_platforms"):
      return _verbatim(eqn, invals)  # lax.platform_dependent: kept per platform as written
    return _cond(env, eqn, invals, run, path)
  if name in ("remat2", "checkpoint"):
    # Explicit fp8 state of the sites inside: an argument and a result of the
    # rematerialised function (recomputed with it in the backward pass).
    keys = _fp8.threaded_keys(env.fp8, path + (0,))

    def fn(args, states):
      with _fp8.threading(env.fp8, states) as new:
        return run(p["jaxpr"], list(args)), {k: new[k] for k in keys}

    outs, new_states = jax.checkpoint(fn, prevent_cse=p.get("prevent_cse", True),
                                      policy=p.get("policy"))(
                                          list(invals), {k: env.fp8.state_in[k] for k in keys})
    if keys:
      env.fp8.state_out.update(new_states)
    return outs
  if name == "custom_jvp_call":
    return _custom_jvp(env, eqn, invals, prefix, path)
  raise AssertionError(name)


def _cond(env: Env, eqn, invals, run, path: tuple):
  p = eqn.params
  out_dtypes = traced_dtypes(eqn.outvars)
  # Explicit fp8 state of the sites in every branch goes into each branch and comes out
  # of each: the taken branch's sites return their new state, the others pass theirs
  # through (and get a zero cotangent: merge_grad_state keeps their gradient state).
  keys = [key for k in range(len(p["branches"]))
          for key in _fp8.threaded_keys(env.fp8, path + (k,))]

  def branch(b, k, ops, states):
    with _fp8.threading(env.fp8, states) as new:
      outs = cast_all(run(b, list(ops), k), out_dtypes)
      return outs, {key: new.get(key, states[key]) for key in keys}

  branches = [lambda ops, states, b=b, k=k: branch(b, k, ops, states)
              for k, b in enumerate(p["branches"])]
  outs, new_states = lax.switch(invals[0], branches, list(invals[1:]),
                                {key: env.fp8.state_in[key] for key in keys})
  if keys:
    env.fp8.state_out.update(new_states)
  return outs


def _scan(env: Env, eqn, invals, run, path: tuple):
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
  carry_dtypes = traced_dtypes(eqn.invars[nc:nc + nk])
  # Explicit fp8 state of the sites in the body: one per iteration, scanned over (its
  # leading axis) and scanned out, the gradient state's token included.
  keys = _fp8.threaded_keys(env.fp8, path + (0,))

  def body(carry, x):
    x, states = x
    with _fp8.threading(env.fp8, states) as new:
      outs = run(p["jaxpr"], [*consts, *carry, *x])
      new_states = {k: new[k] for k in keys}
    return cast_all(outs[:nk], carry_dtypes), (outs[nk:], new_states)

  states = {k: env.fp8.state_in[k] for k in keys}
  carry, (ys, new_states) = lax.scan(body, cast_all(init, carry_dtypes), (xs, states),
                                     length=p["length"], reverse=p["reverse"],
                                     unroll=p["unroll"])
  if keys:
    env.fp8.state_out.update(new_states)
  return [*carry, *ys]


def _while(eqn, invals, run):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  carry_dtypes = traced_dtypes(eqn.invars[cn + bn:])
  cond = lambda c: run(p["cond_jaxpr"], [*cconsts, *c], 0)[0]
  body = lambda c: cast_all(run(p["body_jaxpr"], [*bconsts, *c], 1), carry_dtypes)
  return lax.while_loop(cond, body, cast_all(init, carry_dtypes))


_JVP_RULES: dict = {}


def _custom_jvp_rule(eqn):
  """(jaxpr, consts) of the custom JVP rule with every tangent nonzero (memoised per
  equation while it lives)."""
  key = id(eqn)
  hit = _JVP_RULES.get(key)
  if hit is None or hit[0] is not eqn:
    result = _compat.custom_jvp_rule(eqn.params, [False] * len(eqn.invars))
    hit = _JVP_RULES[key] = (eqn, _closed(result[0])[0], result[1])
    if len(_JVP_RULES) > 4096:
      _JVP_RULES.clear()
      _JVP_RULES[key] = hit
  return hit[1], hit[2]


def _custom_jvp(env: Env, eqn, invals, prefix: str, path: tuple):
  """A custom_jvp call rebuilt around the policy: primal and JVP rule both evaluated by the
  interpreter; tangents returned in the primal outputs' dtypes. Integer operands keep the
  call as written."""
  if not all(_dtypes.is_float(R.dtype_of(x)) for x in invals):
    return _verbatim(eqn, invals)
  call = eqn.params["call_jaxpr"]
  n_out = len(eqn.outvars)

  @jax.custom_jvp
  def f(*args):
    # Paths under a custom_jvp are marked off: no fp8 site lies in one (_fp8.sub_jaxprs).
    return eval_jaxpr(env, *_closed(call), list(args), prefix, path + ("jvp",))

  @f.defjvp
  def f_jvp(primals, tangents):
    jaxpr, consts = _custom_jvp_rule(eqn)
    res = eval_jaxpr(env, jaxpr, consts, [*primals, *tangents], prefix, path + ("jvp_rule",))
    primal_out = f(*primals)
    tangent_out = [R.cast(t, R.dtype_of(y)) for t, y in zip(res[n_out:], primal_out)]
    return primal_out, tangent_out

  return f(*invals)
