"""The study's report: verdicts per recipe, costs, health, curves; `StudyResult`.

Files written into the study folder (all from the finished cells, so every slice's run
or a merge writes the same): results.jsonl (every step record of every cell in grid
order, then the cell's outcome), summary.json (one object per recipe), summary.md (the
same as a table with the rules in words), loss_curves.png and loss_scale.png (when
matplotlib is installed).

Each verdict states its magnitude: the mean difference, relative to the control's metric,
the tightest equivalence bound its seeds support ("within ±x at 95%") and an interval that
agrees with it; a shown difference smaller than the margin or the chaos floor is worded
"practically equivalent". With the chaos floor's arm, summary.json has a top-level
"floor" (its per-seed motion, rms, and the seeds a margin below it would need); a
seeds="auto" study's rows are its sequential rule's decisions, with `seeds_used` and
`decided` per recipe.

summary.json keeps what varies from run to run (step times) under "timing" keys only, so
two runs of one study compare equal once those are dropped (`comparable`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import numpy as np

from precision import _optimizer
from precision.study import _cells
from precision.study import _config
from precision.study import _floor
from precision.study import _sequential
from precision.study import _telemetry_report
from precision.study import _stats

_VERDICT_WORDS = {_stats.WORSE: "worse", _stats.BETTER: "better"}


@dataclasses.dataclass(frozen=True)
class Judging:
  """How verdicts are reached (report settings: they change no trained number).

  margin: equivalence margin (metric units; None: no equivalence verdict). target: the
  metric of time-to-target (None: not reported). alpha: family-wise error rate. test:
  "t" or "sign_flip".
  """

  margin: float | None = None
  target: float | None = None
  alpha: float = _stats.ALPHA
  test: str = "t"

  def __post_init__(self):
    if self.test not in _stats.TESTS:
      raise ValueError(f"test={self.test!r}; accepted: {', '.join(_stats.TESTS)}")
    if not (isinstance(self.alpha, (int, float)) and 0 < self.alpha < 1):
      raise ValueError(f"alpha={self.alpha!r}; accepted: a number in (0, 1)")
    if self.margin is not None and not (isinstance(self.margin, (int, float))
                                        and math.isfinite(self.margin) and self.margin > 0):
      raise ValueError(f"margin={self.margin!r}; accepted: a finite number > 0 (in the "
                       "evaluation metric's units)")
    if self.target is not None and not (isinstance(self.target, (int, float))
                                        and math.isfinite(self.target)):
      raise ValueError(f"target={self.target!r}; accepted: a finite number")


def _cells_of(cfg, arm: str) -> list[_cells.Cell]:
  return [c for c in cfg.grid() if c.arm == arm]


def _health(done: list[dict]) -> dict:
  return {
      "ok": sum(d["status"] == "ok" for d in done),
      "diverged": [d["index"] for d in done if d["status"] == "diverged"],
      "failed": [d["index"] for d in done if d["status"] == "failed"],
      "errors": sorted({d["error"] for d in done if d.get("error")}),
      "skipped_steps": [d.get("skipped_steps", 0) for d in done],
      "nonfinite_steps": [d.get("nonfinite_steps", 0) for d in done],
      "final_loss_scale": [d.get("final_loss_scale") for d in done],
      "max_fp8_saturated": max((d.get("max_fp8_saturated") or 0.0 for d in done),
                               default=0.0),
  }


def judge(out: str, cfg, judging: Judging, floor_nudge: str | None = None) -> dict[str, dict]:
  """One object per arm (control and chaos floor included) from the finished cells in
  `out`. A sequential study's verdicts are its rule's (`_sequential.replay`); the
  floor's row carries its summary under "floor" (summary.json's top-level "floor")."""
  done = {c: _cells.read_done(out, c) for c in cfg.grid()}
  control = [done[c] for c in _cells_of(cfg, cfg.control)]
  ctrl_ok = {d["index"]: d["final_metric"] for d in control if d["status"] == "ok"}
  rows: dict[str, dict] = {}
  family: dict[str, list[float]] = {}
  for arm, recipe, _ in cfg.arms():
    ds = [done[c] for c in _cells_of(cfg, arm)]
    health = _health(ds)
    row = {"recipe": recipe.name, "arm": arm, "control": arm == cfg.control,
           "final_metric": [d.get("final_metric") for d in ds], "health": health,
           "costs": {"bytes_per_param": _optimizer.bytes_per_param(recipe),
                     "step_memory_bytes": next((d.get("step_memory_bytes") for d in ds
                                                if d.get("step_memory_bytes")), None)},
           "n_params": next((d.get("n_params") for d in ds if d.get("n_params")), None)}
    rows[arm] = row
    if arm == cfg.control:
      row["verdict"] = "control"
      row["verdict_code"] = "control"
      continue
    pairs = [(d["index"], d["final_metric"] - ctrl_ok[d["index"]]) for d in ds
             if d["status"] == "ok" and d["index"] in ctrl_ok]
    row["deltas"] = [float(x) for _, x in pairs]
    row["paired_seeds"] = [i for i, _ in pairs]
    row["seeds_used"] = len(ds)
    row["decided"] = False
    ctrl_paired = [ctrl_ok[i] for i, _ in pairs]
    row["relative_delta"] = (float(np.mean(row["deltas"]) / abs(np.mean(ctrl_paired)))
                             if pairs and np.mean(ctrl_paired) != 0 else None)
    n = len(ds)
    if arm == cfg.floor_arm:
      row["verdict"] = "chaos floor (the control from weights one ulp away; not judged)"
      row["verdict_code"] = "floor"
      continue
    if health["failed"]:
      row["verdict_code"] = "failed"
      row["verdict"] = (f"failed on {len(health['failed'])} of {n} seeds: "
                        f"{health['errors'][0] if health['errors'] else ''}")
    elif health["diverged"]:
      ctrl_div = [i for i in health["diverged"] if i not in ctrl_ok]
      row["verdict_code"] = "diverged"
      row["verdict"] = (f"diverged on {len(health['diverged'])} of {n} seeds"
                        + (f" (the control too on seeds {ctrl_div})" if ctrl_div else
                           f", where {cfg.control} did not"))
    elif len(pairs) < 2:
      row["verdict_code"] = "undecided"
      row["verdict"] = (f"undecided: only {len(pairs)} seed(s) where {cfg.control} "
                        "finished too; needs >= 2")
    else:
      family[arm] = row["deltas"]
  floor = _floor_row(rows, cfg, judging, ctrl_ok, floor_nudge, len(cfg.judged_arms()))
  margin = cfg.sequential.margin if cfg.sequential is not None else judging.margin
  comparisons = _stats.compare(family, alpha=judging.alpha, margin=judging.margin,
                               test=judging.test) if family else {}
  for arm, c in comparisons.items():
    row = rows[arm]
    code = _VERDICT_WORDS.get(c.verdict, "no_difference" if c.verdict == _stats.NO_DIFFERENCE
                              else "undecided")
    row.update(verdict_code=code, mean_delta=c.mean_delta, ci=list(c.ci),
               p_value=c.p_value, p_holm=c.p_holm, equivalent=c.equivalent,
               p_equivalence=c.p_equivalence, margin=c.margin, power=c.power,
               seeds_needed=c.seeds_needed, test=c.test, ci_holm=list(c.ci_holm),
               ci_holm_level=c.ci_holm_level, equivalence_bound=c.equivalence_bound,
               ci_rule=("Holm-consistent" if c.test == "t" else "t, not the sign-flip test's"),
               decided=_stats.is_decision(c.verdict) or bool(c.equivalent))
    direction = c.verdict if _stats.is_decision(c.verdict) else None
    row["practically_equivalent"] = _practical(direction, c.mean_delta, margin, floor)
    row["verdict"] = _verdict_words(row, direction, cfg.control, margin, floor,
                                    c.equivalent, f"Holm p = {c.p_holm:.2g}")
  if cfg.sequential is not None:
    _sequential_verdicts(rows, family, cfg, margin, floor)
  for arm, row in rows.items():
    row.setdefault("mean_delta", float(np.mean(row["deltas"])) if row.get("deltas") else None)
    row.setdefault("ci", None)
    row.setdefault("equivalent", None)
  if judging.target is not None:
    _time_to_target(rows, cfg, done, judging)
  return rows


def _floor_row(rows, cfg, judging: Judging, ctrl_ok, nudge, m) -> float | None:
  """Fills the floor arm's row with its summary; returns its spread (rms) or None."""
  if not cfg.floor_arm:
    return None
  row = rows[cfg.floor_arm]
  margin = cfg.sequential.margin if cfg.sequential is not None else judging.margin
  ctrl = [ctrl_ok[i] for i in row["paired_seeds"]]
  row["floor"] = _floor.summarize(row["deltas"], row["paired_seeds"],
                                  float(np.mean(ctrl)) if ctrl else None, margin, nudge,
                                  max(1, m), judging.alpha)
  return row["floor"]["rms"] if row["deltas"] else None


