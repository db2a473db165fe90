"""Stochastic rounding: counter-based randomness, an XLA reference and Pallas kernels."""

from precision.rounding._hash import leaf_seed
from precision.rounding._hash import mix32
from precision.rounding._hash import random_bits
from precision.rounding._hash import seed_from
from precision.rounding._reference import SUPPORTED
from precision.rounding._reference import round_bits
from precision.rounding._reference import stochastic_round_reference
from precision.rounding._api import stochastic_round

__all__ = [
    "SUPPORTED",
    "leaf_seed",
    "mix32",
    "random_bits",
    "round_bits",
    "seed_from",
    "stochastic_round",
    "stochastic_round_reference",
]
