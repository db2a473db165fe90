"""tests/_asserts.py: what bit-identical and close mean for the whole test suite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _asserts import assert_allclose
from _asserts import assert_bit_identical
from _asserts import bit_identical
from _asserts import bits

NAN_A = np.array([0x7FC00000], np.uint32).view(np.float32)
NAN_B = np.array([0x7FC00001], np.uint32).view(np.float32)


def test_bits_are_the_raw_patterns():
  assert bits(jnp.asarray([-0.0], jnp.bfloat16)).tolist() == [0x8000]
  assert bits(np.float32(1.0)).dtype == np.uint32
  assert bits(jax.random.key(0)).tolist() == jax.random.key_data(jax.random.key(0)).tolist()


@pytest.mark.parametrize("got, want, same", [
    (np.float32([0.0]), np.float32([-0.0]), False),   # signed zeros differ
    (NAN_A, NAN_A.copy(), True),                      # a NaN equals the same NaN
    (NAN_A, NAN_B, False),                            # ... and no other
    (np.float32([1.0]), np.float64([1.0]), False),    # dtypes
    (jnp.ones((2,), jnp.bfloat16), jnp.ones((2,), jnp.float32), False),
    (np.zeros((1,), np.float32), np.zeros((), np.float32), False),  # shapes
    ({"a": np.zeros(2)}, {"b": np.zeros(2)}, False),  # structure
    ((np.zeros(2),), [np.zeros(2)], False),
    (jnp.arange(3), np.arange(3, dtype=np.int32), True),  # jax or numpy: the bytes count
    (1, 1, True),
    (1, 1.0, False),                                   # Python leaves: value and type
    (jax.random.key(3), jax.random.key(3), True),      # typed keys: key data and impl
    (jax.random.key(3), jax.random.key(4), False),
    (jax.random.key(3), jax.random.key(3, impl="rbg"), False),
    (jax.random.key(3), jax.random.key_data(jax.random.key(3)), False),
])
def test_bit_identical(got, want, same):
  assert bit_identical(got, want) is same
  if not same:
    with pytest.raises(AssertionError, match="not bit-identical"):
      assert_bit_identical(got, want)


def test_failure_names_the_leaf_and_the_first_element():
  with pytest.raises(AssertionError, match=r"params: not bit-identical: \['w'\]: 1 of 3 "
                                           r"elements differ; first at flat index 1"):
    assert_bit_identical({"w": np.float32([1, 2, 3])}, {"w": np.float32([1, 5, 3])}, "params")


def test_allclose_has_explicit_tolerances_and_checks_dtypes():
  a = {"w": np.float32([1.0, np.nan])}
  assert_allclose(a, {"w": np.float32([1.0 + 1e-6, np.nan])}, rtol=1e-5, atol=0.0)
  with pytest.raises(AssertionError, match=r"\['w'\]"):
    assert_allclose(a, {"w": np.float32([1.1, np.nan])}, rtol=1e-5, atol=0.0)
  with pytest.raises(AssertionError, match=r"float32\[2\] != float64\[2\]"):
    assert_allclose(a, {"w": np.float64([1.0, np.nan])}, rtol=1e-5, atol=0.0)
  with pytest.raises(TypeError):
    assert_allclose(a, a)  # pylint: disable=missing-kwoa
