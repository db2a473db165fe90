"""Stochastic rounding: counter-based randomness, an XLA reference and Pallas kernels,
and a fused AdamW + stochastic-rounding update.

The kernels' lowering follows the platform a program is lowered for: compiled Triton for
CUDA/ROCm, interpret mode (or the XLA reference, for impl="auto") elsewhere. A GPU program
can therefore be exported on a CPU-only machine:

  >>> exported = jax.export.export(
  ...     jax.jit(lambda x: stochastic_round(x, "bf16", key=0)), platforms=["cuda"],
  ...     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)])(x)

``interpret=False`` (`stochastic_round`, `stochastic_round_pallas`, `FusedAdamW`) forces the
compiled lowering for every platform."""

from precision.rounding._hash import leaf_seed
from precision.rounding._hash import mix32
from precision.rounding._hash import random_bits
from precision.rounding._hash import seed_from
from precision.rounding._reference import SUPPORTED
from precision.rounding._reference import round_bits
from precision.rounding._reference import stochastic_round_reference
from precision.rounding._pallas import TRITON_CUSTOM_CALL
from precision.rounding._pallas import stochastic_round_pallas
from precision.rounding._api import stochastic_round
from precision.rounding._fused_adamw import FusedAdamW
from precision.rounding._fused_adamw import FusedAdamWState
from precision.rounding._fused_adamw import llmc_decay_mask

__all__ = [
    "FusedAdamW",
    "FusedAdamWState",
    "SUPPORTED",
    "TRITON_CUSTOM_CALL",
    "leaf_seed",
    "llmc_decay_mask",
    "mix32",
    "random_bits",
    "round_bits",
    "seed_from",
    "stochastic_round",
    "stochastic_round_pallas",
    "stochastic_round_reference",
]
