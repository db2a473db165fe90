"""precision.autocast: a precision policy applied to any JAX function, Flax model or not.

Examples:
  >>> import precision as mp
  >>> fast_loss = mp.autocast(loss_fn, "p=f32,c=bf16,o=f32")   # same signature
  >>> loss, grads = jax.value_and_grad(fast_loss)(params, batch)
  >>> print(mp.audit.audit(jax.grad(fast_loss), params, batch))     # what each op computes in
  >>> vg = mp.value_and_grad(mp.autocast(loss_fn, "fp8_hybrid", fp8_state=True))  # fp8
  >>> loss, grads, fp8_state = vg(mp.fp8.init_state(loss_fn, "fp8_hybrid", params, batch),
  ...                             params, batch)
"""

import os as _os

from precision import _compat

# The interpreter's own functions (glue regions, rebuilt containers) are library code to
# JAX: its cache-miss explanations and user frames skip them (see mark_library_code).
_compat.mark_library_code(_os.path.dirname(__file__) + _os.sep)

from precision._autocast._api import AutocastSpec  # noqa: E402
from precision._autocast._api import autocast  # noqa: E402
from precision._autocast._api import tracing  # noqa: E402

__all__ = [
    "AutocastSpec",
    "autocast",
    "tracing",
]
