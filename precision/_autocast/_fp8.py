"""fp8 GEMMs under precision.autocast: which dot_generals of a traced program go fp8, and how.

A recipe with an fp8 config (`Recipe.fp8`) routes the forward `dot_general`s of the traced
function through `precision.fp8.fp8_dot_general`: operands quantised to E4M3 (the
config's forward format) with their scales, one GEMM on fp8 operands with f32
accumulation, the result rounded once to the compute dtype; in the backward pass (its
custom VJP) the incoming cotangent is quantised to E5M2 and both gradient GEMMs run on
fp8 operands with f32 accumulation, each gradient returned in its operand's own dtype.

Which GEMMs ("sites"): every forward float dot_general of the traced program, in program
order (jit bodies are walked into; scan/while bodies, cond branches and remat bodies
too), numbered by that order. A site stays in the compute dtype (the policy GEMM) when

  * it is the first or the last site with a weight operand outside a loop body and
    `Fp8Config.keep_first_last` is set (default): the embedding/stem projection and the
    output head, whatever they are called (Transformer Engine's practice). A GEMM in a
    scan/while body runs at every iteration (a scan over layers): never first or last;
  * a prefix of its scope (NNX module path, Linen module name, jax.named_scope) matches a
    pattern of `Fp8Config.keep_high_precision` (fnmatch, as `overrides` patterns);
  * an override gives its scope another policy (the override names the dtypes it wants);
  * both its operands are activations (computed from GEMM results: attention's q.k and
    p.v), as Transformer Engine and `precision.fp8.apply_fp8` keep attention's batched
    GEMMs out of fp8 (fp8 attention is out of scope). Weights are the function's inputs
    and constants and what is computed from them alone (casts, reshapes, a weight norm);
  * the scaling state is explicit (`fp8_state=True`) and the site sits in a while-loop
    body: a while loop has no static trip count to stack per-iteration state over
    (`fori_loop` with static bounds is a scan); those sites run in the compute dtype and
    `precision.fp8.autocast_gemms` says so.

With explicit state, a site in a scan body has one state per iteration (a scan over
layers: one per layer, as Transformer Engine keeps one per layer): its state's leaves
carry the scan length as a leading axis (several for nested scans), sliced into the body
as scanned-over inputs and stacked back as scanned-out results; the gradient operand's
token goes the same way, so its cotangent comes back stacked too. A site in a remat
(jax.checkpoint) body gets its state as an argument of the rematerialised function and
returns the new one as a result. The sites of a cond's branches get their states into
every branch and out of every branch: the taken branch's sites return new state, the
others pass theirs through unchanged.

Grouped GEMMs (`lax.ragged_dot`, an MoE layer's expert GEMMs in sorted dispatch) are
sites too, by the same rules (the expert weights are the weight operand): they run
through `precision.fp8._grouped` with one scale per expert group, from this step's
amaxes under every per-tensor scaling (no state: an expert's rows change with the
routing every step), or microscaled blocks within each group under mxfp8; under nvfp4
they stay in the compute dtype.

Not sites: convolutions (fp8 convolutions are out of scope: they run the policy's
compute-dtype convolution), GEMMs inside custom_jvp/custom_vjp functions and Pallas
kernels (run as written), integer and fp8 GEMMs. A function that takes its own gradient
(GEMMs whose name stack says "transpose": ``autocast(jax.grad(f), recipe)``) is refused
with an error naming ``jax.grad(autocast(f, recipe))``: its backward GEMMs are plain
dot_generals that could only run in the compute dtype, not with the E5M2 gradients the
recipe asks for.

Scaling state: current, per_channel and block scaling need none (each GEMM scales with
its operands' own amaxes), so plain `autocast(fn, recipe)` runs them. Delayed scaling
reads an amax history: `autocast(fn, recipe, fp8_state=True)` returns
``g(state, *args) -> (out, new_state)`` over a dict {site key: Fp8DotState} made by
`precision.fp8.init_state`; the gradient operand's state comes back as the cotangent of
`state` (see `precision.fp8.merge_grad_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from precision import _dtypes
from precision import _overrides
from precision._autocast import _rules as R
from precision.fp8 import _dot
from precision.fp8 import _grouped

# Where a site sits, when not inline (top level or a jit body): in a "scan" or "while"
# body, a "cond" branch, a "remat" (jax.checkpoint) body.
LOOPS = ("scan", "while")
# Containers whose sites cannot carry explicit state (see the module docstring).
_NO_STATE = ("while",)


class Site(NamedTuple):
  """One forward float dot_general of a traced program.

  path: equation indices from the root jaxpr, a sub-jaxpr index after each container
    (the interpreter evaluates the same path); position: its index in program order;
    scope: the scope string overrides and keep patterns match; where: the kinds of
    non-inline containers around it, outermost first; stack: the lengths of the scans
    around it (the leading axes of its explicit state); weight: an operand is not an
    activation (see find_sites).
  """
  path: tuple[int, ...]
  position: int
  scope: str
  where: tuple[str, ...]
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  stack: tuple[int, ...] = ()
  weight: bool = True
  grouped: bool = False   # a grouped GEMM (ragged_dot): per-expert scales, no state

  @property
  def key(self) -> str:
    """The site's key in the state dict: "position:scope" ("3:blocks/0/mlp"), or
    "position" for a GEMM traced outside any scope."""
    return f"{self.position}:{self.scope}" if self.scope else str(self.position)


def _join(prefix: str, stack: str) -> str:
  return "/".join(s for s in (prefix, stack) if s)


def _closed(j):
  return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, [])


def sub_jaxprs(eqn, platform_branches: bool = False) -> list[tuple[int, Any, str | None]]:
  """(sub-jaxpr index, jaxpr, kind) of a container equation the interpreter evaluates;
  kind None for inline bodies (jit), else scan, while, cond or remat. The indices are
  those the interpreter appends to a container's path (see _interpret._container).
  `platform_branches`: a `lax.platform_dependent` cond's branches too (kind "cond"; the
  interpreter binds such a cond as written, but values flow through its branches)."""
  name, p = eqn.primitive.name, eqn.params
  if name in ("jit", "pjit", "closed_call", "core_call"):
    return [(0, _closed(p.get("jaxpr", p.get("call_jaxpr")))[0], None)]
  if name == "scan":
    return [(0, _closed(p["jaxpr"])[0], "scan")]
  if name == "while":
    return [(0, _closed(p["cond_jaxpr"])[0], "while"),
            (1, _closed(p["body_jaxpr"])[0], "while")]
  if name == "cond" and (platform_branches or not p.get("branches_platforms")):
    return [(k, _closed(b)[0], "cond") for k, b in enumerate(p["branches"])]
  if name in ("remat2", "checkpoint"):
    return [(0, _closed(p["jaxpr"])[0], "remat")]
  return []  # custom_jvp_call (primal and rule are separate programs), platform cond


def sub_operands(eqn, k: int, xs: list) -> list:
  """The entries of `xs` (one per invar of the container `eqn`) that its sub-jaxpr `k`
  (numbering of `sub_jaxprs`) takes as its invars, in order: a while's cond takes its
  own consts and the carry (not the body's consts), its body the body's consts and the
  carry; a cond's branches all operands but the index; other bodies all operands."""
  name, p = eqn.primitive.name, eqn.params
  if name == "while":
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    return list(xs[:cn]) + list(xs[cn + bn:]) if k == 0 else list(xs[cn:])
  if name == "cond":
    return list(xs[1:])
  return list(xs)


def is_grouped(eqn) -> bool:
  """A ragged_dot_general (a grouped MoE GEMM) with lax.ragged_dot's dimension numbers
  and no group offset: it runs through `precision.fp8._grouped` (per-expert scales)."""
  p = eqn.params
  return (eqn.primitive.name == "ragged_dot_general" and p.get("group_offset") is None
          and _grouped.is_basic(p["ragged_dot_dimension_numbers"]))


def is_candidate(eqn) -> bool:
  """A dot_general (or a grouped GEMM: `is_grouped`) whose traced operands are both
  float and neither is fp8."""
  if eqn.primitive.name != "dot_general" and not is_grouped(eqn):
    return False
  dts = [R.as_dtype(v.aval.dtype) for v in eqn.invars[:2]]
  return all(_dtypes.is_float(d) and not R.is_fp8(d) for d in dts)


def has_gemm(eqn, memo: dict) -> bool:
  """Whether the equation is, or holds in any sub-jaxpr, a dot_general or convolution."""
  if eqn.primitive.name in R.GEMMS:
    return True
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        if id(inner) not in memo:
          memo[id(inner)] = False  # recursion guard
          memo[id(inner)] = any(has_gemm(e, memo) for e in inner.eqns)
        if memo[id(inner)]:
          return True
  return False


def find_sites(env, jaxpr, backward_gemms: list | None = None) -> list[Site]:
  """Every forward candidate dot_general of `jaxpr`, in program order, with whether one
  of its operands is a weight. `backward_gemms`, when given, receives the scope of every
  candidate of a backward pass traced inside `jaxpr` (a name stack with "transpose").

  "Activation" values are the results of GEMMs and everything computed from them (loop
  carries count as activations); the function's inputs and constants, and what is
  computed from them alone, are not. A GEMM whose two operands are activations (an
  attention's q.k and p.v) has no weight operand.
  """
  found: list[tuple] = []
  memo: dict = {}
  is_var = lambda v: isinstance(v, jax.extend.core.Var)

  def walk(jx, prefix: str, path: tuple, where: tuple, stack: tuple, act_in) -> list[bool]:
    act = {v for v, a in zip(jx.invars, act_in) if a}
    is_act = lambda v: is_var(v) and v in act
    for j, eqn in enumerate(jx.eqns):
      raw = _join(prefix, str(eqn.source_info.name_stack))
      ins = [is_act(v) for v in eqn.invars]
      if is_candidate(eqn):
        scope, backward = R.scope_of(raw)
        if not backward:
          found.append((path + (j,), env.local(scope), where,
                        tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape),
                        stack, not (ins[0] and ins[1]), is_grouped(eqn)))
        elif backward_gemms is not None:
          backward_gemms.append(env.local(scope) or "(top level)")
      name, p = eqn.primitive.name, eqn.params
      subs = sub_jaxprs(eqn)
      at = lambda k, kind: (raw, path + (j, k), where + ((kind,) if kind else ()),
                            stack + ((int(p["length"]),) if kind == "scan" else ()))
      outs = None
      if name in ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"):
        (k, sub, kind), = subs
        outs = walk(sub, *at(k, kind), ins)  # exact: the body's own flow
      elif name == "scan":
        nc, nk = p["num_consts"], p["num_carry"]
        walk(subs[0][1], *at(0, "scan"), ins[:nc] + [True] * nk + ins[nc + nk:])
      elif name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = [True] * (len(ins) - cn - bn)
        walk(subs[0][1], *at(0, "while"), ins[:cn] + carry)
        walk(subs[1][1], *at(1, "while"), ins[cn:cn + bn] + carry)
      else:
        for k, sub, kind in subs:  # cond branches
          walk(sub, *at(k, kind), ins[1:])
      if outs is None:
        outs = [any(ins) or has_gemm(eqn, memo)] * len(eqn.outvars)
      act.update(v for v, a in zip(eqn.outvars, outs) if a)
    return [is_act(v) for v in jx.outvars]

  walk(jaxpr, "", (), (), (), [False] * len(jaxpr.invars))
  return [Site(path, i, scope, where, ls, rs, stack, weight, grouped)
          for i, (path, scope, where, ls, rs, stack, weight, grouped) in enumerate(found)]


