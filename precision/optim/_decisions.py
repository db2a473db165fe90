"""OptimizerDecisions: the optimizer chain a recipe asks for, as data.

`precision.bind` decides it from the Recipe (`Plan.optimizer_decisions`); `_build.chain`
builds the chain from it and the memory ledger counts its tensors. It holds no Recipe, so
the optimizer's package needs nothing from the Plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from precision._recipe import LossScaleConfig, SpikeGuardConfig


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


__all__ = ["OptimizerDecisions"]
