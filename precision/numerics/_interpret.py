"""A recording evaluator of a jaxpr: runs it op by op and hands every GEMM operand and
result, with the value it was rounded from, to a callback.

Each value carries a little metadata (`_Meta`) alongside it:
  * `pre`: the array it was rounded from, when a convert_element_type narrowed it from a
    wider float (autocast's cast of an f32 activation, weight or cotangent to bf16);
  * `bwd`: produced by an equation of the backward pass (its name stack is under JAX's
    `transpose(...)`) that is not a recomputation of the forward (`rematted_computation`,
    from jax.checkpoint or autocast's recomputed f32 regions): a cotangent or a value
    derived from one. Casts and ops that only move values (transpose, reshape, rev, pad,
    slice, broadcast) keep their input's origin, so a forward residual cast to bf16 or
    flipped (a conv kernel) inside the backward pass stays forward;
  * `pending`: the GEMM whose f32 accumulator this is, until a convert rounds it (its
    "out" row then states that rounding) or the program ends (the accumulator is stored).
Metadata crosses sub-jaxpr boundaries (pjit, closed_call, remat, custom_jvp/vjp, cond,
scan, while) in both directions, so a cast done in a caller is seen by the GEMM inside.
Other higher-order primitives (shard_map, Pallas calls) run whole; when they hold GEMMs
their names are listed in `Recorder.unvisited` (NumericsReport.unvisited).

Equations run eagerly, one at a time, so every value is what its dtype computes (no
excess precision across a fusion). On the CPU backend a GEMM of operands below f32 runs
on the operands upcast to f32 (products of bf16/f16/fp8 values are exact in f32 and the
accumulation is f32 either way; XLA:CPU lacks some bf16 x bf16 -> f32 layouts); a
`lax.platform_dependent` switch (autocast's CPU fallback) runs its default (accelerator)
branch, as precision.audit reports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from precision import _compat
from precision import _dtypes
from precision.audit import _walk
from precision.numerics import _stats

GEMMS = ("dot_general", "conv_general_dilated", "ragged_dot_general")
# Layout-only ops an accumulator may pass through before the program rounds it.
_LAYOUT = ("transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p")
# Ops that only move (or re-round) the values of their first operand: their result keeps
# its origin (forward or backward). A conv's backward flips its kernel with `rev` inside
# the backward pass; the flipped kernel is still a forward residual, not a cotangent.
_KEEP_ORIGIN = _LAYOUT + ("rev", "pad", "slice", "dynamic_slice", "broadcast_in_dim",
                          "reduce_precision")
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_RECOMPUTED = "rematted_computation"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where a tensor sits in the program (see precision.numerics.TensorStats)."""
  index: int          # the GEMM's position in program (execution) order, from 0
  primitive: str      # "dot_general" | "conv_general_dilated"
  op: str             # primitive, plus " (fn)" for the enclosing jax.nn/ops/flax function
  scope: str
  direction: str      # "fwd" | "bwd"
  role: str           # "lhs" | "rhs" | "out" | "cotangent"
  operand: str        # "lhs" | "rhs" | "out" (the side, also for a cotangent)
  shape: tuple
  dtype: str          # the dtype the program computes the tensor in
  location: str
  iteration: tuple    # iteration numbers of the enclosing scans/while loops, outermost first
  recomputed: bool    # a forward GEMM recomputed in the backward pass (jax.checkpoint)
  block_axes: tuple = ()  # the axes the MXFP8 what-if's blocks run along (see TensorStats)
  group: int | None = None  # a grouped GEMM's expert group (see TensorStats)


class _Meta(NamedTuple):
  pre: Any = None
  bwd: bool = False
  pending: int | None = None


_NONE = _Meta()


def _clean_scope(scope: str) -> str:
  parts = [p for p in scope.split("/") if p and p != _RECOMPUTED]
  return "/".join(parts)


