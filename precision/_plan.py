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

from precision import _overrides
from precision._autocast_spec import AutocastSpec
from precision._policy import Policy, get_policy
from precision.optim import _build
from precision.optim._decisions import OptimizerDecisions
from precision._recipe import MICRO_SCALINGS, PRESETS, Fp8Config, Recipe, get_recipe


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
    return _build.chain(self.optimizer_decisions, inner, seed=seed, axis_name=axis_name)

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


def autocast_spec(policy: Any, overrides: Mapping[Any, Any] | None = None, fp32_ops=None,
                  *, module_base: type = object, recompute_f32: bool = True,
                  fp8_state: bool = False) -> AutocastSpec:
  """The AutocastSpec `precision.autocast` and the Flax policies run under, validated:
  what `policy` (any of the inputs they take) and these arguments decide.

  Args:
    policy: a Policy, a policy string ("p=f32,c=bf16,o=f32"), a Recipe, a preset
      recipe name ("bf16_mixed") or a Plan (`precision.bind`): a recipe contributes its
      policy, fp32_ops and fp8 config, a plan its whole spec (overrides included; it
      takes no further `overrides` or `fp32_ops`) and its recipe's fp8 config, or an
      AutocastSpec (`precision.flax.spec_of(model)`, `fn.autocast_spec`): that spec.
    overrides: {path pattern or module type: policy} (see precision.autocast).
    fp32_ops: op names kept in f32 (default: the recipe's, else DEFAULT_FP32_OPS).
    recompute_f32: recompute the f32 glue between GEMMs (norms, softmax) in the backward
      pass instead of saving its f32 intermediates (see precision._autocast._regions).
    fp8_state: the fp8 scaling state is an explicit argument and result.

  Raises:
    ValueError: a bad policy, override or op name; an fp8 compute dtype (fp8 GEMMs need
      scaling: an fp8 recipe); a recipe with delayed fp8 scaling without
      `fp8_state=True` (its amax histories are state); `fp8_state=True` without a recipe
      with fp8 GEMMs.

  Examples:
    >>> autocast_spec("bf16_mixed", {"head": "f32"}).describe()
    "recipe 'bf16_mixed' (p=f32,c=bf16,o=f32), overrides {'head': 'p=f32,c=f32,o=f32'}"
  """
  if not isinstance(fp8_state, bool):
    raise ValueError(f"fp8_state={fp8_state!r}; accepted: True or False")
  if isinstance(policy, AutocastSpec):
    # A spec read back from a marked model or an autocast'ed function
    # (`.autocast_spec`): the same spec again, so the trace agrees with the mark.
    if overrides is not None or fp32_ops is not None or fp8_state:
      raise ValueError("An AutocastSpec carries its own overrides, fp32_ops and fp8 "
                       "settings; accepted: the spec alone, or its recipe with new ones")
    return policy
  if isinstance(policy, Plan):
    plan = as_plan(policy, overrides, fp32_ops)
    return _with_fp8(plan.autocast_spec, plan, fp8_state, policy)
  plan, given = None, policy
  if is_recipe(policy):
    # A recipe is bound here (its overrides are parsed below, against module_base).
    plan = as_plan(policy)
    policy = plan.policy
    fp32_ops = plan.fp32_ops if fp32_ops is None else fp32_ops
  if isinstance(policy, str) and "=" not in policy:
    try:
      get_policy(policy)
    except ValueError as e:
      raise ValueError(
          f"{policy!r} is neither a dtype nor a preset recipe; accepted: a policy string "
          f"such as 'p=f32,c=bf16,o=f32', a dtype ({e}), or a preset: "
          f"{', '.join(PRESETS)}") from e
  spec = AutocastSpec.build(policy, overrides, fp32_ops, module_base=module_base,
                            recompute_f32=recompute_f32,
                            recipe=None if plan is None else plan.recipe)
  return _with_fp8(spec, plan, fp8_state, given)


def refuse_fp8_recipe(policy: Any, where: str) -> None:
  """Raises for an fp8 recipe (or a plan of one) given where only a policy applies: a
  model marked by apply_policy / linen_policy gets no fp8 layers (apply_recipe does)."""
  if not (isinstance(policy, Plan) or is_recipe(policy)):
    return
  plan = as_plan(policy)
  if plan.fp8 is not None:
    raise ValueError(
        f"{where}: recipe {plan.name!r} has fp8 GEMMs, whose scaling state (amax history, "
        "scales) lives in layers: use precision.flax.apply_recipe(model, recipe) on an "
        "NNX model (its nnx.Linear/Einsum layers get the fp8 GEMMs, every other GEMM the "
        "recipe's policy), precision.autocast(fn, recipe) on a function, or "
        f"{where}(..., recipe.policy) for the policy alone")


def _with_fp8(spec: AutocastSpec, plan: Any, fp8_state: bool,
              given: Any) -> AutocastSpec:
  """`spec` running the fp8 GEMMs of `plan` (a Plan, or None for a bare policy) itself
  (autocast of a function)."""
  fp8 = plan.fp8 if plan is not None else None
  if fp8 is not None and fp8.scaling == "delayed" and fp8_state is not True:
    raise ValueError(
        f"Recipe {plan.name!r} scales its fp8 GEMMs with delayed scaling "
        "(fp8.scaling='delayed'): each GEMM's amax history is state carried from step "
        "to step, which plain autocast has nowhere to keep. Either carry it: "
        "g = precision.autocast(fn, recipe, fp8_state=True) with state = "
        "precision.fp8.init_state(fn, recipe, *args), called as "
        "g(state, *args) -> (out, new_state) (precision.value_and_grad(g) "
        "does the step); or use a stateless scaling: dataclasses.replace(recipe, "
        "fp8=precision.Fp8Config(scaling='current')) ('per_channel' and 'block' are "
        "stateless too)")
  if fp8_state and fp8 is None:
    raise ValueError(
        f"fp8_state=True with {getattr(given, 'name', given)!r}, which has no fp8 GEMMs; "
        "accepted: a recipe with "
        "an fp8 config (precision.get_recipe('fp8_hybrid'), or a Recipe(..., "
        "fp8=precision.Fp8Config(...)))")
  if fp8 is None and not fp8_state:
    return spec
  return dataclasses.replace(spec, fp8=fp8, fp8_state=fp8_state)