def _practical(direction, mean: float, margin: float | None, floor: float | None):
  """Why a shown difference is practically equivalent (None: it is not, or no
  difference was shown): smaller than the margin, or than the chaos floor's spread."""
  if direction is None:
    return None
  if margin is not None and abs(mean) < margin:
    return f"smaller than the margin ±{margin:g}"
  if floor is not None and abs(mean) < floor:
    return f"smaller than the chaos floor {floor:.3g}"
  return None


def _rel(row) -> str:
  r = row.get("relative_delta")
  return "" if r is None else f", {100 * r:+.2g}%"


def _verdict_words(row, direction, control: str, margin, floor, equivalent, why: str) -> str:
  """The verdict with its magnitude: the mean difference and its size relative to the
  control's metric, worded as practically equivalent where `_practical` says so, and the
  tightest bound the seeds support."""
  mean = _fmt(row["mean_delta"])
  reason = _practical(direction, row["mean_delta"], margin, floor)
  how = f"({_rel(row)[2:]}; {why})" if _rel(row) else f"({why})"
  if direction is not None and reason:
    words = f"practically equivalent: {direction} than {control} by {mean} {how}, {reason}"
  elif direction is not None:
    words = f"{direction} than {control} by {mean} {how}"
  else:
    words = f"no difference detected ({mean}{_rel(row)})"
  bound = row.get("equivalence_bound")
  if bound is not None and math.isfinite(bound):
    words += f"; within ±{bound:.3g} at 95%"
  if equivalent is not None and margin is not None:
    words += (f"; holds up within ±{margin:g}" if equivalent else
              f"; not shown within ±{margin:g}")
  return words