class Recorder:
  """Evaluates a jaxpr, calling `on_tensor(info, value, dtype)` for every floating GEMM
  operand and result: `value` is the array before the program's rounding (or the stored
  array), `dtype` the format it is rounded to."""

  def __init__(self, on_tensor: Callable[[TensorInfo, Any, np.dtype], None]):
    self.on_tensor = on_tensor
    self.count = 0
    self.pending: dict[int, tuple[TensorInfo, Any]] = {}
    self.cpu = jax.default_backend() == "cpu"
    self.unvisited: list[str] = []   # higher-order primitives with GEMMs not entered
    self.out_groups: dict[int, list] = {}   # grouped GEMM index -> [(group, out index)]
    self._checked: set[str] = set()

  # ----------------------------------------------------------------------- evaluation

  def run(self, closed, args) -> list:
    outs, _ = self.eval(closed.jaxpr, closed.consts, list(args), [_NONE] * len(args), "", ())
    self.flush()
    return outs

  def flush(self) -> None:
    """Emits every accumulator the program stored without rounding it."""
    for idx in sorted(self.pending):
      info, acc = self.pending.pop(idx)
      self._emit(info, acc, np.dtype(acc.dtype))

  def eval(self, jaxpr, consts, args, metas, outer: str, iteration: tuple):
    vals: dict = {}
    meta: dict = {}
    for v, x in zip(jaxpr.constvars, consts):
      vals[v], meta[v] = x, _NONE
    for v, x, m in zip(jaxpr.invars, args, metas):
      vals[v], meta[v] = x, m

    def read(v):
      if isinstance(v, jex_core.Literal):
        return v.val, _NONE
      return vals[v], meta[v]

    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      invals, inmetas = [x for x, _ in ins], [m for _, m in ins]
      scope, direction = _walk._scope(eqn, outer)
      recomputed = _RECOMPUTED in scope.split("/")
      bwd = direction == "bwd" and not recomputed
      inner = "/".join(s for s in (outer, str(eqn.source_info.name_stack)) if s)
      outs, outmetas = self._eqn(eqn, invals, inmetas, inner, iteration, scope, bwd,
                                 recomputed)
      for v, x, m in zip(eqn.outvars, outs, outmetas):
        vals[v], meta[v] = x, m
    outs = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in outs], [m for _, m in outs]

  def _eqn(self, eqn, invals, inmetas, inner, iteration, scope, bwd, recomputed):
    name = eqn.primitive.name
    plain = lambda outs: (outs, [_Meta(bwd=bwd)] * len(outs))
    if name in GEMMS:
      out = self._gemm(eqn, invals, inmetas, iteration, scope, bwd, recomputed)
      return [out], [_Meta(bwd=bwd, pending=self.count - 1)]
    if name in _CALLS:
      p = eqn.params
      sub = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
      if sub is not None:
        return self._call(sub, invals, inmetas, inner, iteration)
    if name == "cond":
      return self._cond(eqn, invals, inmetas, inner, iteration)
    if name == "scan":
      return self._scan(eqn, invals, inmetas, inner, iteration, bwd)
    if name == "while":
      return self._while(eqn, invals, inmetas, inner, iteration, bwd)
    if _walk._subjaxprs(eqn) and name not in self._checked:
      # A higher-order op run as a whole (shard_map, a Pallas call, ...): its GEMMs are
      # not seen one by one; say so instead of reporting fewer GEMMs silently.
      self._checked.add(name)
      if any(_walk.walk(sub).gemms for sub, _ in _walk._subjaxprs(eqn)):
        self.unvisited.append(name)
    outs = _compat.bind_eqn(eqn, invals)
    outs = outs if eqn.primitive.multiple_results else [outs]
    if name == "convert_element_type":
      src, m = invals[0], inmetas[0]
      new = np.dtype(eqn.params["new_dtype"])
      old = np.dtype(getattr(src, "dtype", new))
      if m.pending is not None and m.pending in self.pending and _narrows(old, new):
        info, acc = self.pending.pop(m.pending)
        self._emit(dataclasses.replace(info, dtype=new.name), acc, new)
      # A cast keeps its input's origin: a forward residual cast again inside the
      # backward pass (autocast of a differentiated function) is no cotangent.
      if _narrows(old, new):
        return outs, [_Meta(pre=src, bwd=m.bwd)]
      return outs, [_Meta(bwd=m.bwd)]
    if name in _KEEP_ORIGIN and inmetas:
      pending = inmetas[0].pending if name in _LAYOUT else None
      return outs, [_Meta(pre=_moved_pre(eqn, invals, inmetas[0].pre),
                          bwd=inmetas[0].bwd, pending=pending)]
    return plain(outs)

  def _call(self, sub, invals, inmetas, inner, iteration):
    jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, [])
    return self.eval(jaxpr, consts, invals, inmetas, inner, iteration)

  def _cond(self, eqn, invals, inmetas, inner, iteration):
    p = eqn.params
    if p.get("branches_platforms"):
      default = [i for i, plat in enumerate(p["branches_platforms"]) if plat is None]
      index = default[0] if default else 0
    else:
      index = int(np.clip(int(invals[0]), 0, len(p["branches"]) - 1))
    return self._call(p["branches"][index], invals[1:], inmetas[1:], inner, iteration)

  def _scan(self, eqn, invals, inmetas, inner, iteration, bwd):
    p = eqn.params
    nc, nk, length = p["num_consts"], p["num_carry"], int(p["length"])
    consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    cmeta, kmeta, xmeta = inmetas[:nc], inmetas[nc:nc + nk], inmetas[nc + nk:]
    body = p["jaxpr"]
    steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
    ys: dict[int, list] = {}
    for i in steps:
      x_i = [x[i] for x in xs]
      x_meta = [_Meta(pre=None if m.pre is None else m.pre[i], bwd=m.bwd) for m in xmeta]
      outs, ometa = self._call(body, [*consts, *carry, *x_i], [*cmeta, *kmeta, *x_meta],
                               inner, (*iteration, i))
      carry, kmeta = outs[:nk], ometa[:nk]
      ys[i] = outs[nk:]
    n_ys = len(eqn.outvars) - nk
    if length == 0:
      outs = _compat.bind_eqn(eqn, invals)
      return outs, [_Meta(bwd=bwd)] * len(outs)
    stacked = [jnp.stack([ys[i][k] for i in range(length)]) for k in range(n_ys)]
    return [*carry, *stacked], [*kmeta, *[_Meta(bwd=bwd)] * n_ys]

  def _while(self, eqn, invals, inmetas, inner, iteration, bwd):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cmeta, bmeta, kmeta = inmetas[:cn], inmetas[cn:cn + bn], inmetas[cn + bn:]
    i = 0
    while True:
      (go,), _ = self._call(p["cond_jaxpr"], [*cconsts, *carry], [*cmeta, *kmeta], inner,
                            (*iteration, i))
      if not bool(go):
        break
      carry, kmeta = self._call(p["body_jaxpr"], [*bconsts, *carry], [*bmeta, *kmeta],
                                inner, (*iteration, i))
      i += 1
    return carry, kmeta

  # ----------------------------------------------------------------------- GEMMs

  def _gemm(self, eqn, invals, inmetas, iteration, scope, bwd, recomputed):
    lhs, rhs = invals[0], invals[1]
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    below = [_dtypes.below_f32(x.dtype) for x in (lhs, rhs)]
    if self.cpu and any(below):
      up = [x.astype(jnp.float32) if b else x for x, b in zip((lhs, rhs), below)]
      out = _compat.bind_eqn(eqn, [*up, *invals[2:]]).astype(out_dtype)
    else:
      out = _compat.bind_eqn(eqn, invals)
    index = self.count
    self.count += 1
    frames = _walk._frames(eqn)
    fn = _walk._op_name(frames)
    base = dict(index=index, primitive=eqn.primitive.name,
                op=eqn.primitive.name + (f" ({fn})" if fn else ""),
                scope=_clean_scope(scope), direction="bwd" if bwd else "fwd",
                location=_walk._location(frames), iteration=tuple(iteration),
                recomputed=recomputed)
    axes = _contraction_axes(eqn)
    groups = group_slices(eqn, invals) if eqn.primitive.name == "ragged_dot_general" else None
    if groups is not None:
      self.out_groups[index] = [(g, oi) for g, _, _, oi in groups]
    for k, (side, x, m, ax) in enumerate((("lhs", lhs, inmetas[0], axes[0]),
                                          ("rhs", rhs, inmetas[1], axes[1]))):
      dtype = np.dtype(x.dtype)
      if not _dtypes.is_float(dtype):
        continue
      role = "cotangent" if (bwd and m.bwd) else side
      value = m.pre if m.pre is not None else x
      info = TensorInfo(role=role, operand=side, shape=tuple(x.shape), dtype=dtype.name,
                        block_axes=ax, **base)
      if groups is None:
        self._emit(info, value, dtype)
        continue
      for g, *where, _ in groups:   # one row per expert group: its rows, its weight
        part = take(value, where[k])
        self._emit(dataclasses.replace(info, shape=part_shape(part, where[k]), group=g,
                                       block_axes=_kept_axes(ax, where[k])), part, dtype)
    if _dtypes.is_float(out_dtype):
      last = (out.ndim - 1,) if out.ndim else ()
      self.pending[index] = (TensorInfo(role="out", operand="out", shape=tuple(out.shape),
                                        dtype=out_dtype.name, block_axes=last, **base), out)
    return out

  def _emit(self, info: TensorInfo, value, dtype: np.dtype) -> None:
    groups = self.out_groups.get(info.index) if info.operand == "out" else None
    if groups is None:
      self.on_tensor(info, value, dtype)
      return
    for g, where in groups:
      part = take(value, where)
      self.on_tensor(dataclasses.replace(info, shape=part_shape(part, where), group=g,
                                         block_axes=_kept_axes(info.block_axes, where)),
                     part, dtype)


