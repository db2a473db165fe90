"""Walks a jaxpr (into pjit, custom_vjp/jvp, scan, while, cond, remat, shard_map) and
records the precision of every GEMM, reduction, transcendental and convert."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jex_core

from precision._policy import dtype_name

GEMM_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")
# Reductions that add (or multiply) many terms: rounding error grows with their length.
ACCUMULATING = ("reduce_sum", "reduce_prod", "reduce", "cumsum", "cumprod", "cumlogsumexp",
                "psum", "scatter-add", "scatter_add")
# Reductions that select a value: exact in any dtype, reported but never a violation.
SELECTING = ("reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin", "pmax",
             "pmin", "reduce_and", "reduce_or")
TRANSCENDENTAL = ("exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh", "pow", "rsqrt",
                  "sqrt", "erf", "sin", "cos")

_PKG_DIRS = tuple(os.sep + d + os.sep for d in ("jax", "jaxlib", "flax", "optax"))
_PRECISION_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WRAPPERS = re.compile(r"\b(?:transpose|jvp|vmap|remat|checkpoint|pjit|jit|vjp)\(")


class GemmRecord(NamedTuple):
  """One GEMM (dot_general, convolution or grouped GEMM) of the traced function.

  A grouped GEMM (`lax.ragged_dot` / `ragged_dot_general`: an MoE layer's experts) is one
  record for all its groups: the group sizes are runtime values, the group count is not.
  `groups` is that count, `ragged` says which dimension the groups split ("rows": a
  non-contracting one, one weight per group: the forward GEMM and JAX's dlhs; "contraction":
  the contracting one, one result per group: JAX's drhs), and `role` names it.
  """
  primitive: str        # "dot_general" | "conv_general_dilated" | ...
  lhs_dtype: str
  rhs_dtype: str
  acc_dtype: str        # preferred_element_type (the output dtype when unset)
  out_dtype: str
  flops: int            # 2 * MACs, times `count`
  count: int            # executions per call (scan trip counts)
  shape: str            # "bf16[8,32] x bf16[32,96] -> f32[8,96]"
  scope: str            # name stack with transform wrappers removed ("blocks/0/qkv")
  direction: str        # "fwd" | "bwd"
  location: str         # user source "file.py:123 (function)"
  op: str               # enclosing precision.ops / flax / jax.nn function, or ""
  groups: int = 0       # a grouped GEMM's group (expert) count; 0 for the others
  ragged: str = ""      # grouped GEMMs: "rows" | "contraction" | "batch" (see above)

  @property
  def is_fp8(self) -> bool:
    return self.lhs_dtype.startswith("float8") or self.rhs_dtype.startswith("float8")

  @property
  def role(self) -> str:
    """A grouped GEMM's part in the MoE layer's step: "fwd" (a forward one), "dlhs" (a
    backward one whose groups split its rows: the gradient of the tokens), "drhs" (a
    backward one whose groups split the contraction: the per-expert weight gradients);
    "" for a GEMM that is not grouped."""
    if not self.groups:
      return ""
    if self.direction == "fwd":
      return "fwd"
    return "drhs" if self.ragged == "contraction" else "dlhs"

  @property
  def grouped(self) -> str:
    """"4 groups, drhs" for a grouped GEMM (what the table and `check` print), else ""."""
    return f"{self.groups} groups, {self.role}" if self.groups else ""


class OpRecord(NamedTuple):
  """A reduction or transcendental op."""
  primitive: str
  kind: str             # "accumulating" | "selecting" | "transcendental"
  dtype: str            # dtype the op computes in (its input)
  count: int
  scope: str
  direction: str
  location: str
  op: str


class ConvertRecord(NamedTuple):
  from_dtype: str
  to_dtype: str
  nbytes: int
  count: int
  scope: str
  direction: str
  location: str
  op: str


def _frames(eqn):
  tb = eqn.source_info.traceback
  return [] if tb is None else list(tb.frames)


def _is_library(path: str) -> bool:
  return any(d in path for d in _PKG_DIRS) or path.startswith(_PRECISION_DIR)


def _location(frames) -> str:
  """The innermost user frame; JAX keeps only the innermost ~10 frames of a traceback, so
  for deeply nested calls fall back to the innermost frame outside jax/jaxlib."""
  fmt = lambda f: f"{os.path.basename(f.file_name)}:{f.line_num} ({f.function_name})"
  for f in frames:  # innermost first
    if not _is_library(f.file_name) and "/contextlib.py" not in f.file_name:
      return fmt(f)
  for f in frames:
    if not any(d in f.file_name for d in _PKG_DIRS[:2]):
      return fmt(f)
  return ""


def _op_name(frames) -> str:
  """The precision.ops function, flax norm layer or jax.nn function an op comes from
  (preferred in that order: an ops.softmax calls jax.nn.softmax)."""
  ops_file = os.path.join(_PRECISION_DIR, "ops.py")
  for f in frames:
    if f.file_name == ops_file:
      return f.function_name
  for f in frames:
    if os.sep + "flax" + os.sep in f.file_name and "normalization" in f.file_name:
      return "norm"
  for f in frames:
    if os.sep + "jax" + os.sep in f.file_name and f.file_name.endswith(
        os.path.join("nn", "functions.py")):
      return f.function_name.lstrip("_").replace("_deprecated", "")
  return ""


def _scope(eqn, outer: str = "") -> tuple[str, str]:
  # Name stacks inside sub-jaxprs are relative to the enclosing equation's.
  own = str(eqn.source_info.name_stack)
  stack = "/".join(s for s in (outer, own) if s)
  direction = "bwd" if "transpose(" in stack else "fwd"
  return _WRAPPERS.sub("", stack).replace(")", ""), direction


def _dtype(aval) -> str:
  return np.dtype(aval.dtype).name


def _short(aval) -> str:
  try:
    name = dtype_name(aval.dtype)
  except (ValueError, KeyError):
    name = np.dtype(aval.dtype).name
  return f"{name}[{','.join(str(d) for d in aval.shape)}]"


def _gemm_flops(eqn) -> int:
  out = eqn.outvars[0].aval
  if eqn.primitive.name == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = int(np.prod([lhs.shape[i] for i in lc])) if lc else 1
    return 2 * int(np.prod(out.shape)) * k
  if eqn.primitive.name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
    return 2 * int(np.prod(out.shape)) * int(np.prod(rhs.shape)) // rhs.shape[out_feature_dim]
  if eqn.primitive.name == "ragged_dot_general":
    # Every row of the ragged dimension belongs to one group, so a grouped GEMM costs what
    # one group's dense GEMM over all rows costs (rows past sum(group_sizes) included: the
    # static bound). Groups splitting the contraction give one result per group: the
    # result counts each output element once per group, the products once.
    rn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), _ = rn.dot_dimension_numbers
    lhs = eqn.invars[0].aval
    k = int(np.prod([lhs.shape[i] for i in lc])) if lc else 1
    per_group = _ragged_kind(eqn) == "contraction"
    return 2 * int(np.prod(out.shape)) * k // (_groups(eqn) if per_group else 1)
  return 0


def _groups(eqn) -> int:
  """The group count of a ragged_dot_general (group_sizes' last dimension)."""
  return int(eqn.invars[2].aval.shape[-1])


def _ragged_kind(eqn) -> str:
  """Which dimension of lhs a ragged_dot_general's groups split: "rows" (a free one),
  "contraction" or "batch"."""
  rn = eqn.params["ragged_dot_dimension_numbers"]
  (lc, _), (lb, _) = rn.dot_dimension_numbers
  dim = rn.lhs_ragged_dimensions[0]
  return "contraction" if dim in lc else "batch" if dim in lb else "rows"


def _subjaxprs(eqn):
  """(jaxpr, multiplicity) pairs for every sub-jaxpr in the equation's params."""
  mult = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
  out = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, jex_core.ClosedJaxpr):
        out.append((v.jaxpr, mult))
      elif isinstance(v, jex_core.Jaxpr):
        out.append((v, mult))
  return out


class OpaqueRecord(NamedTuple):
  """A kernel the jaxpr cannot see the numerics of as ordinary ops (a Pallas call): its
  operands and results as they reach it. autocast runs it as written (operands in the
  dtypes it was traced with); the ops inside its body are walked as written too."""
  primitive: str        # "pallas_call", ...
  name: str             # the kernel's name when the primitive records one, else ""
  operands: str         # "f32[8,8], bf16[8]"
  results: str
  count: int
  scope: str
  direction: str
  location: str


# Primitives whose body is a kernel, not a program of JAX ops the policy governs.
OPAQUE_PRIMITIVES = ("pallas_call", "triton_kernel_call", "mosaic_gpu_call")


class Walk(NamedTuple):
  gemms: list
  ops: list
  converts: list
  bytes_by_dtype: dict
  has_while: bool
  opaque: list


def walk(jaxpr, mult: int = 1, acc: Walk | None = None, outer: str = "") -> Walk:
  """Records every equation of `jaxpr` and of its sub-jaxprs, recursively."""
  acc = acc or Walk([], [], [], {}, False, [])
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in OPAQUE_PRIMITIVES:
      scope, direction = _scope(eqn, outer)
      kernel = eqn.params.get("name_and_src_info", eqn.params.get("name")) or ""
      acc.opaque.append(OpaqueRecord(
          name, str(getattr(kernel, "name", kernel) or ""),
          ", ".join(_short(v.aval) for v in eqn.invars if hasattr(v.aval, "dtype")),
          ", ".join(_short(v.aval) for v in eqn.outvars if hasattr(v.aval, "dtype")),
          mult, scope, direction, _location(_frames(eqn))))
    # A generic `reduce` (lax.reduce with a non-standard init) holds its combiner as a
    # jaxpr: record it as an accumulating reduction instead of walking the combiner.
    subs = [] if name == "reduce" else _subjaxprs(eqn)
    if name == "cond" and eqn.params.get("branches_platforms"):
      # lax.platform_dependent: report the accelerator (default) branch only; the CPU
      # branch of the policy GEMMs is the f32-upcast equivalent (see flax/_gemm.py).
      default = [i for i, p in enumerate(eqn.params["branches_platforms"]) if p is None]
      if default:
        subs = [(eqn.params["branches"][default[0]].jaxpr, 1)]
    if subs:
      if name == "while":
        acc = acc._replace(has_while=True)
      # A custom_vjp/custom_jvp call holds its primal body; count it once.
      for sub, m in subs:
        if name in ("custom_vjp_call", "custom_jvp_call") and sub is not subs[0][0]:
          continue
        acc = walk(sub, mult * m, acc, "/".join(
            s for s in (outer, str(eqn.source_info.name_stack)) if s))
      continue
    for v in eqn.outvars:
      aval = getattr(v, "aval", None)
      if aval is not None and hasattr(aval, "dtype") and hasattr(aval, "shape"):
        try:
          key = np.dtype(aval.dtype).name
        except TypeError:
          continue
        acc.bytes_by_dtype[key] = (acc.bytes_by_dtype.get(key, 0)
                                   + int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize)
    if name not in GEMM_PRIMITIVES + ACCUMULATING + SELECTING + TRANSCENDENTAL + (
        "convert_element_type",):
      continue
    frames = _frames(eqn)
    scope, direction = _scope(eqn, outer)
    loc, op = _location(frames), _op_name(frames)
    if name in GEMM_PRIMITIVES:
      lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
      out = eqn.outvars[0].aval
      pref = eqn.params.get("preferred_element_type")
      acc_dtype = np.dtype(pref).name if pref is not None else _dtype(out)
      ragged = name == "ragged_dot_general"
      acc.gemms.append(GemmRecord(
          name, _dtype(lhs), _dtype(rhs), acc_dtype, _dtype(out), _gemm_flops(eqn) * mult,
          mult, f"{_short(lhs)} x {_short(rhs)} -> {_short(out)}", scope, direction, loc, op,
          _groups(eqn) if ragged else 0, _ragged_kind(eqn) if ragged else ""))
    elif name == "convert_element_type":
      src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
      if not (hasattr(src, "dtype") and hasattr(dst, "dtype")) or src.dtype == dst.dtype:
        continue
      nbytes = int(np.prod(dst.shape)) * np.dtype(dst.dtype).itemsize
      acc.converts.append(ConvertRecord(_dtype(src), _dtype(dst), nbytes, mult, scope,
                                        direction, loc, op))
    else:
      kind = ("accumulating" if name in ACCUMULATING else
              "selecting" if name in SELECTING else "transcendental")
      src = eqn.invars[0].aval if name not in ("scatter-add", "scatter_add") else eqn.invars[-1].aval
      acc.ops.append(OpRecord(name, kind, _dtype(src), mult, scope, direction, loc, op))
  return acc


def trace(fn, *args, **kwargs):
  """The closed jaxpr of fn(*args, **kwargs) (fn may already be jitted)."""
  return jax.make_jaxpr(fn)(*args, **kwargs)
