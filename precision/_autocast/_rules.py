"""What autocast does with each JAX primitive: the tables and the per-op decisions.

Every equation of the traced program falls in one class:

| class            | primitives                                   | under the policy                       |
|------------------|----------------------------------------------|----------------------------------------|
| GEMM             | dot_general, conv_general_dilated,           | operands in the compute dtype, f32     |
|                  | ragged_dot_general (grouped / MoE GEMMs)     | accumulation forward AND backward      |
|                  |                                              | (precision.flax's custom-VJP GEMMs),   |
|                  |                                              | result in the compute dtype            |
| f32 op           | the primitives of the recipe's fp32_ops      | operands below f32 upcast, computed    |
|                  | (exp, log, reduce_sum, rsqrt, ...)           | and returned in f32                    |
| promoting        | add, mul, max, select_n, concatenate, ...    | float operands of mixed dtypes go to   |
|                  |                                              | the wider one (weak-typed scalars      |
|                  |                                              | follow the others)                     |
| dtype-polymorphic| reshape, transpose, gather, neg, reduce_max  | run in whatever dtype arrives          |
|                  | (outside fp32_ops), convert_element_type     | (explicit casts are kept)              |
| as written       | custom_vjp calls, Pallas kernels, shard_map, | operands cast back to their traced     |
|                  | fp8 and integer GEMMs, anything unknown      | dtypes and the op bound unchanged      |

With the "router" f32 op, an MoE router's GEMM (its result reaches a top_k / argmax that
dispatches tokens: _router) runs f32 x f32 -> f32 instead, unless an override governs it.

Control flow (jit, scan, while, cond, remat, custom_jvp) is recursed into; loop carries
and branch results keep their traced dtypes.

In a scope whose policy computes in f32 or wider (`as_written`) the GEMM and f32-op rows
do not apply: every op is bound as traced, so the code's own lower-precision choices
stand and the `fp32` recipe is the identity.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision import _gemm
from precision._dtypes import below_f32, is_float

_F32 = np.dtype(np.float32)

GEMMS = frozenset(("dot_general", "conv_general_dilated", "ragged_dot_general"))

# Operand positions whose float dtypes must agree; None: every operand.
PROMOTING: dict[str, tuple[int, ...] | None] = {
    **{p: None for p in (
        "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "nextafter",
        "eq", "ne", "lt", "le", "gt", "ge", "add_any", "clamp", "concatenate", "and", "or",
        "xor")},
    "select_n": None,          # the predicate is bool/int and is never cast
    "pad": (0, 1),
    "dynamic_update_slice": (0, 1),
    "scatter": (0, 2), "scatter-add": (0, 2), "scatter_add": (0, 2), "scatter-mul": (0, 2),
    "scatter_mul": (0, 2), "scatter-min": (0, 2), "scatter_min": (0, 2),
    "scatter-max": (0, 2), "scatter_max": (0, 2),
}

# Differentiable elementwise ops among them that repeat a size-1 (or scalar) operand over
# the others' shape: their transpose sums the cotangent over the repeated elements.
BROADCASTING = frozenset(("add", "sub", "mul", "div", "max", "min", "pow", "atan2",
                          "add_any"))

# Ops that take any float dtype (per operand) and return it: bound with what arrives.
POLYMORPHIC = frozenset((
    "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "not", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh",
    "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "integer_pow", "square", "reciprocal", "reduce_sum", "reduce_max",
    "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin", "cumsum",
    "cumprod", "cummax", "cummin", "cumlogsumexp", "reshape", "transpose", "broadcast_in_dim",
    "squeeze", "expand_dims", "rev", "slice", "dynamic_slice", "gather", "copy", "copy_p",
    "stop_gradient", "sharding_constraint", "reshard", "mesh_cast", "pvary",
    "convert_element_type", "reduce_precision", "sort", "top_k", "split", "real", "imag",
    "optimization_barrier", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "device_put", "name", "psum", "pmax", "pmin", "all_gather", "reduce_scatter",
))

# Recursed into by the interpreter (see _interpret).
CONTAINERS = frozenset(("jit", "pjit", "closed_call", "core_call", "scan", "while", "cond",
                        "remat2", "checkpoint", "custom_jvp_call"))

_WRAPPERS = re.compile(r"\b(?:transpose|jvp|vmap|remat|checkpoint|pjit|jit|vjp)\(")


def scope_of(name_stack: str) -> tuple[str, bool]:
  """(module/scope path with transform wrappers removed, is-backward) of a name stack
  string such as "blocks/0/transpose(jvp(mlp))"."""
  return _WRAPPERS.sub("", name_stack).replace(")", ""), "transpose(" in name_stack


def as_dtype(d: Any):
  """np.dtype(d), or d itself for JAX's extended dtypes (PRNG keys)."""
  try:
    return np.dtype(d)
  except TypeError:
    return d


def dtype_of(x: Any):
  return as_dtype(x.dtype)


def is_fp8(dtype: Any) -> bool:
  return is_float(dtype) and np.dtype(dtype).itemsize == 1


def cast(x, dtype: np.dtype):
  """x in `dtype` (a no-op when it already is); numpy constants stay numpy."""
  if dtype_of(x) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x, dtype)
  return jax.lax.convert_element_type(x, dtype)


