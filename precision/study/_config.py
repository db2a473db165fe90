"""`StudyConfig`: what a study trains, validated; the grid of cells; shard slices.

`make_config` turns the user's arguments into a StudyConfig (recipes resolved, the control
first, the study's loss-scale growth interval and overrides applied); `StudyConfig.grid`
lists the cells; `parse_shard` reads "K/N" or a Slurm array's environment.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Mapping, Sequence

from precision import _recipe
from precision._plan import bind
from precision._policy import get_policy
from precision._recipe import PRESETS, Recipe, get_recipe
from precision.study import _cells
from precision.study import _sequential

AA_SEED_OFFSET = 1_000_000
GROWTH_STEPS_PER_RUN = 15  # "auto" growth interval: the scale may double this often a run
FLOOR_SUFFIX = "-floor"    # the chaos floor's arm: "<control>-floor"
DEFAULT_MAX_SEEDS = 12


@dataclasses.dataclass(frozen=True)
class Sequential:
  """How a ``seeds="auto"`` study adds seeds (`precision.study._sequential`): rounds up
  to `max_seeds` per recipe, stopping a recipe once it is worse, better or holds up
  within `margin`, at family-wise error rate `alpha`. Part of the study's identity: the
  cells it trains depend on it."""

  max_seeds: int
  margin: float
  alpha: float
  spending: str = "linear"
  first: int = 3
  every: int = 3


@dataclasses.dataclass(frozen=True)
class StudyConfig:
  """What a study trains (the identity an output folder keeps) and how it runs.

  Attributes:
    recipes: the recipes, the control among them (put first).
    seeds: seed indices 0..seeds-1 per recipe.
    steps: optimizer steps per cell.
    eval_every: evaluation every this many steps (and at 0 and the end); 0: at the end.
    save_every: checkpoint every this many steps (resumes lose at most this many).
    control: name of the recipe the others are judged against.
    aa: add the A/A arm (the control on other seeds).
    growth_interval: "recipe" (each recipe's own), "auto" (steps // 15: growth and
      back-off both happen in a short run) or an int: the dynamic loss scale's growth
      interval in this study.
    max_nonfinite: a cell stops as diverged after this many consecutive non-finite steps.
    overrides: (scope pattern, policy string) pairs every recipe is bound with
      (`precision.bind(recipe, overrides=...)`), e.g. (("*head*", "p=f32,c=f32,o=f32"),).
    floor: add the chaos floor's arm (the control from initial weights one ulp away, on
      the control's seeds and batches; `precision.study._floor`).
    sequential: the rule of a ``seeds="auto"`` study (None: a fixed number of seeds).
    arm_seeds: (arm, seeds) where an arm runs fewer than `seeds` (a sequential study's
      recipes that were decided early); the control and the floor run `seeds`.
  """

  recipes: tuple[Recipe, ...]
  seeds: int
  steps: int
  eval_every: int
  save_every: int
  control: str
  aa: bool
  growth_interval: str | int
  max_nonfinite: int
  overrides: tuple[tuple[str, str], ...] = ()
  floor: bool = False
  sequential: Sequential | None = None
  arm_seeds: tuple[tuple[str, int], ...] = ()

  @property
  def floor_arm(self) -> str | None:
    return f"{self.control}{FLOOR_SUFFIX}" if self.floor else None

  def arms(self) -> list[tuple[str, Recipe, int]]:
    """(arm name, recipe, seed offset) of every row: the control first, then the
    recipes, the A/A arm, and the chaos floor last (its cells train `nudged` weights)."""
    out = [(r.name, r, 0) for r in self.recipes]
    if self.aa:
      out.append((f"{self.control}-aa", self.recipe(self.control), AA_SEED_OFFSET))
    if self.floor:
      out.append((self.floor_arm, self.recipe(self.control), 0))
    return out

  def judged_arms(self) -> list[str]:
    """The arms judged against the control (the family of the verdicts)."""
    return [a for a, _, _ in self.arms() if a not in (self.control, self.floor_arm)]

  def n_seeds(self, arm: str) -> int:
    """Seeds `arm` runs (fewer than `seeds` for a recipe a sequential study decided)."""
    return dict(self.arm_seeds).get(arm, self.seeds)

  def recipe(self, name: str) -> Recipe:
    return next(r for r in self.recipes if r.name == name)

  def grid(self) -> list[_cells.Cell]:
    """Every cell, arm-major."""
    return [_cells.Cell(arm, recipe, i, i + offset)
            for arm, recipe, offset in self.arms() for i in range(self.n_seeds(arm))]


def check_int(name: str, v: Any, lo: int) -> int:
  """`v` as an int >= lo, or a ValueError naming `name` and what is accepted."""
  if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
    raise ValueError(f"{name}={v!r}; accepted: an integer >= {lo}")
  return int(v)


def _with_growth(recipe: Recipe, growth: int | None) -> Recipe:
  return _recipe.with_growth_interval(recipe, growth)


def make_config(recipes: Sequence[str | Recipe] | str, seeds: int, steps: int, *,
                eval_every: int | None = None, save_every: int | None = None,
                control: str = "fp32", aa: bool = False,
                growth_interval: str | int = "recipe", max_nonfinite: int = 50,
                overrides: Mapping[str, Any] | None = None, max_seeds: int | None = None,
                margin: float | None = None, alpha: float = 0.05,
                floor: bool | None = None) -> StudyConfig:
  """A validated StudyConfig (ValueError naming any bad value and what is accepted).

  ``seeds="auto"`` makes a sequential study (`Sequential`: up to `max_seeds`, default
  DEFAULT_MAX_SEEDS, at `margin` and `alpha`; its first round's seeds in `seeds`);
  `floor` None: on for a sequential study, off otherwise.
  """
  sequential = None
  if isinstance(seeds, str) and seeds.strip() == "auto":
    sequential = _sequential_of(max_seeds, margin, alpha)
    seeds = sequential_looks(sequential)[0]
  elif max_seeds is not None:
    raise ValueError(f"max_seeds={max_seeds!r} is given with seeds={seeds!r}; accepted: "
                     "max_seeds only with seeds='auto'")
  if floor is None:
    floor = sequential is not None
  if not isinstance(floor, bool):
    raise ValueError(f"floor={floor!r}; accepted: True, False or None (on with "
                     "seeds='auto')")
  if isinstance(recipes, str):
    recipes = [r.strip() for r in recipes.split(",") if r.strip()]
  resolved = []
  for r in recipes:
    if isinstance(r, str) and r not in PRESETS:
      raise ValueError(f"recipe {r!r} does not exist; presets: {', '.join(PRESETS)}")
    resolved.append(get_recipe(r))
  names = [r.name for r in resolved]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"recipes {dup} are named twice; accepted: distinct recipe names")
  if not isinstance(control, str):
    raise ValueError(f"control={control!r}; accepted: a recipe name (str), one of {names} "
                     "or a preset")
  if control not in names:
    if control in PRESETS:
      resolved.insert(0, get_recipe(control))
    else:
      raise ValueError(f"control={control!r} is neither among the recipes {names} nor a "
                       f"preset ({', '.join(PRESETS)})")
  if isinstance(seeds, str):
    raise ValueError(f"seeds={seeds!r}; accepted: an integer >= 2 or 'auto'")
  seeds = check_int("seeds", seeds, 2)
  steps = check_int("steps", steps, 1)
  eval_every = (max(1, steps // 10) if eval_every is None
                else check_int("eval_every", eval_every, 0))
  save_every = (max(1, steps // 10) if save_every is None
                else check_int("save_every", save_every, 1))
  max_nonfinite = check_int("max_nonfinite", max_nonfinite, 1)
  if not isinstance(aa, bool):
    raise ValueError(f"aa={aa!r}; accepted: True or False")
  g = growth_interval
  if isinstance(g, str) and g.isdigit():
    g = int(g)
  if g == "auto":
    growth = max(1, steps // GROWTH_STEPS_PER_RUN)
  elif g == "recipe":
    growth = None
  elif isinstance(g, int) and not isinstance(g, bool) and g >= 1:
    growth = g
  else:
    raise ValueError(f"growth_interval={growth_interval!r}; accepted: 'recipe', 'auto' or "
                     "an integer >= 1 (steps)")
  control_first = sorted(resolved, key=lambda r: r.name != control)
  pairs = ()
  if overrides:
    if not isinstance(overrides, Mapping) or not all(isinstance(k, str) for k in overrides):
      raise ValueError(f"overrides={overrides!r}; accepted: a dict of scope patterns "
                       "(strings) to policies")
    try:
      pairs = tuple(sorted((k, str(get_policy(v))) for k, v in overrides.items()))
      for r in control_first:
        bind(r, overrides=dict(pairs))  # a bad pattern or policy fails here, before any cell
    except ValueError as e:
      raise ValueError(f"overrides={dict(overrides)!r}: {e}") from e
  return StudyConfig(tuple(_with_growth(r, growth) for r in control_first), seeds, steps,
                     eval_every, save_every, control, aa, g, max_nonfinite, pairs,
                     floor, sequential)


def _sequential_of(max_seeds, margin, alpha) -> Sequential:
  max_seeds = DEFAULT_MAX_SEEDS if max_seeds is None else check_int("max_seeds",
                                                                    max_seeds, 2)
  if margin is None:
    raise ValueError("seeds='auto' needs a margin (--margin): the rule stops a recipe "
                     "once it is worse, better or holds up within the margin, and without "
                     "one no recipe equal to the control could ever stop")
  if not (isinstance(margin, (int, float)) and not isinstance(margin, bool)
          and math.isfinite(margin) and margin > 0):
    raise ValueError(f"margin={margin!r}; accepted: a finite number > 0 (in the "
                     "evaluation metric's units)")
  if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < 1):
    raise ValueError(f"alpha={alpha!r}; accepted: a number in (0, 1)")
  return Sequential(max_seeds, float(margin), float(alpha))


def sequential_looks(seq: Sequential) -> tuple[int, ...]:
  """The planned seed counts of a sequential study's looks."""
  return _sequential.looks(seq.max_seeds, seq.first, seq.every)


def sequential_plan(cfg: StudyConfig) -> _sequential.Plan:
  """The rule of a seeds="auto" study: its judged arms (A/A included) are the family."""
  seq = cfg.sequential
  return _sequential.plan(seq.max_seeds, max(1, len(cfg.judged_arms())), seq.alpha,
                          seq.margin, seq.spending, seq.first, seq.every)


def parse_shard(text: str | Sequence[int] | None) -> tuple[int, int]:
  """"K/N" (or (K, N)) -> (K, N) with 1 <= K <= N; None -> the Slurm array slice, else 1/1.

  Slurm: K = SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN + 1 (MIN 0 when unset), N =
  SLURM_ARRAY_TASK_COUNT.
  """
  if text is None:
    tid, count = os.environ.get("SLURM_ARRAY_TASK_ID"), os.environ.get(
        "SLURM_ARRAY_TASK_COUNT")
    if tid is None or count is None:
      return 1, 1
    try:
      k = int(tid) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0")) + 1
      n = int(count)
    except ValueError:
      raise ValueError(f"SLURM_ARRAY_TASK_ID={tid!r}, SLURM_ARRAY_TASK_COUNT={count!r}: "
                       "accepted: integers") from None
    if not 1 <= k <= n:
      raise ValueError(f"the Slurm array gives slice {k} of {n} (SLURM_ARRAY_TASK_ID={tid},"
                       f" SLURM_ARRAY_TASK_MIN={os.environ.get('SLURM_ARRAY_TASK_MIN', '0')}"
                       f", SLURM_ARRAY_TASK_COUNT={count}); accepted: 1 <= K <= N")
    return k, n
  if isinstance(text, str):
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
      raise ValueError(f"shard {text!r}; accepted: K/N with 1 <= K <= N, e.g. 1/4")
    k, n = int(m.group(1)), int(m.group(2))
  else:
    k, n = (int(x) for x in text)
  if not 1 <= k <= n:
    raise ValueError(f"shard {k}/{n}; accepted: K/N with 1 <= K <= N, e.g. 1/4")
  return k, n


def config_from_study(study: dict) -> StudyConfig:
  """The StudyConfig of a study.json (a sequential study's with the seeds it ran, from
  its "sequential_state")."""
  ident, extra = study["identity"], study["settings"]
  recipes = tuple(Recipe.from_dict(d) for d in ident["recipes"])
  seq = ident.get("sequential")
  seq = Sequential(**seq) if seq else None
  state = study.get("sequential_state") or {}
  seeds = state.get("seeds", ident["seeds"]) if seq else ident["seeds"]
  return StudyConfig(recipes, seeds, ident["steps"], ident["eval_every"],
                     extra["save_every"], ident["control"], ident["aa"],
                     extra["growth_interval"], ident["max_nonfinite"],
                     tuple(tuple(p) for p in ident.get("overrides", ())),
                     bool(ident.get("floor", False)), seq,
                     tuple((a, int(n)) for a, n in state.get("arm_seeds", [])))
