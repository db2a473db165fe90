"""fp8 GEMMs for Flax Linen: a dot_general module keeping its state in two collections.

``"fp8_state"`` holds the forward operands' state; apply with ``mutable=["fp8_state"]``
to carry its update out of the step. ``"fp8_grad_state"`` holds the gradient operand's
state, which (as in Flax's fp8_ops) is updated through its cotangent: differentiate with
respect to that collection too and store the result with `precision.fp8.merge_grad_state`.

A module called several times in one `apply` (a shared layer: tied weights, an unrolled
recurrence) passes its gradient-state token from each call to the next, so the stored
state is that of one use of the concatenated gradient operand (amax and scale combined
by max, counts summed), as in `precision.fp8.fp8_dot_general`. Several `apply` calls in
one differentiated function (micro-batches applied one by one) must pass the token on
themselves: apply with ``mutable=[STATE_COLLECTION, GRAD_COLLECTION]`` and give each
apply the collections the previous one returned; applies that all read the same
``fp8_grad_state`` have their gradient states added by autodiff.

Examples:
  >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, precision as mp
  >>> dense = nn.Dense(4, dot_general_cls=functools.partial(
  ...     mp.fp8.LinenFp8DotGeneral, config=mp.Fp8Config(scaling="delayed")))
  >>> variables = dense.init(jax.random.key(0), jnp.ones((2, 8)))
  >>> sorted(variables)
  ['fp8_grad_state', 'fp8_state', 'params']
"""

from __future__ import annotations

import weakref
from typing import Any

import flax.linen as nn
from jax.extend import core as jex_core

from precision._recipe import Fp8Config
from precision.fp8 import _scaling as sc
from precision.fp8._dot import OPERANDS, Fp8DotState, Fp8Spec, fp8_dot_general

STATE_COLLECTION = "fp8_state"
GRAD_COLLECTION = "fp8_grad_state"

# Root scope of an `apply` -> {module path: (trace state, the gradient-state token its
# last call passed on)}. The next call of a shared module in the same apply, and the same
# trace, reads the token from here (the collection need not be mutable); the entries go
# away with the apply's scope. The trace state keeps a token from one trace (a jit, a
# scan body) out of another, e.g. for a bound module called under two jits.
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LinenFp8DotGeneral(nn.Module):
  """`lax.dot_general`-compatible fp8 GEMM for Linen (``nn.Dense(dot_general_cls=...)``).

  Attributes:
    config: the fp8 settings.
    compute_dtype: output dtype (default: the lhs dtype); `preferred_element_type` wins.
    scaling: per-operand override of config.scaling (see `Fp8Spec.from_config`).
  """

  config: Fp8Config = Fp8Config()
  compute_dtype: Any = None
  scaling: Any = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               **unused_kwargs):
    del precision, unused_kwargs  # fp8 operands, f32 accumulation: nothing to choose
    spec = Fp8Spec.from_config(self.config, self.scaling)
    init = spec.init_state()
    variables = {}
    for op in OPERANDS:
      col = GRAD_COLLECTION if op == "grad" else STATE_COLLECTION
      variables[op] = [self.variable(col, f"{op}_{field}", lambda v=v: v)
                       for field, v in zip(sc.OperandState._fields, getattr(init, op))]
    state = Fp8DotState(*(sc.OperandState(*(v.value for v in variables[op])) for op in OPERANDS))
    tokens = _TOKENS.setdefault(self.scope.root, {})
    path = tuple(self.scope.path)
    trace = jex_core.get_opaque_trace_state(convention="flax")
    if path in tokens and tokens[path][0] == trace:
      state = state._replace(grad=tokens[path][1])  # a later call: continue the chain
    out, new = fp8_dot_general(lhs, rhs, dimension_numbers, state, spec,
                               out_dtype=preferred_element_type or self.compute_dtype)
    tokens[path] = (trace, new.grad)
    if self.is_mutable_collection(STATE_COLLECTION) and not self.is_initializing():
      for op in ("lhs", "rhs"):
        for var, value in zip(variables[op], getattr(new, op)):
          var.value = value
    if self.is_mutable_collection(GRAD_COLLECTION) and not self.is_initializing():
      # The token (same values), for a caller that threads the collection from one apply
      # to the next (micro-batches applied separately in one differentiated function).
      for var, value in zip(variables["grad"], new.grad):
        var.value = value
    return out
