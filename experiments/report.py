"""Turning a sweep's runs into verdicts, a markdown summary and plots.

A run is a dict: {"recipe", "seed", "status" ("ok" | "diverged" | "failed"), "error",
"history": [per-step metric dicts, some with "val_bpb"], "summary": {...}} as returned by
experiments.trainlib.train and recorded by experiments.sweep. The statistics live in
experiments.stats; this module applies them per recipe and lays out the results.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections import defaultdict
from typing import Any, Iterable, NamedTuple

import numpy as np

from experiments import stats

CONTROL = "fp32"
# Row fields that depend on the machine and its load, not on the training: a summary
# merged from shards equals a single run's in everything else.
TIMING_FIELDS = ("tokens_per_s", "load_1m", "cpu_count", "loaded")


def _finite_mean(values: Iterable[float]) -> float:
  v = [x for x in values if x is not None and math.isfinite(x)]
  return float(np.mean(v)) if v else float("nan")


def _finite_max(values: Iterable[float]) -> float:
  v = [x for x in values if x is not None and math.isfinite(x)]
  return float(np.max(v)) if v else float("nan")


def group_by_recipe(runs: list[dict]) -> dict[str, list[dict]]:
  groups: dict[str, list[dict]] = defaultdict(list)
  for r in runs:
    groups[r["recipe"]].append(r)
  return dict(groups)


class LossScaleEvents(NamedTuple):
  """Dynamic loss-scale events of one run, by step.

  Attributes:
    growth: steps after which the scale went up (growth after enough finite steps).
    backoff: steps after which it went down (back-off after non-finite gradients).
    skipped: steps whose update was skipped (non-finite gradients: an overflow).
    steps, scale: the scale after every step (f32 values as floats).
  """

  growth: list[int]
  backoff: list[int]
  skipped: list[int]
  steps: list[int]
  scale: list[float]


def loss_scale_events(history: list[dict], initial_scale: float | None = None
                      ) -> LossScaleEvents:
  """Growth, back-off and skipped steps read off a run's per-step records.

  Args:
    history: step records with "step", "loss_scale" and "skipped_steps" (a running count).
    initial_scale: the scale before step 1 (None: step 1's own value; an event at step 1
      is then not seen).

  Returns:
    LossScaleEvents; empty lists for a run without loss-scale records.
  """
  recs = sorted((h for h in history if h.get("loss_scale") is not None),
                key=lambda h: h["step"])
  growth, backoff, skipped = [], [], []
  prev_scale = initial_scale
  prev_skipped = 0
  for h in recs:
    s = float(h["loss_scale"])
    if prev_scale is not None and s > prev_scale:
      growth.append(h["step"])
    elif prev_scale is not None and s < prev_scale:
      backoff.append(h["step"])
    if h.get("skipped_steps", 0) > prev_skipped:
      skipped.append(h["step"])
    prev_scale, prev_skipped = s, h.get("skipped_steps", prev_skipped)
  return LossScaleEvents(growth, backoff, skipped, [h["step"] for h in recs],
                         [float(h["loss_scale"]) for h in recs])


def summarize(runs: list[dict], bytes_per_param: dict[str, float] | None = None,
              control: str = CONTROL, alpha: float = stats.ALPHA) -> list[dict[str, Any]]:
  """One row per recipe: final val BPB, its paired comparison with the control, the
  fp32-spread rule, health (non-finite, skipped, loss-scale events) and cost.

  Row keys: recipe, seeds, val_bpb_mean, val_bpb_spread (max - min over seeds),
  diff_vs_fp32 (mean(recipe) - mean(control), all ok seeds), diff_per_seed (paired by
  seed), diff_mean, diff_ci (95% t interval), p_sign_flip, p_holm, verdict (paired test),
  spread_rule (fp32-spread rule), nonfinite, skipped_steps, loss_scale_growths,
  loss_scale_backoffs, final_loss_scale, tokens_per_s (mean over seeds), load_1m (largest
  1-minute load average at a run's end), cpu_count, loaded (load_1m > cpu_count),
  step_memory_bytes, bytes_per_param, errors. BPB values are bits per byte (lower is
  better).
  """
  groups = group_by_recipe(runs)
  ok_of = lambda rs: [r for r in rs if r["status"] == "ok"]
  ctrl_runs = ok_of(groups.get(control, []))
  ctrl = [r["summary"]["final_val_bpb"] for r in ctrl_runs]
  ctrl_mean = _finite_mean(ctrl)
  ctrl_by_seed = {r["seed"]: r["summary"]["final_val_bpb"] for r in ctrl_runs}

  def status_of(rs):
    if len(ok_of(rs)) == len(rs):
      return "ok"
    return "diverged" if any(r["status"] == "diverged" for r in rs) else "failed"

  # Paired by seed: a seed fixes the init and the data order for every recipe.
  paired = {}
  for recipe, rs in groups.items():
    if recipe != control:
      paired[recipe] = [r["summary"]["final_val_bpb"] - ctrl_by_seed[r["seed"]]
                        for r in sorted(ok_of(rs), key=lambda r: r["seed"])
                        if r["seed"] in ctrl_by_seed]
  family = {k: v for k, v in paired.items() if status_of(groups[k]) == "ok" and v}
  tests = stats.paired_verdicts(family, alpha=alpha)

  rows = []
  for recipe, rs in groups.items():
    ok = ok_of(rs)
    bpbs = [r["summary"]["final_val_bpb"] for r in ok]
    status = status_of(rs)
    mean = _finite_mean(bpbs)
    test = tests.get(recipe)
    if recipe == control:
      verdict = spread = "control"
    elif status != "ok":
      verdict = spread = status
    elif not ctrl_runs:
      verdict = spread = f"no verdict: no {control} run"
    elif test is None:
      verdict = spread = f"no verdict: no seed shared with {control}"
    else:
      verdict, spread = test.verdict, stats.spread_rule(mean - ctrl_mean, ctrl)
    summ = [r.get("summary", {}) for r in rs]
    events = [loss_scale_events(r.get("history", []), r.get("summary", {}).get(
        "initial_loss_scale")) for r in rs]
    cpus = _finite_max(s.get("cpu_count", float("nan")) for s in summ)
    load = _finite_max(s.get("load_1m", float("nan")) for s in summ)
    rows.append({
        "recipe": recipe,
        "seeds": len(rs),
        "val_bpb_mean": mean,
        "val_bpb_spread": float(np.ptp(bpbs)) if len(bpbs) >= 2 else float("nan"),
        "diff_vs_fp32": mean - ctrl_mean if recipe != control else 0.0,
        "diff_per_seed": paired.get(recipe, []),
        "diff_mean": test.mean if test else float("nan"),
        "diff_ci": [test.ci_low, test.ci_high] if test else [float("nan")] * 2,
        "p_sign_flip": test.p_value if test else float("nan"),
        "p_holm": test.p_holm if test else float("nan"),
        "verdict": verdict,
        "spread_rule": spread,
        "nonfinite": int(sum(s.get("nonfinite_steps", 0) or 0 for s in summ)),
        "skipped_steps": int(sum(s.get("skipped_steps", 0) or 0 for s in summ)),
        "loss_scale_growths": sum(len(e.growth) for e in events),
        "loss_scale_backoffs": sum(len(e.backoff) for e in events),
        "final_loss_scale": _finite_mean(s.get("final_loss_scale", float("nan")) for s in summ),
        "tokens_per_s": _finite_mean(s.get("tokens_per_s", float("nan")) for s in summ),
        "load_1m": load,
        "cpu_count": cpus,
        "loaded": bool(math.isfinite(load) and math.isfinite(cpus) and load > cpus),
        "step_memory_bytes": _finite_mean(s.get("step_memory_bytes", float("nan")) for s in summ),
        "bytes_per_param": (bytes_per_param or {}).get(recipe, float("nan")),
        "errors": sorted({r.get("error") for r in rs if r.get("error")}),
    })
  return rows


def family_size(rows: list[dict]) -> int:
  """Recipes that the paired test compared with the control (the Holm family)."""
  return sum(1 for r in rows if math.isfinite(r.get("p_sign_flip", float("nan"))))


def _fmt(x: Any, spec: str) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  return format(x, spec)


def _p(x: float) -> str:
  return "-" if not math.isfinite(x) else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def verdict_notes(rows: list[dict], seeds: int, alpha: float = stats.ALPHA) -> str:
  """The rules behind the verdict table, in words, with this sweep's numbers."""
  m = family_size(rows)
  lines = [
      f"**Verdict: the paired test.** {stats.PAIRED_RULE.format(alpha=alpha)}. The p-value is "
      "the fraction of the 2^n ways to flip the signs of the n per-seed differences whose "
      "mean is at least as far from 0 as the observed one; it assumes only that, without "
      "an effect, a difference is as likely negative as positive.",
  ]
  if m:
    need = stats.seeds_needed(m, alpha)
    lines.append(
        f"With {m} recipe(s) compared, Holm's first step needs p <= {alpha:g}/{m} = "
        f"{alpha / m:.4f}; the smallest p that n seeds can give is 2^(1-n) "
        f"({seeds} seeds: {stats.min_sign_flip_p(seeds):.3g}), so a decision needs >= "
        f"{need} seeds. Below that the verdict is \"undecided: needs >= {need} seeds\" "
        "whatever the data; \"no difference detected\" means the test could have decided "
        "and did not. Run more seeds with `--seeds`.")
  lines.append(
      "**Mean Δ [95% CI]**: the mean per-seed difference (recipe minus fp32, bits per "
      "byte; negative = better) with Student's t interval. The interval assumes roughly "
      "normal differences and is per recipe, not corrected for the number of recipes, so "
      "an interval that excludes 0 is not a verdict.")
  if seeds >= 2:
    rate = stats.spread_rule_null_rate(seeds)
    lines.append(
        f"**The fp32-spread rule.** {stats.SPREAD_RULE}. It controls no error rate: with "
        f"{seeds} seeds, when no recipe differs (synthetic normal noise, no "
        f"seed-to-seed variation) it flags {rate:.0%} of recipes; believe the verdict "
        "column.")
  return "\n\n".join(lines) + "\n"


def summary_markdown(rows: list[dict], gate_rows: list[dict] | None = None,
                     header: str = "", seeds: int | None = None,
                     alpha: float = stats.ALPHA) -> str:
  """summary.md: the verdict table with its rules in words, the health and cost table,
  and the numeric gate with its limits and pass/fail.

  Args:
    rows: `summarize`'s rows.
    gate_rows: `gates.judge`d numeric-gate rows (or {"recipe", "error"} for a failed one).
    header: markdown put first (title, settings).
    seeds: seeds per recipe (None: the largest row's).
    alpha: family-wise error rate of the verdicts.
  """
  seeds = seeds if seeds is not None else max((r["seeds"] for r in rows), default=0)
  lines = [header] if header else []
  lines += ["## Verdicts against fp32", "", verdict_notes(rows, seeds, alpha),
            "| recipe | seeds | val BPB (mean ± range/2) | Δ vs fp32 per seed | "
            "mean Δ [95% CI] | p (sign-flip) | p (Holm) | verdict (paired test) | "
            "fp32-spread rule |",
            "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    spread = r["val_bpb_spread"]
    bpb = _fmt(r["val_bpb_mean"], ".4f")
    if math.isfinite(spread):
      bpb += f" ± {spread / 2:.4f}"
    lo, hi = r["diff_ci"]
    ci = _fmt(r["diff_mean"], "+.4f")
    if math.isfinite(lo):
      ci += f" [{lo:+.4f}, {hi:+.4f}]"
    lines.append(
        f"| {r['recipe']} | {r['seeds']} | {bpb} | "
        f"{' '.join(format(d, '+.3f') for d in r['diff_per_seed']) or '-'} | {ci} | "
        f"{_p(r['p_sign_flip'])} | {_p(r['p_holm'])} | {r['verdict']} | {r['spread_rule']} |")
  errors = [(r["recipe"], e) for r in rows for e in r["errors"]]
  if errors:
    lines += ["", "Failures:"] + [f"- {name}: {err}" for name, err in errors]

  loaded = [r for r in rows if r["loaded"]]
  cpus = _finite_max(r["cpu_count"] for r in rows)
  lines += ["", "## Health and cost", "",
            "Loss-scale events are summed over seeds (growth: the scale doubled after its "
            "growth interval of finite steps; back-off: it halved after non-finite "
            "gradients, whose step was skipped). tokens/s is the mean over seeds of the "
            "median step time; load is the largest 1-minute load average "
            "(`os.getloadavg()`) at the end of a run, on a machine with "
            f"{_fmt(cpus, '.0f')} CPUs (the sweep's own process counts toward it)."]
  if loaded:
    lines.append(f"**Throughput of {', '.join(r['recipe'] for r in loaded)} was measured "
                 "on a loaded machine (load above the CPU count): not an unloaded figure.**")
  lines += ["", "| recipe | non-finite steps | skipped steps | loss-scale growths / "
            "back-offs | final loss scale | tokens/s | load (1 min) | step memory (MiB) | "
            "bytes/param |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    tps = _fmt(r["tokens_per_s"], ".0f") + (" (loaded)" if r["loaded"] else "")
    lines.append(
        f"| {r['recipe']} | {r['nonfinite']} | {r['skipped_steps']} | "
        f"{r['loss_scale_growths']} / {r['loss_scale_backoffs']} | "
        f"{_fmt(r['final_loss_scale'], '.4g')} | {tps} | {_fmt(r['load_1m'], '.2f')} | "
        f"{_fmt(r['step_memory_bytes'] / 2**20, '.2f')} | {_fmt(r['bytes_per_param'], '.1f')} |")

  if gate_rows:
    lines += ["", "## Numeric gate", "",
              "One forward and backward of each recipe against fp32 on the same weights and "
              "batch: rounding alone, no training noise. A recipe passes when every error "
              "is within a multiple of the unit roundoff u of the format it rounds GEMM "
              "inputs to (the coarser of param and compute format; fp8: E4M3 forward, E5M2 "
              "backward) and nothing is non-finite. Limits: loss u/4, logits mean 2.5u "
              "(the project's bf16 acceptance limit of 1e-2 for a policy-wrapped model, in "
              "units of bf16's u = 2^-8), logits p99 10u, worst gradient 8u. Each cell is "
              "value / limit.", "",
              "| recipe | u | loss rel err | logits mean rel err | logits p99 rel err | "
              "worst grad scaled-mean err | non-finite | gate |",
              "|---|---|---|---|---|---|---|---|"]
    for g in gate_rows:
      if "error" in g:
        lines.append(f"| {g['recipe']} | - | - | - | - | - | - | FAIL: gate raised "
                     f"{g['error']} |")
        continue
      cell = lambda k: f"{g[k]:.2e} / {g['limits'][k]:.1e}"
      lines.append(
          f"| {g['recipe']} | {g['u']} | {cell('loss_rel_err')} | "
          f"{cell('logits_mean_rel_err')} | {cell('logits_p99_rel_err')} | "
          f"{cell('grad_worst_scaled_mean_err')} | {g['nonfinite']} | "
          f"{'pass' if g['passed'] else 'FAIL: ' + '; '.join(g['failures'])} |")
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


def _figure(figsize):
  # A Figure on an Agg canvas, not pyplot: the caller's backend (a notebook's inline one)
  # stays as it is.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=figsize)
  FigureCanvasAgg(fig)
  return fig


def _save(fig, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=100)


def _seed_color(seed: int) -> str:
  return f"C{int(seed) % 10}"


def plot_val_curves(runs: list[dict], path: str, control: str = CONTROL,
                    rows: list[dict] | None = None, metric: str = "val_bpb",
                    ylabel: str = "val BPB") -> bool:
  """The validation curves as a reader needs them; False if no run logged `metric`.

  First one panel per recipe with its difference from the control on the same seed (one
  line per seed, coloured by seed alike in every panel; the mean in black; the range over
  seeds shaded), the panels sharing one y axis; the verdict from `rows` in each title.
  Last, the absolute curves over the second half of training (mean over seeds, control
  in black), where they are distinguishable.
  """
  curves = _curves(runs, metric)
  if not curves:
    return False
  by_row = {r["recipe"]: r for r in rows or []}
  base = {seed: (st, v) for st, v, seed in curves.get(control, [])}
  others = [r for r in curves if r != control and base]
  n_panels = len(others) + 1
  ncols = min(4, n_panels)
  nrows = math.ceil(n_panels / ncols)
  fig = _figure((4.3 * ncols, 3.6 * nrows + 0.6))
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  lims, diff_axes = [], []
  for ax, recipe in zip(axes, others):
    pairs = [(st, v, base[seed][1], seed) for st, v, seed in curves[recipe] if seed in base]
    if not pairs:
      ax.set_title(f"{recipe}: no seed shared with {control}", fontsize=9)
      continue
    n = min(min(len(v), len(b)) for _, v, b, _ in pairs)
    steps = pairs[0][0][:n]
    diffs = np.stack([v[:n] - b[:n] for _, v, b, _ in pairs])
    if len(pairs) > 1:
      ax.fill_between(steps, diffs.min(axis=0), diffs.max(axis=0), color="0.8",
                      label=f"range over {len(pairs)} seeds")
    for (_, _, _, seed), d in zip(pairs, diffs):
      ax.plot(steps, d, color=_seed_color(seed), lw=0.9, alpha=0.8, label=f"seed {seed}")
    ax.plot(steps, diffs.mean(axis=0), color="k", lw=2, label="mean over seeds")
    ax.axhline(0.0, color="k", lw=0.6, ls=":")
    row = by_row.get(recipe)
    title = f"{recipe} minus {control}"
    if row is not None:
      ci = row.get("diff_ci", [float("nan")] * 2)
      if math.isfinite(row.get("diff_mean", float("nan"))):
        title += f"\nfinal mean {row['diff_mean']:+.3f}"
        if math.isfinite(ci[0]):
          title += f" [95% CI {ci[0]:+.3f}, {ci[1]:+.3f}]"
      title += "\n" + textwrap.shorten(row["verdict"], 60)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel(f"Δ {ylabel}, same seed")
    ax.grid(alpha=0.3)
    lims.append((float(diffs.min()), float(diffs.max())))
    diff_axes.append(ax)
    if len(diff_axes) == 1:
      ax.legend(fontsize=7, loc="best")
  if lims:
    # One y scale for every difference panel, so their sizes compare at a glance.
    lo, hi = min(a for a, _ in lims), max(b for _, b in lims)
    pad = 0.05 * (hi - lo) or 1e-6
    for ax in diff_axes:
      ax.set_ylim(lo - pad, hi + pad)
  # Last panel: the absolute curves, second half only.
  ax = axes[len(others)]
  for i, (recipe, seeds) in enumerate(curves.items()):
    n = min(len(v) for _, v, _ in seeds)
    steps = seeds[0][0][:n]
    mean = np.stack([v[:n] for _, v, _ in seeds]).mean(axis=0)
    keep = steps >= steps[-1] / 2
    style = dict(color="k", lw=2.2) if recipe == control else dict(color=f"C{i % 10}", lw=1.2)
    ax.plot(steps[keep], mean[keep], label=recipe, marker=".", ms=3, **style)
  ax.set_title(f"{ylabel}, second half of training\n(mean over seeds; lower is better)",
               fontsize=9)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="best")
  for ax in axes[n_panels:]:
    ax.set_visible(False)
  fig.suptitle(f"Validation bits per byte: each recipe minus {control} on the same seed "
               "(same initial weights and data order), then the absolute curves",
               fontsize=10)
  fig.tight_layout()
  _save(fig, path)
  return True


def plot_loss_scale(runs: list[dict], path: str, note: str = "") -> bool:
  """One panel per loss-scaled recipe: its scale per seed over the steps (log2 axis) with
  growth, back-off and skipped-step markers, counted in the legend. False if no run
  logged a loss scale."""
  by_recipe = group_by_recipe([r for r in runs if any(
      h.get("loss_scale") is not None for h in r.get("history", []))])
  if not by_recipe:
    return False
  fig = _figure((11, 3.8 * len(by_recipe) + 0.4))
  axes = fig.subplots(len(by_recipe), 1, squeeze=False).ravel()
  for ax, (recipe, rs) in zip(axes, by_recipe.items()):
    counts = {"growth": 0, "backoff": 0, "skipped": 0}
    marks = {"growth": ([], []), "backoff": ([], []), "skipped": ([], [])}
    for r in sorted(rs, key=lambda r: r["seed"]):
      ev = loss_scale_events(r["history"], r.get("summary", {}).get("initial_loss_scale"))
      scale_at = dict(zip(ev.steps, ev.scale))  # after each step
      first = r.get("summary", {}).get("initial_loss_scale") or (ev.scale[0] if ev.scale else 1)
      before = dict(zip(ev.steps, [first] + ev.scale[:-1]))  # the scale a step ran with
      ax.step([0] + ev.steps, [first] + ev.scale, where="post", color=_seed_color(r["seed"]),
              lw=1, alpha=0.8, label=f"seed {r['seed']}")
      for kind in counts:
        steps = getattr(ev, kind)
        counts[kind] += len(steps)
        marks[kind][0].extend(steps)
        # Growth and back-off at the new scale; an overflow at the scale that overflowed.
        at = before if kind == "skipped" else scale_at
        marks[kind][1].extend(at[s] for s in steps)
    style = {"growth": dict(marker="^", color="tab:green", label="growth (x2)"),
             "backoff": dict(marker="v", color="tab:red", label="back-off (x1/2)"),
             "skipped": dict(marker="x", color="k", label="overflow: step skipped")}
    for kind, (xs, ys) in marks.items():
      st = style[kind]
      ax.scatter(xs, ys, marker=st["marker"], color=st["color"], s=28, zorder=3,
                 label=f"{st['label']}: {counts[kind]}")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale (after the step; step 0: initial)")
    ax.set_title(f"{recipe}: dynamic loss scale, {len(rs)} seed(s), events summed over "
                 "seeds" + (f"\n{note}" if note else ""), fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
  fig.tight_layout()
  _save(fig, path)
  return True
