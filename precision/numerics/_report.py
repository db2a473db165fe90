"""TensorStats (one row: a GEMM operand or result) and NumericsReport (all of them)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from precision.numerics import _stats
from precision.numerics import _heatmap

# Statistics where lower is worse (a threshold is crossed from above).
LOWER_IS_WORSE = ("sqnr_db",) + tuple(f"whatif_{p}_sqnr_db" for p, _, _ in _stats.WHATIF)


@dataclasses.dataclass(frozen=True)
class TensorStats:
  """One GEMM operand or result of the inspected program and its numerics.

  Where it is:
    index: the GEMM's position in program order (0 = first GEMM executed; a scan or while
      body's GEMMs get a new index every iteration).
    primitive: "dot_general" or "conv_general_dilated".
    op: the primitive, plus " (name)" for the enclosing precision.ops / jax.nn / flax norm
      function when the traceback shows one.
    scope: the name stack with JAX's transform wrappers removed: NNX module paths
      ("blocks/0/qkv"), Linen module names ("Model/Dense_0"), jax.named_scope names.
    direction: "fwd" or "bwd" (the GEMM's name stack is under JAX's transpose); a forward
      GEMM recomputed in the backward pass by jax.checkpoint is "fwd" with
      `recomputed=True`.
    role: "lhs" / "rhs" (operands), "out" (the result), or "cotangent": in a backward GEMM,
      the operand produced by the backward pass (by an equation under transpose that is
      not a forward recomputation); the other operand is a forward residual and keeps
      "lhs"/"rhs". `operand` always says the side.
    operand: "lhs", "rhs" or "out".
    shape: the tensor's shape.
    dtype: the dtype the program computes the tensor in: a GEMM operand's dtype as
      autocast runs it ("bfloat16"); for "out", the dtype the f32 accumulator is rounded
      to next (the first narrowing convert_element_type of it, through transposes and
      reshapes), else the accumulator's own dtype (it is stored as is).
    location: the innermost user source line, "file.py:12 (fn)".
    iteration: the iteration numbers of the enclosing scan/while loops, outermost first.
    recomputed: see `direction`.
    block_axes: the axes of the tensor the MXFP8 what-if's blocks run along (see below):
      for a GEMM operand the axes the GEMM contracts (a dot_general's contracting
      dimensions, in its dimension_numbers' order; a convolution's input-feature axis),
      for "out" its last axis.
    group: for a grouped GEMM (ragged_dot_general, an MoE layer's expert GEMMs), the
      expert group the row measures: that group's rows of the ragged operand, its
      expert's weight (or its rows of the other operand, for the weight gradient) and
      its part of the result (rows past the last group, a capacity buffer's padding, are
      in none); None for other GEMMs. Eagerly (inspect) one row per nonempty group;
      under a jitted telemetry, where the sizes are runtime values, one per group, an
      empty group's rows of size 0 included.

  The values measured, x (taken in f32): the value BEFORE the program rounds it to
  `dtype`: for an operand that a convert_element_type narrowed (autocast's cast of an f32
  activation, weight or cotangent to bf16/f16), the f32 value it was cast from; for
  "out", the f32 accumulator; otherwise the stored tensor upcast to f32 (rounding it
  again is exact). "Nonzero" below means finite and != 0; r = round-to-nearest-even of x
  to `dtype` (ml_dtypes, subnormals kept).
    size: number of elements. nonzero: number of nonzero elements.
    nonfinite: fraction of ALL elements that are inf or NaN in x.
    zeros: fraction of ALL elements that are exactly 0 in x (a tensor flushed upstream,
      e.g. a gradient computed from an underflowed cotangent, shows here: its own
      underflow is 0 for want of nonzero elements).
    amax: max |x| over finite elements (0 if none).
    amin_nonzero: min |x| over nonzero elements (0 if none).
    dynamic_range_bits: log2(amax) - log2(amin_nonzero) (0 if no nonzero element).
    underflow: fraction of nonzero elements with r == 0.
    subnormal: fraction of nonzero elements with r finite, nonzero and
      |r| < smallest normal of `dtype`.
    overflow: fraction of nonzero elements with r = +-inf (or NaN: E4M3 has no inf).
    saturated: fp8 `dtype` only (else 0): fraction of nonzero elements with |r| == the
      format's max, i.e. at the clip of the scale the program applied.
    sqnr_db: 10 * log10(sum x^2 / sum (x - r)^2) over nonzero elements, in f64; +inf when
      rounding is exact, -inf when any element overflows. Energy-weighted: a few large
      elements dominate it, so a lone outlier that makes the rest of a scaled fp8 tensor
      underflow leaves it high; read it together with underflow.
  What-if columns, from the same x for formats not in use: whatif_<fmt>_underflow,
  whatif_<fmt>_overflow, whatif_<fmt>_sqnr_db, defined as above with r the rounding to
  <fmt>: bf16 and f16 unscaled; e4m3 (float8_e4m3fn) and e5m2 with per-tensor current
  scaling (Transformer Engine's): r = round(x * s) with s = fmt_max / amax computed and
  applied in f32 (s = 1 when amax is 0), SQNR taken on the scaled values; mxfp8: the
  OCP MX format with E4M3 elements, as precision.fp8.mxfp8_quantize with
  scale_rounding "up" computes it: the axes `block_axes` flattened (in that order) into
  one axis, cut into blocks of 32 consecutive elements (a trailing partial block is a
  block of its own), each block with one power-of-two (E8M0) scale 2**e,
  e = ceil(log2(block_amax / 448)) clamped to [-127, 127] (block_amax over the block's
  finite elements; so no element exceeds 448 and overflow is 0 unless 448 * 2**e passes
  f32's max); r = 2**e * round(x / 2**e) with the element rounded to nearest even in
  E4M3; SQNR on the unscaled values (the scales differ by block). A block with no
  nonzero finite element has nothing measured.
  """

  index: int
  primitive: str
  op: str
  scope: str
  direction: str
  role: str
  operand: str
  shape: tuple
  dtype: str
  location: str
  iteration: tuple
  recomputed: bool
  block_axes: tuple
  size: int
  nonzero: int
  nonfinite: float
  zeros: float
  amax: float
  amin_nonzero: float
  dynamic_range_bits: float
  underflow: float
  subnormal: float
  overflow: float
  saturated: float
  sqnr_db: float
  whatif_bf16_underflow: float
  whatif_bf16_overflow: float
  whatif_bf16_sqnr_db: float
  whatif_f16_underflow: float
  whatif_f16_overflow: float
  whatif_f16_sqnr_db: float
  whatif_e4m3_underflow: float
  whatif_e4m3_overflow: float
  whatif_e4m3_sqnr_db: float
  whatif_e5m2_underflow: float
  whatif_e5m2_overflow: float
  whatif_e5m2_sqnr_db: float
  whatif_mxfp8_underflow: float
  whatif_mxfp8_overflow: float
  whatif_mxfp8_sqnr_db: float
  group: int | None = None


_WHERE = ("index", "primitive", "op", "scope", "direction", "role", "operand", "shape",
          "dtype", "location", "iteration", "recomputed", "block_axes", "size", "nonzero",
          "group")
STATISTICS = tuple(f.name for f in dataclasses.fields(TensorStats) if f.name not in _WHERE)
DEFAULT_THRESHOLDS = {"nonfinite": 0.0, "overflow": 0.0, "underflow": 0.01}
# Overflow before non-finite: the layer that overflows comes before the ones its
# inf or NaN flows into.
_ORDER = ("overflow", "nonfinite", "underflow", "subnormal", "sqnr_db")
# The order a row's statistics are checked against thresholds in (the same reason).
_CHECK_ORDER = ("overflow", "nonfinite", "underflow", "subnormal", "saturated", "sqnr_db")


def crossing(get, thresholds: Mapping[str, float]) -> tuple[str, float] | None:
  """(statistic, value) of the first statistic of one row crossing its threshold:
  above it (below it for the SQNRs), checked in the order overflow, nonfinite,
  underflow, subnormal, saturated, sqnr_db, then any other in the thresholds' order;
  None when none crosses. `get(name)` reads the row's value (None or NaN: not measured,
  never crosses)."""
  rank = lambda n: _CHECK_ORDER.index(n) if n in _CHECK_ORDER else len(_CHECK_ORDER)
  for name in sorted(thresholds, key=rank):
    v, t = get(name), thresholds[name]
    if v is None or (isinstance(v, float) and math.isnan(v)):
      continue
    if (v < t) if name in LOWER_IS_WORSE else (v > t):
      return name, v
  return None


def badness(get) -> tuple:
  """Sort key of one row, worst first when sorted ascending: overflow, nonfinite,
  underflow, subnormal (highest first), then sqnr_db (lowest first). `get(name)` reads
  the row's value; a missing one (None) counts as 0 (+inf for sqnr_db)."""
  key = []
  for s in _ORDER:
    v = get(s)
    if s in LOWER_IS_WORSE:
      key.append(math.inf if v is None else v)
    else:
      key.append(-(v or 0.0))
  return tuple(key)


def _check_statistic(name: Any) -> str:
  if name not in STATISTICS:
    raise ValueError(f"Unknown statistic {name!r}; accepted: {', '.join(STATISTICS)}")
  return name


def _badness(row: TensorStats, by: str | None) -> tuple:
  """Sort key, worst first when sorted ascending."""
  if by is None:
    return badness(lambda s: getattr(row, s)) + (row.index,)
  v = getattr(row, by)
  return (v if by in LOWER_IS_WORSE else -v, row.index)


def _pct(x: float) -> str:
  return "0" if x == 0 else f"{100 * x:.3g}%"


def _db(x: float) -> str:
  return "inf" if x == math.inf else "-inf" if x == -math.inf else f"{x:.1f}"


@dataclasses.dataclass(frozen=True)
class NumericsReport:
  """Every GEMM operand and result of one inspected call, in program order.

  Attributes:
    name: the inspected function's name.
    policy: the policy string the program ran under ("p=f32,c=bf16,o=f32").
    rows: tuple of TensorStats, sorted by (index, lhs/rhs/out).
    unvisited: names of higher-order primitives (shard_map, Pallas calls) that hold GEMMs
      the evaluation ran whole, so their GEMMs have no rows; () when every GEMM is seen.
  """

  name: str
  policy: str
  rows: tuple
  unvisited: tuple = ()

  def to_records(self) -> list[dict]:
    """The rows as dicts (field name -> value; shape, iteration and block_axes as
    lists)."""
    out = []
    for r in self.rows:
      d = dataclasses.asdict(r)
      d["shape"], d["iteration"] = list(r.shape), list(r.iteration)
      d["block_axes"] = list(r.block_axes)
      out.append(d)
    return out

  def select(self, *, direction: str | None = None, role: str | None = None,
             scope: str | None = None) -> tuple:
    """The rows matching every given field exactly."""
    want = {k: v for k, v in dict(direction=direction, role=role, scope=scope).items()
            if v is not None}
    return tuple(r for r in self.rows if all(getattr(r, k) == v for k, v in want.items()))

  def worst(self, n: int = 1, by: str | None = None) -> tuple:
    """The `n` worst rows.

    Args:
      n: how many.
      by: a statistic name (highest first; lowest first for sqnr_db and the what-if
        SQNRs), or None for the default ordering: overflow, then nonfinite, underflow,
        subnormal (each highest first), then sqnr_db (lowest first), then program order.
    Returns:
      A tuple of up to `n` TensorStats.
    Raises:
      ValueError: an unknown statistic name.
    """
    if by is not None:
      _check_statistic(by)
    return tuple(sorted(self.rows, key=lambda r: _badness(r, by))[:n])

  def first_anomaly(self, thresholds: Mapping[str, float] | None = None):
    """The first row in program order whose statistic crosses a threshold, or None.

    Args:
      thresholds: {statistic: threshold}; a row crosses when its value is above the
        threshold (below it for sqnr_db and whatif_*_sqnr_db). Default
        DEFAULT_THRESHOLDS: any non-finite value, any overflow, or more than 1% underflow.
    Returns:
      The TensorStats, or None when no row crosses.
    Raises:
      ValueError: an unknown statistic name or a threshold that is not a real number.
    """
    thresholds = dict(DEFAULT_THRESHOLDS if thresholds is None else thresholds)
    for name, t in thresholds.items():
      _check_statistic(name)
      if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t):
        raise ValueError(f"Threshold for {name!r} is {t!r}; accepted: a real number")
    for r in self.rows:
      if crossing(lambda name: getattr(r, name), thresholds) is not None:
        return r
    return None

  def table(self, worst: int | None = 20, by: str | None = None) -> str:
    """A markdown table of the worst rows, worst first (the ordering of `worst()`).

    Args:
      worst: how many rows (None: all, in program order).
      by: the ordering statistic (see `worst`).
    Returns:
      The table as text: percentages for fractions, dB for SQNR.
    """
    rows = self.rows if worst is None else self.worst(worst, by)
    head = ["#", "dir", "scope", "op", "role", "dtype", "shape", "amax", "range bits",
            "underflow", "subnormal", "overflow", "saturated", "sqnr dB",
            "f16 uf", "f16 of", "e4m3 dB", "e5m2 dB", "mxfp8 dB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
      it = "" if not r.iteration else "@" + ",".join(map(str, r.iteration))
      cells = [f"{r.index}{it}", r.direction + ("*" if r.recomputed else ""),
               r.scope or "-", r.op, r.role, r.dtype, "x".join(map(str, r.shape)) or "()",
               f"{r.amax:.3g}", f"{r.dynamic_range_bits:.1f}", _pct(r.underflow),
               _pct(r.subnormal), _pct(r.overflow), _pct(r.saturated), _db(r.sqnr_db),
               _pct(r.whatif_f16_underflow), _pct(r.whatif_f16_overflow),
               _db(r.whatif_e4m3_sqnr_db), _db(r.whatif_e5m2_sqnr_db),
               _db(r.whatif_mxfp8_sqnr_db)]
      lines.append("| " + " | ".join(cells) + " |")
    title = f"numerics of {self.name} under {self.policy}: {len(self.rows)} tensors"
    if self.unvisited:
      title += f" (GEMMs inside {', '.join(self.unvisited)} not seen)"
    return "\n".join([title, ""] + lines)

  def heatmap(self, path, statistics=("underflow", "overflow")) -> str:
    """Draws each statistic per layer (rows: scopes, in program order) and tensor
    (columns: fwd lhs/rhs/out, bwd cotangent/lhs/rhs/out) as a PNG; a cell is the max
    over that layer's GEMMs (and scan iterations). Needs matplotlib (imported here only).

    Args:
      path: the file to write (.png).
      statistics: names from STATISTICS, one panel each; fractions are shown in percent.
    Returns:
      `path` as a string.
    Raises:
      ValueError: an unknown statistic name.

    Examples:
      >>> report.heatmap("numerics.png", ("underflow", "overflow", "whatif_e4m3_underflow"))
    """
    statistics = tuple(statistics)
    if not statistics:
      raise ValueError("statistics is empty; accepted: names from " + ", ".join(STATISTICS))
    for s in statistics:
      _check_statistic(s)
    return _heatmap.heatmap(self, path, statistics)

  def scale_plot(self, path, max_rows: int = 60) -> str:
    """Draws each tensor's range (log2 of its smallest nonzero and largest magnitude)
    against the ranges of bf16, f16, E4M3 and E5M2 (smallest subnormal, smallest normal,
    max) as a PNG: where each tensor sits in each format. Needs matplotlib.

    Args:
      path: the file to write (.png).
      max_rows: the first this many rows with a nonzero element, in program order.
    Returns:
      `path` as a string.
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
      raise ValueError(f"max_rows={max_rows!r}; accepted: an integer >= 1")
    return _heatmap.scales(self, path, max_rows)

  def __str__(self) -> str:
    return self.table()
