"""The sweep's statistics: a paired sign-flip test, Holm's correction, t intervals, and
the fp32-spread rule.

The sweep trains every recipe on the same seeds; a seed fixes the initial weights and the
data order, so a recipe's difference from the fp32 control *on the same seed* removes the
seed-to-seed variation that both share. For each recipe this module tests whether the
per-seed differences d_1..d_n are centred on zero:

  * paired test: the exact two-sided sign-flip (permutation) test of the mean. Under "no
    effect" the recipe and fp32 are exchangeable on each seed, so each d_i is as likely
    to be -d_i; the p-value is the fraction of the 2^n sign assignments whose |sum| is at
    least the observed one. It assumes only that symmetry (no normality), which matters at
    a handful of seeds. Its smallest possible p-value is 2^(1-n) (3 seeds: 0.25).
  * Holm's step-down correction across the m recipes compared with fp32 keeps the chance
    of any false "worse"/"better" in a sweep at or below alpha, whatever the dependence
    between the tests (they share the control's runs).
  * "undecided: needs >= N seeds": a recipe whose test could not reach Holm's first
    threshold alpha / m even with every seed agreeing (m * 2^(1-n) > alpha) is undecided
    by design, not "no difference"; N is the smallest seed count that could decide.
  * 95% interval: Student's t interval of the mean difference, shown as the effect size;
    it assumes roughly normal differences and is not corrected for the m recipes.
  * fp32-spread rule: a difference counts only beyond the control's range (max - min) over
    seeds. A descriptive check kept for comparison; it is not a test and controls no error
    rate (`spread_rule_null_rate`).

Everything here is numpy on host floats (lower values = better, as bits per byte).

Examples:
  >>> round(sign_flip_p_value([0.05, 0.02, 0.04]), 3)  # every seed worse: smallest p at n=3
  0.25
  >>> seeds_needed(7)  # 7 recipes against fp32, family-wise 5%
  9
  >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03])]
  [0.03, 0.06, 0.06]
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np

ALPHA = 0.05          # family-wise error rate of the verdicts
CI_LEVEL = 0.95       # two-sided level of the effect's interval
EXACT_MAX_SEEDS = 20  # above this, the sign-flip p-value is a seeded Monte Carlo estimate
MONTE_CARLO_FLIPS = 200_000
_CHUNK = 1 << 16      # sign patterns evaluated per block (bounds memory at n <= 20)

# Verdict labels (lower is better); "undecided" carries the seed count it needs.
WORSE, BETTER, NO_DIFFERENCE = "worse than fp32", "better than fp32", "no difference detected"

# The rules in words, for reports ("{alpha}": the family-wise error rate).
PAIRED_RULE = (
    "Per-seed differences from fp32 (same seed = same initial weights and data order), "
    "exact two-sided sign-flip permutation test of their mean, Holm-corrected across the "
    "recipes so that a false \"worse\"/\"better\" anywhere in the table has at most "
    "{alpha:.0%} probability when no recipe differs")
SPREAD_RULE = (
    "A recipe's mean difference from fp32 counts only if it exceeds the fp32 control's "
    "range (max - min) over seeds; a descriptive check, not a test")


def _diffs(values: Sequence[float], name: str = "diffs") -> np.ndarray:
  d = np.asarray(values, dtype=np.float64).reshape(-1)
  if not np.all(np.isfinite(d)):
    raise ValueError(f"{name}={list(values)!r}: every value must be finite")
  return d


def _check_alpha(alpha: float) -> None:
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha!r}; must be in (0, 1)")


def min_sign_flip_p(n: int) -> float:
  """Smallest two-sided p-value the exact sign-flip test can give with n differences.

  Only the observed signs and their mirror image reach the largest |sum|, so the minimum
  is 2 / 2^n.

  Args:
    n: number of paired differences (seeds), >= 1.

  Returns:
    2^(1-n) as a float (1.0 at n = 1).
  """
  if n < 1:
    raise ValueError(f"n={n!r}; the sign-flip test needs >= 1 difference")
  return 2.0 ** (1 - n)


def seeds_needed(m: int, alpha: float = ALPHA) -> int:
  """Fewest seeds with which the Holm-corrected sign-flip test can reject at all.

  Holm's first step compares the smallest p-value with alpha / m; with n seeds the
  smallest possible p-value is 2^(1-n). So N = min{n : m * 2^(1-n) <= alpha}.

  Args:
    m: number of recipes compared with the control (the family), >= 1.
    alpha: family-wise error rate in (0, 1).

  Returns:
    N as an int: 6 for one comparison at 5%, 9 for 7 comparisons.
  """
  if m < 1:
    raise ValueError(f"m={m!r}; the family needs >= 1 comparison")
  _check_alpha(alpha)
  n = 1
  while m * min_sign_flip_p(n) > alpha:
    n += 1
  return n


def sign_flip_p_value(diffs: Sequence[float], rng_seed: int = 0) -> float:
  """Two-sided p-value of the sign-flip permutation test that the differences centre on 0.

  The statistic is |sum(d)| (the same test as |mean|); the p-value is the fraction of
  sign assignments s in {-1, +1}^n with |sum(s * d)| >= |sum(d)|, the observed one
  included. Exact (all 2^n assignments) for n <= EXACT_MAX_SEEDS; above, MONTE_CARLO_FLIPS
  random assignments drawn from `rng_seed` plus the observed one, (1 + hits) / (1 + B),
  which is still a valid p-value. Sums equal up to float rounding count as ties (">=").

  Args:
    diffs: per-seed differences (recipe - control), finite floats, at least one.
    rng_seed: seed of the Monte Carlo assignments (unused when exact).

  Returns:
    p in (0, 1]; 1.0 when every difference is zero.
  """
  d = _diffs(diffs)
  n = d.size
  if n == 0:
    raise ValueError("diffs=[]; the sign-flip test needs >= 1 difference")
  observed = abs(float(np.sum(d)))
  # Different sign patterns can reach the same |sum| exactly yet round differently.
  tol = 4 * n * np.finfo(np.float64).eps * float(np.sum(np.abs(d)))
  hits = 0
  if n <= EXACT_MAX_SEEDS:
    total = 1 << n
    bits = np.arange(n, dtype=np.int64)
    for start in range(0, total, _CHUNK):
      idx = np.arange(start, min(start + _CHUNK, total), dtype=np.int64)[:, None]
      signs = 1.0 - 2.0 * ((idx >> bits) & 1)
      hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
    return hits / total
  rng = np.random.default_rng(rng_seed)
  for start in range(0, MONTE_CARLO_FLIPS, _CHUNK):
    rows = min(_CHUNK, MONTE_CARLO_FLIPS - start)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(rows, n))
    hits += int(np.count_nonzero(np.abs(signs @ d) >= observed - tol))
  return (1 + hits) / (1 + MONTE_CARLO_FLIPS)


def holm(p_values: Sequence[float]) -> list[float]:
  """Holm's step-down adjusted p-values (reject where adjusted <= alpha).

  Sorted ascending, the k-th smallest p (k = 1..m) becomes max over j <= k of
  min(1, (m - j + 1) p_(j)). Controls the family-wise error rate under any dependence.

  Args:
    p_values: unadjusted p-values in [0, 1], in any order.

  Returns:
    The adjusted p-values in the input's order.
  """
  p = np.asarray(p_values, dtype=np.float64).reshape(-1)
  if p.size == 0:
    return []
  if not np.all((p >= 0) & (p <= 1)):
    raise ValueError(f"p_values={list(p_values)!r}: each must be in [0, 1]")
  m = p.size
  order = np.argsort(p, kind="stable")
  adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
  out = np.empty(m)
  out[order] = adjusted
  return [float(x) for x in out]


@functools.lru_cache(maxsize=256)
def _t_quantile(df: int, q: float) -> float:
  # scipy is a dependency of jax, so it is always installed beside it; scipy.special's
  # inverse Student t CDF imports in a fraction of scipy.stats' time.
  from scipy import special  # pylint: disable=g-import-not-at-top
  return float(special.stdtrit(df, q))


def t_interval(diffs: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float]:
  """Student's t interval of the mean of the differences.

  mean +- t_{(1+level)/2, n-1} * sd / sqrt(n), with the sample sd (ddof=1). Exact when the
  differences are independent and normal; not corrected for multiple recipes.

  Args:
    diffs: finite floats.
    level: two-sided confidence level in (0, 1).

  Returns:
    (low, high); (nan, nan) with fewer than 2 differences.
  """
  d = _diffs(diffs)
  if not 0.0 < level < 1.0:
    raise ValueError(f"level={level!r}; must be in (0, 1)")
  if d.size < 2:
    return float("nan"), float("nan")
  half = _t_quantile(d.size - 1, 0.5 + level / 2) * float(np.std(d, ddof=1)) / math.sqrt(d.size)
  mean = float(np.mean(d))
  return mean - half, mean + half


class PairedResult(NamedTuple):
  """One recipe's paired comparison with the control.

  Attributes:
    n: paired differences (seeds run by both).
    mean: mean difference (recipe - control); lower is better.
    ci_low, ci_high: CI_LEVEL t interval of the mean (nan with n < 2).
    p_value: exact two-sided sign-flip p-value, unadjusted.
    p_holm: Holm-adjusted p-value across the family.
    verdict: WORSE, BETTER, NO_DIFFERENCE or "undecided: needs >= N seeds".
  """

  n: int
  mean: float
  ci_low: float
  ci_high: float
  p_value: float
  p_holm: float
  verdict: str


def paired_verdicts(diffs_by_recipe: Mapping[str, Sequence[float]], alpha: float = ALPHA,
                    level: float = CI_LEVEL) -> dict[str, PairedResult]:
  """Verdicts of the paired test for a family of recipes against one control.

  Each recipe's differences are tested with `sign_flip_p_value`; the p-values are
  Holm-corrected across the family. A recipe is "worse"/"better than fp32" when its
  adjusted p <= alpha (by the sign of the mean: lower is better); "undecided: needs >= N
  seeds" when m * 2^(1-n) > alpha, i.e. no data on n seeds could have decided; else
  "no difference detected" (the interval says how large a difference is still plausible).

  Args:
    diffs_by_recipe: recipe -> per-seed differences from the control (finite, >= 1 each).
    alpha: family-wise error rate in (0, 1).
    level: confidence level of the interval.

  Returns:
    recipe -> PairedResult, in the input's order.

  Examples:
    >>> r = paired_verdicts({"a": [0.05, 0.02, 0.04], "b": [0.01, -0.02, 0.0]})
    >>> r["a"].verdict, round(r["a"].p_value, 2)
    ('undecided: needs >= 7 seeds', 0.25)
  """
  _check_alpha(alpha)
  names = list(diffs_by_recipe)
  d = {k: _diffs(diffs_by_recipe[k], f"diffs_by_recipe[{k!r}]") for k in names}
  empty = [k for k in names if d[k].size == 0]
  if empty:
    raise ValueError(f"recipes {empty} have no paired difference; drop them from the family")
  m = len(names)
  if m == 0:
    return {}
  p = [sign_flip_p_value(d[k]) for k in names]
  p_adj = holm(p)
  needed = seeds_needed(m, alpha)
  out = {}
  for k, pk, pa in zip(names, p, p_adj):
    mean = float(np.mean(d[k]))
    lo, hi = t_interval(d[k], level)
    if pa <= alpha:
      verdict = WORSE if mean > 0 else BETTER
    elif m * min_sign_flip_p(d[k].size) > alpha:
      verdict = f"undecided: needs >= {needed} seeds"
    else:
      verdict = NO_DIFFERENCE
    out[k] = PairedResult(int(d[k].size), mean, lo, hi, pk, pa, verdict)
  return out


def is_decision(verdict: str) -> bool:
  """True for a verdict that claims a difference ("worse"/"better than fp32")."""
  return verdict in (WORSE, BETTER)


def spread_rule(diff: float, control_values: Sequence[float]) -> str:
  """The fp32-spread rule: is |diff| beyond the control's range over seeds?

  Args:
    diff: mean(recipe) - mean(control); lower is better.
    control_values: the control's final metric per seed (finite).

  Returns:
    "within fp32 range", "above fp32 range (worse)", "below fp32 range (better)", or
    "n/a (fp32 has < 2 seeds)" / "n/a" for a non-finite diff.
  """
  c = _diffs(control_values, "control_values")
  if c.size < 2:
    return "n/a (fp32 has < 2 seeds)"
  if not math.isfinite(diff):
    return "n/a"
  spread = float(np.ptp(c))
  if abs(diff) <= spread:
    return "within fp32 range"
  return "above fp32 range (worse)" if diff > 0 else "below fp32 range (better)"


def spread_rule_null_rate(n_seeds: int, trials: int = 20_000, seed: int = 0) -> float:
  """How often the fp32-spread rule flags a recipe that does not differ (Monte Carlo).

  Synthetic sweep: every run's final metric is the same mean plus independent standard
  normal noise, with no seed-to-seed variation (which would widen the control's range and
  lower the rate); a recipe is flagged when |mean(recipe) - mean(control)| exceeds the
  control's range over `n_seeds` seeds.

  Args:
    n_seeds: seeds per recipe, >= 2.
    trials: simulated (recipe, control) pairs.
    seed: numpy generator seed.

  Returns:
    The fraction flagged (about 0.14 at 3 seeds, 0.02 at 5).
  """
  if n_seeds < 2:
    raise ValueError(f"n_seeds={n_seeds!r}; the rule needs >= 2 seeds")
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((trials, 2, n_seeds))
  diff = x[:, 1].mean(axis=1) - x[:, 0].mean(axis=1)
  return float(np.mean(np.abs(diff) > np.ptp(x[:, 0], axis=1)))
