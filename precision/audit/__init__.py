"""precision.audit: the precision map of any JAX function, from its jaxpr.

Call the named function, ``precision.audit.audit(fn, *args)``. Calling the package itself,
``precision.audit(fn, *args)`` (the form the library's first versions documented), still
works but is deprecated: it warns (DeprecationWarning) and will be removed.

Examples:
  >>> report = precision.audit.audit(jax.value_and_grad(loss_fn), params, batch)
  >>> print(report)                       # GEMM table + one-screen precision map
  >>> report.check("p=f32,c=bf16,o=f32")  # raises PrecisionViolation listing offenders

The same GEMMs as a platform receives them, from the program lowered for it (StableHLO;
a GPU program can be lowered on a CPU-only machine):
  >>> from precision.audit import lower
  >>> lower(train_step, params, batch, platform="cuda").check("bf16_mixed")
"""

from __future__ import annotations

import sys
import types
import warnings

from precision.audit._lowering import LoweredCustomCall
from precision.audit._lowering import LoweredGemm
from precision.audit._lowering import LoweredProgram
from precision.audit._lowering import custom_call_targets
from precision.audit._lowering import custom_calls
from precision.audit._lowering import lower
from precision.audit._lowering import lowered_gemms
from precision.audit._report import PrecisionReport
from precision.audit._report import PrecisionViolation
from precision.audit._walk import ConvertRecord
from precision.audit._walk import GemmRecord
from precision.audit._walk import OpaqueRecord
from precision.audit._walk import OpRecord
from precision.audit._walk import trace
from precision.audit._walk import walk


def audit(fn, *args, **kwargs) -> PrecisionReport:
  """Traces `fn(*args, **kwargs)` (forward, value_and_grad, or a whole jitted train step)
  and returns its PrecisionReport: every dot_general/convolution with source location,
  operand, accumulation and output dtypes and FLOPs (forward and backward, inside pjit,
  custom_vjp/jvp, scan (times its length), while, cond and remat); every reduction and
  exp/log with its dtype; every convert; bytes of intermediates by dtype; every opaque
  kernel (a Pallas call: its operand and result dtypes; autocast runs it as written).
  Nothing runs: only abstract tracing."""
  closed = trace(fn, *args, **kwargs)
  w = walk(closed.jaxpr)
  name = getattr(fn, "__name__", None) or type(fn).__name__
  return PrecisionReport(name, tuple(w.gemms), tuple(w.ops), tuple(w.converts),
                         dict(w.bytes_by_dtype), w.has_while, tuple(w.opaque))


class _CallableAudit(types.ModuleType):
  """The precision.audit package, callable as its `audit` function for old code only:
  the call warns (DeprecationWarning) that ``precision.audit.audit(fn, *args)`` is the
  name to call."""

  def __call__(self, fn, *args, **kwargs) -> PrecisionReport:
    warnings.warn(
        "precision.audit(fn, *args) (calling the package) is deprecated and will be "
        "removed; call precision.audit.audit(fn, *args)", DeprecationWarning, stacklevel=2)
    return audit(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableAudit

__all__ = [
    "ConvertRecord",
    "GemmRecord",
    "LoweredCustomCall",
    "LoweredGemm",
    "LoweredProgram",
    "OpRecord",
    "OpaqueRecord",
    "PrecisionReport",
    "PrecisionViolation",
    "audit",
    "custom_call_targets",
    "custom_calls",
    "lower",
    "lowered_gemms",
]