class Decision(NamedTuple):
  site: Site
  fp8: bool
  reason: str


def decide(env, sites: list[Site], config, stateful: bool) -> list[Decision]:
  """Which sites run in fp8 (see the module docstring for the rules, in that order)."""
  inline_or_once = [s for s in sites if not set(LOOPS) & set(s.where) and s.weight]
  role = {}
  if config.keep_first_last and inline_or_once:
    role[inline_or_once[-1].path] = "last GEMM of the function (Fp8Config.keep_first_last)"
    role[inline_or_once[0].path] = "first GEMM of the function (Fp8Config.keep_first_last)"
  out = []
  for s in sites:
    pattern = next((pat for prefix in _overrides.scope_prefixes(s.scope)
                    for pat in config.keep_high_precision
                    if fnmatch.fnmatchcase(prefix, pat)), None)
    if s.path in role:
      out.append(Decision(s, False, role[s.path]))
    elif pattern is not None:
      out.append(Decision(s, False, f"scope matches keep_high_precision pattern {pattern!r}"))
    elif any(env.policy_at(s.scope, d) != env.policy for d in _overrides.DIRECTIONS):
      pols = "/".join(dict.fromkeys(str(env.policy_at(s.scope, d))
                                    for d in _overrides.DIRECTIONS))
      out.append(Decision(s, False, f"an override sets its policy ({pols})"))
    elif not s.weight:
      out.append(Decision(s, False, "both operands are activations (attention's q.k, p.v): "
                          "no weight operand (compute dtype)"))
    elif s.grouped and config.scaling == "nvfp4":
      out.append(Decision(s, False, "a grouped GEMM under nvfp4 (its tensor scale and "
                          "weight tiles are not defined per expert): compute dtype"))
    elif s.grouped:
      out.append(Decision(s, True, "fp8, grouped GEMM: one scale per expert group from "
                          "this step's amaxes (no state)" if config.scaling != "mxfp8"
                          else "mxfp8, grouped GEMM: blocks within expert groups"))
    elif stateful and set(_NO_STATE) & set(s.where):
      out.append(Decision(s, False, "inside a while body: explicit fp8 state is not "
                          "threaded through while loops (compute dtype)"))
    else:
      out.append(Decision(s, True, "fp8"))
  return out


