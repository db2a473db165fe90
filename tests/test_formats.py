"""Float format facts, cross-checked against ml_dtypes.finfo."""

import ml_dtypes
import numpy as np
import pytest

from precision import formats

ML = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16,
      "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


@pytest.mark.parametrize("name", formats.FORMATS)
def test_against_ml_dtypes(name):
  fi, ref = formats.info(name), ml_dtypes.finfo(ML[name])
  assert fi.bits == ref.bits
  assert fi.mantissa_bits == ref.nmant
  assert fi.exponent_bits == ref.nexp
  assert fi.eps == float(ref.eps)
  assert fi.max == float(ref.max)
  assert fi.smallest_normal == float(ref.smallest_normal)
  assert fi.smallest_subnormal == float(ref.smallest_subnormal)
  assert fi.sign_bits + fi.exponent_bits + fi.mantissa_bits == fi.bits
  # inf exists iff casting inf gives inf
  assert fi.has_inf == bool(np.isinf(np.array(np.inf, np.float32).astype(ML[name])))


def test_known_values():
  assert formats.info("bf16").eps == 2.0 ** -7
  assert formats.info("e4m3").max == 448.0 and not formats.info("e4m3").has_inf
  assert formats.info("e5m2").max == 57344.0 and formats.info("e5m2").has_inf
  assert formats.info("f16").max == 65504.0
  assert formats.info("f16").smallest_subnormal == 2.0 ** -24


@pytest.mark.parametrize("name", formats.FORMATS)
def test_ulp(name):
  fi = formats.info(name)
  assert formats.ulp(1.0, name) == fi.eps
  assert formats.ulp(-2.0, name) == 2 * fi.eps
  assert formats.ulp(fi.smallest_subnormal, name) == fi.smallest_subnormal
  assert formats.ulp(0.0, name) == fi.smallest_subnormal
  # next value above 1.0 is 1 + ulp(1)
  one = np.array(1.0, np.float32).astype(ML[name])
  nxt = np.nextafter(np.float64(1.0), 2.0)
  assert float(np.array(1.0 + fi.eps, np.float64).astype(ML[name])) == 1.0 + fi.eps
  assert float(one) + formats.ulp(1.0, name) > nxt
  assert np.isnan(formats.ulp(np.inf, "bf16"))


def test_swamping_seed_004():
  assert formats.swamped(1.0, 1e-5, "bf16")
  assert not formats.swamped(1.0, 1e-5, "f32")
  assert float(np.array(1.0, np.float32).astype(ml_dtypes.bfloat16)) + formats.ulp(1.0, "bf16") == 1.0078125
  assert not formats.swamped(1.0, 0.0078125, "bf16")
  assert formats.swamped(1.0, 0.0078125 / 2, "bf16")  # tie rounds to even: 1.0
  assert not formats.swamped(1.0, 0.0078125 / 2 * 1.01, "bf16")
  np.testing.assert_array_equal(formats.swamped(np.ones(3), np.array([1e-3, 1e-2, 0.0]), "bf16"),
                                [True, False, False])
