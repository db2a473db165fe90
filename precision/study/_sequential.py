"""Sequential seeds: add rounds of seeds until every recipe is decided, at stated error rates.

A study with ``seeds="auto"`` looks at its per-seed paired differences d_i (recipe -
control on seed i, lower metric = better) at planned seed counts n_1 < n_2 < ... < n_K =
max_seeds (`looks`), and at each look decides every recipe still undecided:

  worse / better   the paired t statistic T = mean / (sd / sqrt(n)) crosses +-b_k;
  holds up         both one-sided equivalence statistics cross: (mean + margin) / se >= e_k
                   and (mean - margin) / se <= -e_k (TOST at every look);
  continue         neither: the recipe takes the next round of seeds;
  undecided        neither at the last look (the budget is spent).

A decided recipe takes no more seeds; the control runs every seed any recipe uses.

Why group-sequential alpha spending of a t statistic
----------------------------------------------------
Looking again after every round and stopping on the first crossing inflates a fixed-n
test's error (five looks of a 5% t test reject about 14% of true nulls). Two families of
methods keep the rate under such optional stopping:

* anytime-valid e-values / confidence sequences: valid at any data-dependent time, but
  their guarantees need a known bound or sub-Gaussian scale of d (the chaotic spread of
  a training run is what the study does not know), and the versions that estimate the
  scale (t-type sequential tests) are built for long streams: at 3 to 12 seeds they need
  several times the seeds of a planned design to decide anything.
* group-sequential designs (Lan & DeMets alpha spending): a fixed schedule of looks and a
  boundary per look such that the probability of ever crossing is the planned alpha. The
  study's looks are exactly such a schedule (rounds of seeds up to a budget), so nothing
  of the anytime generality is needed, and the boundaries are as tight as the schedule
  allows.

The boundaries are computed for the z statistic of a Brownian motion at information
fractions n_k / n_K (exact recursive numerical integration, `z_boundaries`) and carried
to the t statistic per look by equal tail probability: b_k = t^{-1}_{n_k - 1}(Phi(c_k))
(the "significance level" approach of Jennison & Turnbull, Group Sequential Methods,
ch. 11). This is exact for the first look and an approximation after it; the simulation
tests measure its actual error rates.

The spending function is linear by default, alpha(t) = a t at information fraction t =
n_k / max_seeds (Kim & DeMets' power family with exponent 1), chosen from the measured
trade-off between the classic two (`expected_seeds_table`, ``python -m
experiments.bench_sequential``; looks 3, 6, 9, 12, m = 3, normal differences, 2,000 to
4,000 studies per figure; E[seeds] per recipe at true differences 0 / margin / 2 x margin):

  sd of a difference / margin      0.1            0.25           0.5            1.0
  fixed design of equal power      4              6              10             10 to 13
  linear (default)                 3.4 4.0 3.0    5.3 5.5 4.5    7.1 7.2 5.5    11.2 10.5 7.2
  Pocock-type                      3.2 3.6 3.0    5.0 5.3 4.1    7.0 7.1 5.3    11.2 10.5 7.1
  O'Brien-Fleming-type             6.0 6.0 6.0    6.3 6.8 6.0    8.6 8.8 6.8    11.5 11.1 8.8

  "holds up" shown at a true difference 0, sd = margin: linear 0.47, Pocock 0.40, O'Brien-
  Fleming 0.63 (every design decides ~100% at sd <= margin / 2).

O'Brien-Fleming spends almost nothing at the first looks: a study never stops before 6
seeds, and a clear effect costs twice the seeds a fixed design needs. Pocock stops clear
effects soonest but decides least when the budget is tight. Linear spending costs at most
0.4 seeds more than Pocock where effects are clear, decides more often at sd = margin, and
uses fewer seeds than the fixed design of equal power for sd <= margin / 2 (at sd = margin,
where half the studies end undecided, about one more).
``spending="obf"`` / ``"pocock"`` are available to `plan`.

Error rates. Every recipe's "worse" and "better" boundaries are one-sided tests at level
alpha / (2 m) each, its two equivalence tests at alpha / m each (Bonferroni over the m
recipes: Holm's step-down has no simple group-sequential form without recomputing every
boundary after each rejection). A recipe stops at its own first crossing; its other
boundaries can then no longer be crossed, which only lowers their error. So:

  family-wise P(any false worse/better | every true difference 0) <= alpha
  family-wise P(any false holds up | every true difference = +-margin) <= alpha

under independent normal d_i, whatever the other recipes do. What the t statistic
assumes: that the d_i are independent and roughly normal. A per-seed difference of two
training runs on the same seed is the difference of two runs' chaotic noises; when the
recipe and the control have noise of the same shape, that difference is *symmetric*,
however heavy-tailed or skewed each run's noise is, and the t test on symmetric heavy
tails is conservative, not liberal (it loses power, keeps size). The simulation tests draw
each run's noise normal, t3 and centred lognormal (the control's noise shared by every
recipe of a seed, as in a study) and check both rates. A difference that is itself
skewed with mean 0 (a recipe slightly better on most seeds and much worse on a few) is
outside what any test of a mean can protect at a few seeds (Bahadur & Savage, 1956);
`simulate(..., on="differences")` measures that case and the docstring of
tests/test_study_sequential.py states the rates.

Everything here is numpy and scipy.special; nothing imports jax.

Examples:
  >>> p = plan(12, m=3, margin=0.01)
  >>> p.looks
  (3, 6, 9, 12)
  >>> decide([0.021, 0.029, 0.031], 0, p).verdict    # clear, but 3 seeds at df 2
  'continue'
  >>> decide([0.021, 0.029, 0.031, 0.024, 0.027, 0.03], 1, p).verdict
  'worse'
  >>> decide([0.001, -0.0005, 0.0002, 0.0008, -0.001, 0.0004], 1, p).verdict
  'holds up'
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, NamedTuple, Sequence

import numpy as np
from scipy import optimize, special

ALPHA = 0.05
SPENDINGS = ("linear", "obf", "pocock")
FIRST_LOOK = 3   # seeds of the first look: a t statistic with 2 degrees of freedom
EVERY = 3        # seeds added per round after it
NOISES = ("normal", "t3", "lognormal")
CONTINUE, WORSE, BETTER, HOLDS, UNDECIDED = ("continue", "worse", "better", "holds up",
                                             "undecided")
_GRID = 1601     # points of the numerical integration per look (against 6401 points:
                 # boundaries within 3e-10, spent alpha within 1e-12, over 6 looks)
_LOW = -9.0      # the grid's lower end in standard deviations of the score (mass below
                 # it is < 1e-18, far under the spending it could disturb)


# --------------------------------------------------------------------------- validation


def _check_alpha(alpha, name: str = "alpha") -> None:
  if not (isinstance(alpha, (int, float, np.floating)) and not isinstance(alpha, bool)
          and 0.0 < float(alpha) < 1.0):
    raise ValueError(f"{name}={alpha!r}; accepted: a number in (0, 1)")


def _check_int(value, name: str, least: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
    raise ValueError(f"{name}={value!r}; accepted: an integer >= {least}")
  return int(value)


def _check_margin(margin) -> None:
  if margin is not None and not (isinstance(margin, (int, float, np.floating))
                                 and not isinstance(margin, bool)
                                 and math.isfinite(margin) and margin > 0):
    raise ValueError(f"margin={margin!r}; accepted: a finite number > 0 (metric units) "
                     "or None")


# --------------------------------------------------------------------------- the schedule


def looks(max_seeds: int, first: int = FIRST_LOOK, every: int = EVERY) -> tuple[int, ...]:
  """The planned seed counts of the looks: first, first + every, ..., max_seeds.

  The last look is always at `max_seeds` (a shorter last round where the budget is not a
  multiple); with max_seeds <= first, one look at max_seeds.

  Examples:
    >>> looks(12), looks(10), looks(2), looks(4)
    ((3, 6, 9, 12), (3, 6, 9, 10), (2,), (3, 4))
  """
  max_seeds = _check_int(max_seeds, "max_seeds", 2)
  first = _check_int(first, "first", 2)
  every = _check_int(every, "every", 1)
  out = list(range(min(first, max_seeds), max_seeds, every))
  return tuple(out + [max_seeds])


def spent(t: np.ndarray, a: float, kind: str) -> np.ndarray:
  """Cumulative one-sided error spent by information fraction t in [0, 1] (Lan-DeMets).

  linear: a t (Kim & DeMets' power family with exponent 1; Hwang-Shih-DeCani at gamma 0).
  pocock: a ln(1 + (e - 1) t).   obf: 2 - 2 Phi(z_{1 - a/2} / sqrt(t)).  All reach a at 1.
  """
  t = np.asarray(t, np.float64)
  if kind == "linear":
    return a * t
  if kind == "pocock":
    return a * np.log1p((math.e - 1.0) * t)
  if kind == "obf":
    z = special.ndtri(1.0 - a / 2.0)
    with np.errstate(divide="ignore"):
      return np.where(t > 0, 2.0 - 2.0 * special.ndtr(z / np.sqrt(np.maximum(t, 1e-300))),
                      0.0)
  raise ValueError(f"spending={kind!r}; accepted: {', '.join(SPENDINGS)}")


@functools.lru_cache(maxsize=256)
def z_boundaries(info: tuple[int, ...], a: float, kind: str = "linear") -> tuple[float, ...]:
  """One-sided upper boundaries c_k of the z statistic Z_k = S(I_k) / sqrt(I_k), S a
  standard Brownian motion, such that P(Z_j < c_j for j < k, Z_k >= c_k) = spent(t_k) -
  spent(t_{k-1}) with t_k = I_k / I_K.

  Computed by the recursive integration of Armitage, McPherson & Rowe (1969): the
  sub-density of S(I_k) on the continuation region is carried from look to look on a
  grid (Simpson weights) and each c_k is solved by Brent's method.

  Examples:
    >>> [round(c, 3) for c in z_boundaries((1,), 0.025)]
    [1.96]
  """
  info_arr = np.asarray(info, np.float64)
  cum = spent(info_arr / info_arr[-1], a, kind)
  steps = np.diff(np.concatenate([[0.0], cum]))
  out = []
  grid = weights = dens = None
  for k, i_k in enumerate(info_arr):
    sd_k = math.sqrt(i_k)
    if k == 0:
      c = float(special.ndtri(1.0 - steps[0])) if steps[0] > 0 else math.inf
    else:
      delta = i_k - info_arr[k - 1]
      sd_d = math.sqrt(delta)
      mass = weights * dens

      def crossing(c):
        return float(np.sum(mass * special.ndtr((grid - c * sd_k) / sd_d))) - steps[k]

      # Nothing to spend here, or more than is left to cross: no boundary at this look.
      bracketed = steps[k] > 0 and crossing(40.0) < 0 < crossing(-10.0)
      c = optimize.brentq(crossing, -10.0, 40.0, xtol=1e-10) if bracketed else math.inf
    out.append(c)
    # The sub-density of S(I_k) below the boundary, on a fresh grid.
    top = min(c, 12.0) * sd_k
    new_grid = np.linspace(_LOW * math.sqrt(info_arr[-1]), top, _GRID)
    h = new_grid[1] - new_grid[0]
    w = np.full(_GRID, 2.0)
    w[1::2] = 4.0
    w[0] = w[-1] = 1.0
    w *= h / 3.0
    if k == 0:
      new_dens = np.exp(-0.5 * (new_grid / sd_k) ** 2) / (sd_k * math.sqrt(2 * math.pi))
    else:
      z = (new_grid[:, None] - grid[None, :]) / sd_d
      new_dens = (np.exp(-0.5 * z * z) / (sd_d * math.sqrt(2 * math.pi))) @ mass
    grid, weights, dens = new_grid, w, new_dens
  return tuple(out)


class Plan(NamedTuple):
  """A sequential design: the looks and each look's boundary on the t scale.

  Attributes:
    looks: planned seed counts per look (increasing; the last is the budget).
    m: recipes in the family (Bonferroni over them).
    alpha: family-wise error rate of the worse/better and of the holds-up verdicts.
    margin: equivalence margin (None: no holds-up verdict).
    spending: one of SPENDINGS ("linear", the default, "obf" or "pocock").
    difference_t: per look, |T| >= this decides worse / better (one-sided alpha/(2m) each).
    equivalence_t: per look, both TOST statistics beyond this decide holds up (alpha/m).
  """

  looks: tuple[int, ...]
  m: int
  alpha: float
  margin: float | None
  spending: str
  difference_t: tuple[float, ...]
  equivalence_t: tuple[float, ...]


_CAL_PATHS = 400_000   # normal studies simulated to calibrate a plan's t boundaries
_CAL_SEED = 20_260_41


@functools.lru_cache(maxsize=64)
def _t_paths(ns: tuple[int, ...]) -> np.ndarray:
  """(paths, K) t statistics at the looks of independent standard normal differences
  (seeded: every plan of these looks sees the same paths)."""
  rng = np.random.default_rng(_CAL_SEED)
  total = np.zeros(_CAL_PATHS)
  squares = np.zeros(_CAL_PATHS)
  out = np.empty((_CAL_PATHS, len(ns)))
  prev = 0
  for k, n in enumerate(ns):
    block = rng.standard_normal((_CAL_PATHS, n - prev))
    total += block.sum(1)
    squares += (block * block).sum(1)
    prev = n
    mean = total / n
    var = np.maximum(squares - n * mean * mean, 0.0) / (n - 1)
    out[:, k] = mean / np.sqrt(var / n)
  return out


@functools.lru_cache(maxsize=256)
def t_boundaries(ns: tuple[int, ...], a: float, kind: str = "linear") -> tuple[float, ...]:
  """One-sided upper boundaries b_k of the t statistic at the looks `ns`, total level a.

  Start: the z boundaries of `z_boundaries` carried per look by equal tail probability,
  b_k = t^{-1}_{n_k - 1}(1 - q_k), q_k = 1 - Phi(c_k). Those are exact for one look; with
  more, the t statistics of the looks share their variance estimates and the crossing
  probability comes out a little above a (measured 0.053 for a = 0.05 over looks 3, 6, 9,
  12). So every q_k is scaled by one factor lambda, solved by bisection such that the
  probability that `_t_paths` (400,000 seeded normal studies) cross any b_k is a (Monte
  Carlo standard error of the total: 1% of a at a = 0.025, 2.6% at 0.0036).
  """
  z = z_boundaries(ns, a, kind)
  q = np.array([1.0 - special.ndtr(c) for c in z])
  df = np.asarray(ns, np.float64) - 1.0

  def bounds(lam):
    return special.stdtrit(df, 1.0 - np.minimum(lam * q, 0.5))

  if len(ns) == 1:
    return tuple(float(b) for b in bounds(1.0))
  paths = _t_paths(ns)
  lo, hi = 0.2, 1.5
  for _ in range(40):
    lam = 0.5 * (lo + hi)
    rate = float(np.mean(np.any(paths >= bounds(lam), axis=1)))
    lo, hi = (lam, hi) if rate <= a else (lo, lam)
  return tuple(float(b) for b in bounds(lo))


def plan(max_seeds: int, m: int, alpha: float = ALPHA, margin: float | None = None,
         spending: str = "linear", first: int = FIRST_LOOK, every: int = EVERY,
         schedule: Sequence[int] | None = None) -> Plan:
  """The sequential design for m recipes and a budget of `max_seeds` seeds per recipe.

  Args:
    max_seeds: the budget (the last look), >= 2.
    m: recipes judged against the control, >= 1.
    alpha: family-wise error rate in (0, 1).
    margin: equivalence margin (> 0) or None.
    spending: one of SPENDINGS.
    first, every: the schedule of `looks`.
    schedule: explicit looks instead (increasing, each >= 2; a fixed design is one look).

  Raises:
    ValueError: a value out of range, named.
  """
  _check_int(m, "m", 1)
  _check_alpha(alpha)
  _check_margin(margin)
  if spending not in SPENDINGS:
    raise ValueError(f"spending={spending!r}; accepted: {', '.join(SPENDINGS)}")
  if schedule is None:
    ns = looks(max_seeds, first, every)
  else:
    ns = tuple(_check_int(n, "schedule entry", 2) for n in schedule)
    if not ns or any(b <= a for a, b in zip(ns, ns[1:])):
      raise ValueError(f"schedule={list(schedule)!r}; accepted: increasing seed counts >= 2")
  diff = t_boundaries(ns, float(alpha) / (2 * m), spending)
  equiv = t_boundaries(ns, float(alpha) / m, spending)
  return Plan(ns, int(m), float(alpha), None if margin is None else float(margin),
              spending, diff, equiv)


# --------------------------------------------------------------------------- the rule


def decide_array(deltas: np.ndarray, look: int, p: Plan) -> tuple[np.ndarray, np.ndarray]:
  """The rule at look `look`, vectorised over leading axes.

  Args:
    deltas: (..., n) per-seed differences with n == p.looks[look].
    look: index of the look.
    p: the Plan.

  Returns:
    (direction, holds): direction int8, +1 worse, -1 better, 0 neither; holds bool (both
    equivalence boundaries crossed; always False without a margin).
  """
  d = np.asarray(deltas, np.float64)
  n = d.shape[-1]
  if n != p.looks[look]:
    raise ValueError(f"look {look} is planned at {p.looks[look]} seeds; got {n} "
                     "differences")
  mean = d.mean(-1)
  sd = d.std(-1, ddof=1)
  # sd is 0 exactly when every difference is the same (np.std can leave 1e-17 there).
  sd = np.where(np.all(d == d[..., :1], axis=-1), 0.0, sd)
  se = sd / math.sqrt(n)
  safe = np.where(se > 0, se, 1.0)
  # sd 0: the same difference on every seed, infinitely significant unless it is 0.
  flat = np.where(mean > 0, np.inf, np.where(mean < 0, -np.inf, 0.0))
  t = np.where(se > 0, mean / safe, flat)
  b = p.difference_t[look]
  direction = np.where(t >= b, 1, np.where(t <= -b, -1, 0)).astype(np.int8)
  if p.margin is None:
    return direction, np.zeros(mean.shape, bool)
  e = p.equivalence_t[look]
  lo = np.where(se > 0, (mean + p.margin) / safe, np.where(mean + p.margin > 0, np.inf, -np.inf))
  hi = np.where(se > 0, (mean - p.margin) / safe, np.where(mean - p.margin < 0, -np.inf, np.inf))
  return direction, (lo >= e) & (hi <= -e)


class Decision(NamedTuple):
  """One recipe at one look.

  Attributes:
    verdict: CONTINUE, WORSE, BETTER, HOLDS (holds up within the margin) or UNDECIDED
      (neither at the last look). WORSE / BETTER with `holds` True: a difference shown
      and shown smaller than the margin (practically equivalent).
    holds: both equivalence boundaries crossed.
    look: index of the look; n: seeds.
    mean: mean difference; t: its t statistic (inf with sd 0 and a mean != 0).
    interval: mean -+ difference_t * se, the repeated confidence interval: it covers the
      true difference at every look at once with probability >= 1 - alpha / m.
    bound: |mean| + equivalence_t * se: the tightest margin the seeds show the recipe
      within (family-wise level, valid under the optional stopping).
  """

  verdict: str
  holds: bool
  look: int
  n: int
  mean: float
  t: float
  interval: tuple[float, float]
  bound: float


def decide(deltas: Sequence[float], look: int, p: Plan) -> Decision:
  """The rule for one recipe's differences at look `look` (see `decide_array`)."""
  d = np.asarray(deltas, np.float64).reshape(-1)
  if not np.all(np.isfinite(d)):
    raise ValueError(f"deltas={list(deltas)!r}: every value must be finite")
  direction, holds = decide_array(d, look, p)
  direction, holds = int(direction), bool(holds)
  if direction > 0:
    verdict = WORSE
  elif direction < 0:
    verdict = BETTER
  elif holds:
    verdict = HOLDS
  else:
    verdict = UNDECIDED if look == len(p.looks) - 1 else CONTINUE
  n = d.size
  mean = float(d.mean())
  sd = 0.0 if np.all(d == d[0]) else float(d.std(ddof=1))
  se = sd / math.sqrt(n)
  t = mean / se if se > 0 else (math.copysign(math.inf, mean) if mean else 0.0)
  half = p.difference_t[look] * se
  return Decision(verdict, holds, look, n, mean, float(t), (mean - half, mean + half),
                  abs(mean) + p.equivalence_t[look] * se)


def replay(deltas_by_recipe: Mapping[str, Sequence[float]], p: Plan) -> dict[str, Decision]:
  """Each recipe's decision from the differences of the seeds it ran, in seed order.

  Walks the looks as the driver does: at look k every recipe still undecided with >= n_k
  differences is decided on its first n_k; one with fewer than n_k (it stopped, or the
  study stopped before that look) keeps its last decision. A recipe with fewer than
  n_1 differences is CONTINUE at look -1 (nothing decided yet).
  """
  out = {}
  for name, values in deltas_by_recipe.items():
    d = np.asarray(values, np.float64).reshape(-1)
    dec = None
    for k, n in enumerate(p.looks):
      if d.size < n:
        break
      dec = decide(d[:n], k, p)
      if dec.verdict != CONTINUE:
        break
    if dec is None:
      mean = float(d.mean()) if d.size else math.nan
      dec = Decision(CONTINUE, False, -1, int(d.size), mean, math.nan,
                     (math.nan, math.nan), math.nan)
    out[name] = dec
  return out


def seeds_to_run(decisions: Mapping[str, Decision], p: Plan) -> dict[str, int]:
  """Seeds each recipe should have after the next round: the next look's count for a
  recipe still CONTINUE, its current count for a decided one."""
  out = {}
  for name, dec in decisions.items():
    if dec.verdict == CONTINUE:
      out[name] = p.looks[dec.look + 1]
    else:
      out[name] = dec.n
  return out


# --------------------------------------------------------------------------- simulation


def unit_noise(rng: np.random.Generator, kind: str, shape) -> np.ndarray:
  """Mean-0, variance-1 noise: normal, Student t3 / sqrt(3) (heavy tails, infinite 4th
  moment) or centred lognormal(0, 1) / its sd (skewed: skewness 6.2)."""
  if kind == "normal":
    return rng.standard_normal(shape)
  if kind == "t3":
    return rng.standard_t(3, shape) / math.sqrt(3.0)
  if kind == "lognormal":
    return (rng.lognormal(0.0, 1.0, shape) - math.exp(0.5)) / math.sqrt(
        (math.e - 1.0) * math.e)
  raise ValueError(f"noise={kind!r}; accepted: {', '.join(NOISES)}")


class Simulated(NamedTuple):
  """Outcomes of simulated sequential studies, (studies, m) arrays.

  direction: +1 worse / -1 better / 0 at the first decision; holds: holds-up at it;
  seeds: seeds the recipe used; decided: any decision before the budget ran out.
  """

  direction: np.ndarray
  holds: np.ndarray
  seeds: np.ndarray
  decided: np.ndarray

  def control_seeds(self) -> np.ndarray:
    """Seeds the control ran per study: every seed any recipe used."""
    return self.seeds.max(axis=1)


def simulate(p: Plan, shift: float | Sequence[float], sd: float, noise: str = "normal",
             studies: int = 2000, seed: int = 0, on: str = "runs") -> Simulated:
  """Simulated studies under the rule of `decide_array` (the driver's rule), vectorised.

  on="runs": seed i's metric of run r is a shared seed effect (cancels in the pair) plus
  the run's own noise: d_ri = shift_r + sd * (e_ri - e_0i) / sqrt(2), with e_0i the
  control's noise, shared by every recipe of seed i (as in a study), and each e of
  `unit_noise` shape; sd is then the sd of one difference. on="differences": d_ri =
  shift_r + sd * e_ri, the difference itself of that shape (skewed for "lognormal").

  Args:
    p: the Plan (m recipes).
    shift: true mean difference, one for all recipes or one per recipe.
    sd: sd of one per-seed difference, > 0.
    noise: one of NOISES.
    studies: simulated studies, >= 1.
    seed: numpy generator seed.
    on: "runs" or "differences".
  """
  _check_int(studies, "studies", 1)
  if on not in ("runs", "differences"):
    raise ValueError(f"on={on!r}; accepted: runs, differences")
  rng = np.random.default_rng(seed)
  n_max = p.looks[-1]
  mu = np.broadcast_to(np.asarray(shift, np.float64), (p.m,))[None, :, None]
  if on == "runs":
    ctrl = unit_noise(rng, noise, (studies, 1, n_max))
    own = unit_noise(rng, noise, (studies, p.m, n_max))
    d = mu + sd * (own - ctrl) / math.sqrt(2.0)
  else:
    d = mu + sd * unit_noise(rng, noise, (studies, p.m, n_max))
  direction = np.zeros((studies, p.m), np.int8)
  holds = np.zeros((studies, p.m), bool)
  seeds = np.full((studies, p.m), n_max, np.int64)
  decided = np.zeros((studies, p.m), bool)
  for k, n in enumerate(p.looks):
    dk, hk = decide_array(d[..., :n], k, p)
    new = ~decided & ((dk != 0) | hk)
    direction[new], holds[new], seeds[new] = dk[new], hk[new], n
    decided |= new
  return Simulated(direction, holds, seeds, decided)


def error_rates(p: Plan, sd: float, noise: str, studies: int = 2000, seed: int = 0,
                on: str = "runs") -> dict[str, float]:
  """Family-wise error rates of the rule: false worse/better with every true difference
  0, false holds-up with every true difference +margin (and with -margin: half the
  studies each, the margin's sign alternating), over `studies` simulated studies each."""
  if p.margin is None:
    raise ValueError("error_rates needs a Plan with a margin (the holds-up rate)")
  null = simulate(p, 0.0, sd, noise, studies, seed, on)
  half = studies // 2
  plus = simulate(p, p.margin, sd, noise, studies - half, seed + 1, on)
  minus = simulate(p, -p.margin, sd, noise, half, seed + 2, on) if half else None
  false_holds = int(np.any(plus.holds, axis=1).sum()) + (
      int(np.any(minus.holds, axis=1).sum()) if minus is not None else 0)
  return {"false_difference": float(np.mean(np.any(null.direction != 0, axis=1))),
          "false_holds": false_holds / studies}


# --------------------------------------------------------------------------- the table


def fixed_equal_power(p: Plan, sd: float, studies: int = 4000, seed: int = 0) -> int:
  """Fewest seeds of a fixed design (one look, the same alpha split) with at least the
  sequential design's power at both of its goals: holds-up at a true difference 0 and
  worse at 2 x margin (normal differences, simulated on the same random numbers). The
  search stops at 4 x the budget (returned when even that is not enough)."""
  seq0 = simulate(p, 0.0, sd, "normal", studies, seed)
  seq2 = simulate(p, 2 * p.margin, sd, "normal", studies, seed + 1)
  want_holds = float(np.mean(seq0.holds))
  want_worse = float(np.mean(seq2.direction > 0))
  for n in range(2, 4 * p.looks[-1] + 1):
    f = plan(n, p.m, p.alpha, p.margin, p.spending, schedule=(n,))
    f0 = simulate(f, 0.0, sd, "normal", studies, seed)
    f2 = simulate(f, 2 * p.margin, sd, "normal", studies, seed + 1)
    if (np.mean(f0.holds) >= want_holds
        and np.mean(f2.direction > 0) >= want_worse):
      return n
  return 4 * p.looks[-1]


def expected_seeds_table(max_seeds: int = 12, m: int = 3, sd_over_margin=(0.5, 1.0),
                         spendings=SPENDINGS, studies: int = 4000, seed: int = 0) -> str:
  """Markdown table: expected seeds per recipe (and the control's) at true differences 0,
  margin and 2 x margin, the decisions' rates, and the fixed design of equal power."""
  rows = ["| spending | sd/margin | fixed n (equal power) | true Δ | E[seeds] recipe | "
          "E[seeds] control | worse | better | holds up | undecided |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for spending in spendings:
    for ratio in sd_over_margin:
      p = plan(max_seeds, m, margin=1.0, spending=spending)
      fixed = fixed_equal_power(p, ratio, studies, seed)
      for label, shift in (("0", 0.0), ("margin", 1.0), ("2 x margin", 2.0)):
        s = simulate(p, shift, ratio, "normal", studies, seed + 7)
        rows.append(
            f"| {spending} | {ratio:g} | {fixed} | {label} | {s.seeds.mean():.2f} | "
            f"{s.control_seeds().mean():.2f} | {np.mean(s.direction > 0):.3f} | "
            f"{np.mean(s.direction < 0):.3f} | {np.mean(s.holds):.3f} | "
            f"{np.mean(~s.decided):.3f} |")
  return "\n".join(rows)


def main() -> None:
  print(f"Sequential seeds: looks {looks(12)}, m = 3 recipes, alpha = {ALPHA}, normal "
        "differences, every recipe at the same true difference; 4000 studies per row.")
  print(expected_seeds_table())


if __name__ == "__main__":
  main()
