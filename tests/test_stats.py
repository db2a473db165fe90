"""The sweep's statistics on synthetic data: exactness, error rates, power, "undecided".

Synthetic sweeps: every run's final metric is a seed effect shared by all recipes on that
seed, plus the recipe's true shift (0 under the null), plus independent per-run noise
(normal, heavy-tailed Student t with 3 degrees of freedom, or skewed lognormal). Monte
Carlo with seeded numpy generators, so every figure is reproducible.
"""

import doctest
import itertools
import math

import numpy as np
import pytest

from experiments import report
from experiments import stats
from experiments import sweep

DEFAULT_SEEDS = sweep.SweepConfig().seeds                 # 3
DEFAULT_FAMILY = len(sweep.SweepConfig().recipes) - 1     # 7 recipes against fp32
NOISES = ("normal", "t3", "lognormal")


def _noise(rng, kind, shape):
  if kind == "normal":
    return rng.standard_normal(shape)
  if kind == "t3":
    return rng.standard_t(3, shape)
  if kind == "lognormal":
    return rng.lognormal(0.0, 1.0, shape)  # skewed; a paired difference is still symmetric
  raise ValueError(kind)


def _finals(rng, kind, m, n, shifts=None, seed_sd=1.0):
  """[m + 1, n] final metrics: row 0 the control, rows 1..m the recipes."""
  shifts = np.zeros(m) if shifts is None else np.asarray(shifts, np.float64)
  seed_effect = seed_sd * rng.standard_normal(n)
  x = seed_effect + _noise(rng, kind, (m + 1, n))
  x[1:] += shifts[:, None]
  return x


def _within_alpha(rate, trials, alpha=stats.ALPHA):
  """A Monte Carlo rate consistent with a true rate <= alpha: at most 3 standard errors
  above it (a test at exactly alpha would fail half the time by chance)."""
  return rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / trials)


def _family(x):
  return {f"r{i}": x[i] - x[0] for i in range(1, x.shape[0])}


def test_doc_examples():
  assert doctest.testmod(stats).failed == 0


@pytest.mark.parametrize("n", range(1, 8))
def test_sign_flip_p_value_is_the_exact_enumeration(n):
  rng = np.random.default_rng(n)
  for _ in range(5):
    d = rng.normal(0.3, 1.0, n)
    obs = abs(d.sum())
    hits = sum(abs(np.dot(s, d)) >= obs - 1e-12
               for s in itertools.product((-1.0, 1.0), repeat=n))
    assert stats.sign_flip_p_value(d) == pytest.approx(hits / 2**n, abs=0)


def test_sign_flip_known_values_and_ties():
  assert stats.sign_flip_p_value([0.05, 0.02, 0.04]) == 0.25    # all one sign, n = 3
  assert stats.sign_flip_p_value([-0.05, -0.02, -0.04]) == 0.25  # two-sided
  assert stats.sign_flip_p_value([0.0, 0.0, 0.0]) == 1.0
  assert stats.sign_flip_p_value([1.0, -1.0]) == 1.0
  # Sums equal in reals but not in floats tie: |0.3 - 0.1 - 0.2 + 0.6| = 0.6 is reached by
  # 10 of the 16 sign patterns (hand count), two of them through a rounded 0.3 - 0.1 - 0.2.
  assert stats.sign_flip_p_value([0.3, -0.1, -0.2, 0.6]) == 10 / 16
  assert stats.sign_flip_p_value([0.1] * 6) == 2 / 64


def test_sign_flip_monte_carlo_agrees_with_exact(monkeypatch):
  d = np.random.default_rng(7).normal(0.4, 1.0, 12)
  exact = stats.sign_flip_p_value(d)
  monkeypatch.setattr(stats, "EXACT_MAX_SEEDS", 10)
  approx = stats.sign_flip_p_value(d)
  assert abs(approx - exact) < 0.005, (approx, exact)  # B = 200k: s.e. <= 0.0012


def test_min_p_and_seeds_needed():
  assert stats.min_sign_flip_p(3) == 0.25
  assert stats.seeds_needed(1) == 6 and stats.seeds_needed(7) == 9
  for m in (1, 2, 7, 20):
    need = stats.seeds_needed(m)
    d = np.arange(1.0, need + 1)  # every seed worse, distinct sizes: the smallest p
    assert stats.sign_flip_p_value(d) == stats.min_sign_flip_p(need)
    assert m * stats.min_sign_flip_p(need) <= stats.ALPHA < m * stats.min_sign_flip_p(need - 1)


def test_holm_matches_its_definition():
  assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
  rng = np.random.default_rng(0)
  for _ in range(50):
    p = rng.uniform(0, 0.2, rng.integers(1, 9))
    m = p.size
    order = np.argsort(p)
    want = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
      running = max(running, min(1.0, (m - rank) * p[i]))
      want[i] = running
    assert stats.holm(p) == pytest.approx(list(want))