def _sequential_verdicts(rows, family, cfg, margin, floor) -> None:
  """A seeds="auto" study's verdicts: its rule replayed over the seeds each recipe ran,
  with the rule's repeated interval and bound (both valid under the stopping)."""
  p = _config.sequential_plan(cfg)
  for arm, dec in _sequential.replay(family, p).items():
    row = rows[arm]
    direction = {_sequential.WORSE: _stats.WORSE, _sequential.BETTER: _stats.BETTER}.get(
        dec.verdict)
    row.update(verdict_code={_sequential.WORSE: "worse", _sequential.BETTER: "better",
                             _sequential.HOLDS: "holds_up"}.get(dec.verdict, "undecided"),
               decided=dec.verdict in (_sequential.WORSE, _sequential.BETTER,
                                       _sequential.HOLDS),
               equivalent=dec.holds, margin=margin, equivalence_bound=dec.bound,
               ci_holm=list(dec.interval), ci_holm_level=1 - p.alpha / p.m,
               ci_rule="repeated CI", look=dec.look,
               practically_equivalent=_practical(direction, dec.mean, margin, floor))
    if dec.verdict in (_sequential.UNDECIDED, _sequential.CONTINUE):
      words = (f"undecided after {dec.n} seeds ({_fmt(dec.mean)}{_rel(row)}); "
               f"within ±{dec.bound:.3g} at 95%, not within ±{margin:g}"
               if math.isfinite(dec.bound) else f"undecided after {dec.n} seeds")
      if floor is not None and margin <= floor:
        words += f" (the chaos floor {floor:.3g} is above the margin)"
      row["verdict"] = words
    else:
      where = f"sequential, look {dec.look + 1} of {len(p.looks)}, {dec.n} seeds"
      if dec.verdict == _sequential.HOLDS:
        row["verdict"] = (f"holds up within ±{margin:g} ({_fmt(dec.mean)}{_rel(row)}; "
                          f"within ±{dec.bound:.3g} at 95%; {where})")
      else:
        row["verdict"] = _verdict_words(row, direction, cfg.control, margin, floor,
                                        dec.holds, where)