class GroupRows(NamedTuple):
  """A traced expert group's rows along a ragged axis: from `start`, `n` of them (int32
  scalars, runtime values under a jitted telemetry)."""
  start: Any
  n: Any


class GroupPart(NamedTuple):
  """A traced expert group's part of a tensor (see `take`): `value` has the tensor's
  static shape with the group's `rows` (int32, runtime) first along the ragged axis and
  zeros after them, which feed no statistic (precision.numerics._device_stats)."""
  value: Any
  rows: Any
  axis: int


def group_slices(eqn, invals) -> list | None:
  """A grouped GEMM's (ragged_dot_general's) expert groups: [(group, lhs index, rhs
  index, out index)], each index a tuple of slices/ints selecting that group's part (its
  rows of lhs, its weight or its rows of the other operand, its part of the result).
  Rows past the last group (a capacity buffer's padding) are in no group.

  Concrete group sizes (inspect): one entry per nonempty group, the ragged rows a slice.
  Traced sizes (a jitted telemetry: the number of groups E is static, their sizes are
  not): one entry per group, empty ones included, the ragged rows a `GroupRows` that
  `take` reads. None for a ragged batch dimension."""
  sizes = invals[2]
  if np.ndim(sizes) != 1:
    return None
  traced = isinstance(sizes, jax.core.Tracer)
  if traced:
    sizes = jnp.asarray(sizes, jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    rows = lambda g: GroupRows(starts[g], sizes[g])
  else:
    sizes = np.asarray(sizes).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = lambda g: slice(int(starts[g]), int(starts[g] + sizes[g]))
  dims = eqn.params["ragged_dot_dimension_numbers"]
  (lc, rc), (lb, _) = dims.dot_dimension_numbers
  (r,) = dims.lhs_ragged_dimensions
  nl, nr, no = np.ndim(invals[0]), np.ndim(invals[1]), len(eqn.outvars[0].aval.shape)
  full = lambda n: [slice(None)] * n
  out = []
  for g in range(int(sizes.shape[0])):
    if not traced and sizes[g] <= 0:
      continue
    li, ri, oi = full(nl), full(nr), full(no)
    li[r] = rows(g)
    if r in lc:      # ragged contraction (a weight gradient): out [G, ...], group g's
      ri[rc[list(lc).index(r)]] = rows(g)
      oi = [g] + full(no - 1)
    elif r not in lb:   # ragged rows: the rhs group dimension picks expert g
      (gd,) = dims.rhs_group_dimensions
      ri[gd] = g
      free = [d for d in range(nl) if d not in lc and d not in lb]
      oi[len(lb) + free.index(r)] = rows(g)
    else:
      return None
    out.append((g, tuple(li), tuple(ri), tuple(oi)))
  return out


def take(value, where):
  """value[where]; where a `GroupRows` selects traced rows along an axis, a `GroupPart`:
  the rows moved to the front of that axis (a dynamic slice of the tensor padded with
  zeros), the other rows zeroed, so the part keeps a static shape, its MXFP8 blocks along
  the ragged axis start at the group's first row as inspect's do, and rows of other
  groups or past the last group (NaN included) feed nothing."""
  ragged = [a for a, w in enumerate(where) if isinstance(w, GroupRows)]
  if not ragged:
    return value[where]
  (a,) = ragged
  w, length = where[a], value.shape[a]
  padded = jnp.concatenate([value, jnp.zeros_like(value)], axis=a)
  part = lax.dynamic_slice_in_dim(padded, w.start, length, axis=a)
  part = jnp.where(lax.broadcasted_iota(jnp.int32, part.shape, a) < w.n, part,
                   jnp.zeros((), part.dtype))
  static = tuple(slice(None) if isinstance(x, GroupRows) else x for x in where)
  kept = a - sum(isinstance(x, (int, np.integer)) for x in where[:a])
  return GroupPart(part[static], w.n, kept)


def part_shape(part, where) -> tuple:
  """The shape of a group's part; a traced part's ragged axis is -1 (known at runtime:
  the TelemetryRecord's "rows" column)."""
  if isinstance(part, GroupPart):
    shape = list(part.value.shape)
    shape[part.axis] = -1
    return tuple(shape)
  return tuple(part.shape)


def _kept_axes(axes: tuple, where: tuple) -> tuple:
  """`axes` of a tensor renumbered for its part `where` (an int index drops its axis)."""
  dropped = [i for i, w in enumerate(where) if isinstance(w, (int, np.integer))]
  return tuple(a - sum(d < a for d in dropped) for a in axes if a not in dropped)


def _moved_pre(eqn, invals, pre):
  """The value a moving op's result was rounded from: the same op applied to its input's
  `pre` (an fp8 GEMM squeezes or transposes its quantised operand after the cast, and the
  statistics must still see the f32 values the cast rounded); a re-rounding
  (reduce_precision) keeps the original value."""
  if pre is None or eqn.primitive.name == "reduce_precision":
    return pre
  rest = list(invals[1:])
  if eqn.primitive.name == "pad":   # the padding value, in the wider dtype of `pre`
    rest[0] = jnp.asarray(rest[0]).astype(pre.dtype)
  return _compat.bind_eqn(eqn, [pre, *rest])


def _contraction_axes(eqn) -> tuple:
  """(lhs axes, rhs axes) a GEMM contracts: a dot_general's contracting dimensions in
  the order of its dimension_numbers (flattened into one contraction, as
  precision.fp8's canonical [M, K] layout does); a convolution's input-feature axis of
  each operand (its spatial window is contracted too, but not along one tensor axis)."""
  if eqn.primitive.name == "dot_general":
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return tuple(int(a) for a in lc), tuple(int(a) for a in rc)
  if eqn.primitive.name == "ragged_dot_general":
    (lc, rc), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    return tuple(int(a) for a in lc), tuple(int(a) for a in rc)
  dn = eqn.params.get("dimension_numbers")
  if dn is None:   # lax's default layout: NC... lhs, OI... rhs
    return (1,), (1,)
  return (int(dn.lhs_spec[1]),), (int(dn.rhs_spec[1]),)


def _narrows(old: np.dtype, new: np.dtype) -> bool:
  """A float-to-float convert that can round: to a narrower format, or between formats of
  one width (bf16 <-> f16)."""
  if not (_dtypes.is_float(old) and _dtypes.is_float(new)) or old == new:
    return False
  return new.itemsize <= old.itemsize
