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

import ml_dtypes
import numpy as np

from precision._autocast import _overrides
from precision._autocast._api import AutocastSpec
from precision._policy import Policy
from precision._recipe import (MICRO_SCALINGS, PRESETS, Fp8Config, LossScaleConfig, Recipe,
                               SpikeGuardConfig, get_recipe)


_F32 = np.dtype(np.float32)

# Moments each inner optimizer keeps per param: which of mu / nu (the memory ledger).
INNER_MOMENTS = {
    "adamw": ("mu", "nu"), "adam": ("mu", "nu"), "lamb": ("mu", "nu"),
    "lion": ("mu",), "momentum": ("mu",), "sgd": (),
}
# Element and scale formats of the GEMMs a lowering must show (precision.audit).
_FP8_FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
                "e2m1": ml_dtypes.float4_e2m1fn}
_MICRO_SCALES = {"mxfp8": ml_dtypes.float8_e8m0fnu, "nvfp4": ml_dtypes.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class OptimizerDecisions:
  """The optimizer chain a recipe asks for, decided once by `bind`: what
  `precision.optim.build_optimizer` builds around the user's optimizer (from the inside
  out) and what the memory ledger counts.

  Attributes:
    recipe_name: the recipe's name (for messages).
    param_dtype: the dtype the params are stored in.
    fused: the update is the fused AdamW + stochastic rounding kernel (steps 1 and 2).
    moment_dtypes: (mu, nu) storage dtypes when one of them is not f32 (step 1), else None.
    mu_dtype, nu_dtype: the moments' storage dtypes (f32 when moment_dtypes is None).
    updates: how updates reach the params (step 2): "master" (an f32 master copy,
      rounded per `rounding`), "stochastic" (stochastic rounding into 16-bit params),
      "kahan" (a compensation buffer), "f32_update" (f32 updates rounded to nearest into
      16-bit params) or "as_is" (f32 params take the inner updates).
    master_dtype: the master copy's dtype, or None.
    rounding: "nearest", "stochastic" or "kahan".
    loss_scale: the LossScaleConfig of a scaled recipe (step 3: loss scaling), or None
      (step 3: non-finite steps skipped).
    spike_guard: the SpikeGuardConfig (step 4), or None.
  """

  recipe_name: str
  param_dtype: np.dtype
  fused: bool
  moment_dtypes: tuple[np.dtype, np.dtype] | None
  mu_dtype: np.dtype
  nu_dtype: np.dtype
  updates: str
  master_dtype: np.dtype | None
  rounding: str
  loss_scale: LossScaleConfig | None
  spike_guard: SpikeGuardConfig | None

  @property
  def seeds_rounding(self) -> bool:
    """The update draws random bits (stochastic rounding, of the params or the master)."""
    return self.fused or self.rounding == "stochastic"


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
  """Bytes per parameter of each persistent tensor with an Adam-style inner optimizer (the
  ZeRO paper's accounting), read from the optimizer decisions: params, grads (in the param
  dtype, as jax.grad returns them), master (0 without), compensation (Kahan buffer, param
  dtype), mu, nu. Per-tensor scalars (counts, loss scale) are O(1) and left out."""

  params: float
  grads: float
  master: float
  compensation: float
  mu: float
  nu: float

  @classmethod
  def of(cls, opt: OptimizerDecisions) -> MemoryLedger:
    p = float(np.dtype(opt.param_dtype).itemsize)
    return cls(params=p, grads=p,
               master=0.0 if opt.master_dtype is None else float(opt.master_dtype.itemsize),
               compensation=p if opt.updates == "kahan" else 0.0,
               mu=float(opt.mu_dtype.itemsize), nu=float(opt.nu_dtype.itemsize))

  def for_inner(self, inner: str = "adamw") -> dict[str, float]:
    """{tensor: bytes per param} with `inner` (moments it does not keep count 0)."""
    if inner not in INNER_MOMENTS:
      raise ValueError(f"inner={inner!r}; accepted: {', '.join(INNER_MOMENTS)}")
    d = dataclasses.asdict(self)
    return {k: (v if k not in ("mu", "nu") or k in INNER_MOMENTS[inner] else 0.0)
            for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class GemmDtypes:
  """The dtypes the GEMMs of a lowered program of the plan must show
  (`precision.audit.gemm_violations` checks them).

  Attributes:
    recipe_name: the recipe's name (for messages).
    compute: dtype name of the operands of a GEMM without fp8 (the policy's compute dtype).
    allowed: `compute` and the compute dtypes of the overrides (a lowered program has no
      module scopes: any of them is accepted at any GEMM).
    fwd8, bwd8: per-tensor-scaled fp8 formats (forward; gradient) as dtype names, or None
      (no fp8, or a microscaled scaling).
    micro: "mxfp8" / "nvfp4" for a microscaled recipe, else None.
    micro_gemm: its lowering choice (`Fp8Config.micro_gemm`), else None.
    micro_elements: (forward, backward) element dtype names of its block-scaled GEMMs.
    micro_scale: the dtype name of its block scales.
    micro_block: its block length (`Fp8Config.block_size`).
  """

  recipe_name: str
  compute: str
  allowed: frozenset
  fwd8: str | None = None
  bwd8: str | None = None
  micro: str | None = None
  micro_gemm: str | None = None
  micro_elements: tuple[str, str] | None = None
  micro_scale: str | None = None
  micro_block: int | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """A Recipe bound to its overrides: every decision the entry points take from it.

  Build it with `precision.bind`. Frozen and hashable (it can be a static jit argument).
  The decisions are data, read by the entry points instead of the recipe's fields.

  Attributes:
    recipe: the Recipe (what a checkpoint serialises; the decisions below come from it).
    autocast_spec: the `AutocastSpec` the model's calls run under: the recipe's policy,
      the overrides, the fp32 ops (an fp8 recipe's fp8 GEMMs come from its layers,
      `precision.flax.apply_recipe`; the spec covers every other GEMM).
    optimizer_decisions: the optimizer chain (`OptimizerDecisions`).
    fp8: the recipe's Fp8Config (its fp8 GEMMs), or None.
    ledger: the memory ledger (`MemoryLedger`).
    gemms: the GEMM dtypes a lowering must show (`GemmDtypes`).
    reduce_dtype: the dtype gradients are summed in across devices.
    bytes_per_param: persistent bytes per parameter with an Adam-style inner optimizer
      (`precision.optim.bytes_per_param(recipe)`); `memory_ledger(inner)` itemises it.
  """

  recipe: Recipe
  autocast_spec: AutocastSpec
  optimizer_decisions: OptimizerDecisions
  fp8: Fp8Config | None
  ledger: MemoryLedger
  gemms: GemmDtypes
  reduce_dtype: np.dtype

  @property
  def name(self) -> str:
    """The recipe's name."""
    return self.recipe.name

  @property
  def bytes_per_param(self) -> float:
    return float(sum(self.memory_ledger().values()))

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
  def loss_scaled(self) -> bool:
    """The loss is scaled before backward (the optimizer's guard unscales the grads)."""
    return self.optimizer_decisions.loss_scale is not None

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
    return self.ledger.for_inner(inner)

  def optimizer(self, inner, seed: int = 0, *, axis_name: str | None = None):
    """`precision.optim.build_optimizer(self, inner, seed=seed, axis_name=...)`.

    Examples:
      >>> tx = plan.optimizer(optax.adamw(3e-4))
    """
    # In the function: precision.optim imports this module (build_optimizer takes a Plan).
    from precision.optim import _build  # pylint: disable=g-import-not-at-top
    return _build.build_optimizer(self, inner, seed=seed, axis_name=axis_name)

  def bound_dict(self) -> dict[str, Any]:
    """What `bind` added to the recipe, JSON-safe (a checkpoint records it beside
    ``recipe.to_dict()``, and restore compares it): {"overrides": [[key, direction,
    policy], ...] in the order given, "fp32_ops": [op names]}. A module-type key is
    written by its qualified name.

    Examples:
      >>> bind("bf16_mixed", overrides={"*head*": "f32"}).bound_dict()["overrides"]
      [['*head*', 'both', 'p=f32,c=f32,o=f32']]
    """
    key = lambda k: k if isinstance(k, str) else f"{k.__module__}.{k.__qualname__}"
    return {"overrides": [[key(r.key), r.direction, str(r.policy)]
                          for r in self.autocast_spec.rules],
            "fp32_ops": list(self.fp32_ops)}

  def describe(self) -> str:
    """One line: the recipe, its policy and the overrides."""
    return self.autocast_spec.describe()

  def __str__(self) -> str:
    return f"Plan({self.describe()})"


def _optimizer_decisions(recipe: Recipe) -> OptimizerDecisions:
  """Steps 1-4 of `precision.optim.build_optimizer` for `recipe`."""
  param = recipe.policy.param_dtype
  if recipe.master_dtype is not None:
    updates = "master"
  elif recipe.rounding in ("stochastic", "kahan"):
    updates = recipe.rounding
  elif param != _F32:
    updates = "f32_update"
  else:
    updates = "as_is"
  moments = (recipe.mu_dtype, recipe.nu_dtype)
  return OptimizerDecisions(
      recipe_name=recipe.name, param_dtype=param, fused=recipe.fused,
      moment_dtypes=None if moments == (_F32, _F32) else moments,
      mu_dtype=recipe.mu_dtype, nu_dtype=recipe.nu_dtype, updates=updates,
      master_dtype=recipe.master_dtype, rounding=recipe.rounding,
      loss_scale=None if recipe.loss_scale.kind == "none" else recipe.loss_scale,
      spike_guard=recipe.spike_guard)


def _gemm_dtypes(recipe: Recipe, spec: AutocastSpec) -> GemmDtypes:
  """The GEMM dtypes of a lowering of `recipe` under `spec`'s overrides."""
  compute = np.dtype(recipe.policy.compute_dtype).name
  allowed = frozenset({compute} | {np.dtype(r.policy.compute_dtype).name
                                   for r in spec.rules})
  fp8 = recipe.fp8
  if fp8 is None:
    return GemmDtypes(recipe.name, compute, allowed)
  name = lambda fmt: np.dtype(_FP8_FORMATS[fmt]).name
  if fp8.scaling not in MICRO_SCALINGS:
    return GemmDtypes(recipe.name, compute, allowed, fwd8=name(fp8.forward_format),
                      bwd8=name(fp8.backward_format))
  return GemmDtypes(recipe.name, compute, allowed, micro=fp8.scaling,
                    micro_gemm=fp8.micro_gemm,
                    micro_elements=(name(fp8.forward_format), name(fp8.backward_format)),
                    micro_scale=np.dtype(_MICRO_SCALES[fp8.scaling]).name,
                    micro_block=fp8.block_size)


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
                            recipe.fp32_ops if fp32_ops is None else fp32_ops, recipe=recipe,
                            grouped_fp8=recipe.fp8)
  opt = _optimizer_decisions(recipe)
  return Plan(recipe, spec, opt, recipe.fp8, MemoryLedger.of(opt), _gemm_dtypes(recipe, spec),
              recipe.reduce_dtype)


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