@dataclasses.dataclass
class Fp8Run:
  """The interpreter's fp8 record for one evaluation: the sites chosen (path -> key), the
  per-operand spec, the state read (None: fresh unit scales) and the state written."""
  spec: Any                       # precision.fp8.Fp8Spec
  selected: dict                  # path -> key
  state_in: Mapping[str, Any] | None
  state_out: dict = dataclasses.field(default_factory=dict)
  stacks: dict = dataclasses.field(default_factory=dict)   # key -> scan lengths around it
  grouped: frozenset = frozenset()  # paths of the grouped sites (stateless)


def threaded_keys(run: Fp8Run | None, prefix: tuple) -> list[str]:
  """Keys of the explicit-state sites under `prefix` (a container's sub-jaxpr path)."""
  if run is None or run.state_in is None:
    return []
  return [k for path, k in run.selected.items()
          if path[:len(prefix)] == prefix and path not in run.grouped]


@contextlib.contextmanager
def threading(run: Fp8Run | None, states: Mapping[str, Any]):
  """While a container's body is traced: its sites read `states` (their slices, for a
  scan) and write into the dict yielded, which the container returns as results."""
  if run is None or run.state_in is None:
    yield {}
    return
  saved = run.state_in, run.state_out
  run.state_in, run.state_out = {**run.state_in, **states}, {}
  try:
    yield run.state_out
  finally:
    run.state_in, run.state_out = saved


