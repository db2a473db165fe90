"""One timing rule for every benchmark: warm up (compile) once, then the median of repeats."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(fn, *args, repeats: int) -> float:
  """Median wall-clock seconds per call of `fn(*args)`, waiting for the device each time;
  the first call (compilation, warm-up) is not timed."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))
