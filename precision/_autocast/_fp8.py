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

  * it is the first or the last site outside a loop body and
    `Fp8Config.keep_first_last` is set (default): the embedding/stem projection and the
    output head, whatever they are called (Transformer Engine's practice);
  * a prefix of its scope (NNX module path, Linen module name, jax.named_scope) matches a
    pattern of `Fp8Config.keep_high_precision` (fnmatch, as `overrides` patterns);
  * an override gives its scope another policy (the override names the dtypes it wants);
  * the scaling keeps state (`fp8_state=True`) and the site sits in a scan/while body, a
    cond branch or a remat body: the state of one GEMM per iteration or branch would have
    to be threaded through the loop carry or the branch outputs, which is not done; those
    sites run in the compute dtype and `precision.fp8.autocast_gemms` says so.

Not sites: convolutions (fp8 convolutions are out of scope: they run the policy's
compute-dtype convolution), GEMMs inside custom_jvp/custom_vjp functions and Pallas
kernels (run as written), integer and fp8 GEMMs, and the GEMMs of a gradient taken
*inside* the traced function (their name stack says "transpose"): differentiate the
autocast function from outside for fp8 backward GEMMs.

Scaling state: current, per_channel and block scaling need none (each GEMM scales with
its operands' own amaxes), so plain `autocast(fn, recipe)` runs them. Delayed scaling
reads an amax history: `autocast(fn, recipe, fp8_state=True)` returns
``g(state, *args) -> (out, new_state)`` over a dict {site key: Fp8DotState} made by
`precision.fp8.init_state`; the gradient operand's state comes back as the cotangent of
`state` (see `precision.fp8.merge_state_grads`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping, NamedTuple

import numpy as np

from precision._autocast import _overrides
from precision._autocast import _rules as R

# Where a site sits, when not inline (top level or a jit body): "loop" (scan/while body),
# "cond" (a branch), "remat" (a jax.checkpoint body).
_NESTED = ("loop", "cond", "remat")


class Site(NamedTuple):
  """One forward float dot_general of a traced program.

  path: equation indices from the root jaxpr, a sub-jaxpr index after each container
    (the interpreter evaluates the same path); position: its index in program order;
    scope: the scope string overrides and keep patterns match; where: the kinds of
    non-inline containers around it, outermost first.
  """
  path: tuple[int, ...]
  position: int
  scope: str
  where: tuple[str, ...]
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]

  @property
  def key(self) -> str:
    """The site's key in the state dict: "position:scope" ("3:blocks/0/mlp"), or
    "position" for a GEMM traced outside any scope."""
    return f"{self.position}:{self.scope}" if self.scope else str(self.position)


def _join(prefix: str, stack: str) -> str:
  return "/".join(s for s in (prefix, stack) if s)


def _closed(j):
  return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, [])


def sub_jaxprs(eqn) -> list[tuple[int, Any, str | None]]:
  """(sub-jaxpr index, jaxpr, kind) of a container equation the interpreter evaluates;
  kind None for inline bodies (jit), else one of _NESTED. The indices are those the
  interpreter appends to a container's path (see _interpret._container)."""
  name, p = eqn.primitive.name, eqn.params
  if name in ("jit", "pjit", "closed_call", "core_call"):
    return [(0, _closed(p.get("jaxpr", p.get("call_jaxpr")))[0], None)]
  if name == "scan":
    return [(0, _closed(p["jaxpr"])[0], "loop")]
  if name == "while":
    return [(0, _closed(p["cond_jaxpr"])[0], "loop"), (1, _closed(p["body_jaxpr"])[0], "loop")]
  if name == "cond" and not p.get("branches_platforms"):
    return [(k, _closed(b)[0], "cond") for k, b in enumerate(p["branches"])]
  if name in ("remat2", "checkpoint"):
    return [(0, _closed(p["jaxpr"])[0], "remat")]
  return []  # custom_jvp_call (primal and rule are separate programs), platform cond


def is_candidate(eqn) -> bool:
  """A dot_general whose traced operands are both float and neither is fp8."""
  if eqn.primitive.name != "dot_general":
    return False
  dts = [R.as_dtype(v.aval.dtype) for v in eqn.invars[:2]]
  return all(R.is_float(d) and not R.is_fp8(d) for d in dts)


def find_sites(env, jaxpr) -> list[Site]:
  """Every forward candidate dot_general of `jaxpr`, in program order."""
  found: list[tuple] = []

  def walk(jx, prefix: str, path: tuple, where: tuple):
    for j, eqn in enumerate(jx.eqns):
      raw = _join(prefix, str(eqn.source_info.name_stack))
      if is_candidate(eqn):
        scope, backward = R.scope_of(raw)
        if not backward:
          found.append((path + (j,), env.local(scope), where,
                        tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)))
      for k, sub, kind in sub_jaxprs(eqn):
        walk(sub, raw, path + (j, k), where + ((kind,) if kind else ()))

  walk(jaxpr, "", (), ())
  return [Site(path, i, scope, where, ls, rs)
          for i, (path, scope, where, ls, rs) in enumerate(found)]