def _check_state(state: Any, keys: list[str], spec, stacks: Mapping[str, tuple]) -> None:
  """`state` is a dict {key: Fp8DotState} with exactly `keys`, shaped for `spec` (with
  the scan lengths `stacks[key]` leading)."""
  if not isinstance(state, Mapping):
    raise ValueError(
        f"fp8 state {type(state).__name__} {state!r:.80}; accepted: the dict "
        "{site key: precision.fp8.Fp8DotState} made by precision.fp8.init_state(fn, recipe, "
        "*args) (or g.init_state(*args)) and returned as new_state by the previous call")
  missing = [k for k in keys if k not in state]
  unknown = [k for k in state if k not in keys]
  if missing or unknown:
    raise ValueError(
        f"fp8 state keys do not match the fp8 GEMMs of this trace: missing "
        f"{missing or 'none'}, unknown {unknown or 'none'}; this trace's keys are "
        f"{keys or '(none)'}. Make the state with precision.fp8.init_state at the same "
        "arguments' shapes (and the same recipe and overrides)")
  want = {op: (getattr(spec, op).state_len,) for op in ("lhs", "rhs", "grad")}
  for k in keys:
    st = state[k]
    if not isinstance(st, _dot.Fp8DotState):
      raise ValueError(f"fp8 state[{k!r}] is {type(st).__name__}; accepted: an "
                       "precision.fp8.Fp8DotState (from precision.fp8.init_state)")
    for op, shape in want.items():
      got = tuple(np.shape(getattr(st, op).amax_history))
      if got != stacks[k] + shape:
        raise ValueError(
            f"fp8 state[{k!r}].{op}.amax_history has shape {got}; accepted: "
            f"{stacks[k] + shape} (the lengths of the scans around the GEMM, then the "
            "recipe's amax_history_len for delayed scaling, else 1)")


