"""NumericsReport.heatmap: statistics per layer and tensor role as a PNG (matplotlib,
imported only when a figure is drawn; no pyplot, so no backend is chosen or changed)."""

from __future__ import annotations

import os

import numpy as np

# Columns, in the order a GEMM's tensors meet: forward operands and result, then the
# backward GEMMs' cotangent, residual operand and gradient.
_COLUMNS = (("fwd", "lhs"), ("fwd", "rhs"), ("fwd", "out"), ("bwd", "cotangent"),
            ("bwd", "lhs"), ("bwd", "rhs"), ("bwd", "out"))


def grid(rows, statistic: str) -> tuple[list[str], list[str], np.ndarray]:
  """(layer labels, column labels, values[layer, column]): the max of `statistic` over the
  rows of each (scope, direction, role), NaN where a layer has no such tensor. Layers are
  in order of their first GEMM."""
  scopes: list[str] = []
  for r in rows:
    if (r.scope or "(root)") not in scopes:
      scopes.append(r.scope or "(root)")
  cols = [c for c in _COLUMNS if any((r.direction, r.role) == c for r in rows)]
  values = np.full((len(scopes), len(cols)), np.nan)
  for r in rows:
    i, key = scopes.index(r.scope or "(root)"), (r.direction, r.role)
    if key in cols:
      j = cols.index(key)
      v = getattr(r, statistic)
      values[i, j] = v if np.isnan(values[i, j]) else max(values[i, j], v)
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