class GemmPlan(NamedTuple):
  """compute: the GEMM's operand dtype; out: its result dtype; backward: the operand
  dtype of its two gradient GEMMs."""
  compute: np.dtype
  out: np.dtype
  backward: np.dtype


def as_written(compute: np.dtype) -> bool:
  """Whether a scope whose policy computes in `compute` runs every op as written: a
  compute dtype of f32 or wider asks for no lower precision, so nothing the code chose
  (its own bf16 casts around an attention, a GEMM's precision, lower-precision params it
  multiplies without promotion) is changed; operands are only brought back to the dtypes
  they were traced with (a value a bf16 scope handed to an f32 override scope)."""
  return np.dtype(compute).itemsize >= 4


def _states_its_numerics(eqn, lt: np.dtype, rt: np.dtype) -> bool:
  """A GEMM that asked for its result in a wider dtype than the policy would give it:
  `preferred_element_type` wider than its operands (bf16 x bf16 -> f32), or f32 operands
  with precision HIGHEST or an explicit dot algorithm (the code asked for f32 accuracy).
  jnp writes `preferred_element_type` = the operand dtype on every f32 GEMM, so on f32
  operands only `precision` tells an explicit request apart."""
  pref = eqn.params.get("preferred_element_type")
  if pref is not None and np.dtype(pref).itemsize > max(lt.itemsize, rt.itemsize):
    return True
  if min(lt.itemsize, rt.itemsize) < 4:
    return False
  precision = eqn.params.get("precision")
  values = precision if isinstance(precision, (tuple, list)) else (precision,)
  if any(v == jax.lax.Precision.HIGHEST for v in values):
    return True
  return any(isinstance(v, (jax.lax.DotAlgorithm, jax.lax.DotAlgorithmPreset))
             and v != jax.lax.DotAlgorithmPreset.DEFAULT for v in values)


def gemm_plan(eqn, lhs_dtype: np.dtype, rhs_dtype: np.dtype, compute: np.dtype,
              backward: bool, backward_compute: np.dtype | None = None) -> GemmPlan | None:
  """How a traced GEMM runs under a policy with `compute` dtype, given the dtypes its
  operands arrive in; None: bind it as written, its operands cast back to their traced
  dtypes (non-float or fp8 operands, or an f32-or-wider compute dtype: `as_written`).

  The result dtype is the compute dtype, except for a GEMM that asked for a wider result
  (`_states_its_numerics`: `preferred_element_type=f32` on bf16 operands, precision
  HIGHEST on f32 operands; it keeps its traced result dtype) and for GEMMs of a
  differentiated program's backward pass (gradients keep their traced dtype, e.g. f32
  for f32 params).

  `backward_compute` (default `compute`) is the operand dtype of the GEMM's gradient
  GEMMs (a direction-specific override). With an f32-or-wider `compute` and a narrower
  `backward_compute` the forward runs as written (traced result dtype) and only its
  gradient GEMMs are narrow; with both f32 or wider the GEMM is bound as written.
  """
  backward_compute = compute if backward_compute is None else np.dtype(backward_compute)
  lt, rt = (np.dtype(v.aval.dtype) for v in eqn.invars[:2])
  traced_out = np.dtype(eqn.outvars[0].aval.dtype)
  if not all(is_float(d) for d in (lt, rt, lhs_dtype, rhs_dtype)):
    return None
  if any(is_fp8(d) for d in (lt, rt, lhs_dtype, rhs_dtype)):
    return None  # an fp8 GEMM (precision.fp8) already scaled its operands
  if eqn.params.get("group_offset") is not None:
    return None  # a sharded grouped GEMM's offset: JAX has no transpose for it
  if as_written(compute) and as_written(backward_compute):
    return None
  keep = backward or as_written(compute) or _states_its_numerics(eqn, lt, rt)
  return GemmPlan(compute, traced_out if keep else compute, backward_compute)


def f32_plan(in_dtypes) -> bool:
  """An f32 op runs upcast when some float operand arrives below f32."""
  return any(below_f32(d) for d in in_dtypes)


def promoted(eqn, in_dtypes: list[np.dtype]) -> np.dtype | None:
  """The common float dtype of a promoting op's operand group (None: no float operand)."""
  positions = PROMOTING[eqn.primitive.name]
  idx = range(len(in_dtypes)) if positions is None else positions
  idx = [i for i in idx if i < len(in_dtypes) and is_float(in_dtypes[i])]
  if not idx:
    return None
  # Scalar literals (Python numbers in the traced code: `x * 2.0`, `var + eps`) follow the
  # other operands, as weakly typed values would: the jaxpr has already resolved them to
  # the traced dtype, so their own dtype says nothing about the user's intent.
  strong = [in_dtypes[i] for i in idx
            if not getattr(eqn.invars[i].aval, "weak_type", False)
            and not isinstance(eqn.invars[i], jax.extend.core.Literal)]
  return _gemm.wider_float(*(strong or [in_dtypes[i] for i in idx]))


def promote_operands(eqn, invals: list) -> list:
  """invals with the promoting op's float operand group cast to its common dtype."""
  dts = [dtype_of(v) for v in invals]
  target = promoted(eqn, dts)
  if target is None:
    return invals
  positions = PROMOTING[eqn.primitive.name]
  idx = set(range(len(invals)) if positions is None else positions)
  return [cast(v, target) if i in idx and is_float(dts[i]) else v
          for i, v in enumerate(invals)]
