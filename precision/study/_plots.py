"""The study's figures (matplotlib, imported only here: the library needs none of it).

loss_curves.png: left, each recipe's evaluation metric minus the control's on the same
seed over steps (one thin line per seed, the mean thick); right, the absolute curves
(mean over seeds). loss_scale.png: the loss scale of every recipe that scales its loss,
per seed, with skipped steps marked.
"""

from __future__ import annotations

import os

import matplotlib
import numpy as np
# Figures are made without pyplot: no backend is chosen or changed (a notebook's inline
# display keeps working), and savefig draws with Agg whatever the session uses.
from matplotlib.figure import Figure


def _curve(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
  if not pts:
    return np.zeros(0), np.zeros(0)
  s, v = zip(*pts)
  return np.asarray(s, np.int64), np.asarray(v, np.float64)


def _colors(arms: list[str]) -> dict[str, str]:
  cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
  return {a: cycle[i % len(cycle)] for i, a in enumerate(arms)}


def curves_figure(result):
  arms = list(result.rows)
  seeds = sorted({i for _, i in result._runs})  # pylint: disable=protected-access
  colors = _colors(arms)
  fig = Figure(figsize=(12, 4.5))
  ax_d, ax_a = fig.subplots(1, 2)
  for arm in arms:
    mine = [i for i in seeds if (arm, i) in result._runs]  # pylint: disable=protected-access
    curves = [_curve(result.runs(arm, i), "eval") for i in mine]
    ctrl = [_curve(result.runs(result.control, i), "eval") for i in mine]
    diffs = []
    for (s, v), (cs, cv) in zip(curves, ctrl):
      common, ia, ib = np.intersect1d(s, cs, return_indices=True)
      if arm != result.control and common.size:
        ax_d.plot(common, v[ia] - cv[ib], color=colors[arm], lw=0.7, alpha=0.5)
        diffs.append((common, v[ia] - cv[ib]))
    if diffs and all(d[0].size == diffs[0][0].size for d in diffs):
      ax_d.plot(diffs[0][0], np.mean([d[1] for d in diffs], 0), color=colors[arm], lw=2,
                label=arm)
    if curves and all(c[0].size == curves[0][0].size and c[0].size for c in curves):
      ax_a.plot(curves[0][0], np.mean([c[1] for c in curves], 0), color=colors[arm], lw=1.5,
                label=arm)
  ax_d.axhline(0.0, color="black", lw=0.8)
  ax_d.set(title=f"metric - {result.control} (same seed)", xlabel="step",
           ylabel="Δ metric (lower is better)")
  ax_a.set(title="evaluation metric (mean over seeds)", xlabel="step", ylabel="metric")
  for ax in (ax_d, ax_a):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def _loss_scale_figure(result, arms: list[str]):
  seeds = sorted({i for _, i in result._runs})  # pylint: disable=protected-access
  colors = _colors(arms)
  fig = Figure(figsize=(8, 4))
  ax = fig.subplots()
  for arm in arms:
    for i in seeds:
      if (arm, i) not in result._runs:  # pylint: disable=protected-access
        continue  # a sequential study's recipe decided before this seed
      recs = result.runs(arm, i)
      s, v = _curve(recs, "loss_scale")
      ax.plot(s, v, color=colors[arm], lw=1, label=arm if i == seeds[0] else None)
      skipped = [r["step"] for r, prev in zip(recs[1:], recs[:-1])
                 if r.get("skipped_steps", 0) > prev.get("skipped_steps", 0)]
      if skipped:
        ax.plot(skipped, [v[np.searchsorted(s, x)] for x in skipped], "x",
                color=colors[arm], ms=4)
  ax.set_yscale("log", base=2)
  ax.set(title="dynamic loss scale (x: skipped steps)", xlabel="step", ylabel="loss scale")
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def write(result) -> list[str]:
  paths = []
  fig = curves_figure(result)
  path = os.path.join(result.out, "loss_curves.png")
  fig.savefig(path, dpi=110)
  paths.append(path)
  scaled = [a for a, r in result.rows.items()
            if any(len({x.get("loss_scale") for x in result.runs(a, i)} - {None, 1.0}) > 0
                   for arm, i in result._runs if arm == a)]  # pylint: disable=protected-access
  path = os.path.join(result.out, "loss_scale.png")
  fig = _loss_scale_figure(result, scaled)
  if not scaled:
    fig.axes[0].text(0.5, 0.5, "no recipe of this study scales its loss", ha="center",
                     transform=fig.axes[0].transAxes)
  fig.savefig(path, dpi=110)
  paths.append(path)
  return paths
