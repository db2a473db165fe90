"""The one check of a stochastic-rounding seed, shared by build_optimizer and fused_adamw."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def check_seed(seed: Any) -> None:
  """ValueError naming `seed` unless it is a stochastic-rounding seed."""
  accepted = "an int in [0, 2**32), an integer scalar array, or a jax.random key"
  if isinstance(seed, (jax.Array, np.ndarray)) and (
      jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key)
      or (seed.shape == (2,) and seed.dtype == np.uint32)):
    pass  # a jax.random key (typed, or raw uint32[2]): its bits are the seed
  elif isinstance(seed, (jax.Array, np.ndarray)) and seed.shape == () and (
      jnp.issubdtype(seed.dtype, jnp.integer)):
    pass  # range-checked where it is used (precision.rounding), traced or not
  elif isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f"seed={seed!r} (a {type(seed).__name__}); accepted: {accepted}")
  elif not 0 <= int(seed) < 2 ** 32:
    raise ValueError(f"seed={int(seed)} is outside the uint32 range; accepted: {accepted}")