class Decision(NamedTuple):
  site: Site
  fp8: bool
  reason: str


def decide(env, sites: list[Site], config, stateful: bool) -> list[Decision]:
  """Which sites run in fp8 (see the module docstring for the rules, in that order)."""
  inline_or_once = [s for s in sites if "loop" not in s.where]
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
    elif env.policy_at(s.scope) != env.policy:
      out.append(Decision(s, False, f"an override sets its policy ({env.policy_at(s.scope)})"))
    elif stateful and s.where:
      out.append(Decision(s, False, f"inside a {s.where[0]} body: its scaling state is not "
                          "threaded through loops, branches or remat (compute dtype)"))
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


def _check_state(state: Any, keys: list[str], spec) -> None:
  """`state` is a dict {key: Fp8DotState} with exactly `keys`, shaped for `spec`."""
  from precision.fp8._dot import Fp8DotState  # pylint: disable=g-import-not-at-top
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
    if not isinstance(st, Fp8DotState):
      raise ValueError(f"fp8 state[{k!r}] is {type(st).__name__}; accepted: an "
                       "precision.fp8.Fp8DotState (from precision.fp8.init_state)")
    for op, shape in want.items():
      got = tuple(np.shape(getattr(st, op).amax_history))
      if got != shape:
        raise ValueError(
            f"fp8 state[{k!r}].{op}.amax_history has shape {got}; accepted: {shape} "
            "(the recipe's amax_history_len for delayed scaling, else 1)")


def prepare(env, jaxpr, config, stateful: bool, state: Any, check_state: bool = True
            ) -> tuple[Fp8Run, list[Decision]]:
  """The Fp8Run for evaluating `jaxpr` under `config`; a stateful run's `state` is checked
  against the sites chosen (unless `check_state` is False: choosing sites only)."""
  from precision.fp8._dot import Fp8Spec  # pylint: disable=g-import-not-at-top
  spec = Fp8Spec.from_config(config)
  decisions = decide(env, find_sites(env, jaxpr), config, stateful)
  selected = {d.site.path: d.site.key for d in decisions if d.fp8}
  if stateful and check_state:
    _check_state(state, list(selected.values()), spec)
  return Fp8Run(spec, selected, state if stateful else None), decisions


def dot(env, eqn, invals, path: tuple):
  """The fp8 GEMM of a selected site: `fp8_dot_general` on the operands as they arrive
  (any float dtype: the quantisation divides in f32), the result in the compute dtype (or
  the wider accumulator the traced program asked for, as the policy GEMM)."""
  from precision.fp8._dot import fp8_dot_general  # pylint: disable=g-import-not-at-top
  run: Fp8Run = env.fp8
  key = run.selected[path]
  lt, rt = (np.dtype(v.aval.dtype) for v in eqn.invars[:2])
  pref = eqn.params.get("preferred_element_type")
  explicit = pref is not None and np.dtype(pref).itemsize > max(lt.itemsize, rt.itemsize)
  out_dtype = np.dtype(pref) if explicit else np.dtype(env.policy.compute_dtype)
  state = run.spec.init_state() if run.state_in is None else run.state_in[key]
  out, new = fp8_dot_general(invals[0], invals[1], eqn.params["dimension_numbers"], state,
                             run.spec, out_dtype=out_dtype)
  if run.state_in is not None:  # stateless runs keep no record (sites may sit in loops)
    run.state_out[key] = new
  return out


def init_states(config, decisions: list[Decision]) -> dict:
  """Fresh state (zero histories, unit scales, zero counters) for every fp8 site."""
  from precision.fp8._dot import Fp8Spec  # pylint: disable=g-import-not-at-top
  spec = Fp8Spec.from_config(config)
  return {d.site.key: spec.init_state() for d in decisions if d.fp8}
