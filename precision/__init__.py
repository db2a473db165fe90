"""precision: numeric-precision recipes for training with JAX, Flax and Optax.

Public surface: Policy and get_policy (jmp's grammar), Recipe and get_recipe, `bind` (a
recipe with its overrides interpreted once, a Plan every entry point takes), `autocast`
(a policy or recipe applied to any JAX function), float-format facts
(`precision.formats`), the faithful-rounding switch, stochastic rounding, the training
step of every recipe (`value_and_grad`, `train_step`, and `jit_train_step`: that step
jitted for one model at the host cost of plain jax.jit), `TrainState` (what checkpoints
and data parallelism carry), and the subpackages flax, audit, numerics, optim, fp8,
parallel, checkpoint, study. `precision.audit` is the package (`precision.audit.lower`,
...) and calling it is `precision.audit.audit(fn, *args)`.
"""

from precision import _autocast
from precision import audit
from precision import checkpoint
from precision import flax
from precision import formats
from precision import fp8
from precision import numerics
from precision import optim
from precision import ops
from precision import parallel
from precision import rounding
from precision import study
from precision._autocast import autocast
from precision.audit import PrecisionReport
from precision.audit import PrecisionViolation
from precision._plan import Plan
from precision._plan import bind
from precision._numerics import enable_faithful_rounding
from precision._numerics import faithful_rounding_enabled
from precision._numerics import faithful_rounding_status
from precision._policy import Policy
from precision._policy import cast_floating
from precision._policy import dtype_name
from precision._policy import get_policy
from precision._policy import parse_dtype
from precision._recipe import DEFAULT_FP32_OPS
from precision._recipe import Fp8Config
from precision._recipe import LossScaleConfig
from precision._recipe import PRESETS
from precision._recipe import Recipe
from precision._recipe import SpikeGuardConfig
from precision._recipe import get_recipe
from precision._state import TrainState
from precision._jit_step import jit_train_step
from precision._train import train_step
from precision._train import value_and_grad
from precision.rounding import stochastic_round
from precision.optim import DynamicLossScale
from precision.optim import LossScale
from precision.optim import NoOpLossScale
from precision.optim import StaticLossScale
from precision.optim import all_finite
from precision.optim import select_tree
from precision import _deprecated_grads
from precision import _optimizer
from precision._autocast import _fp8_state

# The entry points of precision.fp8 and precision.optim that take a recipe bind it
# (precision.bind), and the Plan derives its decisions from those two packages: they live
# above the Plan and are attached to the packages here, under their public names, so
# neither package imports upward.
fp8.GemmSite = _fp8_state.GemmSite
fp8.autocast_gemms = _fp8_state.autocast_gemms
fp8.init_state = _fp8_state.init_state
optim.build_optimizer = _optimizer.build_optimizer
optim.memory_ledger = _optimizer.memory_ledger
optim.bytes_per_param = _optimizer.bytes_per_param

# The deprecated value_and_grads of precision.fp8 and precision.optim call
# precision.value_and_grad, above both packages: they live above it too and are attached
# to the two packages here, under their old names, so neither package imports upward.
fp8.value_and_grad = _deprecated_grads.value_and_grad
fp8.autocast_value_and_grad = _deprecated_grads.autocast_value_and_grad
optim.scaled_value_and_grad = _deprecated_grads.scaled_value_and_grad

from precision._version import __version__  # noqa: E402

__all__ = [
    "autocast",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "select_tree",
    "optim",
    "DEFAULT_FP32_OPS",
    "Fp8Config",
    "LossScaleConfig",
    "PRESETS",
    "Plan",
    "PrecisionReport",
    "PrecisionViolation",
    "Policy",
    "Recipe",
    "SpikeGuardConfig",
    "TrainState",
    "cast_floating",
    "checkpoint",
    "dtype_name",
    "enable_faithful_rounding",
    "faithful_rounding_enabled",
    "faithful_rounding_status",
    "audit",
    "bind",
    "flax",
    "formats",
    "fp8",
    "get_policy",
    "get_recipe",
    "jit_train_step",
    "numerics",
    "ops",
    "parallel",
    "parse_dtype",
    "rounding",
    "study",
    "stochastic_round",
    "train_step",
    "value_and_grad",
]
