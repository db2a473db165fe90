"""precision.study._stats on synthetic data: exactness, error rates, power, bad input.

Every Monte Carlo uses a seeded numpy generator, so each figure below is reproducible.
A rate that must be <= alpha is accepted up to 3 Monte Carlo standard errors above it (a
test at exactly alpha would otherwise fail half the time by chance).
"""

import doctest
import itertools
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from precision.study import _stats as st

M = 7  # recipes in the family, as in the default study


def _within_alpha(rate, trials, alpha=st.ALPHA):
  return rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / trials)


def _within_3se(rate, p, trials):
  return abs(rate - p) <= 3 * math.sqrt(max(p * (1 - p), 1e-4) / trials)


def test_doc_examples():
  result = doctest.testmod(st)
  assert result.attempted > 10 and result.failed == 0


# --------------------------------------------------------------------------- the example


def test_the_decisive_example_is_worse_by_default_and_undecided_by_sign_flip():
  rng = np.random.default_rng(11)
  family = {"bad": [0.106, 0.102, 0.101],
            **{f"r{i}": list(0.003 * rng.standard_normal(3)) for i in range(6)}}
  res = st.compare(family)
  bad = res["bad"]
  assert bad.verdict == st.WORSE and bad.test == "t"
  assert bad.p_holm <= st.ALPHA and bad.p_value <= st.ALPHA / M
  lo, hi = bad.ci
  assert 0.095 < lo < 0.098 and 0.108 < hi < 0.111, bad.ci
  assert bad.deltas == (0.106, 0.102, 0.101) and bad.n == 3
  assert all(res[f"r{i}"].verdict == st.NO_DIFFERENCE for i in range(6))
  # The same numbers negated are better; the exact sign-flip test cannot decide at all.
  assert st.compare({**family, "bad": [-0.106, -0.102, -0.101]})["bad"].verdict == st.BETTER
  sf = st.compare(family, test="sign_flip")
  assert sf["bad"].verdict == "undecided: needs >= 9 seeds" and sf["bad"].p_value == 0.25
  assert sf["bad"].power == 0.0 and sf["bad"].seeds_needed >= 9
  assert all(c.verdict.startswith("undecided") for c in sf.values())


def test_sign_flip_decides_with_enough_seeds():
  rng = np.random.default_rng(4)
  nine = {"a": 0.3 + 0.02 * rng.standard_normal(9),
          **{f"b{i}": 0.02 * rng.standard_normal(9) for i in range(6)}}
  res = st.compare(nine, test="sign_flip")
  assert res["a"].verdict == st.WORSE
  assert all(res[f"b{i}"].verdict == st.NO_DIFFERENCE for i in range(6))


# --------------------------------------------------------------------------- p-values


def test_t_p_value_matches_scipy():
  rng = np.random.default_rng(0)
  for n in (2, 3, 5, 12, 40):
    for _ in range(10):
      d = rng.normal(rng.uniform(-1, 1), rng.uniform(0.1, 2), n)
      want = scipy_stats.ttest_1samp(d, 0.0).pvalue
      assert st.paired_t_p_value(d) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_t_p_value_matches_a_monte_carlo_of_its_null():
  """p is the null probability of a |t| at least the observed one (normal differences)."""
  rng = np.random.default_rng(0)
  d = np.array([0.21, 0.05, 0.13, -0.02])
  p = st.paired_t_p_value(d)
  t_obs = abs(d.mean()) / (d.std(ddof=1) / 2)
  trials = 200_000
  z = rng.standard_normal((trials, 4))
  t_sim = np.abs(z.mean(1)) / (z.std(1, ddof=1) / 2)
  rate = float(np.mean(t_sim >= t_obs))
  assert 0.05 < p < 0.2 and _within_3se(rate, p, trials), (rate, p)


