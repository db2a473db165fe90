"""AutocastSpec: everything `precision.autocast` applies, as one frozen value.

A policy, its override rules, the ops kept in f32 and the recipe's fp8 GEMMs. `precision.bind`
decides it (`Plan.autocast_spec`; `precision._plan.autocast_spec` for the other inputs
autocast and the Flax policies take); the autocast interpreter (precision._autocast) and
the audit read it. It sits below both so that the Plan can hold one without importing the
interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import numpy as np

from precision import _fp32_ops
from precision import _overrides
from precision._policy import Policy, dtype_name, get_policy
from precision._recipe import DEFAULT_FP32_OPS, Fp8Config, Recipe


@dataclasses.dataclass(frozen=True)
class AutocastSpec:
  """A policy, its overrides, the ops kept in f32 and the recipe's fp8 GEMMs: everything
  autocast applies.

  Frozen and hashable (NNX keeps it in a module's static graph definition). `recipe` is
  the Recipe the spec was made from (None for a bare policy): a model marked with one
  recipe and traced under another is refused (see precision.flax.apply_recipe). `fp8` is
  the recipe's Fp8Config when autocast itself runs its fp8 GEMMs (None: no fp8 GEMMs; a
  model marked by apply_recipe gets them from its fp8 layers instead); `fp8_state`: the
  scaling state is an explicit argument and result (``g(state, *args) -> (out,
  new_state)``).
  """

  policy: Policy
  rules: tuple = ()
  fp32_ops: tuple[str, ...] = DEFAULT_FP32_OPS
  recompute_f32: bool = True
  recipe: Recipe | None = None
  fp8: Fp8Config | None = None
  fp8_state: bool = False
  grouped_fp8: Fp8Config | None = None

  def describe(self) -> str:
    """One line for error messages: recipe (or policy), overrides, fp32 ops if not default.

    Examples:
      >>> precision._plan.autocast_spec("bf16_mixed", {"head": "f32"}).describe()
      "recipe 'bf16_mixed' (p=f32,c=bf16,o=f32), overrides {'head': 'p=f32,c=f32,o=f32'}"
    """
    text = (f"recipe {self.recipe.name!r} ({self.policy})" if self.recipe is not None
            else f"policy {str(self.policy)!r}")
    if self.rules:
      shown = ", ".join(f"{_overrides.key_name(k)}: {_overrides.describe_value(v)}"
                        for k, v in _overrides.as_mapping(self.rules).items())
      text += f", overrides {{{shown}}}"
    else:
      text += ", no overrides"
    if self.fp32_ops != (self.recipe.fp32_ops if self.recipe is not None
                         else DEFAULT_FP32_OPS):
      text += f", fp32_ops {list(self.fp32_ops)}"
    return text

  @functools.cached_property
  def fp32_primitives(self) -> frozenset:
    return _fp32_ops.primitives_of(self.fp32_ops)

  @classmethod
  def build(cls, policy: Policy | str, overrides: Mapping[Any, Any] | None = None,
            fp32_ops=None, *, module_base: type = object, recompute_f32: bool = True,
            recipe: Recipe | None = None,
            grouped_fp8: Fp8Config | None = None) -> AutocastSpec:
    """The spec of a policy (never a recipe name; `precision._plan.autocast_spec` takes
    those), recording `recipe` as the spec's origin, without dense fp8 GEMMs of its own:
    the spec a Plan keeps and apply_recipe marks an NNX model with (its dense fp8 GEMMs come from its fp8 layers; its grouped GEMMs run
    fp8 by `grouped_fp8`)."""
    base = get_policy(policy)
    rules = _overrides.parse_overrides(overrides, module_base)
    for where, pol in [("policy", base)] + [(f"override {r.key!r}", r.policy) for r in rules]:
      c = np.dtype(pol.compute_dtype)
      if c.itemsize == 1:
        raise ValueError(
            f"{where}: compute dtype {dtype_name(c)} is an fp8 format; fp8 GEMMs need "
            "scaling (an unscaled cast turns 500 into NaN in E4M3): use an fp8 recipe "
            "(precision.get_recipe('fp8_hybrid'), or a Recipe with "
            "fp8=precision.Fp8Config(...)), whose compute dtype is bf16/f16/f32")
    fp32 = _fp32_ops.check_names(DEFAULT_FP32_OPS if fp32_ops is None else fp32_ops)
    if not isinstance(recompute_f32, bool):
      raise ValueError(f"recompute_f32={recompute_f32!r}; accepted: True or False")
    return cls(base, rules, fp32, recompute_f32, recipe, grouped_fp8=grouped_fp8)


__all__ = ["AutocastSpec"]
