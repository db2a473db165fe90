"""Turning a sweep's runs into verdicts, a markdown summary and plots.

A run is a dict: {"recipe", "seed", "status" ("ok" | "diverged" | "failed"), "error",
"history": [per-step metric dicts, some with "val_bpb"], "summary": {...}} as returned by
experiments.trainlib.train and recorded by experiments.sweep.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Iterable

import numpy as np

CONTROL = "fp32"


def _finite_mean(values: Iterable[float]) -> float:
  v = [x for x in values if x is not None and math.isfinite(x)]
  return float(np.mean(v)) if v else float("nan")


def group_by_recipe(runs: list[dict]) -> dict[str, list[dict]]:
  groups: dict[str, list[dict]] = defaultdict(list)
  for r in runs:
    groups[r["recipe"]].append(r)
  return dict(groups)


def verdict(diff: float, control_spread: float, n_control: int, status: str) -> str:
  """Seed 001's rule: a difference counts only where it beats the control's spread.

  `control_spread` is the range (max - min) of the fp32 control's final BPB over seeds;
  lower BPB is better.
  """
  if status != "ok":
    return status
  if n_control < 2:
    return "no verdict (control has 1 seed)"
  if not math.isfinite(diff):
    return "no verdict"
  if abs(diff) <= control_spread:
    return "holds (within fp32 spread)"
  return "worse than fp32" if diff > 0 else "better than fp32"


def paired_verdict(diffs: list[float]) -> str:
  """A second, paired reading of the same runs: a seed fixes the init and the data order for
  every recipe, so per-seed differences from the control isolate the recipe's effect from
  seed-to-seed variation (which the control's range includes). "worse"/"better" when every
  seed agrees in sign and the mean difference exceeds two standard errors; needs >= 3 seeds.
  """
  d = np.asarray([x for x in diffs if math.isfinite(x)], dtype=np.float64)
  if d.size < 3:
    return "n/a (< 3 seeds)"
  mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))
  if np.all(d > 0) and mean > 2 * se:
    return "worse (paired)"
  if np.all(d < 0) and -mean > 2 * se:
    return "better (paired)"
  return "no paired difference"


def summarize(runs: list[dict], bytes_per_param: dict[str, float] | None = None,
              control: str = CONTROL) -> list[dict[str, Any]]:
  """One row per recipe: final val BPB mean/spread, difference from the control, verdict,
  non-finite count, skipped steps, final loss scale, tokens/s, compiled memory, bytes/param."""
  groups = group_by_recipe(runs)
  ctrl = [r["summary"]["final_val_bpb"] for r in groups.get(control, []) if r["status"] == "ok"]
  ctrl_mean = _finite_mean(ctrl)
  ctrl_spread = float(np.ptp(ctrl)) if len(ctrl) >= 2 else float("nan")
  rows = []
  for recipe, rs in groups.items():
    ok = [r for r in rs if r["status"] == "ok"]
    bpbs = [r["summary"]["final_val_bpb"] for r in ok]
    status = "ok" if len(ok) == len(rs) else (
        "diverged" if any(r["status"] == "diverged" for r in rs) else "failed")
    mean = _finite_mean(bpbs)
    diff = mean - ctrl_mean if recipe != control else 0.0
    summ = [r.get("summary", {}) for r in rs]
    # Paired by seed: a seed fixes the init and the data order for every recipe.
    ctrl_by_seed = {r["seed"]: r["summary"]["final_val_bpb"]
                    for r in groups.get(control, []) if r["status"] == "ok"}
    paired = [r["summary"]["final_val_bpb"] - ctrl_by_seed[r["seed"]]
              for r in sorted(ok, key=lambda r: r["seed"]) if r["seed"] in ctrl_by_seed]
    rows.append({
        "recipe": recipe,
        "seeds": len(rs),
        "val_bpb_mean": mean,
        "val_bpb_spread": float(np.ptp(bpbs)) if len(bpbs) >= 2 else float("nan"),
        "diff_vs_fp32": diff,
        "diff_per_seed": paired,
        "paired_verdict": "control" if recipe == control else (
            paired_verdict(paired) if status == "ok" else status),
        "verdict": "control" if recipe == control else verdict(
            diff, ctrl_spread, len(ctrl), status),
        "nonfinite": int(sum(s.get("nonfinite_steps", 0) or 0 for s in summ)),
        "skipped_steps": int(sum(s.get("skipped_steps", 0) or 0 for s in summ)),
        "final_loss_scale": _finite_mean(s.get("final_loss_scale", float("nan")) for s in summ),
        "tokens_per_s": _finite_mean(s.get("tokens_per_s", float("nan")) for s in summ),
        "step_memory_bytes": _finite_mean(s.get("step_memory_bytes", float("nan")) for s in summ),
        "bytes_per_param": (bytes_per_param or {}).get(recipe, float("nan")),
        "errors": sorted({r.get("error") for r in rs if r.get("error")}),
    })
  return rows


def _fmt(x: Any, spec: str) -> str:
  if isinstance(x, float) and not math.isfinite(x):
    return "-"
  return format(x, spec)


def summary_markdown(rows: list[dict], gate_rows: list[dict] | None = None,
                     header: str = "") -> str:
  lines = [header] if header else []
  lines += [
      "| recipe | seeds | val BPB (mean ± range/2) | Δ vs fp32 | Δ per seed | verdict | "
      "paired verdict | non-finite | skipped | final loss scale | tokens/s | "
      "step memory (MiB) | bytes/param |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    spread = r["val_bpb_spread"]
    bpb = _fmt(r["val_bpb_mean"], ".4f")
    if math.isfinite(spread):
      bpb += f" ± {spread / 2:.4f}"
    lines.append(
        f"| {r['recipe']} | {r['seeds']} | {bpb} | {_fmt(r['diff_vs_fp32'], '+.4f')} | "
        f"{' '.join(format(d, '+.3f') for d in r['diff_per_seed']) or '-'} | "
        f"{r['verdict']} | {r['paired_verdict']} | {r['nonfinite']} | {r['skipped_steps']} | "
        f"{_fmt(r['final_loss_scale'], '.4g')} | {_fmt(r['tokens_per_s'], '.0f')} | "
        f"{_fmt(r['step_memory_bytes'] / 2**20, '.2f')} | {_fmt(r['bytes_per_param'], '.1f')} |")
  errors = [(r["recipe"], e) for r in rows for e in r["errors"]]
  if errors:
    lines += ["", "Failures:"] + [f"- {name}: {err}" for name, err in errors]
  if gate_rows:
    lines += ["", "Numeric gate (same weights and batch as fp32; seed 000's table: loss 1.2e-4, "
              "logits mean 2.0e-3 / p99 6.8e-3, grads 1.0e-2):", "",
              "| recipe | loss rel err | logits mean rel err | logits p99 rel err | "
              "worst grad scaled-mean err | non-finite |", "|---|---|---|---|---|---|"]
    for g in gate_rows:
      lines.append(
          f"| {g['recipe']} | {g['loss_rel_err']:.2e} | {g['logits_mean_rel_err']:.2e} | "
          f"{g['logits_p99_rel_err']:.2e} | {g['grad_worst_scaled_mean_err']:.2e} | "
          f"{g['nonfinite']} |")
  return "\n".join(lines) + "\n"


def _curves(runs: list[dict], key: str) -> dict[str, list[tuple[np.ndarray, np.ndarray, int]]]:
  """recipe -> [(steps, values, seed)] for every run that logged `key`."""
  out: dict[str, list] = defaultdict(list)
  for r in runs:
    pts = [(h["step"], h[key]) for h in r.get("history", []) if h.get(key) is not None]
    if pts:
      steps, vals = zip(*pts)
      out[r["recipe"]].append((np.asarray(steps), np.asarray(vals, dtype=np.float64),
                               r.get("seed")))
  return dict(out)


def plot_metric(runs: list[dict], key: str, path: str, ylabel: str, log: bool = False,
                baseline: str | None = None) -> bool:
  """One line per recipe (mean over seeds), the seeds' min-max shaded. False if no data.

  With `baseline` (a recipe present in `runs`), a second panel shows each recipe's
  difference from the baseline paired by seed (same seed: same init and data order): the
  mean over seeds, their min-max shaded, from the second evaluation on.
  """
  # A Figure on an Agg canvas, not pyplot: the caller's backend (a notebook's inline one)
  # stays as it is.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  curves = _curves(runs, key)
  if not curves:
    return False
  paired = baseline is not None and baseline in curves
  fig = Figure(figsize=(13, 5) if paired else (8, 5))
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, 2) if paired else [fig.subplots()]
  ax = axes[0]
  colors = {}
  for recipe, seeds in curves.items():
    n = min(len(s) for s, _, _ in seeds)
    steps = seeds[0][0][:n]
    vals = np.stack([v[:n] for _, v, _ in seeds])
    line, = ax.plot(steps, np.nanmean(vals, axis=0), label=recipe)
    colors[recipe] = line.get_color()
    if len(seeds) > 1:
      ax.fill_between(steps, np.nanmin(vals, axis=0), np.nanmax(vals, axis=0),
                      color=line.get_color(), alpha=0.2)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  if log:
    ax.set_yscale("log", base=2)
  ax.grid(alpha=0.3)
  ax.legend()
  if paired:
    base = {seed: v for _, v, seed in curves[baseline]}
    bx = axes[1]
    for recipe, seeds in curves.items():
      pairs = [(st, v, base[seed]) for st, v, seed in seeds if seed in base]
      if not pairs:
        continue
      n = min(min(len(v), len(b)) for _, v, b in pairs)
      steps = pairs[0][0][1:n]
      diffs = np.stack([v[1:n] - b[1:n] for _, v, b in pairs])
      bx.plot(steps, np.nanmean(diffs, axis=0), label=recipe, color=colors[recipe])
      if len(pairs) > 1:
        bx.fill_between(steps, np.nanmin(diffs, axis=0), np.nanmax(diffs, axis=0),
                        color=colors[recipe], alpha=0.15)
    bx.axhline(0.0, color="k", lw=0.8)
    bx.set_xlabel("step")
    bx.set_ylabel(f"{ylabel} minus {baseline}, same seed")
    bx.grid(alpha=0.3)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=100)
  return True