def _non_float_gemms(jaxpr, out: list, seen: set) -> list:
  """"lhs x rhs -> out" dtypes of every dot_general of `jaxpr` (sub-jaxprs included) with
  an operand that is not a float."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      dts = [R.as_dtype(v.aval.dtype) for v in eqn.invars[:2]]
      if not all(_dtypes.is_float(d) for d in dts):
        out.append(f"{dts[0].name} x {dts[1].name} -> "
                   f"{R.as_dtype(eqn.outvars[0].aval.dtype).name}")
    for value in eqn.params.values():
      for v in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(v, "jaxpr", v)
        if hasattr(inner, "eqns") and id(inner) not in seen:
          seen.add(id(inner))
          _non_float_gemms(inner, out, seen)
  return out


def _refuse_integer_gemms(jaxpr, config) -> None:
  """An fp8 recipe on a function whose GEMMs all have non-float operands (int8 GEMMs of
  quantised inference, say) would quantise nothing: refused, as a recipe that cannot
  apply. (A function without any GEMM passes: there is nothing to refuse.)"""
  found = _non_float_gemms(jaxpr, [], set())
  if found:
    shown = ", ".join(sorted(set(found))[:4])
    raise ValueError(
        f"fp8.scaling={config.scaling!r}: the recipe's fp8 GEMMs need floating operands, "
        f"but no GEMM of this function has them ({len(found)} dot_general(s) {shown}); "
        "fp8 quantises float operands and cannot apply to integer GEMMs. Accepted: a "
        "function with float GEMMs, or a recipe without fp8 (Recipe.fp8=None, e.g. "
        "'bf16_mixed') to run the integer GEMMs as written")


def _refuse_inner_backward(config, scopes: list[str]) -> None:
  """A function that takes its own gradient has backward GEMMs traced as plain
  dot_generals: autocast cannot give them the fp8 GEMMs' E5M2 gradients (those come from
  the fp8 GEMMs' own VJP), and running them in the compute dtype instead would not be the
  recipe asked for. Refused, naming the composition that runs it."""
  shown = ", ".join(dict.fromkeys(scopes))
  raise ValueError(
      f"autocast with fp8 (fp8.scaling={config.scaling!r}): the function takes its own "
      f"gradient ({len(scopes)} backward-pass GEMM(s), scopes {shown:.120}), whose GEMMs "
      "would run in the compute dtype, not fp8 with E5M2 gradients; differentiate the "
      "autocast function instead: jax.grad(precision.autocast(f, recipe)), not "
      "precision.autocast(jax.grad(f), recipe)")


def prepare(env, jaxpr, config, stateful: bool, state: Any, check_state: bool = True
            ) -> tuple[Fp8Run, list[Decision]]:
  """The Fp8Run for evaluating `jaxpr` under `config`; a stateful run's `state` is checked
  against the sites chosen (unless `check_state` is False: choosing sites only)."""
  spec = _dot.Fp8Spec.from_config(config)
  backward_gemms: list = []
  sites = find_sites(env, jaxpr, backward_gemms)
  if backward_gemms:
    _refuse_inner_backward(config, backward_gemms)
  if not sites:
    _refuse_integer_gemms(jaxpr, config)
  decisions = decide(env, sites, config, stateful)
  selected = {d.site.path: d.site.key for d in decisions if d.fp8}
  grouped = frozenset(d.site.path for d in decisions if d.fp8 and d.site.grouped)
  stacks = {d.site.key: d.site.stack for d in decisions if d.fp8 and not d.site.grouped}
  if stateful and check_state:
    _check_state(state, list(stacks), spec, stacks)
  state_in = dict(state) if stateful and state is not None else None
  return Fp8Run(spec, selected, state_in, stacks=stacks, grouped=grouped), decisions


def prepare_grouped(env, jaxpr, config) -> tuple[Fp8Run | None, list[Decision] | None]:
  """The Fp8Run of a program whose dense fp8 GEMMs come from a model's fp8 layers
  (`precision.flax.apply_recipe`: the plan's spec, its `fp8` None): its grouped GEMMs
  (ragged_dot experts, which hold their weights as plain params: no layer to replace)
  run fp8 here, one scale per expert group from this step's amaxes (no state, under every
  per-tensor scaling, delayed included), microscaled blocks within groups under mxfp8, by
  `decide`'s rules but `keep_first_last` (an expert GEMM is neither the model's
  embedding nor its head; the layers kept theirs). (None, None) for a program without
  grouped GEMMs: the program runs exactly as without this."""
  sites = [s for s in find_sites(env, jaxpr) if s.grouped]
  if not sites:
    return None, None
  decisions = decide(env, sites, dataclasses.replace(config, keep_first_last=False), False)
  selected = {d.site.path: d.site.key for d in decisions if d.fp8}
  if not selected:
    return None, decisions
  spec = _dot.Fp8Spec.from_config(config)
  return Fp8Run(spec, selected, None, grouped=frozenset(selected)), decisions


def dot(env, eqn, invals, path: tuple):
  """The fp8 GEMM of a selected site: `fp8_dot_general` on the operands as they arrive
  (any float dtype: the quantisation divides in f32), the result in the compute dtype (or
  the wider accumulator the traced program asked for, as the policy GEMM)."""
  run: Fp8Run = env.fp8
  key = run.selected[path]
  lt, rt = (np.dtype(v.aval.dtype) for v in eqn.invars[:2])
  pref = eqn.params.get("preferred_element_type")
  explicit = pref is not None and np.dtype(pref).itemsize > max(lt.itemsize, rt.itemsize)
  out_dtype = np.dtype(pref) if explicit else np.dtype(env.policy.compute_dtype)
  if path in run.grouped:
    return _grouped.fp8_ragged_dot(invals[0], invals[1], invals[2], run.spec,
                                   out_dtype=out_dtype)
  state = run.spec.init_state() if run.state_in is None else run.state_in[key]
  out, new = _dot.fp8_dot_general(invals[0], invals[1], eqn.params["dimension_numbers"],
                                  state, run.spec, out_dtype=out_dtype)
  if run.state_in is not None:  # stateless runs keep no record (sites may sit in loops)
    run.state_out[key] = new
  return out


def init_states(config, decisions: list[Decision]) -> dict:
  """Fresh state (zero histories, unit scales, zero counters) for every fp8 site, with
  the lengths of the scans around it leading."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  spec = _dot.Fp8Spec.from_config(config)
  out = {}
  for d in decisions:
    if d.fp8 and not d.site.grouped:
      fresh = spec.init_state()
      out[d.site.key] = type(fresh)(*(type(op)(*(
          jnp.broadcast_to(x, d.site.stack + x.shape) for x in op)) for op in fresh))
  return out
