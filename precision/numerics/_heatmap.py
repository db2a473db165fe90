"""NumericsReport.heatmap: statistics per layer and tensor role as a PNG (matplotlib,
imported only when a figure is drawn; no pyplot, so no backend is chosen or changed)."""

from __future__ import annotations

import os

import numpy as np

from precision import formats

# Columns, in the order a GEMM's tensors meet: forward operands and result, then the
# backward GEMMs' cotangent, residual operand and gradient.
_COLUMNS = (("fwd", "lhs"), ("fwd", "rhs"), ("fwd", "out"), ("bwd", "cotangent"),
            ("bwd", "lhs"), ("bwd", "rhs"), ("bwd", "out"))


def max_grid(cells, layers: list[str], columns: list) -> np.ndarray:
  """values[layer, column]: the max of the values of `cells` ((layer, column, value)
  triples; None values skipped) at each (layer, column) of the given labels, NaN where
  there is none."""
  values = np.full((len(layers), len(columns)), np.nan)
  for layer, col, v in cells:
    if v is None or col not in columns:
      continue
    i, j = layers.index(layer), columns.index(col)
    values[i, j] = v if np.isnan(values[i, j]) else max(values[i, j], v)
  return values


def layer_of(scope: str | None) -> str:
  return scope or "(root)"


def grid(rows, statistic: str) -> tuple[list[str], list[str], np.ndarray]:
  """(layer labels, column labels, values[layer, column]): the max of `statistic` over the
  rows of each (scope, direction, role), NaN where a layer has no such tensor. Layers are
  in order of their first GEMM."""
  scopes = list(dict.fromkeys(layer_of(r.scope) for r in rows))
  cols = [c for c in _COLUMNS if any((r.direction, r.role) == c for r in rows)]
  values = max_grid(((layer_of(r.scope), (r.direction, r.role), getattr(r, statistic))
                     for r in rows), scopes, cols)
  return scopes, [f"{d} {role}" for d, role in cols], values


def heatmap(report, path: str | os.PathLike, statistics=("underflow", "overflow")) -> str:
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  n = len(statistics)
  layers = grid(report.rows, statistics[0])[0]
  fig = Figure(figsize=(4.5 * n + 1, 1.2 + 0.35 * max(len(layers), 2)),
               layout="constrained")
  axes = np.atleast_1d(fig.subplots(1, n, squeeze=False))[0]
  for ax, stat in zip(axes, statistics):
    layers, cols, values = grid(report.rows, stat)
    fraction = "sqnr" not in stat and stat not in ("amax", "amin_nonzero",
                                                   "dynamic_range_bits")
    shown = np.ma.masked_invalid(100 * values if fraction else values)
    im = ax.imshow(shown, aspect="auto", cmap="viridis" if not fraction else "magma_r",
                   vmin=0 if fraction else None, vmax=100 if fraction else None,
                   interpolation="nearest")
    ax.set_xticks(range(len(cols)), cols, rotation=40, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), layers, fontsize=8)
    for (i, j), v in np.ndenumerate(values):
      if not np.isnan(v) and v != 0:
        ax.text(j, i, f"{100 * v:.3g}" if fraction else f"{v:.3g}", ha="center",
                va="center", fontsize=7, color="white" if fraction and v > 0.5 else "black")
    ax.set_title(f"{stat}" + (" (% of nonzero)" if fraction else ""), fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
  fig.suptitle(f"{report.name} under {report.policy}", fontsize=10)
  path = os.fspath(path)
  fig.savefig(path, dpi=110)
  return path


# The formats drawn as range lines: (label, dtype name for precision.formats, color).
_RANGE_FORMATS = (("bf16", "bf16", "tab:blue"), ("f16", "f16", "tab:orange"),
                  ("e4m3", "e4m3", "tab:green"), ("e5m2", "e5m2", "tab:red"))


def scales(report, path: str | os.PathLike, max_rows: int = 60) -> str:
  """Each tensor's magnitude range, log2(amin_nonzero) to log2(amax), one line per row
  (forward black, backward purple), against every format's range: its smallest
  subnormal (dotted), smallest normal (dashed) and max (solid). Values left of a format's
  dotted line flush to zero in it, right of its solid line overflow (unit-scaling's
  picture of where a tensor sits in a format)."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  rows = [r for r in report.rows if r.nonzero][:max_rows]
  fig = Figure(figsize=(9, 1.5 + 0.22 * max(len(rows), 2)), layout="constrained")
  ax = fig.subplots()
  los = [np.log2(r.amin_nonzero) for r in rows] or [0.0]
  his = [np.log2(r.amax) for r in rows] or [0.0]
  # The axis spans the tensors and the 16- and 8-bit formats; bf16's range (f32's
  # exponents) lies far outside it and is named in the legend instead.
  left = min(min(los), np.log2(float(formats.info("f16").smallest_subnormal))) - 4
  right = max(max(his), np.log2(float(formats.info("f16").max))) + 4
  for i, r in enumerate(rows):
    color = "black" if r.direction == "fwd" else "purple"
    ax.plot([los[i], his[i]], [i, i], color=color, lw=2.5, solid_capstyle="butt",
            marker="|", markersize=6)
  notes = []
  for label, name, color in _RANGE_FORMATS:
    info = formats.info(name)
    for value, style in ((info.smallest_subnormal, ":"), (info.smallest_normal, "--"),
                         (info.max, "-")):
      x = np.log2(float(value))
      if left <= x <= right:
        ax.axvline(x, color=color, ls=style, lw=1, alpha=0.8)
    x = np.log2(float(info.max))
    if left <= x <= right:
      ax.text(x, len(rows) - 0.3, label, color=color, fontsize=8, ha="right", va="bottom")
    else:
      notes.append(f"{label}: 2^{np.log2(float(info.smallest_subnormal)):.0f} .. "
                   f"2^{x:.0f}")
  ax.set_xlim(left, right)
  if notes:
    ax.text(0.01, 0.99, "off the axis: " + "; ".join(notes), transform=ax.transAxes,
            fontsize=7, va="top")
  ax.set_yticks(range(len(rows)), [f"{r.scope or '(root)'} {r.direction} {r.role}"
                                   for r in rows], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("log2 |value| (amin_nonzero .. amax)", fontsize=9)
  ax.set_title(f"{report.name} under {report.policy}: tensor ranges against formats' "
               "(dotted: min subnormal, dashed: min normal, solid: max)", fontsize=9)
  path = os.fspath(path)
  fig.savefig(path, dpi=100)
  return path