def test_t_p_value_zero_sd_conventions():
  assert st.paired_t_p_value([0.0, 0.0, 0.0]) == 1.0
  assert st.paired_t_p_value([0.1, 0.1, 0.1]) == 0.0  # np.std leaves 1.7e-17 here
  assert st.paired_t_p_value([-0.3, -0.3]) == 0.0
  res = st.compare({"a": [0.1, 0.1, 0.1], "z": [0.0, 0.0, 0.0]})
  assert res["a"].verdict == st.WORSE and res["z"].verdict == st.NO_DIFFERENCE
  assert math.isnan(res["a"].power) and res["a"].seeds_needed is None
  assert res["z"].seeds_needed is None


@pytest.mark.parametrize("n", range(1, 8))
def test_sign_flip_p_value_is_the_exact_enumeration(n):
  rng = np.random.default_rng(n)
  for _ in range(5):
    d = rng.normal(0.3, 1.0, n)
    obs = abs(d.sum())
    hits = sum(abs(np.dot(s, d)) >= obs - 1e-12
               for s in itertools.product((-1.0, 1.0), repeat=n))
    assert st.sign_flip_p_value(d) == hits / 2**n


def test_sign_flip_known_values_and_ties():
  assert st.sign_flip_p_value([0.05, 0.02, 0.04]) == 0.25
  assert st.sign_flip_p_value([-0.05, -0.02, -0.04]) == 0.25
  assert st.sign_flip_p_value([0.0, 0.0, 0.0]) == 1.0
  assert st.sign_flip_p_value([0.3, -0.1, -0.2, 0.6]) == 10 / 16  # float-rounded ties
  assert st.min_sign_flip_p(3) == 0.25
  assert st.sign_flip_seeds(1) == 6 and st.sign_flip_seeds(7) == 9


def test_holm_hand_computed():
  # m = 4, sorted 0.005, 0.01, 0.03, 0.04 -> 4*0.005 = 0.02, 3*0.01 = 0.03,
  # 2*0.03 = 0.06, max(0.06, 1*0.04) = 0.06; back in input order:
  assert st.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
  # Capped at 1 and monotone: 3*0.5 -> 1, then max(1, 2*0.6) = 1, then max(1, 0.9) = 1.
  assert st.holm([0.5, 0.9, 0.6]) == [1.0, 1.0, 1.0]
  assert st.holm([0.02]) == [0.02] and st.holm([]) == []


def test_tost_p_value_is_the_larger_one_sided_p():
  d = np.array([0.02, -0.01, 0.03, 0.0, 0.01])
  margin = 0.05
  lower = scipy_stats.ttest_1samp(d, -margin, alternative="greater").pvalue
  upper = scipy_stats.ttest_1samp(d, margin, alternative="less").pvalue
  assert st.tost_p_value(d, margin) == pytest.approx(max(lower, upper), rel=1e-9)
  assert st.tost_p_value([0.01, 0.01], 0.05) == 0.0
  assert st.tost_p_value([0.05, 0.05], 0.05) == 1.0
  res = st.compare({"a": list(d), "b": [0.3, 0.2, 0.25, 0.31, 0.28]}, margin=margin)
  assert res["a"].equivalent is True and res["b"].equivalent is False
  assert res["a"].p_equivalence == pytest.approx(min(1.0, 2 * st.tost_p_value(d, margin)))
  assert res["a"].margin == margin
  plain = st.compare({"a": list(d)})["a"]
  assert plain.margin is None and plain.equivalent is None and plain.p_equivalence is None


def test_t_interval_covers_at_its_level():
  rng = np.random.default_rng(5)
  trials, mu = 4000, 0.7
  covered = sum(lo <= mu <= hi for lo, hi in
                (st.t_interval(mu + rng.standard_normal(3)) for _ in range(trials)))
  assert 0.935 <= covered / trials <= 0.965, covered / trials
  assert all(np.isnan(st.t_interval([0.1])))


# --------------------------------------------------------------------------- error rates

