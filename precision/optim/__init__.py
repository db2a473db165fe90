"""Optax transformations for mixed-precision training.

Master weights (`master_weights`, `remainder_master_weights`), loss scaling
(`loss_scaling` with NoOp/Static/DynamicLossScale or any `LossScale`; `all_finite`
and `select_tree` as in jmp), non-finite skipping (`skip_nonfinite`), loss-spike
skipping (`spike_guard`, read with `spike_metrics`),
updates straight into 16-bit params (`stochastic_updates`, `kahan_updates`, `f32_update`,
and `fused_adamw`, the fused AdamW + stochastic-rounding kernel of a ``fused=True`` recipe),
moment dtypes (`moment_dtypes`), f32 global norm and clipping, and `build_optimizer`, which
assembles all of it from a Recipe. Apply updates with `apply_updates` (exact rounding under
strict promotion), or take the whole step with `update_and_apply` (update, apply, and the
state's writes ordered after the params', so a jitted step updates its donated buffers in
place).

The train-step protocol (`precision.train_step` and `precision.value_and_grad` do the
first two lines for NNX models and param pytrees; an update whose grads were computed
without reading the scale warns once, `UnscaledGradientsWarning`):
  >>> scale = loss_scale_of(opt_state)
  >>> loss, grads = jax.value_and_grad(lambda p: loss_fn(p, batch) * scale)(params)
  >>> params, opt_state = update_and_apply(tx, grads, opt_state, params)
  >>> metrics = optimizer_metrics(opt_state)
A spike-guarded optimizer (`spike_guard`, ``Recipe.spike_guard``) is an optax
GradientTransformationExtraArgs whose update also takes the loss,
``tx.update(grads, opt_state, params, value=loss)`` (``update_and_apply(..., value=loss)``);
the train steps above pass it.
"""

from precision.optim._apply import apply_updates
from precision.optim._clip import clip_by_global_norm
from precision.optim._clip import global_norm
from precision.optim._direct import StochasticState
from precision.optim._direct import f32_update
from precision.optim._direct import stochastic_updates
from precision.optim._fused import fused_adamw
from precision.optim._guard import GuardState
from precision.optim._guard import NonFiniteStreakError
from precision.optim._guard import UnscaledGradientsWarning
from precision.optim._guard import check_nonfinite_streak
from precision.optim._guard import loss_scaling
from precision.optim._guard import nonfinite_loss_guard
from precision.optim._guard import skip_nonfinite
from precision.optim._inplace import order_after
from precision.optim._inplace import update_and_apply
from precision.optim._kahan import KahanState
from precision.optim._kahan import kahan_updates
from precision.optim._loss_scale import DynamicLossScale
from precision.optim._loss_scale import LossScale
from precision.optim._loss_scale import NoOpLossScale
from precision.optim._loss_scale import StaticLossScale
from precision.optim._master import MasterState
from precision.optim._master import master_weights
from precision.optim._moments import moment_dtypes
from precision.optim._query import loss_scale_of
from precision.optim._query import master_params
from precision.optim._query import optimizer_metrics
from precision.optim._query import spike_metrics
from precision.optim._query import step_skipped
from precision.optim._remainder import RemainderState
from precision.optim._remainder import merge_master
from precision.optim._remainder import remainder_master_weights
from precision.optim._remainder import split_master
from precision.optim._spike import SpikeGuardState
from precision.optim._spike import spike_guard
from precision.optim._tree import all_finite
from precision.optim._tree import select_tree
# `build_optimizer`, `memory_ledger` and `bytes_per_param` bind a recipe, so they live above
# the Plan (which derives its optimizer decisions from this package), in
# precision/_optimizer.py; precision/__init__.py attaches them here. The deprecated
# `scaled_value_and_grad` (precision.value_and_grad(loss_fn, opt_state) replaces it) lives
# above this package too, in precision/_deprecated_grads.py, attached the same way.

__all__ = [
    "DynamicLossScale",
    "GuardState",
    "KahanState",
    "LossScale",
    "MasterState",
    "NoOpLossScale",
    "NonFiniteStreakError",
    "RemainderState",
    "SpikeGuardState",
    "StaticLossScale",
    "StochasticState",
    "UnscaledGradientsWarning",
    "all_finite",
    "apply_updates",
    "build_optimizer",
    "bytes_per_param",
    "check_nonfinite_streak",
    "clip_by_global_norm",
    "f32_update",
    "fused_adamw",
    "global_norm",
    "kahan_updates",
    "loss_scale_of",
    "loss_scaling",
    "nonfinite_loss_guard",
    "master_params",
    "master_weights",
    "memory_ledger",
    "merge_master",
    "moment_dtypes",
    "optimizer_metrics",
    "order_after",
    "remainder_master_weights",
    "scaled_value_and_grad",
    "select_tree",
    "skip_nonfinite",
    "spike_guard",
    "spike_metrics",
    "split_master",
    "step_skipped",
    "stochastic_updates",
    "update_and_apply",
]
