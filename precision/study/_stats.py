"""Verdict statistics of the study: recipes x seeds against an fp32 control.

Every recipe is trained on the same seeds as the control; a seed fixes the initial weights
and the data order (common random numbers), so the per-seed difference

  d_i = metric(recipe, seed_i) - metric(control, seed_i)      (lower metric = better)

removes the seed-to-seed variation both runs share. A family of m recipes is judged
against the one control; each recipe gets a verdict WORSE, BETTER, NO_DIFFERENCE or (only
for the sign-flip test) "undecided: needs >= N seeds", and the verdicts are corrected with
Holm's step-down procedure so that the chance of *any* false "worse"/"better" in the family
is at most alpha when no recipe differs (family-wise error rate), whatever the dependence
between the comparisons (they share the control's runs).

Why the default test is the paired t test
-----------------------------------------
The exact sign-flip (permutation) test assumes only that, under "no effect", d_i is as
likely as -d_i; but its smallest possible p-value is 2^(1-n). With 3 seeds that is 0.25,
and Holm's first threshold for 7 recipes is 0.05 / 7 = 0.0071, so it can never decide: a
recipe worse on every seed by +0.106, +0.102, +0.101 (95% interval [+0.096, +0.110]) stays
"undecided" and the study needs >= 9 seeds for the test to be able to say anything. The
paired t test of the mean of d uses the sizes of the differences, not only their signs, so
it decides where the data are clear. It is exact (size = alpha) when the d_i are
independent and normal. Its false-decision rate under other noise was measured with
`aa_false_decision_rate` (A/A families: every run = shared seed effect + independent
per-run noise, the same recipe m + 1 times, 20,000 trials each, seed 0; standard error
about 0.0015):

  family-wise false-decision rate, paired t + Holm, m = 7, alpha = 0.05
    noise        n = 3     n = 5
    normal       0.046     0.048
    t3           0.038     0.032     (heavy tails: the t test is conservative)
    lognormal    0.021     0.014     (skewed runs; the A/A difference is still symmetric)

All are <= alpha: the paired t test with Holm keeps the family-wise rate under alpha on
these heavy-tailed and skewed noises too (under a true A/A null the recipe and control
runs are exchangeable, so a per-seed difference is always symmetric, and symmetric heavy
tails make the t test conservative, not liberal). What the t test does not promise is
size for a mean-zero but *skewed difference* (a recipe slightly better on most seeds and
much worse on a few): with centred lognormal(0, 1) differences, independent between
recipes (10,000 trials), a single t test at alpha = 0.05 rejected 0.16 of the time at
n = 3 and 0.18 at n = 5, and the family of 7 had a decision in 0.24 / 0.42. Such a recipe
differs from the control on the typical seed, though not in mean; the sign-flip test,
whose null is symmetry about 0, would not protect that mean-null either. For comparison,
the A/A rate of the sign-flip test with Holm at n = 9, m = 7 (5,000 trials): 0.029
normal, 0.023 t3, 0.029 lognormal. `test="sign_flip"` keeps the distribution-free test for
studies with enough seeds (m * 2^(1-n) <= alpha: n >= 9 for 7 recipes).

Equivalence: with a `margin`, a recipe is also tested for equivalence with the control by
two one-sided t tests (TOST, H0: |mu| >= margin), Holm-corrected over the family. Measured
with `equivalence_error_rates` (normal differences, margin 1, 20,000 trials, seed 0):

    n   sd / margin   false equivalence at |mu| = margin   equivalence at mu = 0
    3   0.25          0.049                                0.980
    3   0.5           0.049                                0.559
    3   1.0           0.039                                0.127
    5   0.5           0.049                                0.948
    5   1.0           0.045                                0.289
    10  1.0           0.048                                0.796

The false-equivalence rate stays <= alpha (TOST's size is alpha as sd / margin -> 0 and
smaller otherwise); with 3 seeds equivalence can be shown only for a margin several times
the sd of a per-seed difference.

Everything here is numpy on host floats plus scipy.special (a dependency of jax); nothing
imports jax.

Examples:
  The decisive example: one recipe worse on every seed, six others noise around zero.

  >>> family = {"bf16_sr": [0.106, 0.102, 0.101],
  ...           **{f"r{i}": list(d) for i, d in enumerate(
  ...               [[0.004, -0.003, 0.001], [-0.002, 0.003, -0.001], [0.001, 0.002, -0.004],
  ...                [-0.003, -0.001, 0.004], [0.002, -0.004, 0.001], [0.0, 0.003, -0.002]])}}
  >>> res = compare(family)
  >>> r = res["bf16_sr"]
  >>> r.verdict, r.test, r.n
  ('worse', 't', 3)
  >>> round(r.mean_delta, 3), [round(x, 3) for x in r.ci], r.p_holm < 0.05
  (0.103, [0.096, 0.11], True)
  >>> sorted({c.verdict for k, c in res.items() if k != "bf16_sr"})
  ['no difference detected']
  >>> compare(family, test="sign_flip")["bf16_sr"].verdict  # cannot decide at 3 seeds
  'undecided: needs >= 9 seeds'
  >>> round(sign_flip_p_value([0.106, 0.102, 0.101]), 2)
  0.25
  >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03])]
  [0.03, 0.06, 0.06]

Size: every statistic a verdict uses and the Monte Carlo calibrations that measure its
error rates, kept together so each test's definition sits beside its measured rate.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np
from scipy import special

ALPHA = 0.05          # family-wise error rate of the verdicts
CI_LEVEL = 0.95       # two-sided level of the effect's interval
TESTS = ("t", "sign_flip")
NOISES = ("normal", "t3", "lognormal")
TARGET_POWER = 0.8    # the power `Comparison.seeds_needed` asks for

EXACT_MAX_SEEDS = 20  # above this, the sign-flip p-value is a seeded Monte Carlo estimate
MONTE_CARLO_FLIPS = 200_000
_CHUNK = 1 << 16      # sign patterns evaluated per block (bounds memory at n <= 20)

# Verdict words (lower is better); the report appends "than fp32". "undecided: needs >= N
# seeds" (sign-flip test only) carries the seed count the test needs to be able to decide.
WORSE, BETTER, NO_DIFFERENCE = "worse", "better", "no difference detected"
FASTER, SLOWER = "faster", "slower"


# --------------------------------------------------------------------------- validation


def _deltas(values: Sequence[float], name: str = "deltas") -> np.ndarray:
  d = np.asarray(values, dtype=np.float64).reshape(-1)
  if not np.all(np.isfinite(d)):
    raise ValueError(f"{name}={list(values)!r}: every value must be finite")
  return d


def _sd(d: np.ndarray) -> float:
  """Sample sd (ddof = 1); exactly 0.0 when every value is the same (np.std can leave
  rounding residue there: [0.1, 0.1, 0.1] -> 1.7e-17)."""
  return 0.0 if np.all(d == d[0]) else float(np.std(d, ddof=1))


def _at_least_two(d: np.ndarray, name: str, values) -> None:
  if d.size < 2:
    raise ValueError(f"{name}={list(values)!r}: the test needs >= 2 seeds (paired "
                     f"differences), got {d.size}")


def _check_alpha(alpha: float, name: str = "alpha") -> None:
  if not (isinstance(alpha, (int, float, np.floating)) and 0.0 < float(alpha) < 1.0):
    raise ValueError(f"{name}={alpha!r}; must be a number in (0, 1)")


def _check_test(test: str) -> None:
  if test not in TESTS:
    raise ValueError(f"test={test!r}; accepted tests are {TESTS}")


def _check_margin(margin: float) -> None:
  if not (isinstance(margin, (int, float, np.floating)) and math.isfinite(margin)
          and margin > 0):
    raise ValueError(f"margin={margin!r}; must be a finite number > 0 (in the units of "
                     "the deltas)")


def _check_count(value, name: str, least: int) -> None:
  if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
          and value >= least):
    raise ValueError(f"{name}={value!r}; must be an integer >= {least}")


# --------------------------------------------------------------------------- tests


def paired_t_p_value(deltas: Sequence[float]) -> float:
  """Two-sided p-value of the paired (one-sample) t test that the mean of deltas is 0.

  t = mean / (sd / sqrt(n)) with the sample sd (ddof = 1), referred to Student's t with
  n - 1 degrees of freedom. Assumes independent, normally distributed differences; then the
  test has size exactly alpha. It is robust to symmetric heavy tails (conservative) but
  can be liberal for strongly skewed differences; see the module docstring for the rates
  measured on synthetic studies.

  With sd == 0 (every difference identical) the statistic is undefined; by convention the
  p-value is 1.0 when every difference is exactly zero (nothing to detect) and 0.0 when
  they are all equal and nonzero (the same nonzero difference on every seed, no noise).

  Args:
    deltas: per-seed differences (recipe - control), finite floats, at least 2.

  Returns:
    p in [0, 1].

  Examples:
    >>> round(paired_t_p_value([0.3, 0.1, 0.2]), 4)
    0.0742
    >>> paired_t_p_value([0.0, 0.0]), paired_t_p_value([0.1, 0.1, 0.1])
    (1.0, 0.0)
  """
  d = _deltas(deltas)
  _at_least_two(d, "deltas", deltas)
  sd = _sd(d)
  mean = float(np.mean(d))
  if sd == 0.0:
    return 1.0 if mean == 0.0 else 0.0
  t = abs(mean) / (sd / math.sqrt(d.size))
  return float(min(1.0, 2.0 * special.stdtr(d.size - 1, -t)))


def min_sign_flip_p(n: int) -> float:
  """Smallest two-sided p-value the exact sign-flip test can give with n differences.

  Only the observed signs and their mirror image reach the largest |sum|: 2 / 2^n.
  """
  _check_count(n, "n", 1)
  return 2.0 ** (1 - n)


def sign_flip_seeds(m: int, alpha: float = ALPHA) -> int:
  """Fewest seeds with which the Holm-corrected sign-flip test can reject at all.

  N = min{n : m * 2^(1-n) <= alpha} (Holm's first threshold is alpha / m): 6 for one
  comparison at 5%, 9 for 7.
  """
  _check_count(m, "m", 1)
  _check_alpha(alpha)
  n = 1
  while m * min_sign_flip_p(n) > alpha:
    n += 1
  return n


def sign_flip_p_value(deltas: Sequence[float], rng_seed: int = 0) -> float:
  """Two-sided p-value of the sign-flip permutation test that the differences centre on 0.

  Assumes only that under "no effect" each d_i is as likely as -d_i (exchangeable recipe
  and control on each seed), no normality; the test has size <= alpha for any such
  distribution. The statistic is |sum(d)|; the p-value is the fraction of sign
  assignments s in {-1, +1}^n with |sum(s * d)| >= |sum(d)|, the observed one included.
  Exact (all 2^n assignments) for n <= EXACT_MAX_SEEDS; above, MONTE_CARLO_FLIPS random
  assignments drawn from `rng_seed` plus the observed one, (1 + hits) / (1 + B), still a
  valid p-value. Sums equal up to float rounding count as ties. The smallest possible
  value is 2^(1-n) (`min_sign_flip_p`), so it needs m * 2^(1-n) <= alpha to decide.

  Args:
    deltas: per-seed differences (recipe - control), finite floats, at least one.
    rng_seed: seed of the Monte Carlo assignments (unused when exact).

  Returns:
    p in (0, 1]; 1.0 when every difference is zero.

  Examples:
    >>> sign_flip_p_value([0.05, 0.02, 0.04]), sign_flip_p_value([0.1] * 6)
    (0.25, 0.03125)
  """
  d = _deltas(deltas)
  n = d.size
  if n == 0:
    raise ValueError("deltas=[]; the sign-flip test needs >= 1 difference")
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
  min(1, (m - j + 1) p_(j)). Controls the family-wise error rate at alpha under any
  dependence between the tests; uniformly more powerful than Bonferroni.

  Args:
    p_values: unadjusted p-values in [0, 1], in any order.

  Returns:
    The adjusted p-values in the input's order.

  Examples:
    >>> [round(p, 3) for p in holm([0.01, 0.04, 0.03, 0.005])]
    [0.03, 0.06, 0.06, 0.02]
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


def tost_p_value(deltas: Sequence[float], margin: float) -> float:
  """p-value of two one-sided t tests (TOST) for equivalence within +-margin.

  H0: |mu| >= margin against H1: |mu| < margin, mu the mean difference. The two one-sided
  tests are H0: mu <= -margin (statistic (mean + margin) / se) and H0: mu >= margin
  (statistic (mean - margin) / se), each referred to Student's t with n - 1 degrees of
  freedom; the TOST p-value is the larger of the two one-sided p's, and equivalence is
  declared when it is <= alpha. Assumes independent normal differences; the size is at
  most alpha at the boundary |mu| = margin (alpha in the limit sd / margin -> 0, smaller
  otherwise). Equivalent to the (1 - 2 alpha) t interval lying inside (-margin, margin).

  With sd == 0 (every difference identical): 0.0 if |mean| < margin, else 1.0.

  Args:
    deltas: per-seed differences, finite floats, at least 2.
    margin: equivalence margin in the units of the deltas, finite and > 0.

  Returns:
    p in [0, 1].

  Examples:
    >>> round(tost_p_value([0.01, -0.02, 0.005, 0.0], margin=0.1), 4)
    0.0003
  """
  _check_margin(margin)
  d = _deltas(deltas)
  _at_least_two(d, "deltas", deltas)
  mean = float(np.mean(d))
  sd = _sd(d)
  if sd == 0.0:
    return 0.0 if abs(mean) < margin else 1.0
  se = sd / math.sqrt(d.size)
  df = d.size - 1
  p_lower = float(special.stdtr(df, -(mean + margin) / se))  # H0: mu <= -margin
  p_upper = float(special.stdtr(df, (mean - margin) / se))   # H0: mu >= margin
  return max(p_lower, p_upper)


@functools.lru_cache(maxsize=512)
def _t_quantile(df: int, q: float) -> float:
  return float(special.stdtrit(df, q))


def t_interval(deltas: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float]:
  """Student's t interval of the mean of the differences.

  mean +- t_{(1+level)/2, n-1} * sd / sqrt(n), sample sd (ddof = 1). Exact coverage when
  the differences are independent and normal; not corrected for the m recipes.

  Args:
    deltas: finite floats.
    level: two-sided confidence level in (0, 1).

  Returns:
    (low, high); (nan, nan) with fewer than 2 differences.
  """
  d = _deltas(deltas)
  _check_alpha(level, "level")
  if d.size < 2:
    return float("nan"), float("nan")
  half = _t_quantile(d.size - 1, 0.5 + level / 2) * _sd(d) / math.sqrt(d.size)
  mean = float(np.mean(d))
  return mean - half, mean + half


# --------------------------------------------------------------------------- power


_QUAD_Q = (np.arange(4096) + 0.5) / 4096  # chi-square quantile midpoints


def _nct_cdf(df: np.ndarray, ncp: np.ndarray, t: np.ndarray) -> np.ndarray:
  """CDF of the noncentral t, scipy.special.nctdtr with a quadrature fallback.

  scipy 1.17's nctdtr returns nan in far tails (e.g. df=2, ncp=8, t=-12; measured: every
  nan cell on a df 1..399 x ncp 0..60 grid has a true value below 1e-16). There the CDF
  is recomputed as E[Phi(t sqrt(V / df) - ncp)], V ~ chi-square(df), by the midpoint rule
  on 4096 quantiles of V (absolute error <= 1e-6 where checked against nctdtr).
  """
  df, ncp, t = np.broadcast_arrays(*(np.asarray(a, np.float64) for a in (df, ncp, t)))
  out = np.array(special.nctdtr(df, ncp, t), dtype=np.float64)
  for i in zip(*np.nonzero(~np.isfinite(out))):
    v = special.chdtri(df[i], _QUAD_Q)
    out[i] = float(np.mean(special.ndtr(t[i] * np.sqrt(v / df[i]) - ncp[i])))
  return out


def _t_power_array(effect: float, sd: float, n: np.ndarray, alpha: float,
                   two_sided: bool) -> np.ndarray:
  df = (np.asarray(n) - 1).astype(np.float64)
  ncp = abs(effect) * np.sqrt(np.asarray(n, np.float64)) / sd
  if two_sided:
    crit = special.stdtrit(df, 1.0 - alpha / 2)
    power = _nct_cdf(df, ncp, -crit) + (1.0 - _nct_cdf(df, ncp, crit))
  else:
    crit = special.stdtrit(df, 1.0 - alpha)
    power = 1.0 - _nct_cdf(df, ncp, crit)
  return np.clip(power, 0.0, 1.0)


def t_power(effect: float, sd: float, n: int, alpha: float, two_sided: bool = True) -> float:
  """Power of the paired t test at level alpha to detect a true mean difference `effect`.

  With independent normal differences of standard deviation `sd`, the t statistic follows
  a noncentral t with n - 1 degrees of freedom and noncentrality effect * sqrt(n) / sd;
  the power is its probability beyond the critical values +-t_{1 - alpha/2, n-1} (two
  sided) or t_{1 - alpha, n-1} (one sided, in the direction of the effect), computed with
  scipy.special.nctdtr. For a family of m recipes under Holm, t_power(..., alpha / m) is a
  lower bound on a recipe's power (Holm's first threshold; Bonferroni).

  Args:
    effect: true mean difference, in the units of the deltas (its sign does not matter).
    sd: standard deviation of one per-seed difference, > 0.
    n: seeds, >= 2.
    alpha: level of the test, in (0, 1).
    two_sided: two-sided (the verdict's test) or one-sided.

  Returns:
    The power in [0, 1]; nan when undefined (sd <= 0 or a non-finite effect / sd).
  """
  _check_alpha(alpha)
  _check_count(n, "n", 2)
  if not (math.isfinite(effect) and math.isfinite(sd)) or sd <= 0:
    return float("nan")
  return float(_t_power_array(effect, sd, np.array([n]), alpha, two_sided)[0])


def seeds_needed(effect: float, sd: float, m: int, alpha: float = ALPHA,
                 power: float = TARGET_POWER, test: str = "t",
                 max_seeds: int = 1000) -> int | None:
  """Fewest seeds giving at least `power` to detect a true shift `effect` in a family of m.

  test="t": the smallest n >= 2 with t_power(effect, sd, n, alpha / m) >= power (alpha / m:
  Holm's first threshold, so the recipe is detected with at least that probability when
  the others are null). test="sign_flip": the same normal-theory count, but never fewer
  than `sign_flip_seeds(m, alpha)`, the seeds without which the sign-flip test cannot
  decide at all. That is an approximation: the permutation test of the mean has the t
  test's power asymptotically, less at small n (its p-values are discrete), so the count
  is optimistic near the minimum. Measured (normal differences, 1000 trials, level
  alpha / m, at the shift where the t power is 0.80): sign-flip power 0.57 at n = 9,
  m = 7; 0.79 at n = 12, m = 7; 0.78 at n = 16, m = 7; 0.79 at n = 10, m = 1.

  Args:
    effect: true mean difference to detect (units of the deltas; sign ignored).
    sd: standard deviation of one per-seed difference.
    m: recipes in the family, >= 1.
    alpha: family-wise error rate in (0, 1).
    power: the power wanted, in (0, 1).
    test: one of TESTS.
    max_seeds: the largest count searched.

  Returns:
    The count, or None when it is not computable (sd <= 0, effect 0, non-finite inputs)
    or larger than max_seeds.

  Examples:
    >>> seeds_needed(1.0, 1.0, m=1), seeds_needed(1.0, 1.0, m=7)
    (10, 17)
    >>> seeds_needed(5.0, 1.0, m=7), seeds_needed(5.0, 1.0, m=7, test="sign_flip")
    (4, 9)
  """
  _check_count(m, "m", 1)
  _check_alpha(alpha)
  _check_alpha(power, "power")
  _check_test(test)
  _check_count(max_seeds, "max_seeds", 2)
  if not (math.isfinite(effect) and math.isfinite(sd)) or sd <= 0 or effect == 0:
    return None
  least = 2 if test == "t" else max(2, sign_flip_seeds(m, alpha))
  if least > max_seeds:
    return None
  def enough(n: int) -> bool:
    return bool(_t_power_array(effect, sd, np.array([n]), alpha / m, True)[0] >= power)

  # The t test's power increases with n (larger noncentrality, smaller critical value), so
  # the first n reaching `power` is found by doubling, then bisection.
  if enough(least):
    return least
  low, high = least, least
  while not enough(high):
    if high >= max_seeds:
      return None
    low, high = high, min(2 * high, max_seeds)
  while high - low > 1:  # enough(high) and not enough(low)
    mid = (low + high) // 2
    low, high = (low, mid) if enough(mid) else (mid, high)
  return high


# --------------------------------------------------------------------------- verdicts


class Comparison(NamedTuple):
  """One recipe against the control.

  Attributes:
    n: paired seeds.
    deltas: per-seed differences (recipe - control), seed order.
    mean_delta: their mean; lower is better.
    ci: `level` t interval of the mean ((nan, nan) if n < 2; not family-corrected).
    p_value: unadjusted two-sided p-value of the chosen test.
    p_holm: Holm-adjusted p-value over the family.
    verdict: WORSE / BETTER (p_holm <= alpha, by the sign of the mean), NO_DIFFERENCE, or
      "undecided: needs >= N seeds" (sign-flip test only: it could not have decided at
      this n, m * 2^(1-n) > alpha).
    margin: the equivalence margin, None when not asked.
    equivalent: TOST at `margin`, Holm-corrected over the family (None without margin).
    p_equivalence: Holm-adjusted TOST p-value (None without margin).
    power: power of the verdict's test (this n, level alpha / m, the lower bound under
      Holm) to detect a true shift equal to the margin, or, without a margin, equal to
      |mean_delta| at the observed sd (an "observed power": a function of the p-value,
      useful only to size the next study); nan when undefined (sd 0). For the sign-flip
      test it is the normal-theory t power (optimistic near the fewest seeds that can
      decide, see `seeds_needed`), 0.0 where the test cannot decide.
    seeds_needed: fewest seeds giving >= 80% power for that same effect (None if not
      computable, e.g. sd 0 or effect 0).
    test: the test used ("t" or "sign_flip").
    ci_holm: the interval that agrees with the verdict (`holm_intervals`): the t interval
      at level 1 - alpha / (m - k + 1) for the recipe Holm rejected at its k-th step, and
      at the level where Holm stopped for the others, so it excludes 0 exactly when the
      verdict (t test) says WORSE / BETTER. For the sign-flip test it is still the t
      interval, and can disagree with that test's verdict.
    ci_holm_level: its two-sided level.
    equivalence_bound: the tightest equivalence margin the seeds support: the smallest x
      such that TOST at level alpha / m (Bonferroni over the family) shows |mu| < x,
      |mean| + t_{1 - alpha/m, n-1} * sd / sqrt(n) (`equivalence_bound`): "within +-x
      at 95%" for alpha 0.05, family-wise. A margin above it holds up; Holm can also show
      a margin slightly below it for any but the least certain recipe.
  """

  n: int
  deltas: tuple[float, ...]
  mean_delta: float
  ci: tuple[float, float]
  p_value: float
  p_holm: float
  verdict: str
  margin: float | None
  equivalent: bool | None
  p_equivalence: float | None
  power: float
  seeds_needed: int | None
  test: str
  ci_holm: tuple[float, float] = (float("nan"), float("nan"))
  ci_holm_level: float = float("nan")
  equivalence_bound: float = float("nan")


def is_decision(verdict: str) -> bool:
  """True for a verdict that claims a difference (WORSE, BETTER, FASTER, SLOWER)."""
  return verdict in (WORSE, BETTER, FASTER, SLOWER)


def equivalence_bound(deltas: Sequence[float], alpha: float = ALPHA, m: int = 1) -> float:
  """Tightest equivalence margin n differences support: |mean| + t_{1-alpha/m, n-1} se.

  TOST at level a = alpha / m rejects |mu| >= x exactly when the (1 - 2a) t interval lies
  inside (-x, x), i.e. when x > max(|low|, |high|) = |mean| + t_{1-a, n-1} * sd / sqrt(n).
  Bonferroni over the m recipes of the family: every row's "within +-x" holds at once
  with probability >= 1 - alpha under normal differences. nan with fewer than 2.

  Examples:
    >>> round(equivalence_bound([0.01, -0.02, 0.005, 0.0]), 4)
    0.0167
  """
  d = _deltas(deltas)
  _check_alpha(alpha)
  _check_count(m, "m", 1)
  if d.size < 2:
    return float("nan")
  return abs(float(np.mean(d))) + _t_quantile(d.size - 1, 1.0 - alpha / m) * _sd(d) / \
      math.sqrt(d.size)


def holm_levels(p_values: Sequence[float], alpha: float = ALPHA) -> list[float]:
  """Per test, the two-sided level 1 - a_i of an interval that agrees with Holm's verdict.

  Holm compares the k-th smallest p with alpha / (m - k + 1) and stops at the first that
  is larger; the r tests before it are rejected. A rejected test at step k gets a_i =
  alpha / (m - k + 1) (its p <= a_i: its interval excludes 0); every test not rejected
  gets the level where Holm stopped, a_i = alpha / (m - r) (its p > a_i: its interval
  includes 0). For a t test, whose interval and p-value are dual, the interval at 1 - a_i
  then excludes 0 exactly for the rejected tests.

  Examples:
    >>> [round(x, 4) for x in holm_levels([0.01, 0.04, 0.03, 0.005])]
    [0.9833, 0.975, 0.975, 0.9875]
  """
  p = np.asarray(p_values, np.float64).reshape(-1)
  m = p.size
  order = np.argsort(p, kind="stable")
  adjusted = holm(p)
  out = np.empty(m)
  rejected = 0
  for k, i in enumerate(order):
    if adjusted[i] <= alpha:
      out[i] = alpha / (m - k)
      rejected = k + 1
  for i in order[rejected:]:
    out[i] = alpha / (m - rejected)
  return [float(1.0 - a) for a in out]


def _p_value(d: np.ndarray, test: str) -> float:
  return paired_t_p_value(d) if test == "t" else sign_flip_p_value(d)


def _compare(deltas_by_recipe, alpha, margin, test, level, with_power):
  _check_test(test)
  _check_alpha(alpha)
  _check_alpha(level, "level")
  if margin is not None:
    _check_margin(margin)
  names = list(deltas_by_recipe)
  d = {}
  for k in names:
    d[k] = _deltas(deltas_by_recipe[k], f"deltas_by_recipe[{k!r}]")
    _at_least_two(d[k], f"deltas_by_recipe[{k!r}]", deltas_by_recipe[k])
  m = len(names)
  if m == 0:
    return {}
  p = [_p_value(d[k], test) for k in names]
  p_adj = holm(p)
  if margin is not None:
    p_eq = holm([tost_p_value(d[k], margin) for k in names])
  levels = holm_levels(p, alpha)
  out = {}
  for i, k in enumerate(names):
    dk = d[k]
    n = int(dk.size)
    mean = float(np.mean(dk))
    if p_adj[i] <= alpha and mean != 0.0:
      verdict = WORSE if mean > 0 else BETTER
    elif test == "sign_flip" and m * min_sign_flip_p(n) > alpha:
      verdict = f"undecided: needs >= {sign_flip_seeds(m, alpha)} seeds"
    else:
      verdict = NO_DIFFERENCE
    power, needed = float("nan"), None
    if with_power:
      sd = _sd(dk)
      effect = margin if margin is not None else abs(mean)
      power = t_power(effect, sd, n, alpha / m)
      if test == "sign_flip" and m * min_sign_flip_p(n) > alpha and not math.isnan(power):
        power = 0.0
      needed = seeds_needed(effect, sd, m, alpha, TARGET_POWER, test)
    out[k] = Comparison(
        n=n, deltas=tuple(float(x) for x in dk), mean_delta=mean,
        ci=t_interval(dk, level), p_value=float(p[i]), p_holm=float(p_adj[i]),
        verdict=verdict, margin=None if margin is None else float(margin),
        equivalent=None if margin is None else bool(p_eq[i] <= alpha),
        p_equivalence=None if margin is None else float(p_eq[i]),
        power=power, seeds_needed=needed, test=test,
        ci_holm=t_interval(dk, levels[i]), ci_holm_level=levels[i],
        equivalence_bound=equivalence_bound(dk, alpha, m))
  return out


def compare(deltas_by_recipe: Mapping[str, Sequence[float]], *, alpha: float = ALPHA,
            margin: float | None = None, test: str = "t",
            level: float = CI_LEVEL) -> dict[str, Comparison]:
  """Verdicts for a family of recipes against one control from their per-seed differences.

  Each recipe's differences are tested (test="t": `paired_t_p_value`, the default;
  test="sign_flip": `sign_flip_p_value`), the p-values are Holm-corrected over the m
  recipes, and a recipe is WORSE / BETTER when its adjusted p <= alpha (by the sign of its
  mean; lower is better). Otherwise:

    * test="sign_flip": "undecided: needs >= N seeds" when m * 2^(1-n) > alpha, i.e. no
      data on n seeds could have decided (N = `sign_flip_seeds(m, alpha)`); else
      NO_DIFFERENCE.
    * test="t": NO_DIFFERENCE. The t test can reach any p-value at n >= 2, so it is never
      undecided by construction; `power` and `seeds_needed` say how many seeds would give
      80% power for the margin (or the observed |mean_delta|).

  NO_DIFFERENCE is not equivalence; pass `margin` for a TOST equivalence verdict (always
  by t tests, whatever `test`), Holm-corrected over the family.

  Error rates: family-wise rate of a false WORSE/BETTER <= alpha when no recipe differs,
  exactly for the sign-flip test (symmetric differences), and for the t test under normal
  differences (measured on heavy-tailed and skewed noise: module docstring).

  Args:
    deltas_by_recipe: recipe -> per-seed differences from the control (finite, >= 2).
    alpha: family-wise error rate in (0, 1).
    margin: equivalence margin (> 0, finite) or None.
    test: one of TESTS.
    level: two-sided level of each recipe's interval.

  Returns:
    recipe -> Comparison, in the input's order.
  """
  return _compare(deltas_by_recipe, alpha, margin, test, level, with_power=True)


# --------------------------------------------------------------------------- time to target


def time_to_target(curve: Sequence[tuple[int, float]], target: float) -> int | None:
  """First step whose metric is <= target (lower is better), None if never.

  Args:
    curve: (step, metric) pairs in increasing step order; points with a non-finite metric
      (a NaN / inf evaluation) are ignored.
    target: the metric to reach, finite.

  Returns:
    The step (int) or None.

  Examples:
    >>> time_to_target([(0, 3.0), (100, float("nan")), (200, 1.4), (300, 1.2)], 1.5)
    200
    >>> time_to_target([(0, 3.0), (100, 2.0)], 1.5) is None
    True
  """
  if not (isinstance(target, (int, float, np.floating)) and math.isfinite(target)):
    raise ValueError(f"target={target!r}; must be a finite number")
  last = None
  for point in curve:
    try:
      step, metric = point
    except (TypeError, ValueError):
      raise ValueError(f"curve point {point!r}; each must be a (step, metric) pair") from None
    if last is not None and step <= last:
      raise ValueError(f"curve steps must increase; step {step!r} follows {last!r}")
    last = step
    if math.isfinite(metric) and metric <= target:
      return int(step)
  return None


class TimeToTarget(NamedTuple):
  """One recipe's time to target against the control's, paired by seed.

  Attributes:
    n_reached_both: seeds on which both the recipe and the control reached the target.
    deltas: steps, recipe - control, on those seeds (seed order).
    mean_delta: their mean (nan if none); negative = faster.
    ci: CI_LEVEL t interval of the mean ((nan, nan) with < 2).
    p_holm: Holm-adjusted p-value over the family (1.0 where no test was possible).
    verdict: FASTER / SLOWER (p_holm <= alpha), NO_DIFFERENCE, or "undecided: ..." saying
      why (fewer than 2 seeds where both reached; seeds where only one of the two reached,
      which censors the difference; the sign-flip test's seed count).
    never_reached: seeds where the recipe never reached the target but the control did.
    p_value: unadjusted p-value (nan where no test was possible).
    test: the test used.
  """

  n_reached_both: int
  deltas: tuple[float, ...]
  mean_delta: float
  ci: tuple[float, float]
  p_holm: float
  verdict: str
  never_reached: int
  p_value: float
  test: str


def _steps(values, name: str) -> list[int | None]:
  out = []
  for v in values:
    if v is None:
      out.append(None)
    elif isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0:
      out.append(int(v))
    else:
      raise ValueError(f"{name}={list(values)!r}: each entry must be a step (int >= 0) or "
                       "None (never reached)")
  return out


def compare_time_to_target(ttt_by_recipe: Mapping[str, Sequence[int | None]],
                           control: Sequence[int | None], *, alpha: float = ALPHA,
                           test: str = "t") -> dict[str, TimeToTarget]:
  """Faster / slower verdicts on the steps each recipe needs to reach a target metric.

  Entry i of every sequence is seed i's `time_to_target` (None: never reached). The paired
  difference (recipe - control, in steps) is taken on the seeds where both reached; it is
  tested with `test` and Holm-corrected over all m recipes (a recipe that cannot be tested
  enters the correction with p = 1, which only makes it stricter). Verdict:

    * "undecided: the recipe never reached the target on k seed(s) where the control did"
      (or the reverse): a seed where only one run reached it has no step difference, only
      a bound, and dropping it would bias the mean; so no verdict is claimed.
    * "undecided: needs >= 2 seeds where both reach the target".
    * "undecided: needs >= N seeds" (sign-flip only, as in `compare`).
    * else FASTER (mean < 0) / SLOWER when p_holm <= alpha, NO_DIFFERENCE otherwise.

  Args:
    ttt_by_recipe: recipe -> per-seed steps (or None), same length as `control`.
    control: the control's per-seed steps (or None).
    alpha: family-wise error rate in (0, 1).
    test: one of TESTS.

  Returns:
    recipe -> TimeToTarget, in the input's order.
  """
  _check_test(test)
  _check_alpha(alpha)
  ctrl = _steps(control, "control")
  names = list(ttt_by_recipe)
  m = len(names)
  rows = {}
  for k in names:
    r = _steps(ttt_by_recipe[k], f"ttt_by_recipe[{k!r}]")
    if len(r) != len(ctrl):
      raise ValueError(f"ttt_by_recipe[{k!r}] has {len(r)} seeds, control has {len(ctrl)}; "
                       "entries must be paired by seed")
    both = [float(a - c) for a, c in zip(r, ctrl) if a is not None and c is not None]
    never = sum(a is None and c is not None for a, c in zip(r, ctrl))
    only = sum(a is not None and c is None for a, c in zip(r, ctrl))
    rows[k] = (np.array(both), never, only)
  p = [_p_value(d, test) if d.size >= 2 and not never and not only else float("nan")
       for d, never, only in rows.values()]
  p_adj = holm([1.0 if math.isnan(x) else x for x in p])
  out = {}
  for i, k in enumerate(names):
    d, never, only = rows[k]
    mean = float(np.mean(d)) if d.size else float("nan")
    if never:
      verdict = (f"undecided: the recipe never reached the target on {never} seed(s) where "
                 "the control did")
    elif only:
      verdict = (f"undecided: the control never reached the target on {only} seed(s) where "
                 "the recipe did")
    elif d.size < 2:
      verdict = "undecided: needs >= 2 seeds where both reach the target"
    elif p_adj[i] <= alpha and mean != 0.0:
      verdict = FASTER if mean < 0 else SLOWER
    elif test == "sign_flip" and m * min_sign_flip_p(d.size) > alpha:
      verdict = f"undecided: needs >= {sign_flip_seeds(m, alpha)} seeds"
    else:
      verdict = NO_DIFFERENCE
    out[k] = TimeToTarget(
        n_reached_both=int(d.size), deltas=tuple(float(x) for x in d), mean_delta=mean,
        ci=t_interval(d), p_holm=float(p_adj[i]), verdict=verdict, never_reached=int(never),
        p_value=float(p[i]), test=test)
  return out


# --------------------------------------------------------------------------- error rates


def _noise(rng: np.random.Generator, kind: str, shape) -> np.ndarray:
  if kind == "normal":
    return rng.standard_normal(shape)
  if kind == "t3":
    return rng.standard_t(3, shape)
  if kind == "lognormal":
    return rng.lognormal(0.0, 1.0, shape)
  raise ValueError(f"noise={kind!r}; accepted noises are {NOISES}")


def aa_false_decision_rate(n_seeds: int, m: int, trials: int = 2000, alpha: float = ALPHA,
                           test: str = "t", noise: str = "normal", seed: int = 0) -> float:
  """Family-wise false-decision rate of `compare` on synthetic A/A studies (Monte Carlo).

  Each trial is a study of m + 1 runs of the *same* recipe on n_seeds seeds: a run's
  final metric is a seed effect shared by every run on that seed (standard normal) plus
  independent per-run noise: standard normal, Student t with 3 degrees of freedom (heavy
  tails), or lognormal(0, 1) (skewed). Row 0 is the control; the m others give the deltas.
  The trial counts when `compare`'s verdict rule (the same code, without the power
  columns) calls any recipe WORSE or BETTER. Seeded: reproducible.

  Args:
    n_seeds: seeds per run, >= 2.
    m: recipes in the family, >= 1.
    trials: simulated studies, >= 1.
    alpha: family-wise error rate in (0, 1).
    test: one of TESTS.
    noise: one of NOISES.
    seed: numpy generator seed.

  Returns:
    The fraction of trials with any decision (standard error sqrt(r (1 - r) / trials)).
  """
  _check_count(n_seeds, "n_seeds", 2)
  _check_count(m, "m", 1)
  _check_count(trials, "trials", 1)
  _check_alpha(alpha)
  _check_test(test)
  if noise not in NOISES:
    raise ValueError(f"noise={noise!r}; accepted noises are {NOISES}")
  rng = np.random.default_rng(seed)
  hits = 0
  for _ in range(trials):
    x = rng.standard_normal(n_seeds) + _noise(rng, noise, (m + 1, n_seeds))
    family = {f"r{i}": x[i] - x[0] for i in range(1, m + 1)}
    res = _compare(family, alpha, None, test, CI_LEVEL, with_power=False)
    hits += any(is_decision(c.verdict) for c in res.values())
  return hits / trials


def equivalence_error_rates(n_seeds: int, margin: float, sd: float, trials: int = 2000,
                            alpha: float = ALPHA, seed: int = 0) -> dict[str, float]:
  """Error rates of the TOST equivalence verdict for one recipe (Monte Carlo).

  Per-seed differences are drawn normal with standard deviation `sd` and mean equal to
  the margin (the boundary of H0, where a declared equivalence is false) or zero (where it
  is true), n_seeds per trial; equivalence is declared when `tost_p_value` <= alpha.

  Args:
    n_seeds: seeds, >= 2.
    margin: equivalence margin, finite and > 0.
    sd: standard deviation of one per-seed difference, finite and > 0.
    trials: simulated studies per rate, >= 1.
    alpha: level in (0, 1).
    seed: numpy generator seed.

  Returns:
    {"false_equivalence_at_margin": rate at a true shift == margin (<= alpha),
     "equivalence_power_at_zero": rate at a true shift of 0}.
  """
  _check_count(n_seeds, "n_seeds", 2)
  _check_margin(margin)
  if not (isinstance(sd, (int, float, np.floating)) and math.isfinite(sd) and sd > 0):
    raise ValueError(f"sd={sd!r}; must be a finite number > 0")
  _check_count(trials, "trials", 1)
  _check_alpha(alpha)
  rng = np.random.default_rng(seed)
  rates = {}
  for key, shift in (("false_equivalence_at_margin", margin),
                     ("equivalence_power_at_zero", 0.0)):
    d = shift + sd * rng.standard_normal((trials, n_seeds))
    rates[key] = sum(tost_p_value(row, margin) <= alpha for row in d) / trials
  return rates
