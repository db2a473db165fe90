import pytest

from experiments import mfu


def test_flops_per_token_gpt2():
  # GPT-2 124M at T=1024: 6N + 6LCT = 6*124.4M + 6*12*768*1024
  assert mfu.flops_per_token(124_439_808, 12, 768, 1024) == 6 * 124_439_808 + 56_623_104


def test_match_device_and_mfu():
  assert mfu.match_device("NVIDIA H100 80GB HBM3").name == "H100"
  assert mfu.match_device("NVIDIA H200").name == "H200"
  assert mfu.match_device("cpu") is None
  # 1e5 tok/s * 1e9 FLOP/token = 1e14 FLOP/s = 10.1% of 989 TFLOP/s
  assert mfu.mfu(1e5, 10**9, "NVIDIA H100 80GB HBM3") == pytest.approx(1e14 / 989e12)
  assert mfu.mfu(1e5, 10**9, "NVIDIA A100-SXM4-40GB", "fp8") is None
  assert mfu.mfu(1e5, 10**9, "TFRT_CPU_0") is None
