"""Which GEMMs of a traced program are MoE routers: the `router` f32 op.

A router GEMM is a GEMM whose result reaches a routing decision - a `top_k` or an
`argmax`/`argmin` whose indices dispatch tokens (reach a GEMM operand, a gather or scatter
index, a sort or a dynamic slice: Mixtral's argsort and bincount into ragged_dot's group
sizes, Switch's one-hot dispatch einsum) - through ops that do not mix values across a
GEMM: dtype-polymorphic, promoting and f32 ops (softmax, a bias, a noise term, a
temperature). An argmax of an LM head's logits for an accuracy metric dispatches nothing
and leaves the head alone.

Why f32 (Megatron's `moe_router_dtype="fp32"`, DeepSeek-V3 keeping its gating in
f32, MaxText's f32 gate logits): a router's logits rounded to bf16 tie where f32's differ
(8 significant bits), and top-k then picks by index, not by value - a routing decision
that differs from fp32's, with no error to show for it. The router GEMM is tiny (E
columns), so f32 costs nothing measurable.

`router_gemms(jaxpr)` returns the interpreter paths of those GEMMs (the numbering of
`_interpret.eval_jaxpr`: equation indices, each container's followed by its sub-jaxpr's
index), found through jit/pjit, remat and scan/while/cond bodies.

A program that holds its own backward pass (``autocast(jax.grad(f), ...)``) has the
router's gradient GEMMs as plain dot_generals of its own; they are routers too, so that
they run f32 as those of ``jax.grad(autocast(f, ...))`` do (JAX's transpose of the f32
router GEMM). They are found by what JAX's transpose gives them: the forward GEMM's
traceback (the Python stack it was traced at; JAX binds a GEMM's gradient GEMMs under it)
and its shapes (the cotangent, of the forward result's shape, against one of the forward
operands), in a backward name stack ("transpose(") - in whatever container JAX put them
(a scan over layers' backward scan, a remat's recomputation). A program with backward
GEMMs whose router GEMM has no traceback to match them by is refused, naming the
composition that gives f32 router gradients.
"""

from __future__ import annotations

import os

import jax

from precision._autocast import _fp8
from precision._autocast import _rules as R

# The routing decisions.
DECISIONS = frozenset(("top_k", "argmax", "argmin"))
# Ops whose index operands dispatch rows.
_DISPATCH = R.GEMMS | frozenset((
    "gather", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
    "scatter-min", "scatter_min", "scatter-max", "scatter_max", "sort", "dynamic_slice",
    "dynamic_update_slice"))
# Ops a logit passes through on its way from the router GEMM to the decision.
_PASS = R.POLYMORPHIC | frozenset(R.PROMOTING)


def _subs(eqn) -> list:
  """(sub-jaxpr, path index, the eqn's invars its invars take, whether its outvars are
  the eqn's outvars) for each sub-jaxpr of a container: the interpreter's numbering
  (`_fp8.sub_jaxprs`), a platform-dependent cond's branches included (values flow through
  them), a while's cond the one body whose outputs are not the loop's."""
  return [(sub, k, _fp8.sub_operands(eqn, k, eqn.invars), not (kind == "while" and k == 0))
          for k, sub, kind in _fp8.sub_jaxprs(eqn, platform_branches=True)]


def _is_var(v) -> bool:
  return not isinstance(v, jax.extend.core.Literal)


def _float_vars(vs) -> list:
  return [v for v in vs if _is_var(v) and R.is_float(getattr(v.aval, "dtype", None))]


def _jaxpr(j):
  return getattr(j, "jaxpr", j)


def _dispatches(jaxpr, start) -> bool:
  """Whether the values `start` (variables of `jaxpr`) reach a dispatching op."""
  tainted = set(start)
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if _is_var(v)]
    if not any(v in tainted for v in ins):
      continue
    if eqn.primitive.name in _DISPATCH or _subs(eqn):
      return True
    tainted.update(eqn.outvars)
  return False


def _has_gemm(jaxpr) -> bool:
  """Whether `jaxpr` holds a GEMM, in any sub-jaxpr too (`_fp8.has_gemm` per equation)."""
  memo: dict = {}
  return any(_fp8.has_gemm(eqn, memo) for eqn in _jaxpr(jaxpr).eqns)


