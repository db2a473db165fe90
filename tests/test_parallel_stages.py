"""A data_parallel state handed to a data_parallel of another ZeRO stage is refused in
the user's words (issue 40): the stage the state was made for and the one it was given
to, not shard_map's in_specs message."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from precision import parallel
from _asserts import assert_bit_identical


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"][None, :] - b["y"]) ** 2)


PARAMS = {"w": np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3),
          "b": np.zeros((3,), np.float32)}
BATCH = {"x": np.ones((8, 5), np.float32), "y": np.ones((8, 3), np.float32)}
WORDS = {0: "ZeRO stage 0 data_parallel (nothing sharded)",
         1: "ZeRO stage 1 or 2 data_parallel (optimizer state sharded)",
         3: "ZeRO stage 3 data_parallel (params and optimizer state sharded)"}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((8,), ("data",))


def _dp(mesh, stage):
  return parallel.data_parallel(_loss, optax.adam(1e-3), mesh, zero_stage=stage)


@pytest.mark.parametrize("made, given", [(1, 0), (0, 1), (3, 1), (2, 3), (0, 3)])
def test_another_stages_state_names_both_stages(mesh, made, given):
  state = _dp(mesh, made).init(PARAMS)
  with pytest.raises(ValueError) as e:
    _dp(mesh, given).step(state, BATCH)
  msg = str(e.value)
  assert msg.startswith(f"state was made by a {WORDS[min(made, 1) if made < 3 else 3]} and "
                        f"given to one of zero_stage={given} "), msg
  assert f"accepted: a state of a data_parallel of zero_stage={given}" in msg
  assert "shard_map" not in msg and "\n" not in msg
  with pytest.raises(ValueError, match=f"made by a ZeRO stage {'3' if made == 3 else ''}"):
    _dp(mesh, given).compile(state, BATCH)


def test_stages_1_and_2_share_a_state_and_the_hint_moves_stage_3s(mesh):
  dp1, dp2, dp3 = _dp(mesh, 1), _dp(mesh, 2), _dp(mesh, 3)
  s1 = dp1.init(PARAMS)
  a, _ = dp1.step(dp1.init(PARAMS), BATCH)
  b, _ = dp2.step(s1, BATCH)      # no error: the same layout, bit-identical steps
  assert_bit_identical(dp1.state_for_checkpoint(a), dp2.state_for_checkpoint(b))
  s3 = dp3.init(PARAMS)
  with pytest.raises(ValueError, match=r"state_from_checkpoint\(other.state_for_checkpoint"):
    dp1.step(s3, BATCH)
  moved = dp1.state_from_checkpoint(dp3.state_for_checkpoint(s3))
  c, _ = dp1.step(moved, BATCH)
  assert_bit_identical(dp1.state_for_checkpoint(c), dp1.state_for_checkpoint(a))
