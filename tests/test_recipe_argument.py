"""The recipe argument is named `recipe`, second after the function, in the public entry
points that take one; the old keyword names still work, with a DeprecationWarning."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp


def _f(w, x):
  return jnp.tanh(x @ w)


W, X = jnp.full((4, 4), 0.1, jnp.float32), jnp.ones((2, 4), jnp.float32)


@pytest.mark.parametrize("fn", [mp.autocast, mp.numerics.inspect, mp.numerics.capture,
                                mp.numerics.gemm_telemetry, mp.fp8.autocast_gemms,
                                mp.fp8.init_state])
def test_recipe_is_the_second_argument(fn):
  params = list(inspect.signature(fn).parameters)
  assert params[1] == "recipe", (fn.__qualname__, params)


def test_autocast_policy_keyword_is_a_deprecated_alias():
  new = mp.autocast(_f, recipe="bf16_mixed")(W, X)
  with pytest.warns(DeprecationWarning, match=r"precision\.autocast\(recipe=\.\.\.\)"):
    old = mp.autocast(_f, policy="bf16_mixed")(W, X)
  assert old.dtype == new.dtype and np.asarray(old).tobytes() == np.asarray(new).tobytes()
  with pytest.raises(ValueError, match="both policy= and recipe="):
    mp.autocast(_f, policy="bf16_mixed", recipe="bf16_mixed")


def test_numerics_recipe_or_policy_keyword_is_a_deprecated_alias():
  g = lambda: _f(W, X)
  new = mp.numerics.inspect(g, "bf16_mixed")
  with pytest.warns(DeprecationWarning, match=r"numerics\.inspect\(recipe=\.\.\.\)"):
    old = mp.numerics.inspect(g, recipe_or_policy="bf16_mixed")
  assert len(new.rows) > 0 and repr(old.rows) == repr(new.rows)