# Measured with the seeds below (1000 trials each; s.e. about 0.007), paired t + Holm, m = 7:
#   n = 3:  normal 0.051, t3 0.042, lognormal 0.018
#   n = 5:  normal 0.036, t3 0.037, lognormal 0.012
# (20,000-trial figures in the module docstring: n = 3 normal 0.046, t3 0.038, lognormal
# 0.021.) Every one is within alpha + 3 s.e. (0.0707); the t test is not liberal at n = 3
# for any of the three noises.
@pytest.mark.parametrize("noise", st.NOISES)
@pytest.mark.parametrize("n", [3, 5])
def test_aa_family_wise_false_decision_rate_at_most_alpha(noise, n):
  trials = 1000
  rate = st.aa_false_decision_rate(n, M, trials=trials, noise=noise, seed=100 + n)
  assert _within_alpha(rate, trials), (noise, n, rate)


def test_aa_rate_uses_compares_verdicts():
  """aa_false_decision_rate runs compare's verdict code without the power columns (10 ms
  a family with them); the verdicts and p-values are the same either way."""
  rng = np.random.default_rng(3)
  for test in st.TESTS:
    for n in (3, 9):
      for _ in range(15):
        fam = {f"r{i}": rng.standard_normal(n) + (1.5 if i == 0 else 0.0) for i in range(M)}
        fast = st._compare(fam, st.ALPHA, None, test, st.CI_LEVEL, with_power=False)
        full = st.compare(fam, test=test)
        assert [(c.verdict, c.p_value, c.p_holm) for c in fast.values()] == [
            (c.verdict, c.p_value, c.p_holm) for c in full.values()]


def test_aa_rate_can_fail():
  """The check above has teeth: a family run at alpha * m (per-test 5% after Holm's
  division, i.e. no family-wise correction) has a rate far above alpha (measured 0.263)."""
  rate = st.aa_false_decision_rate(3, M, trials=1000, alpha=st.ALPHA * M, seed=1)
  assert not _within_alpha(rate, 1000), rate


def test_aa_sign_flip_where_it_can_decide():
  rate = st.aa_false_decision_rate(9, M, trials=300, test="sign_flip", noise="t3")  # 0.023
  assert _within_alpha(rate, 300), rate
  assert st.aa_false_decision_rate(3, M, trials=50, test="sign_flip") == 0.0


# Measured (1000 trials, n = 3, margin 1, seed 7): sd 0.5 -> false equivalence at the margin
# 0.045, equivalence at a true shift of 0: 0.562; sd 0.25 -> 0.045 and 0.984.
@pytest.mark.parametrize("sd,power_low", [(0.5, 0.45), (0.25, 0.95)])
def test_tost_false_equivalence_at_most_alpha_and_its_power(sd, power_low):
  trials = 1000
  r = st.equivalence_error_rates(3, 1.0, sd, trials=trials, seed=7)
  assert _within_alpha(r["false_equivalence_at_margin"], trials), r
  assert r["equivalence_power_at_zero"] >= power_low, r


# --------------------------------------------------------------------------- power


@pytest.mark.parametrize("effect,sd,n,alpha,two_sided", [
    (1.0, 1.0, 5, 0.05, True), (0.5, 1.0, 12, 0.05 / 7, True),
    (0.8, 0.5, 3, 0.05, False), (2.0, 1.0, 4, 0.05 / 7, True)])
def test_t_power_matches_a_monte_carlo_of_the_test(effect, sd, n, alpha, two_sided):
  rng = np.random.default_rng(n)
  trials = 4000
  d = effect + sd * rng.standard_normal((trials, n))
  t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
  if two_sided:
    rejected = [st.paired_t_p_value(row) <= alpha for row in d]
  else:
    rejected = t >= scipy_stats.t.ppf(1 - alpha, n - 1)
  rate = float(np.mean(rejected))
  p = st.t_power(effect, sd, n, alpha, two_sided)
  assert 0.05 < p < 0.95 and _within_3se(rate, p, trials), (rate, p)


