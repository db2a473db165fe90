"""f32 regions recomputed in the backward pass instead of saved.

Between two GEMMs a model runs "glue": norms, softmax, activations, residual adds, RoPE.
Under a bf16 policy the f32 ops of that glue (reductions, exp/tanh/logistic) run in f32,
and plain autodiff of it keeps its f32 intermediates for the backward pass (a norm's f32
input and normalised value, a softmax's f32 exponentials and probabilities, an
activation's f32 output: 4 bytes per element where the bf16 GEMM output that fed it takes
2). A contiguous run of glue equations holding such an f32 op is evaluated inside
`jax.checkpoint(..., policy=nothing_saveable)`: the backward
pass keeps only the region's inputs (typically a bf16 GEMM output, the residual stream and
the params) and recomputes the region from them, as FlashAttention recomputes its
probabilities. Values and gradients are those of the plain evaluation (the same ops on
the same inputs); the price is one more forward of the glue in the backward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from precision._autocast import _rules as R

# Cheap, side-effect-free ops a region may hold (besides the policy's f32 ops).
_GLUE = frozenset(R.POLYMORPHIC) | frozenset(R.PROMOTING) | frozenset(("iota",))
MIN_EQNS = 2


def _is_glue(eqn, allowed: frozenset) -> bool:
  """A glue equation, or a jit call (jnp.where, jax.nn.silu, ...) made only of glue."""
  name = eqn.primitive.name
  if name in allowed:
    return True
  if name in ("jit", "pjit"):
    inner = eqn.params["jaxpr"]
    return all(_is_glue(e, allowed) for e in getattr(inner, "jaxpr", inner).eqns)
  return False


class Region(NamedTuple):
  members: tuple    # indices of the region's equations, ascending
  at: int           # evaluated just before equation `at` (len(eqns): at the end)
  inputs: tuple     # Vars the region reads and does not define
  outputs: tuple    # Vars the region defines and something outside it reads


def _has_trigger(eqn, fp32_primitives: frozenset) -> bool:
  """An f32 op (a norm's or softmax's reduction, an activation's exp/tanh/logistic): under
  a narrow policy it upcasts, and what follows it runs in f32."""
  if eqn.primitive.name in ("jit", "pjit"):
    inner = eqn.params["jaxpr"]
    return any(_has_trigger(e, fp32_primitives) for e in getattr(inner, "jaxpr", inner).eqns)
  return eqn.primitive.name in fp32_primitives


def _reads(eqn, values: set) -> bool:
  return any(isinstance(v, jax.extend.core.Var) and v in values for v in eqn.invars)


def plan(jaxpr, env, below_f32_at) -> list[Region]:
  """The glue regions of `jaxpr` worth recomputing, in evaluation order.

  A region grows from a glue equation over the following ones: glue joins it; a GEMM or
  other non-glue equation that reads none of the region's values is stepped over (it runs
  first: a GEMM between an MLP's activation and its gating multiply is independent of the
  activation); the first non-glue equation that reads the region closes it, and the
  region is evaluated just before that equation. A region is kept when it holds an f32 op
  (`_has_trigger`) at a scope whose policy computes below f32 (`below_f32_at(eqn)`): its
  reductions already in the policy's f32 gain nothing.
  """
  eqns = jaxpr.eqns
  allowed = _GLUE | env.fp32_primitives
  glue = [_is_glue(e, allowed) for e in eqns]
  outside_reads: dict = {}   # Var -> indices of the equations reading it
  for i, e in enumerate(eqns):
    for v in e.invars:
      if isinstance(v, jax.extend.core.Var):
        outside_reads.setdefault(v, []).append(i)
  final = {v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var)}
  taken: set[int] = set()
  regions: list[Region] = []
  for start in range(len(eqns)):
    if not glue[start] or start in taken:
      continue
    members, defined, at = [start], set(eqns[start].outvars), len(eqns)
    for j in range(start + 1, len(eqns)):
      if glue[j] and j not in taken:
        members.append(j)
        defined.update(eqns[j].outvars)
      elif _reads(eqns[j], defined):
        at = j
        break
    if len(members) < MIN_EQNS or not any(
        _has_trigger(eqns[i], env.fp32_primitives) and below_f32_at(eqns[i]) for i in members):
      continue
    inside = set(members)
    inputs, outputs = [], []
    for i in members:
      for v in eqns[i].invars:
        if isinstance(v, jax.extend.core.Var) and v not in defined and v not in inputs:
          inputs.append(v)
      for v in eqns[i].outvars:
        if v in final or any(r not in inside for r in outside_reads.get(v, ())):
          outputs.append(v)
    if outputs:
      taken.update(members)
      regions.append(Region(tuple(members), at, tuple(inputs), tuple(outputs)))
  return regions
