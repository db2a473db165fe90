"""Test set-up: 8 host CPU devices, faithful rounding and strict dtype promotion.

XLA reads XLA_FLAGS once, when the first backend starts, so both flags are set here
before anything imports JAX.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "").split()
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_allow_excess_precision=false"):
  if _flag not in _flags:
    _flags.append(_flag)
os.environ["XLA_FLAGS"] = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

# Strict promotion: a silent upcast (bf16 + f32 -> f32) inside the library raises a
# TypePromotionError instead of quietly changing the precision a test checks. Where a
# dependency cannot run under it, the library scopes "standard" promotion around that one
# call and says why in a comment.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def devices():
  return jax.devices()