def _walk(jaxpr, path: tuple, needed_outs: set, found: dict) -> set:
  """Adds to `found` the router GEMMs of `jaxpr` (path -> equation); returns the indices of its
  invars whose values reach a routing decision (of its own, or through the outputs
  `needed_outs` of the enclosing program)."""
  jaxpr = _jaxpr(jaxpr)
  needed = {v for i, v in enumerate(jaxpr.outvars) if i in needed_outs}
  for i in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[i]
    name = eqn.primitive.name
    outs_needed = [k for k, v in enumerate(eqn.outvars) if v in needed]
    if name in DECISIONS:
      if _dispatches(jaxpr, eqn.outvars[-1:]) or outs_needed:
        needed.update(_float_vars(eqn.invars))
      continue
    subs = _subs(eqn)
    if subs:
      for sub, k, operands, maps_outs in subs:
        ins = _walk(sub, path + (i, k), set(outs_needed) if maps_outs else set(), found)
        needed.update(_float_vars(operands[n] for n in ins))
      continue
    if not outs_needed:
      continue
    if name in R.GEMMS:
      found[path + (i,)] = eqn
    elif name in _PASS or (name == "custom_jvp_call"
                           and not _has_gemm(eqn.params["call_jaxpr"])):
      # A custom_jvp (jax.nn.softmax, relu) without a GEMM inside passes its logits on.
      needed.update(_float_vars(eqn.invars))
  return {n for n, v in enumerate(jaxpr.invars) if v in needed}


_JAX_DIRS = tuple(os.sep + d + os.sep for d in ("jax", "jaxlib"))


def _frames(eqn) -> tuple | None:
  """(file, line, function) of the frames `eqn` was traced at outside JAX's own code
  (which differs between a GEMM and the gradient GEMMs JAX binds under its traceback);
  None when the equation has no traceback."""
  tb = eqn.source_info.traceback
  if tb is None:
    return None
  return tuple((f.file_name, f.line_num, f.function_name) for f in tb.frames
               if not any(d in f.file_name for d in _JAX_DIRS))


def _shape(v) -> tuple:
  return tuple(getattr(v.aval, "shape", ()))


def _gradient_shapes(eqn) -> set:
  """The operand shapes (sorted pair) of the gradient GEMMs JAX's transpose gives a
  forward GEMM: the cotangent (of the result's shape) against one forward operand."""
  out = _shape(eqn.outvars[0])
  return {tuple(sorted((out, _shape(v)))) for v in eqn.invars[:2]}


def _gemms(jaxpr, path: tuple, prefix: str):
  """(path, equation, is-backward) of every dot_general of `jaxpr`, its containers'
  bodies included (the interpreter's paths; name stacks joined as it joins them)."""
  for i, eqn in enumerate(_jaxpr(jaxpr).eqns):
    raw = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
    if eqn.primitive.name == "dot_general":
      yield path + (i,), eqn, R.scope_of(raw)[1]
    for sub, k, _, _ in _subs(eqn):
      yield from _gemms(sub, path + (i, k), raw)


def _backward_of(jaxpr, routers: dict) -> set:
  """The paths of the router GEMMs' gradient GEMMs in `jaxpr` (see the module
  docstring)."""
  backward = [(p, e) for p, e, bwd in _gemms(jaxpr, (), "") if bwd and p not in routers]
  if not backward or not routers:
    return set()
  want: dict = {}
  for eqn in routers.values():
    frames = _frames(eqn)
    if not frames:
      raise ValueError(
          "autocast with the 'router' f32 op on a function that takes its own gradient: "
          "its router GEMM has no traceback to find its gradient GEMMs by, which would run "
          "in the compute dtype; differentiate the autocast function instead: "
          "jax.grad(precision.autocast(f, recipe, fp32_ops=...)), not "
          "precision.autocast(jax.grad(f), ...)")
    want.setdefault(frames, set()).update(_gradient_shapes(eqn))
  return {p for p, e in backward
          if tuple(sorted(_shape(v) for v in e.invars[:2])) in want.get(_frames(e), ())}


def router_gemms(jaxpr) -> frozenset:
  """The interpreter paths of the router GEMMs of `jaxpr` and of their gradient GEMMs
  where `jaxpr` holds its own backward pass (see the module docstring)."""
  found: dict = {}
  _walk(jaxpr, (), set(), found)
  return frozenset(found) | frozenset(_backward_of(jaxpr, found))
