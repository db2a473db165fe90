"""Per-device memory and communication of a compiled data-parallel step.

Memory: the bytes of params and optimizer state each device holds come from the shardings
the executable is compiled with (shard shape x itemsize of every argument); arguments,
outputs, aliasing (donation) and temporaries from the executable's `memory_analysis()`.
Beside them, the ZeRO paper's model (Rajbhandari et al. 2020, Fig. 1) for Psi params on
n devices with P, G, K bytes per param of params, grads and optimizer state:
  stage 0: (P + G + K) Psi      stage 1: (P + G) Psi + K Psi / n
  stage 2: P Psi + (G + K) Psi / n      stage 3: (P + G + K) Psi / n

Communication: every all-reduce, reduce-scatter and all-gather in the compiled HLO, with
the bytes one device sends per step under a ring algorithm (n devices, S = full buffer):
all-reduce 2 (n-1)/n S, reduce-scatter (n-1)/n S, all-gather (n-1)/n S.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import jax
import numpy as np

from precision.parallel._collectives import wider_dtype

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_ARRAY = re.compile(r"\b(pred|[fsu](?:8|16|32|64)|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_BITS = {"pred": 8, "bf16": 16, "f8e4m3fn": 8, "f8e5m2": 8}


def _itemsize(hlo_type: str) -> int:
  bits = _BITS.get(hlo_type) or int(hlo_type[1:])
  return bits // 8


def _bytes_on_device(x) -> int:
  shape = x.sharding.shard_shape(x.shape)
  return math.prod(shape) * np.dtype(x.dtype).itemsize


class MemoryReport(NamedTuple):
  """Per-device bytes of one step. `formula_*` follow the ZeRO paper's model."""

  zero_stage: int
  devices: int
  param_count: int          # unpadded
  params_bytes: int         # held by each device, from the compiled shardings
  opt_state_bytes: int
  batch_bytes: int
  argument_bytes: int       # memory_analysis()
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  formula_params: float
  formula_grads: float
  formula_opt_state: float

  @property
  def formula_total(self) -> float:
    return self.formula_params + self.formula_grads + self.formula_opt_state

  def summary(self) -> str:
    mib = lambda b: f"{b / 2**20:8.3f}"
    return (f"stage {self.zero_stage}: params {mib(self.params_bytes)} MiB (ZeRO "
            f"{mib(self.formula_params)}), opt state {mib(self.opt_state_bytes)} MiB (ZeRO "
            f"{mib(self.formula_opt_state)}), grads ZeRO {mib(self.formula_grads)} MiB, "
            f"temporaries {mib(self.temp_bytes)} MiB, arguments {mib(self.argument_bytes)} "
            f"MiB per device")


def zero_formula(stage: int, psi: int, devices: int, p: float, g: float, k: float):
  """(params, grads, optimizer state) bytes per device in the ZeRO paper's model."""
  shard = {0: (1, 1, 1), 1: (1, 1, devices), 2: (1, devices, devices),
           3: (devices, devices, devices)}[stage]
  return tuple(b * psi / s for b, s in zip((p, g, k), shard))


def memory_report(compiled, state, batch, *, zero_stage: int, devices: int,
                  reduce_dtype) -> MemoryReport:
  layout = state.layout
  params_b = sum(_bytes_on_device(x) for x in jax.tree.leaves(state.params))
  opt_b = sum(_bytes_on_device(x) for x in jax.tree.leaves(state.opt_state))
  batch_b = sum(_bytes_on_device(x) for x in jax.tree.leaves(batch)
                if isinstance(x, jax.Array))
  psi = layout.param_count
  p = sum(lay.size * lay.dtype.itemsize for lay in layout.leaves) / psi
  g = sum(lay.size * wider_dtype(lay.dtype, reduce_dtype or lay.dtype).itemsize
          for lay in layout.leaves) / psi
  # K from the state itself: its global bytes per (unpadded) parameter.
  k = sum(x.nbytes for x in jax.tree.leaves(state.opt_state)) / psi
  fp, fg, fk = zero_formula(zero_stage, psi, devices, p, g, k)
  ma = compiled.memory_analysis()
  return MemoryReport(zero_stage, devices, psi, params_b, opt_b, batch_b,
                      int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                      int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes), fp, fg, fk)


class Collective(NamedTuple):
  kind: str                 # "all-reduce", "reduce-scatter", "all-gather", ...
  dtypes: tuple[str, ...]   # HLO element types of the result(s)
  full_bytes: int           # S: the full (unscattered / gathered) buffer per device
  sent_bytes: float         # ring estimate of what one device sends


class CollectiveReport(NamedTuple):
  devices: int
  ops: tuple[Collective, ...]

  def count(self, kind: str) -> int:
    return sum(op.kind == kind for op in self.ops)

  def bytes_by_kind(self) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in self.ops:
      out[op.kind] = out.get(op.kind, 0.0) + op.sent_bytes
    return out

  @property
  def sent_bytes(self) -> float:
    """Bytes one device sends per step (ring algorithm)."""
    return sum(op.sent_bytes for op in self.ops)

  def largest(self, kind: str) -> int:
    return max((op.full_bytes for op in self.ops if op.kind == kind), default=0)


def collective_report(hlo_text: str, devices: int) -> CollectiveReport:
  """Parses the collectives out of compiled HLO text."""
  n = devices
  ops = []
  for line in hlo_text.splitlines():
    m = _OP.search(line)
    if not m or "-done(" in line:
      continue
    kind = m.group(2)
    arrays = _ARRAY.findall(m.group(1))
    out_bytes = sum(_itemsize(t) * math.prod(int(d) for d in dims.split(",") if d)
                    for t, dims in arrays)
    # reduce-scatter's result is one shard: the reduced buffer is n times larger.
    full = out_bytes * n if kind == "reduce-scatter" else out_bytes
    factor = {"all-reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
    ops.append(Collective(kind, tuple(t for t, _ in arrays), full, factor * full))
  return CollectiveReport(n, tuple(ops))


def format_table(rows: list[dict[str, Any]]) -> str:
  """A plain-text table of dict rows (same keys), for benchmark output."""
  keys = list(rows[0])
  width = {k: max(len(k), *(len(f"{r[k]}") for r in rows)) for k in keys}
  lines = ["  ".join(k.rjust(width[k]) for k in keys)]
  lines += ["  ".join(f"{r[k]}".rjust(width[k]) for k in keys) for r in rows]
  return "\n".join(lines)