@pytest.mark.parametrize("noise", NOISES)
def test_null_default_sweep_says_no_difference_or_undecided(noise):
  """Done-when of the sweep's verdicts: the same recipe twice, at the default seeds and
  recipe count, through report.summarize as the sweep calls it."""
  rng = np.random.default_rng(1)
  trials, clean = 1000, 0
  for _ in range(trials):
    x = _finals(rng, noise, DEFAULT_FAMILY, DEFAULT_SEEDS)
    runs = [{"recipe": "fp32" if i == 0 else f"r{i}", "seed": s, "status": "ok",
             "history": [], "summary": {"final_val_bpb": float(x[i, s])}}
            for i in range(x.shape[0]) for s in range(DEFAULT_SEEDS)]
    rows = report.summarize(runs)
    verdicts = [r["verdict"] for r in rows if r["recipe"] != "fp32"]
    clean += all(v == stats.NO_DIFFERENCE or v.startswith("undecided") for v in verdicts)
  assert clean / trials >= 0.95, clean / trials


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("n", [stats.seeds_needed(DEFAULT_FAMILY), 12])
def test_null_family_wise_error_at_most_alpha_where_the_test_can_decide(noise, n):
  rng = np.random.default_rng(2)
  trials = 1000
  false_calls = sum(
      any(stats.is_decision(r.verdict) for r in stats.paired_verdicts(_family(
          _finals(rng, noise, DEFAULT_FAMILY, n))).values())
      for _ in range(trials))
  assert _within_alpha(false_calls / trials, trials), false_calls / trials


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_power_against_a_known_shift(sign):
  """One recipe of seven shifted by 1.5 s.d. of a per-seed difference, 12 seeds: the test
  names it (in the right direction) in >= 85% of trials (0.92 in a 600-sweep Monte Carlo:
  the bound sits 6 standard errors below) and names any of the six others no more often
  than alpha allows."""
  rng = np.random.default_rng(3)
  trials, n = 600, 12
  shift = sign * 1.5 * np.sqrt(2.0)  # per-run noise s.d. 1: a difference has s.d. sqrt(2)
  found = others = 0
  for _ in range(trials):
    x = _finals(rng, "normal", DEFAULT_FAMILY, n, shifts=[shift] + [0.0] * 6)
    res = stats.paired_verdicts(_family(x))
    found += res["r1"].verdict == (stats.WORSE if sign > 0 else stats.BETTER)
    others += any(stats.is_decision(res[f"r{i}"].verdict) for i in range(2, 8))
  assert found / trials >= 0.85, found / trials
  assert _within_alpha(others / trials, trials), others / trials


def test_undecided_path_says_how_many_seeds():
  strong = [0.30, 0.28, 0.33]  # every seed clearly worse
  family = {"a": strong, **{f"b{i}": [0.01, -0.02, 0.0] for i in range(6)}}
  res = stats.paired_verdicts(family)
  assert res["a"].verdict == "undecided: needs >= 9 seeds"
  assert res["a"].p_value == 0.25 and res["a"].ci_low > 0  # the CI alone is no verdict
  assert stats.paired_verdicts({"a": strong})["a"].verdict == "undecided: needs >= 6 seeds"
  rng = np.random.default_rng(4)
  nine = {"a": 0.3 + 0.02 * rng.standard_normal(9),
          **{f"b{i}": 0.02 * rng.standard_normal(9) for i in range(6)}}
  res = stats.paired_verdicts(nine)
  assert res["a"].verdict == stats.WORSE
  assert all(res[f"b{i}"].verdict == stats.NO_DIFFERENCE for i in range(6))
  assert stats.paired_verdicts({"a": -nine["a"]})["a"].verdict == stats.BETTER


def test_t_interval_covers_at_its_level():
  rng = np.random.default_rng(5)
  trials, n, mu = 4000, DEFAULT_SEEDS, 0.7
  covered = 0
  for _ in range(trials):
    lo, hi = stats.t_interval(mu + rng.standard_normal(n))
    covered += lo <= mu <= hi
  assert 0.935 <= covered / trials <= 0.965, covered / trials
  assert all(np.isnan(stats.t_interval([0.1])))


def test_spread_rule_and_its_null_rate():
  assert stats.spread_rule(0.05, [3.0, 3.1]) == "within fp32 range"
  assert stats.spread_rule(0.2, [3.0, 3.1]) == "above fp32 range (worse)"
  assert stats.spread_rule(-0.2, [3.0, 3.1]) == "below fp32 range (better)"
  assert stats.spread_rule(0.2, [3.0]).startswith("n/a")
  # Not a test: it flags far more than 5% of no-effect recipes at 3 seeds.
  rate = stats.spread_rule_null_rate(3)
  assert 0.12 < rate < 0.17, rate
  assert stats.spread_rule_null_rate(5) < 0.03


def test_bad_input_names_the_value():
  with pytest.raises(ValueError, match="finite"):
    stats.sign_flip_p_value([0.1, float("nan")])
  with pytest.raises(ValueError, match="alpha"):
    stats.paired_verdicts({"a": [0.1, 0.2]}, alpha=1.5)
  with pytest.raises(ValueError, match="no paired difference"):
    stats.paired_verdicts({"a": []})
  with pytest.raises(ValueError, match="m=0"):
    stats.seeds_needed(0)
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    stats.holm([0.2, 1.3])
