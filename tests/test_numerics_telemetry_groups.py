"""Telemetry rows per expert group inside a jitted step.

A grouped GEMM's (lax.ragged_dot's) group sizes are runtime values under jit, but their
number E is static: the telemetry gives one row per group and operand (empty groups
included, with size 0), each group's rows taken from its runtime start, rows past
sum(group_sizes) in no group. Checked against the numpy reference on the tensors inspect
captures eagerly (one row per nonempty group) and against inspect's rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import precision as mp
from precision.numerics import _stats

T, D, H, E = 16, 8, 16, 4
GROUPS = (5, 3, 0, 6)          # an empty expert; 2 rows past the last group
PAD = 1e30                      # the rows past the groups: would dominate any amax


@pytest.fixture(autouse=True)
def _faithful():
  mp.enable_faithful_rounding()
  yield


def _moe(w1, w2, x, group_sizes):
  h = jax.nn.gelu(lax.ragged_dot(x, w1, group_sizes))
  return jnp.mean(lax.ragged_dot(h, w2, group_sizes) ** 2)


def _args():
  k = jax.random.split(jax.random.key(0), 3)
  x = np.array(jax.random.normal(k[2], (T, D)))
  x[sum(GROUPS):] = PAD
  return (jax.random.normal(k[0], (E, D, H)) / np.sqrt(D),
          jax.random.normal(k[1], (E, H, D)) / np.sqrt(H), jnp.asarray(x),
          jnp.asarray(GROUPS, jnp.int32))


_STEP = jax.value_and_grad(_moe, argnums=(0, 1))
_KEY = lambda r: (r.index, r.group, r.primitive, r.direction, r.role, r.shape, r.dtype)


def test_jitted_rows_per_group_equal_the_numpy_reference_and_inspect():
  args = _args()
  record = jax.jit(lambda *a: mp.numerics.gemm_telemetry(_STEP, "f16_mixed", *a))(*args)
  got = record.report().rows
  caps = mp.numerics.capture(_STEP, "f16_mixed", *args)
  ref = mp.numerics.inspect(_STEP, "f16_mixed", *args).rows
  # Every row of inspect (nonempty groups) is one of the telemetry's, in order; the
  # telemetry's others are the empty expert's:
  nonempty = [r for r in got if r.group != 2]
  assert [_KEY(r) for r in nonempty] == [_KEY(r) for r in ref]
  empty = [r for r in got if r.group == 2]
  # its token rows (lhs/out forward, the cotangent's rows) have size 0; its weight and
  # the weight's gradient are whole tensors
  assert {r.size == 0 for r in empty} == {True, False}, [(r.role, r.shape) for r in empty]
  assert all(r.nonzero == 0 and r.amax == 0 for r in empty if r.size == 0)
  grouped = [r for r in nonempty if r.group is not None]
  assert {r.primitive for r in grouped} == {"ragged_dot_general"}
  assert {r.direction for r in grouped} == {"fwd", "bwd"}
  for c, r in zip(caps, nonempty):
    want = _stats.tensor_stats(c.value, c.dtype, c.info.block_axes)
    where = (r.index, r.group, r.role)
    assert want["nonzero"] == r.nonzero, where
    assert np.float32(want["amax"]) == np.float32(r.amax), where
    for f in ("nonfinite", "zeros", "underflow", "subnormal", "overflow",
              "whatif_mxfp8_underflow", "whatif_e4m3_underflow"):
      assert abs(want[f] - getattr(r, f)) <= 1e-3, (where, f, want[f], getattr(r, f))
    for f in ("sqnr_db", "whatif_mxfp8_sqnr_db", "whatif_e4m3_sqnr_db"):
      a, b = want[f], getattr(r, f)
      assert a == b or abs(a - b) <= 1e-2 or min(a, b) > 300, (where, f, a, b)
  # The rows past the last group feed no group's statistics.
  assert max(r.amax for r in grouped) < 1e3


def test_without_grouped_gemms_the_record_is_unchanged():
  w, x = jnp.ones((D, H)), jnp.ones((T, D))
  record = jax.jit(lambda w, x: mp.numerics.gemm_telemetry(
      jax.grad(lambda w, x: jnp.sum(x @ w)), "bf16_mixed", w, x))(w, x)
  assert "rows" not in record.fields and record.stats.shape[1] == len(record.fields)
