"""f32 regions recomputed in the backward pass instead of saved.

Between two GEMMs a model runs "glue": norms, softmax, activations, residual adds, RoPE.
Under a bf16 policy the reductions of that glue run in f32, and plain autodiff of it keeps
its f32 intermediates for the backward pass (a norm's f32 input and normalised value, a
softmax's f32 exponentials and probabilities: 4 bytes per element where the bf16 GEMM
output that fed it takes 2). A contiguous run of glue equations holding such an f32
reduction is evaluated inside `jax.checkpoint(..., policy=nothing_saveable)`: the backward
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
# The reductions that make a region worth recomputing (a norm's or softmax's statistics).
_TRIGGERS = frozenset(("reduce_sum", "reduce_max"))
MIN_EQNS = 4


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
  start: int        # first equation index
  stop: int         # one past the last
  inputs: tuple     # Vars read in the region and defined before it
  outputs: tuple    # Vars defined in the region and read after it


def _has_trigger(eqn, fp32_primitives: frozenset) -> bool:
  if eqn.primitive.name in ("jit", "pjit"):
    inner = eqn.params["jaxpr"]
    return any(_has_trigger(e, fp32_primitives) for e in getattr(inner, "jaxpr", inner).eqns)
  return eqn.primitive.name in _TRIGGERS & fp32_primitives


def plan(jaxpr, env, prefix: str, below_f32_at) -> dict[int, Region]:
  """{start index: Region} for the glue runs of `jaxpr` worth recomputing.

  `below_f32_at(eqn)`: whether the policy at the equation's scope computes below f32 (a
  run whose reductions already run in the policy's f32 gains nothing).
  """
  eqns = jaxpr.eqns
  last_use: dict = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, jax.extend.core.Var):
        last_use[v] = i
  for v in jaxpr.outvars:
    if isinstance(v, jax.extend.core.Var):
      last_use[v] = len(eqns)
  regions: dict[int, Region] = {}
  allowed = _GLUE | env.fp32_primitives
  glue = [_is_glue(e, allowed) for e in eqns]
  i = 0
  while i < len(eqns):
    if not glue[i]:
      i += 1
      continue
    j = i
    while j < len(eqns) and glue[j]:
      j += 1
    run = eqns[i:j]
    if j - i >= MIN_EQNS and any(_has_trigger(e, env.fp32_primitives) and below_f32_at(e)
                                 for e in run):
      defined = {v for e in run for v in e.outvars}
      inputs, outputs = [], []
      for e in run:
        for v in e.invars:
          if isinstance(v, jax.extend.core.Var) and v not in defined and v not in inputs:
            inputs.append(v)
      for e in run:
        for v in e.outvars:
          if last_use.get(v, -1) >= j:
            outputs.append(v)
      if outputs:
        regions[i] = Region(i, j, tuple(inputs), tuple(outputs))
    i = j
  return regions