def test_t_power_edges_and_the_nctdtr_fallback():
  assert st.t_power(0.0, 1.0, 5, 0.05) == pytest.approx(0.05, abs=1e-9)  # size
  assert math.isnan(st.t_power(1.0, 0.0, 5, 0.05))
  # scipy 1.17's nctdtr returns nan in these far tails; the fallback fills them in.
  for effect, n in ((5.0, 3), (5.0, 5), (30.0, 10), (60.0, 9)):
    p = st.t_power(effect, 1.0, n, 0.05 / 7)
    assert 0.0 <= p <= 1.0, (effect, n, p)
  grid = st._t_power_array(1.0, 1.0, np.arange(2, 400), 0.05 / 7, True)
  assert np.all(np.isfinite(grid)) and np.all(np.diff(grid) >= -1e-12)


def test_seeds_needed_monotone_and_consistent_with_t_power():
  prev = None
  for effect in (2.0, 1.5, 1.0, 0.7, 0.5, 0.3):
    need = st.seeds_needed(effect, 1.0, M)
    assert st.t_power(effect, 1.0, need, st.ALPHA / M) >= 0.8
    assert need == 2 or st.t_power(effect, 1.0, need - 1, st.ALPHA / M) < 0.8
    assert prev is None or need >= prev  # smaller effect: more seeds
    prev = need
  assert st.seeds_needed(1.0, 1.0, 1) <= st.seeds_needed(1.0, 1.0, M)  # bigger family: more
  assert st.seeds_needed(1.0, 1.0, M, power=0.9) >= st.seeds_needed(1.0, 1.0, M)
  assert st.seeds_needed(5.0, 1.0, M, test="sign_flip") == st.sign_flip_seeds(M) == 9
  assert st.seeds_needed(0.0, 1.0, M) is None and st.seeds_needed(1.0, 0.0, M) is None
  assert st.seeds_needed(0.01, 1.0, M, max_seeds=50) is None


def test_compare_power_fields():
  d = [0.02, -0.01, 0.015, 0.005]
  c = st.compare({"a": d, "b": [0.0, 0.01, -0.01, 0.0]}, margin=0.05)["a"]
  sd = float(np.std(d, ddof=1))
  assert c.power == pytest.approx(st.t_power(0.05, sd, 4, st.ALPHA / 2))
  assert c.seeds_needed == st.seeds_needed(0.05, sd, 2)
  c = st.compare({"a": d})["a"]  # no margin: the observed |mean| at the observed sd
  assert c.power == pytest.approx(st.t_power(abs(np.mean(d)), sd, 4, st.ALPHA))
  assert c.seeds_needed == st.seeds_needed(abs(np.mean(d)), sd, 1)


# --------------------------------------------------------------------------- time to target


def test_time_to_target_hand_curves():
  curve = [(0, 4.0), (100, 2.5), (200, float("nan")), (300, 1.9), (400, 1.7)]
  assert st.time_to_target(curve, 2.0) == 300      # the NaN at 200 is skipped
  assert st.time_to_target(curve, 2.5) == 100      # <= target counts
  assert st.time_to_target(curve, 5.0) == 0
  assert st.time_to_target(curve, 1.0) is None     # never reached
  assert st.time_to_target([(0, float("inf")), (10, float("-inf")), (20, 0.5)], 1.0) == 20
  assert st.time_to_target([], 1.0) is None
  assert st.time_to_target([(0, float("nan"))], 1.0) is None


