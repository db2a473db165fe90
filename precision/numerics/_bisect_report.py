"""BisectResult (what `precision.numerics.bisect` found) and Replay (one replay)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from precision.numerics import _report
from precision.numerics._bisect_groups import describe_group

# Statistics a verdict names, in the order a row's worst one is looked for (sqnr_db when
# none is nonzero): the layer that overflows comes before those its inf flows into.
_VERDICT_STATS = ("overflow", "nonfinite", "underflow", "saturated", "subnormal", "zeros")


class Replay(NamedTuple):
  """One replay of the steps after the restored state.

  kind: "baseline" (the recipe as is), "reference" (its f32 counterpart), "halve" (a
    bisection step), "verify" (the single candidate alone), "all" (every group
    promoted) or "shrink" (a group dropped from a promoted set).
  promoted: the groups promoted to f32 ("scope:fwd" / "scope:bwd"; () for the baseline
    and the reference).
  losses: the loss of every replayed step (f32 values as Python floats).
  final_gap, max_gap: |loss - reference loss| at the last step and the largest over the
    steps (inf where either loss is not finite).
  within: max_gap <= tolerance.
  """

  kind: str
  promoted: tuple
  losses: tuple
  final_gap: float
  max_gap: float
  within: bool


@dataclasses.dataclass(frozen=True)
class BisectResult:
  """What `bisect` found.

  Attributes:
    recipe, reference: names of the recipe replayed and of its f32 counterpart.
    start_step: the step of the restored state (None for an in-memory state without one).
    steps, tolerance: as given.
    groups: the groups searched, in program order: "scope:fwd" (the scope's forward
      GEMMs and its other ops) and "scope:bwd" (its backward GEMMs), adjacent.
    culprits: the promoted set found whose replay stays within `tolerance` of the
      reference: one group when a single one explains the divergence, else a minimal set
      (dropping any one of its groups leaves the replay outside tolerance); () when the
      baseline is within tolerance already, or when no promoted set reaches it.
    single: one group explains the divergence.
    diverged: the baseline's max gap exceeds `tolerance`.
    explained: some promoted set brought the replay within `tolerance` (False also when
      the baseline did not diverge).
    baseline_bit_identical: the baseline's losses equal the original run's bit for bit;
      None when no original losses were given or recorded.
    baseline_mismatch: the first differing step, one line (None when identical or not
      checked).
    replays: every Replay, in the order run.
    telemetry: the culprits' worst GEMM tensors (TensorStats of `inspect` at the first
      replayed step where the baseline leaves tolerance: its state and batch), worst
      first (overflow, then non-finite values, ..., then SQNR); () without culprits or a
      loss.
    unscoped: GEMM tensors of the loss outside any scope (no override reaches them).
    telemetry_step: the replayed step (1-based) the telemetry was read at; None without
      telemetry.
  """

  recipe: str
  reference: str
  start_step: int | None
  steps: int
  tolerance: float
  groups: tuple
  culprits: tuple
  single: bool
  diverged: bool
  explained: bool
  baseline_bit_identical: bool | None
  baseline_mismatch: str | None
  replays: tuple
  telemetry: tuple = ()
  unscoped: int = 0
  telemetry_step: int | None = None

  @property
  def n_replays(self) -> int:
    return len(self.replays)

  def __str__(self) -> str:
    base, ref = self.replays[0], self.replays[1]
    at = f" from step {self.start_step}" if self.start_step is not None else ""
    head = (f"{self.recipe}{at}, {self.steps} steps replayed {self.n_replays} times "
            f"against {self.reference} (tolerance {self.tolerance:g}): ")
    if self.baseline_bit_identical is None:
      ident = "baseline not compared with the original run (no original losses). "
    elif self.baseline_bit_identical:
      ident = "baseline bit-identical to the original run. "
    else:
      ident = f"baseline NOT bit-identical to the original run ({self.baseline_mismatch}). "
    if not all(math.isfinite(x) for x in ref.losses):
      return head + ident + "The f32 reference itself is not finite: nothing to bisect."
    if not self.diverged:
      return head + ident + (f"The baseline stays within tolerance of {self.reference} "
                             f"(max gap {base.max_gap:.3g}): no divergence to explain.")
    if not self.culprits:
      return head + ident + (
          f"The baseline diverges (max gap {base.max_gap:.3g}) and no single group, nor "
          f"all {len(self.groups)} promoted together, brings it within tolerance: the "
          "cause lies outside the GEMM scopes searched (GEMMs or elementwise ops outside "
          f"any scope: {self.unscoped} unscoped GEMM tensors; the optimizer).")
    fixed = next(r for r in reversed(self.replays) if r.within
                 and set(r.promoted) == set(self.culprits))
    names = " + ".join(describe_group(c) for c in self.culprits)
    what = ("layer" if self.single else
            "no single group explains it; a minimal set (none of its groups can be dropped)")
    text = (f"{what} {names}: promoting {'them' if self.single else 'it'} to f32 brings "
            "the max loss gap from "
            f"{base.max_gap:.3g} to {fixed.max_gap:.3g}")
    if self.telemetry:
      at = f" (replayed step {self.telemetry_step})" if self.telemetry_step else ""
      text += f"; its worst GEMM tensor{at}: " + describe_row(self.telemetry[0])
    return head + ident + text + "."


def describe_row(row: _report.TensorStats) -> str:
  """"l0, backward GEMM cotangent, float16: 100% underflow" for a TensorStats row."""
  where = "backward" if row.direction == "bwd" else "forward"
  stat = next((s for s in _VERDICT_STATS if getattr(row, s) > 0), None)
  value = (f"{100 * getattr(row, stat):.3g}% {stat}" if stat is not None
           else f"SQNR {row.sqnr_db:.1f} dB")
  return f"{row.scope}, {where} GEMM {row.role}, {row.dtype}: {value}"
