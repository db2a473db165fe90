"""The faithful-rounding switch, and what the running backend actually does.

XLA may keep bf16/f16 intermediates of a fused computation in f32 ("excess precision"):
the rounding a program asks for between two ops can silently disappear, so a result no
longer is what the stated dtypes compute. ``--xla_allow_excess_precision=false`` makes XLA
keep every rounding. XLA reads its flags once, when the first backend starts, so the switch
must be thrown before any computation runs; setting XLA_FLAGS afterwards changes nothing.

`faithful_rounding_enabled()` therefore reads XLA_FLAGS only while no backend has started
(it then says what the backend will start with). Once one has, it asks the backend: it
runs a probe whose result differs with and without excess precision and caches the
answer for the process. The probe: ``y = exp(x)`` for 16 bf16 values in [0, 1) and the
f32 sum of ``y``, both returned. With every rounding kept, the sum adds the bf16 values of
``y`` and is exact in f32 (16 values with 8-bit significands below 3), so it equals the
exact sum of the returned ``y``; with excess precision XLA feeds the unrounded f32
exponentials to the sum and it differs. Measured on this project's CPU machine (jax
0.10.2, XLA:CPU): the probe differs without the flag and matches with it, as does a
jitted bf16 softmax (about 2% of the elements of a 512 x 512 softmax change); elementwise
multiply/add chains already rounded per op there (tests/test_numerics.py records both).
"""

from __future__ import annotations

import os

import numpy as np

from precision import _compat

_FLAG = "--xla_allow_excess_precision=false"
_ENV = "XLA_FLAGS"
# The probe's answer for this process (None until a probe ran after a backend started).
_PROBED: bool | None = None


def _backends_started() -> bool:
  return _compat.backends_are_initialized()


def _flag_in_env() -> bool:
  return _FLAG in os.environ.get(_ENV, "").split()


def _probe_input() -> np.ndarray:
  """16 bf16 values in [0, 1): exp of each is in [1, e), not a bf16 value in general."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  x = np.arange(16, dtype=np.float32) / np.float32(16) + np.float32(1 / 48)
  return x.astype(ml_dtypes.bfloat16)


def probe_faithful_rounding() -> bool:
  """Runs the probe on the default backend: True when it rounds every bf16 op as stated.

  Compiles and runs one tiny jitted function (about 0.1 s); starts the backend if none
  has started. `faithful_rounding_enabled()` calls it once per process and caches it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def probe(x):
    y = jnp.exp(x)  # bf16
    return y, jnp.sum(y, dtype=jnp.float32)

  # Evaluated now even when called while a function is being traced.
  with jax.ensure_compile_time_eval():
    y, total = jax.jit(probe)(_probe_input())
  # Exact: 16 bf16 values in [1, e) are multiples of 2**-7 below 44; float64 adds them
  # without error, as f32 does when it gets the rounded values.
  exact = np.asarray(y).astype(np.float64).sum()
  return float(np.asarray(total)) == float(exact)


def faithful_rounding_enabled() -> bool:
  """Whether every jitted bf16/f16 op rounds as its dtype says (no excess precision).

  Before any JAX backend has started: whether XLA_FLAGS holds
  ``--xla_allow_excess_precision=false`` (what the backend will start with). After: the
  answer of the running backend, from a probe run once per process (see the module
  docstring), so setting XLA_FLAGS after the start does not change it.

  Returns:
    bool.

  Examples:
    >>> import precision
    >>> precision.enable_faithful_rounding()   # first thing in a script
    >>> precision.faithful_rounding_enabled()  # later, in a report: the mode in force
    True
  """
  global _PROBED
  if _PROBED is not None:
    return _PROBED
  if not _backends_started():
    return _flag_in_env()
  _PROBED = probe_faithful_rounding()
  return _PROBED


def enable_faithful_rounding() -> None:
  """Makes every jitted bf16/f16 op round as its dtype says. Call before JAX computes anything.

  Before any backend has started it adds the flag to XLA_FLAGS (idempotent). After one
  has, it returns quietly if the running backend already rounds faithfully (it was
  started with the flag), and raises RuntimeError otherwise: XLA would ignore the flag,
  and the message says how to do it right.

  Raises:
    RuntimeError: a backend has started without faithful rounding.

  Examples:
    >>> import precision
    >>> precision.enable_faithful_rounding()   # first thing in a script, before any jnp op
  """
  if not _backends_started():
    if not _flag_in_env():
      flags = os.environ.get(_ENV, "")
      os.environ[_ENV] = f"{flags} {_FLAG}".strip()
    return
  if faithful_rounding_enabled():
    return
  raise RuntimeError(
      "precision.enable_faithful_rounding() was called after a JAX backend started "
      "without it, so XLA would ignore it (setting XLA_FLAGS now changes nothing). Call it "
      "before the first JAX computation (first lines of the script), or start Python with "
      f"{_ENV}='{_FLAG}' in the environment.")