def test_compare_time_to_target():
  control = [1000, 1100, 900, 1000, None]
  ttt = {
      "fast": [700, 820, 590, 710, None],
      "same": [1010, 1090, 905, 990, None],
      "never": [1500, None, 1300, 1400, None],
      "lucky": [900, 1000, 800, 900, 1200],
  }
  res = st.compare_time_to_target(ttt, control)
  f = res["fast"]
  assert f.verdict == st.FASTER and f.n_reached_both == 4 and f.never_reached == 0
  assert f.deltas == (-300.0, -280.0, -310.0, -290.0) and f.mean_delta == -295.0
  assert f.ci[1] < 0 and f.p_holm <= st.ALPHA
  assert f.p_holm == pytest.approx(min(1.0, 4 * st.paired_t_p_value(f.deltas)))
  assert res["same"].verdict == st.NO_DIFFERENCE
  assert res["never"].never_reached == 1 and res["never"].verdict.startswith(
      "undecided: the recipe never reached")
  assert res["never"].n_reached_both == 3 and res["never"].p_holm == 1.0
  assert res["lucky"].verdict.startswith("undecided: the control never reached")
  few = st.compare_time_to_target({"few": [990, None, None]}, [1000, None, None])["few"]
  assert few.verdict == "undecided: needs >= 2 seeds where both reach the target"
  assert few.n_reached_both == 1 and few.never_reached == 0 and few.mean_delta == -10.0
  assert math.isnan(few.p_value) and few.p_holm == 1.0
  slow = st.compare_time_to_target({"s": [1300, 1390, 1210, 1300, None]}, control)["s"]
  assert slow.verdict == st.SLOWER
  sf = st.compare_time_to_target({"fast": ttt["fast"]}, control, test="sign_flip")["fast"]
  assert sf.verdict == "undecided: needs >= 6 seeds" and sf.test == "sign_flip"


# --------------------------------------------------------------------------- bad input


def test_bad_input_names_the_value():
  ok = {"a": [0.1, 0.2, 0.15]}
  with pytest.raises(ValueError, match=r"test='wilcoxon'.*\('t', 'sign_flip'\)"):
    st.compare(ok, test="wilcoxon")
  for alpha in (0.0, 1.0, 1.5, -0.1):
    with pytest.raises(ValueError, match=rf"alpha={alpha!r}.*\(0, 1\)"):
      st.compare(ok, alpha=alpha)
  for margin in (0.0, -0.1, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"margin=.*finite number > 0"):
      st.compare(ok, margin=margin)
  with pytest.raises(ValueError, match=r"margin=0.*finite number > 0"):
    st.tost_p_value([0.1, 0.2], 0)
  with pytest.raises(ValueError, match=r"deltas_by_recipe\['a'\]=.*nan.*finite"):
    st.compare({"a": [0.1, float("nan"), 0.2]})
  with pytest.raises(ValueError, match=r"deltas_by_recipe\['a'\]=\[0.1\].*needs >= 2 seeds"):
    st.compare({"a": [0.1]})
  with pytest.raises(ValueError, match="needs >= 2 seeds"):
    st.paired_t_p_value([0.3])
  with pytest.raises(ValueError, match="needs >= 2 seeds"):
    st.tost_p_value([0.3], 1.0)
  with pytest.raises(ValueError, match="finite"):
    st.sign_flip_p_value([0.1, float("inf")])
  with pytest.raises(ValueError, match="finite"):
    st.paired_t_p_value([0.1, float("nan")])
  with pytest.raises(ValueError, match=r"level=1.2"):
    st.compare(ok, level=1.2)
  with pytest.raises(ValueError, match=r"\[0, 1\]"):
    st.holm([0.2, 1.3])
  with pytest.raises(ValueError, match=r"test='z'"):
    st.seeds_needed(1.0, 1.0, 3, test="z")
  with pytest.raises(ValueError, match=r"m=0.*integer >= 1"):
    st.seeds_needed(1.0, 1.0, 0)
  with pytest.raises(ValueError, match=r"n=1.*integer >= 2"):
    st.t_power(1.0, 1.0, 1, 0.05)
  with pytest.raises(ValueError, match=r"alpha=2"):
    st.t_power(1.0, 1.0, 5, 2)
  with pytest.raises(ValueError, match=r"noise='cauchy'.*\('normal', 't3', 'lognormal'\)"):
    st.aa_false_decision_rate(3, 7, trials=10, noise="cauchy")
  with pytest.raises(ValueError, match=r"n_seeds=1.*integer >= 2"):
    st.aa_false_decision_rate(1, 7, trials=10)
  with pytest.raises(ValueError, match=r"sd=0.*finite number > 0"):
    st.equivalence_error_rates(3, 1.0, 0.0, trials=10)
  with pytest.raises(ValueError, match=r"target=nan.*finite"):
    st.time_to_target([(0, 1.0)], float("nan"))
  with pytest.raises(ValueError, match="steps must increase"):
    st.time_to_target([(10, 1.0), (5, 0.5)], 0.7)
  with pytest.raises(ValueError, match=r"\(step, metric\) pair"):
    st.time_to_target([1.0, 2.0], 0.7)
  with pytest.raises(ValueError, match=r"ttt_by_recipe\['a'\] has 2 seeds, control has 3"):
    st.compare_time_to_target({"a": [1, 2]}, [1, 2, 3])
  with pytest.raises(ValueError, match=r"control=\[1, -2\].*int >= 0.*None"):
    st.compare_time_to_target({"a": [1, 2]}, [1, -2])
  with pytest.raises(ValueError, match=r"ttt_by_recipe\['a'\]=\[1.5, 2\]"):
    st.compare_time_to_target({"a": [1.5, 2]}, [1, 2])
  with pytest.raises(ValueError, match=r"test='t2'"):
    st.compare_time_to_target({"a": [1, 2]}, [1, 2], test="t2")


