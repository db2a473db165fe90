"""Text rendering of a PrecisionReport: a GEMM table and a one-screen precision map."""

from __future__ import annotations

import collections

from precision._policy import dtype_name


def short_dtype(name: str) -> str:
  """A dtype name as the reports print it ("bf16", "f32"); a name that is no dtype as is."""
  try:
    return dtype_name(name)
  except (ValueError, KeyError, TypeError):
    return name


def _si(x: float, unit: str = "") -> str:
  for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= div:
      return f"{x / div:.3g} {suffix}{unit}"
  return f"{x:.3g} {unit}"


def gemm_table(report, max_rows: int = 40) -> str:
  head = f"{'dir':<4} {'lhs x rhs -> acc -> out':<28} {'FLOPs':>9}  {'scope':<22} shape / source"
  lines = [f"GEMMs of {report.name}: {report.num_gemms} ({_si(report.flops, 'FLOP')})", head]
  for g in report.gemms[:max_rows]:
    sig = (f"{short_dtype(g.lhs_dtype)} x {short_dtype(g.rhs_dtype)} -> "
           f"{short_dtype(g.acc_dtype)} -> {short_dtype(g.out_dtype)}") + (
               " fp8" if g.is_fp8 else "")
    times = f" x{g.count}" if g.count > 1 else ""
    groups = f" ({g.grouped})" if g.groups else ""
    lines.append(f"{g.direction:<4} {sig:<28} {_si(g.flops):>9}  {g.scope[-22:]:<22} "
                 f"{g.shape}{times}{groups}  {g.location}")
  if len(report.gemms) > max_rows:
    lines.append(f"... {len(report.gemms) - max_rows} more GEMMs")
  return "\n".join(lines)


def _counter_str(counter, fmt) -> str:
  return ", ".join(f"{fmt(k)} x{n}" for k, n in sorted(counter.items(), key=lambda kv: -kv[1]))


def precision_map(report) -> str:
  """One screen: what runs in which precision (GEMMs, reductions, islands, converts)."""
  rows = []
  for direction in ("fwd", "bwd"):
    sigs = report.gemm_signatures(direction)
    if sigs:
      rows.append((f"GEMM {direction}", _counter_str(
          sigs, lambda s: f"{s[0]} x {s[1]} in, {s[2]} accumulate, {s[3]} out")))
  grouped = collections.Counter(
      (g.role, g.groups, short_dtype(g.lhs_dtype), short_dtype(g.rhs_dtype),
       short_dtype(g.acc_dtype)) for g in report.gemms if g.groups for _ in range(g.count))
  if grouped:
    rows.append(("GEMM grouped", _counter_str(
        grouped, lambda k: f"{k[0]} {k[2]} x {k[3]} -> {k[4]} ({k[1]} groups)")))
  fp8 = [g for g in report.gemms if g.is_fp8]
  if fp8:
    rows.append(("GEMM fp8", f"{sum(g.count for g in fp8)} GEMMs with float8 operands"))
  for op, dtypes in sorted(report.island_dtypes().items()):
    rows.append((op, "/".join(sorted(dtypes))))
  red = collections.Counter((o.primitive, short_dtype(o.dtype)) for o in report.ops
                            if o.kind != "transcendental" for _ in range(o.count))
  if red:
    rows.append(("reductions", _counter_str(red, lambda k: f"{k[0]} {k[1]}")))
  tr = collections.Counter((o.primitive, short_dtype(o.dtype)) for o in report.ops
                           if o.kind == "transcendental" for _ in range(o.count))
  if tr:
    rows.append(("exp/log/...", _counter_str(tr, lambda k: f"{k[0]} {k[1]}")))
  conv = report.convert_counts()
  if conv:
    rows.append(("converts", _counter_str(conv, lambda k: f"{k[0]}->{k[1]}")))
  mem = sorted(report.bytes_by_dtype.items(), key=lambda kv: -kv[1])
  rows.append(("intermediates", ", ".join(f"{short_dtype(k)} {_si(v, 'B')}" for k, v in mem)))
  for k in report.opaque:
    rows.append(("opaque kernel", f"{k.primitive}{' ' + k.name if k.name else ''} "
                 f"({k.direction}, {k.location or '?'}): {k.operands} -> {k.results}, "
                 "run as written"))
  if report.has_while:
    rows.append(("note", "a while loop was counted once (unknown trip count)"))
  width = max(len(r[0]) for r in rows)
  lines = [f"precision map of {report.name}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
  return "\n".join(lines)