def _time_to_target(rows, cfg, done, judging: Judging) -> None:
  ttt = {}
  for arm, _, _ in cfg.arms():
    ttt[arm] = [_stats.time_to_target([tuple(p) for p in done[c].get("eval_curve", [])],
                                      judging.target)
                for c in _cells_of(cfg, arm)]
  others = {a: v for a, v in ttt.items() if a != cfg.control}
  res = _stats.compare_time_to_target(others, ttt[cfg.control], alpha=judging.alpha,
                                      test=judging.test) if others else {}
  rows[cfg.control]["time_to_target"] = {"steps": ttt[cfg.control]}
  for arm, r in res.items():
    rows[arm]["time_to_target"] = {"steps": ttt[arm], "mean_delta": r.mean_delta,
                                   "ci": list(r.ci), "p_holm": r.p_holm,
                                   "verdict": r.verdict, "never_reached": r.never_reached,
                                   "deltas": list(r.deltas)}


def _fmt(x, spec: str = "+.3g") -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "n/a"
  return format(x, spec)


def _mib(b) -> str:
  return "n/a" if not b else f"{b / 2 ** 20:.1f} MiB"


def markdown(rows: dict[str, dict], cfg, judging: Judging, study: dict, costs: dict | None,
             task_name: str) -> str:
  """summary.md: the table and the rules it follows, in words."""
  ctrl = rows[cfg.control]
  finals = [x for x in ctrl["final_metric"] if x is not None]
  lines = [
      f"# Study: {task_name}", "",
      f"Model kind `{study.get('kind')}`, {cfg.steps} steps, "
      + (f"{cfg.seeds} seeds per recipe" if cfg.sequential is None else
         f"seeds added in rounds until decided (up to {cfg.sequential.max_seeds}; "
         f"{cfg.control} ran {cfg.seeds})")
      + " (seed i: the same initial weights and batches for every recipe). Metric: the "
      f"task's evaluation at the last step, lower is better; {cfg.control}: "
      + (f"{np.mean(finals):.4f} (range over seeds {np.ptp(finals):.4f})." if finals else
         "no finished seed.") + " Δ = recipe - control on the same seed.", ""]
  floor = rows[cfg.floor_arm].get("floor") if cfg.floor_arm else None
  if floor and floor.get("rms") is not None:
    lines += [_floor_line(floor, cfg.control), ""]
  timing = (costs or {}).get("ratio_to_control", {})
  ci_head = ("mean Δ [95% CI]" if cfg.sequential is None and not any(
      r.get("ci_holm") for r in rows.values()) else "mean Δ [interval of the verdict]")
  head = (f"| recipe | verdict | Δ per seed | {ci_head} | "
          + ("time to target (Δ steps) | " if judging.target is not None else "")
          + "bytes/param | step memory | step time / " + cfg.control + " | health |")
  lines += [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
  for arm, row in rows.items():
    deltas = " ".join(_fmt(d) for d in row.get("deltas", [])) or "-"
    ci = row.get("ci_holm") or row.get("ci")
    mean = (f"{_fmt(row.get('mean_delta'))} [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            if ci else _fmt(row.get("mean_delta")))
    if row.get("ci_holm"):
      mean += f" ({row['ci_holm_level']:.1%} {row['ci_rule']})"
    h = row["health"]
    health = [f"{h['ok']}/{cfg.n_seeds(arm)} ok"]
    if any(h["skipped_steps"]):
      health.append(f"skipped {sum(h['skipped_steps'])} steps")
    if h["max_fp8_saturated"]:
      health.append(f"fp8 saturated <= {h['max_fp8_saturated']:g}")
    cells = [arm, row["verdict"] if arm != cfg.control else "control",
             "-" if arm == cfg.control else deltas, "-" if arm == cfg.control else mean]
    if judging.target is not None:
      t = row.get("time_to_target", {})
      steps = " ".join("never" if s is None else str(s) for s in t.get("steps", []))
      if arm != cfg.control and t.get("verdict"):
        steps += f" ({_fmt(t.get('mean_delta'), '+.1f')}: {t['verdict']})"
      cells.append(steps or "-")
    ratio = timing.get(row["recipe"])
    cells += [f"{row['costs']['bytes_per_param']:g}", _mib(row["costs"]["step_memory_bytes"]),
              _fmt(ratio, ".2f"), ", ".join(health)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "## How the verdicts are reached", ""]
  test_words = {
      "t": ("a paired t-test of the mean difference (two-sided), Holm-corrected across the "
            "recipes: the chance of any false \"worse\"/\"better\" in the table is at most "
            f"{judging.alpha:.0%} when no recipe differs and the per-seed differences are "
            "roughly normal (checked on synthetic data, heavy-tailed and skewed noise "
            "included, in the library's tests)"),
      "sign_flip": ("the exact sign-flip permutation test of the mean difference, "
                    "Holm-corrected across the recipes (no normality assumed; its smallest "
                    "p-value with n seeds is 2^(1-n), so few seeds cannot decide)")}
  if cfg.sequential is not None:
    seq = cfg.sequential
    p = _config.sequential_plan(cfg)
    lines.append(
        f"- Sequential seeds: looks at {', '.join(map(str, p.looks))} seeds; at each look "
        "a recipe still undecided is \"worse\"/\"better\" when its paired t statistic "
        f"crosses a group-sequential boundary ({p.spending} alpha spending, "
        f"alpha / (2 x {p.m}) per side) and \"holds up within ±{seq.margin:g}\" when both "
        f"one-sided equivalence statistics cross theirs (alpha / {p.m} each); a decided "
        f"recipe takes no more seeds. Under that stopping, the chance of any false "
        f"\"worse\"/\"better\" is at most {seq.alpha:.0%}, and of any false \"holds up\" "
        f"for recipes whose true difference is the margin at most {seq.alpha:.0%} "
        "(independent, roughly normal or symmetric per-seed differences; simulated in the "
        "library's tests). The interval is the repeated confidence interval of the look "
        "that decided (it covers the true difference at every look at once), and \"within "
        "±x at 95%\" the tightest margin those seeds show.")
  else:
    lines.append(f"- Test: {test_words[judging.test]}. The interval beside a verdict "
                 "agrees with it: Student's t at the level Holm tested that recipe at "
                 "(1 - alpha / (m - k + 1) for the k-th rejected, and the level where Holm "
                 "stopped for the rest)" + (", while the verdict is the sign-flip test's"
                                            if judging.test == "sign_flip" else "")
                 + "; summary.json keeps the uncorrected 95% interval as \"ci\". "
                 "\"Within ±x at 95%\" is the tightest equivalence margin the seeds show "
                 "(two one-sided t-tests at alpha / m: every row at once).")
  lines.append("- Magnitude: Δ is also given relative to the control's metric; a "
               "\"worse\"/\"better\" smaller than the margin or than the chaos floor's "
               "spread is written \"practically equivalent\".")
  if judging.margin is not None and cfg.sequential is None:
    lines.append(f"- Equivalence: \"holds up within ±{judging.margin:g}\" when two "
                 f"one-sided t-tests reject a difference of ±{judging.margin:g} or more "
                 "(Holm-corrected): a false \"holds up\" for a recipe whose true "
                 f"difference is the margin has at most {judging.alpha:.0%} probability.")
  decided = [r for r in rows.values() if r.get("power") is not None and not r["control"]]
  if decided and cfg.sequential is None:
    lines.append("- Power: " + "; ".join(
        f"{r['arm']} {_fmt(r['power'], '.2f')}" + (
            f" (80% needs {r['seeds_needed']} seeds)" if r.get("seeds_needed") else "")
        for r in decided) + (f" — to detect a difference of the margin ±{judging.margin:g}"
                             if judging.margin is not None else
                             " — to detect the observed mean difference at the observed "
                             "spread"))
  if judging.target is not None:
    lines.append(f"- Time to target: the first evaluated step with metric <= "
                 f"{judging.target:g}; its paired difference uses the same test on the "
                 "seeds where both reached it.")
  if cfg.aa:
    lines.append(f"- `{cfg.control}-aa` is the control trained again on other seeds, "
                 "paired with the control: a recipe equal to the control by construction "
                 "(its verdict should be \"no difference detected\"); it counts in Holm's "
                 "family like the recipes.")
  kept = study.get("fp8_kept_by_role") or []
  if any(r.fp8 is not None for r in cfg.recipes):
    lines.append("- fp8: the first and last GEMM of the model stay in the compute dtype "
                 "by role" + (f" (here `{'`, `'.join(kept)}`)" if kept else "")
                 + ", as do modules matching the recipe's keep_high_precision patterns.")
  g = study.get("settings", {}).get("growth_interval", "recipe")
  scaled = [r.name for r in cfg.recipes if r.loss_scale.kind == "dynamic"]
  if scaled:
    lines.append(f"- Loss scaling ({', '.join(scaled)}): growth interval "
                 + (f"{scaled and cfg.recipe(scaled[0]).loss_scale.growth_interval} steps"
                    + (" (study setting `growth_interval`)" if g != "recipe" else
                       " (the recipe's own)")) + ".")
  lines.append("- Costs: bytes/param is the persistent ledger (params, grads, master, "
               "moments; AdamW); step memory is the compiled step's arguments + "
               "temporaries (XLA's memory analysis); step time is the median of "
               + (f"{costs['rounds']} interleaved rounds on {costs['device']}"
                  if costs else "(not measured)")
               + ": CPU times say nothing about a GPU's.")
  return "\n".join(lines) + "\n"


def _floor_line(floor: dict, control: str) -> str:
  rel = f" ({100 * floor['relative']:.2g}% of the metric)" if floor.get("relative") else ""
  line = (f"**Chaos floor**: {control} trained again on the same seeds and batches from "
          f"initial weights one ulp away ({floor.get('nudge') or 'one element'}) moves by "
          + " ".join(_fmt(d) for d in floor["deltas"])
          + f" per seed: rms {floor['rms']:.3g}{rel}, max {floor['max_abs']:.3g}. No "
          "margin below it can be told apart from chaos on few seeds.")
  if floor.get("margin_below_floor"):
    need = floor.get("seeds_for_margin")
    line += (f" The margin ±{floor['margin']:g} is below it: showing a recipe within it "
             + (f"needs about {need} seeds (80% power for a true difference 0)." if need
                else "needs more than 1000 seeds."))
  return line


def write(out: str, cfg, judging: Judging, task_name: str) -> StudyResult:
  """Writes results.jsonl, summary.json, summary.md and the plots; returns the result."""
  with open(os.path.join(out, "study.json")) as f:
    study = json.load(f)
  costs = None
  if os.path.exists(os.path.join(out, "costs.json")):
    with open(os.path.join(out, "costs.json")) as f:
      costs = json.load(f)
  rows = judge(out, cfg, judging, study.get("floor_nudge"))
  lines = []
  runs: dict[tuple[str, int], list[dict]] = {}
  for cell in cfg.grid():
    steps = _cells.read_steps(out, cell)
    runs[(cell.arm, cell.index)] = steps
    tag = {"arm": cell.arm, "recipe": cell.recipe.name, "index": cell.index,
           "seed": cell.seed}
    lines += [json.dumps({**tag, **r}) for r in steps]
    lines.append(json.dumps({**tag, "outcome": _cells.read_done(out, cell)}))
  _cells.write_atomic(os.path.join(out, "results.jsonl"), "\n".join(lines) + "\n")
  summary = {"task": task_name, "kind": study.get("kind"),
             "config": study["identity"], "judging": dataclasses.asdict(judging),
             "recipes": rows, "timing": costs}
  if cfg.floor_arm:
    summary["floor"] = {"arm": cfg.floor_arm, **rows[cfg.floor_arm].get("floor", {})}
  telemetry = _telemetry_report.summarize(out, cfg)
  if any(telemetry.values()):
    summary["telemetry"] = telemetry
  _cells.write_atomic(os.path.join(out, "summary.json"),
                      json.dumps(summary, indent=1, default=_json_default))
  md = markdown(rows, cfg, judging, study, costs, task_name)
  md += "".join(line + "\n" for line in _telemetry_report.markdown(telemetry))
  md += failed_cells_markdown(out, cfg)
  _cells.write_atomic(os.path.join(out, "summary.md"), md)
  result = StudyResult(out, rows, summary, md, runs, cfg.control)
  result.write_plots()
  if any(telemetry.values()):
    try:
      _telemetry_report.write_heatmaps(out, cfg)
    except ImportError:
      pass  # matplotlib is optional
  return result


def failed_cells_markdown(out: str, cfg) -> str:
  """summary.md's list of the cells finished as "failed", each with its error ("" when
  none failed)."""
  failed = [(c, d) for c in cfg.grid()
            for d in [_cells.read_done(out, c)] if d and d["status"] == "failed"]
  if not failed:
    return ""
  lines = ["", "## Failed cells", "",
           "Each raised an error in the task's code or under the recipe (its traceback: "
           "cells/<cell>/error.txt). A cell that an earlier version recorded as failed for "
           "a fault of its environment (a full disk) trains again with `--retry-failed`.", ""]
  lines += [f"- `{c.name}` (recipe {c.recipe.name}, seed {c.seed}): {d.get('error')}"
            for c, d in failed]
  return "\n".join(lines) + "\n"


def _json_default(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def comparable(summary: dict) -> dict:
  """`summary` without its run-to-run varying parts (every "timing" entry)."""
  if isinstance(summary, dict):
    return {k: comparable(v) for k, v in summary.items() if k != "timing"}
  if isinstance(summary, list):
    return [comparable(v) for v in summary]
  return summary


@dataclasses.dataclass
class StudyResult:
  """A finished study, for notebooks.

  Attributes:
    out: its folder. rows: arm -> summary object (verdict, deltas, ci, equivalent,
    costs, health, ...). summary: summary.json's content. markdown: summary.md's.
  """

  out: str
  rows: dict[str, dict]
  summary: dict
  markdown: str
  _runs: dict
  control: str

  def table(self) -> str:
    """The summary table (markdown)."""
    return self.markdown

  def verdict(self, recipe: str) -> str:
    return self.rows[recipe]["verdict"]

  def runs(self, recipe: str, seed: int) -> list[dict]:
    """Every step record of the cell (recipe or arm name, seed index)."""
    if (recipe, seed) not in self._runs:
      raise ValueError(f"runs({recipe!r}, {seed!r}): no such cell; accepted: recipes "
                       f"{sorted({a for a, _ in self._runs})}, seeds "
                       f"{sorted({s for _, s in self._runs})}")
    return self._runs[(recipe, seed)]

  def plot(self):
    """The loss-curve figure (matplotlib), as in loss_curves.png."""
    from precision.study import _plots  # pylint: disable=g-import-not-at-top
    return _plots.curves_figure(self)

  def write_plots(self) -> list[str]:
    try:
      from precision.study import _plots  # pylint: disable=g-import-not-at-top
    except ImportError:
      return []  # matplotlib is optional: the report's numbers need none of it
    return _plots.write(self)
