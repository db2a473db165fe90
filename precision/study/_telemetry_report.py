"""The study's numerics section: what each recipe's telemetry says (first anomaly, worst
tensors, monitors) and the per-layer heatmap over steps, from the cells' telemetry.jsonl.

A telemetry record of step s holds every GEMM operand, cotangent and result of the step
taken from the state after s steps (precision.numerics.TensorStats fields) and the
monitors. The first anomaly of a recipe is the earliest step, over its seeds, with a
row crossing a threshold (precision.numerics.DEFAULT_THRESHOLDS unless told otherwise:
any non-finite value, any overflow, more than 1% of nonzero values flushed to zero);
within a step, the first such row in program order (forward before backward).
"""

from __future__ import annotations

import math
import os
from typing import Mapping

import numpy as np

from precision.numerics import _heatmap
from precision.numerics import _report
from precision.numerics._report import DEFAULT_THRESHOLDS, LOWER_IS_WORSE
from precision.study import _cells

def first_anomaly(records: list[dict], thresholds: Mapping[str, float]) -> dict | None:
  """{"step", "row", "statistic", "value", "threshold"} of the first crossing, or None
  (precision.numerics' `crossing`, on the rows of the records in step order)."""
  for rec in sorted(records, key=lambda r: r["step"]):
    for row in rec["rows"]:
      hit = _report.crossing(row.get, thresholds)
      if hit is not None:
        name, value = hit
        return {"step": rec["step"], "row": row, "statistic": name,
                "value": value, "threshold": thresholds[name]}
  return None


def _monitor(records: list[dict], kind: str) -> tuple[float | None, float | None]:
  """The max over scopes of monitor `kind` at the first and at the last record."""
  def at(rec):
    vals = [v for k, v in rec["monitors"].items() if k.split("/", 1)[0] == kind
            and v is not None and math.isfinite(v)]
    return max(vals) if vals else None
  if not records:
    return None, None
  return at(records[0]), at(records[-1])


def summarize(out: str, cfg, thresholds: Mapping[str, float] | None = None) -> dict:
  """arm -> its telemetry summary ({} for an arm without telemetry)."""
  thresholds = dict(DEFAULT_THRESHOLDS if thresholds is None else thresholds)
  result: dict = {}
  for arm, _, _ in cfg.arms():
    cells = [c for c in cfg.grid() if c.arm == arm]
    per_seed = {c.index: _cells.read_telemetry(out, c) for c in cells}
    per_seed = {i: sorted(r, key=lambda x: x["step"]) for i, r in per_seed.items() if r}
    if not per_seed:
      result[arm] = {}
      continue
    firsts = [(fa["step"], i, fa) for i, recs in per_seed.items()
              if (fa := first_anomaly(recs, thresholds)) is not None]
    first = None
    if firsts:
      step, seed, fa = min(firsts, key=lambda x: (x[0], x[1]))
      first = {**fa, "seed": seed, "seeds_with_anomaly": len(firsts)}
    seed0 = min(per_seed)
    last = per_seed[seed0][-1]
    worst = sorted(last["rows"], key=lambda r: _report.badness(r.get))[:5]
    monitors = {k: _monitor(per_seed[seed0], k) for k in (
        "logit_max", "log_z_absmax", "update_lost", "adam_rms_g2_over_v",
        "update_to_param")}
    steps = [r["step"] for r in per_seed[seed0]]
    every = min((b - a for a, b in zip(steps, steps[1:])), default=None)
    result[arm] = {"first_anomaly": first, "worst_at_last": worst, "last_step": last["step"],
                   "every": every,
                   "seed": seed0, "records": sum(len(r) for r in per_seed.values()),
                   "monitors": monitors, "seeds": len(per_seed)}
  return result


def _pct(x) -> str:
  return "-" if x is None else "0" if x == 0 else f"{100 * x:.3g}%"


def _num(x) -> str:
  return "-" if x is None else f"{x:.3g}"


def _where(row: dict) -> str:
  it = "@" + ",".join(map(str, row["iteration"])) if row.get("iteration") else ""
  return (f"`{row.get('scope') or '(root)'}`{it} {row['direction']} {row['role']} "
          f"({row['dtype']})")


