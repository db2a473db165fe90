"""precision.numerics: per-tensor numerics of every GEMM operand and cotangent, on any model.

`inspect` runs a function (forward, loss or gradient) once under a recipe, as
precision.autocast runs it, and measures every GEMM's operands, cotangents and results:
range, underflow, subnormals, overflow, fp8 saturation and SQNR against the dtype they
are computed in, plus what-if columns for bf16, f16, fp8 (E4M3/E5M2 with per-tensor
current scaling) and block-scaled MXFP8 (E4M3 elements, one E8M0 scale per 32 elements
along the GEMM's contraction) from the same tensors. Every statistic is defined in
TensorStats.

`gemm_telemetry` measures the same rows inside a compiled step (jnp reductions on the
device, returned as a TelemetryRecord pytree) with the logit monitors (max logit of each
softmax, the log-partition of each log_softmax/logsumexp); `param_monitors` adds update
RMS, param RMS, updates lost to rounding and Adam's RMS(g^2/v) per parameter.
precision.study records both every N steps (`telemetry=N`).

`bisect` replays the steps after a checkpoint and searches, by bisection over the
model's scopes promoted to f32, for the smallest set of layers whose promotion removes a
divergence, and names the culprit with its telemetry row.

Examples:
  >>> import precision as mp
  >>> report = mp.numerics.inspect(jax.value_and_grad(loss), "f16_mixed", params, x, y)
  >>> print(report.table(worst=10))
  >>> row = report.first_anomaly({"underflow": 0.01, "overflow": 0.0})
  >>> row.scope, row.direction, row.role          # ('head', 'bwd', 'cotangent')
"""

from precision.numerics._bisect import BisectResult
from precision.numerics._bisect import Replay
from precision.numerics._bisect import bisect
from precision.numerics._inspect import Captured
from precision.numerics._inspect import capture
from precision.numerics._inspect import inspect
from precision.numerics._interpret import TensorInfo
from precision.numerics._telemetry import TelemetryRecord
from precision.numerics._telemetry import gemm_telemetry
from precision.numerics._telemetry import param_monitors
from precision.numerics._report import DEFAULT_THRESHOLDS
from precision.numerics._report import NumericsReport
from precision.numerics._report import STATISTICS
from precision.numerics._report import TensorStats

__all__ = [
    "BisectResult",
    "Captured",
    "DEFAULT_THRESHOLDS",
    "NumericsReport",
    "Replay",
    "STATISTICS",
    "TensorInfo",
    "TensorStats",
    "TelemetryRecord",
    "bisect",
    "capture",
    "gemm_telemetry",
    "inspect",
    "param_monitors",
]
