"""Model FLOPs utilisation: FLOPs per token and the devices' dense peak rates.

FLOPs per token follow llm.c (`gpt2_estimate_mfu`, after the PaLM paper):
6 N (forward + backward of every weight) + 6 L C T (attention scores and values),
with N parameters, L layers, C channels and T the sequence length.

Peaks are vendor datasheet figures for DENSE math (no 2:4 sparsity), in TFLOP/s, for the
SXM parts where there are several form factors. None means the unit does not exist.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DevicePeak:
  name: str
  bf16: float | None
  fp8: float | None
  tf32: float | None
  fp32: float | None


PEAKS: dict[str, DevicePeak] = {p.name: p for p in (
    DevicePeak("V100", None, None, None, 15.7),           # fp16 tensor cores only: 125
    DevicePeak("A100", 312.0, None, 156.0, 19.5),
    DevicePeak("A10G", 70.0, None, 35.0, 31.2),
    DevicePeak("L4", 121.0, 242.0, 60.0, 30.3),
    DevicePeak("L40S", 362.0, 733.0, 183.0, 91.6),
    DevicePeak("RTX 4090", 165.2, 330.3, 82.6, 82.6),
    DevicePeak("H100", 989.0, 1979.0, 494.0, 67.0),
    DevicePeak("H200", 989.0, 1979.0, 494.0, 67.0),
    DevicePeak("B200", 2250.0, 4500.0, 1100.0, 80.0),
    DevicePeak("TPU v5e", 197.0, None, None, None),
)}


def match_device(device_kind: str) -> DevicePeak | None:
  """The peak entry whose name appears in a jax `device_kind` string (e.g. 'NVIDIA H100
  80GB HBM3'), longest name first; None for CPUs and unknown devices."""
  kind = device_kind.upper()
  for name in sorted(PEAKS, key=len, reverse=True):
    if name.upper() in kind:
      return PEAKS[name]
  return None


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> int:
  """Training FLOPs per token: 6 N + 6 L C T (llm.c)."""
  return 6 * n_params + 6 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_token: int, device_kind: str, dtype: str = "bf16") -> float | None:
  """Achieved FLOP/s over the device's dense peak for `dtype` (bf16|fp8|tf32|fp32);
  None where the peak is not known (CPUs, unknown devices)."""
  peak = match_device(device_kind)
  if peak is None:
    return None
  rate = getattr(peak, dtype)
  if rate is None:
    return None
  return tokens_per_s * flops_token / (rate * 1e12)