def markdown(summary: dict, thresholds: Mapping[str, float] | None = None) -> list[str]:
  """The summary.md section (lines); [] when no arm has telemetry."""
  if not any(summary.values()):
    return []
  thresholds = dict(DEFAULT_THRESHOLDS if thresholds is None else thresholds)
  every = next((s["every"] for s in summary.values() if s and s.get("every")), None)
  rule = ", ".join(f"{k} {'<' if k in LOWER_IS_WORSE else '>'} {v:g}"
                   for k, v in thresholds.items())
  lines = ["", "## Numerics telemetry", "",
           (f"Every {every} steps" if every else "At step 0") + ", every GEMM operand, cotangent and result of the step "
           "(forward and backward), measured in the dtype it is computed in. First anomaly: "
           f"the earliest step over the seeds where a tensor crosses {rule}. Monitors at "
           "the first → last record of the first seed (max over layers/params).", "",
           "| recipe | first anomaly | worst tensor at last record | max logit | "
           "updates lost to rounding | Adam RMS(g²/v) |", "|---|---|---|---|---|---|"]
  for arm, s in summary.items():
    if not s:
      lines.append(f"| {arm} | (no telemetry) | | | | |")
      continue
    fa = s["first_anomaly"]
    if fa is None:
      first = "none"
    else:
      first = (f"step {fa['step']} (seed {fa['seed']}; {fa['seeds_with_anomaly']}/"
               f"{s['seeds']} seeds): {_where(fa['row'])} {fa['statistic']} "
               + (_pct(fa["value"]) if fa["statistic"] != "sqnr_db" else _num(fa["value"])))
    w = s["worst_at_last"][0] if s["worst_at_last"] else None
    worst = ("-" if w is None else f"{_where(w)}: underflow {_pct(w.get('underflow'))}, "
             f"overflow {_pct(w.get('overflow'))}, SQNR {_num(w.get('sqnr_db'))} dB")
    m = s["monitors"]
    arrow = lambda pair, f: f"{f(pair[0])} → {f(pair[1])}"
    lines.append(f"| {arm} | {first} | {worst} | {arrow(m['logit_max'], _num)} | "
                 f"{arrow(m['update_lost'], _pct)} | {arrow(m['adam_rms_g2_over_v'], _num)} |")
  for arm, s in summary.items():
    if s and s["first_anomaly"] is not None:
      lines.append(f"- {arm}: heatmap of underflow/overflow per layer over steps in "
                   f"`telemetry_{_cells.safe_name(arm)}.png`; every row in "
                   f"`cells/{_cells.safe_name(arm)}__s{s['first_anomaly']['seed']}/"
                   "telemetry.jsonl`.")
  return lines


_PANELS = (("fwd", "underflow"), ("bwd", "underflow"), ("fwd", "overflow"),
           ("bwd", "overflow"))


def grid(records: list[dict], direction: str, statistic: str):
  """(layers, steps, values[layer, step]): the max of `statistic` over the rows of each
  layer (scope) in `direction`, per telemetry step; NaN where none."""
  layers = list(dict.fromkeys(_heatmap.layer_of(r.get("scope"))
                              for rec in records for r in rec["rows"]))
  steps = [rec["step"] for rec in records]
  cells = ((_heatmap.layer_of(r.get("scope")), j, r.get(statistic))
           for j, rec in enumerate(records) for r in rec["rows"]
           if r["direction"] == direction)
  return layers, steps, _heatmap.max_grid(cells, layers, list(range(len(steps))))


def write_heatmaps(out: str, cfg) -> list[str]:
  """telemetry_<arm>.png per arm with telemetry (its first seed); needs matplotlib."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  paths = []
  for arm, _, _ in cfg.arms():
    cells = sorted((c for c in cfg.grid() if c.arm == arm), key=lambda c: c.index)
    records = next((r for r in (_cells.read_telemetry(out, c) for c in cells) if r), None)
    if not records:
      continue
    records = sorted(records, key=lambda r: r["step"])
    layers = grid(records, "fwd", "underflow")[0]
    fig = Figure(figsize=(14, 1.6 + 0.3 * max(len(layers), 2)), layout="constrained")
    axes = fig.subplots(1, len(_PANELS), squeeze=False)[0]
    for ax, (direction, stat) in zip(axes, _PANELS):
      layers, steps, values = grid(records, direction, stat)
      im = ax.imshow(np.ma.masked_invalid(100 * values), aspect="auto", cmap="magma_r",
                     vmin=0, vmax=100, interpolation="nearest")
      ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7, rotation=90)
      ax.set_yticks(range(len(layers)), layers if ax is axes[0] else [""] * len(layers),
                    fontsize=7)
      ax.set_xlabel("step", fontsize=8)
      ax.set_title(f"{direction} {stat} (% of nonzero)", fontsize=9)
    fig.colorbar(im, ax=axes[-1], shrink=0.8)
    fig.suptitle(f"{arm}: worst tensor per layer, seed {cells[0].index}", fontsize=10)
    path = os.path.join(out, f"telemetry_{_cells.safe_name(arm)}.png")
    fig.savefig(path, dpi=100)
    paths.append(path)
  return paths
