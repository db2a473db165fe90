"""Plan: a Recipe interpreted once, for every entry point that applies it.

A Recipe is data (dtypes, rounding, loss scale, fp8 config); applying it needs several
derived things: the autocast spec (policy, overrides, fp32 ops) the model's calls run
under, the optimizer around the user's optax optimizer, the dtypes the data-parallel step
casts and reduces in, the memory ledger. `bind` derives them once, validated, into one
frozen value; `precision.flax.apply_recipe`, `precision.autocast`,
`precision.optim.build_optimizer`, `precision.parallel.data_parallel` and
`PrecisionReport.check` take a Plan as well as a Recipe or a preset name (which they bind
themselves, once), so a model marked with a plan and trained with it agree on every GEMM.

Examples:
  >>> plan = precision.bind("bf16_mixed", overrides={"*head*": "f32"})
  >>> model = precision.flax.apply_recipe(model, plan)
  >>> dp = precision.parallel.data_parallel(loss_fn, optax.adamw(3e-4), mesh, recipe=plan)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from precision._autocast import _overrides
from precision._autocast._api import AutocastSpec
from precision._policy import Policy
from precision._recipe import PRESETS, Fp8Config, Recipe, get_recipe


@dataclasses.dataclass(frozen=True)
class Plan:
  """A Recipe bound to its overrides: everything the entry points derive from it.

  Build it with `precision.bind`. Frozen and hashable (it can be a static jit argument).

  Attributes:
    recipe: the Recipe.
    autocast_spec: the `AutocastSpec` the model's calls run under: the recipe's policy,
      the overrides, the fp32 ops (an fp8 recipe's fp8 GEMMs come from its layers,
      `precision.flax.apply_recipe`; the spec covers every other GEMM).
    bytes_per_param: persistent bytes per parameter with an Adam-style inner optimizer
      (`precision.optim.bytes_per_param(recipe)`); `memory_ledger(inner)` itemises it.
  """

  recipe: Recipe
  autocast_spec: AutocastSpec
  bytes_per_param: float

  @property
  def policy(self) -> Policy:
    """The module Policy (param / compute / output dtypes) outside the overrides."""
    return self.autocast_spec.policy

  @property
  def param_dtype(self) -> np.dtype:
    return self.policy.param_dtype

  @property
  def compute_dtype(self) -> np.dtype:
    return self.policy.compute_dtype

  @property
  def output_dtype(self) -> np.dtype:
    return self.policy.output_dtype

  @property
  def reduce_dtype(self) -> np.dtype:
    """The dtype gradients are summed in across devices."""
    return self.recipe.reduce_dtype

  @property
  def fp8(self) -> Fp8Config | None:
    return self.recipe.fp8

  @property
  def fp32_ops(self) -> tuple[str, ...]:
    return self.autocast_spec.fp32_ops

  @property
  def overrides(self) -> dict[Any, Any]:
    """{path pattern or module type: Policy, or {"fwd": Policy, "bwd": Policy} for a
    direction-specific override (the keys given)}, in the order given to `bind`."""
    return _overrides.as_mapping(self.autocast_spec.rules)

  def memory_ledger(self, inner: str = "adamw") -> dict[str, float]:
    """Bytes per parameter of each persistent tensor (`precision.optim.memory_ledger`)."""
    # In the function: precision.optim imports this module (build_optimizer takes a Plan).
    from precision.optim import _ledger  # pylint: disable=g-import-not-at-top
    return _ledger.memory_ledger(self.recipe, inner)

  def optimizer(self, inner, seed: int = 0, *, axis_name: str | None = None):
    """`precision.optim.build_optimizer(self.recipe, inner, seed=seed, axis_name=...)`.

    Examples:
      >>> tx = plan.optimizer(optax.adamw(3e-4))
    """
    # In the function: precision.optim imports this module (build_optimizer takes a Plan).
    from precision.optim import _build  # pylint: disable=g-import-not-at-top
    return _build.build_optimizer(self.recipe, inner, seed=seed, axis_name=axis_name)

  def describe(self) -> str:
    """One line: the recipe, its policy and the overrides."""
    return self.autocast_spec.describe()

  def __str__(self) -> str:
    return f"Plan({self.describe()})"


def bind(recipe: Recipe | str, overrides: Mapping[Any, Any] | None = None,
         fp32_ops=None) -> Plan:
  """Validates a recipe with its overrides once and returns the Plan every entry point takes.

  Args:
    recipe: a Recipe or a preset name ("bf16_mixed"). A Plan is refused: it is bound.
    overrides: {path pattern or module type: policy}, as `precision.autocast` takes them
      ({"*head*": "f32"}, or direction-specific {"l0": {"bwd": "f32"}}): another policy
      for part of the model.
    fp32_ops: op names kept in f32 (default: the recipe's `fp32_ops`).

  Returns:
    A Plan.

  Raises:
    ValueError: an unknown preset, a bad override key or policy, an unknown op name, an
      fp8 compute dtype in an override, or a Plan passed as `recipe`.

  Examples:
    >>> plan = bind("bf16_mixed", overrides={"head": "f32"})
    >>> str(plan.policy), plan.overrides["head"].compute_dtype
    ('p=f32,c=bf16,o=f32', dtype('float32'))
    >>> tx = plan.optimizer(optax.adamw(3e-4))
  """
  if isinstance(recipe, Plan):
    raise ValueError(f"bind({recipe}): the plan is already bound; accepted: a Recipe or a "
                     "preset name (pass the plan itself where a recipe is taken)")
  if not isinstance(recipe, (Recipe, str)):
    raise ValueError(f"recipe={recipe!r}; accepted: a Recipe or a preset name")
  recipe = get_recipe(recipe)
  spec = AutocastSpec.build(recipe.policy, overrides,
                            recipe.fp32_ops if fp32_ops is None else fp32_ops, recipe=recipe)
  # In the function: precision.optim imports this module (memory_ledger takes a Plan).
  from precision.optim import _ledger  # pylint: disable=g-import-not-at-top
  return Plan(recipe, spec, _ledger.bytes_per_param(recipe))


def as_plan(recipe: Plan | Recipe | str, overrides: Mapping[Any, Any] | None = None,
            fp32_ops=None) -> Plan:
  """`recipe` as a Plan: a Plan passes through (it takes no further overrides or fp32_ops),
  a Recipe or a preset name is bound once.

  Raises:
    ValueError: overrides or fp32_ops given with a Plan, or what `bind` raises.
  """
  if isinstance(recipe, Plan):
    if overrides is not None or fp32_ops is not None:
      raise ValueError(
          f"{recipe} is already bound; got overrides={overrides!r}, fp32_ops={fp32_ops!r} "
          "besides; accepted: precision.bind(recipe, overrides=..., fp32_ops=...) and the "
          "plan alone")
    return recipe
  return bind(recipe, overrides, fp32_ops)


def recipe_of(recipe: Plan | Recipe | str) -> Recipe:
  """The Recipe of a Plan, a Recipe or a preset name (for code that needs no overrides:
  the optimizer, the memory ledger)."""
  return recipe.recipe if isinstance(recipe, Plan) else get_recipe(recipe)


def is_recipe(value: Any) -> bool:
  """A Recipe or a preset name (a policy string such as "bf16" or "p=f32,c=bf16" is not)."""
  return isinstance(value, Recipe) or (isinstance(value, str) and value in PRESETS)


def spec_for(policy: Any, overrides: Mapping[Any, Any] | None = None,
             fp32_ops=None) -> AutocastSpec:
  """The autocast spec of a Plan, a Recipe or preset name (bound once; fp8 recipes too:
  their other GEMMs follow the spec), or a Policy / policy string with `overrides`.

  For code that reads a spec without running it (the audit's checks); `autocast` itself
  refuses fp8 recipes, whose scaling state lives in layers.
  """
  if isinstance(policy, Plan) or is_recipe(policy):
    return as_plan(policy, overrides, fp32_ops).autocast_spec
  return AutocastSpec.build(policy, overrides, fp32_ops)