# --------------------------------------------------------------------------- magnitude


def test_holm_interval_agrees_with_the_verdict():
  """The interval shown beside a verdict excludes 0 exactly for WORSE / BETTER rows (the
  t test's duality at the level Holm tested each row at), on random families."""
  rng = np.random.default_rng(8)
  seen = set()
  for trial in range(300):
    m = int(rng.integers(1, 8))
    n = int(rng.integers(3, 9))
    fam = {f"r{i}": rng.normal(rng.choice([0.0, 0.3, 1.0]), 0.4, n) for i in range(m)}
    for c in st.compare(fam).values():
      lo, hi = c.ci_holm
      decided = st.is_decision(c.verdict)
      seen.add(decided)
      assert decided == (lo > 0 or hi < 0), (trial, c.verdict, c.ci_holm, c.p_holm)
      assert st.CI_LEVEL <= c.ci_holm_level <= 1 - st.ALPHA / m + 1e-12
  assert seen == {True, False}


def test_holm_levels_hand_computed():
  # m = 4, sorted p 0.005 (<= 0.0125, rejected), 0.01 (<= 0.0167, rejected), 0.03
  # (> 0.025: Holm stops) -> the two rejected at 1 - 0.05/4 and 1 - 0.05/3, the rest at
  # 1 - 0.05/2.
  levels = st.holm_levels([0.01, 0.04, 0.03, 0.005])
  assert levels == pytest.approx([1 - 0.05 / 3, 0.975, 0.975, 1 - 0.05 / 4])
  assert st.holm_levels([0.5, 0.6]) == pytest.approx([1 - 0.05 / 2] * 2)


def test_equivalence_bound_is_the_tightest_tost_margin():
  rng = np.random.default_rng(9)
  for m in (1, 3, 7):
    for _ in range(20):
      d = rng.normal(0.01, 0.02, int(rng.integers(3, 10)))
      b = st.equivalence_bound(d, m=m)
      assert st.tost_p_value(d, b * (1 + 1e-9)) <= st.ALPHA / m + 1e-12
      assert st.tost_p_value(d, b * (1 - 1e-6)) > st.ALPHA / m
  c = st.compare({"a": [0.01, -0.02, 0.005, 0.0], "b": [0.3, 0.2, 0.25, 0.31]})["a"]
  assert c.equivalence_bound == pytest.approx(st.equivalence_bound(
      [0.01, -0.02, 0.005, 0.0], m=2))
  assert st.equivalence_bound([0.1, 0.1, 0.1]) == pytest.approx(0.1)  # sd 0: the mean
  assert math.isnan(st.equivalence_bound([0.1]))
