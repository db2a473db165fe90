"""The recipe that ran is the recipe asked for: fp8 on a function holding its own backward.

`precision.autocast(jax.grad(f), fp8 recipe)` used to run the traced backward pass's GEMMs
as bf16 x bf16 (the policy GEMM), silently, while `jax.grad(precision.autocast(f, recipe))`
gives E5M2 gradient GEMMs. Now the first is refused with an error naming the second, and
both checks (`precision.audit.audit(...).check` on the jaxpr, `precision.audit.lower(...)
.check` on the CUDA lowering) flag the program the old behaviour built (rebuilt here by
switching the refusal off).
"""

import jax
import jax.numpy as jnp
import pytest

import precision as mp
from precision._autocast import _fp8
from precision.audit import lower

RECIPE = mp.Recipe("fp8_current", "p=f32,c=bf16,o=f32", fp8=mp.Fp8Config(scaling="current"))


def _mlp(params, x):
  h = x
  for w in params[:-1]:
    h = jax.nn.relu(h @ w)
  return jnp.mean((h @ params[-1]) ** 2)


def _args():
  ks = jax.random.split(jax.random.key(0), 5)
  params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
  return params, jax.random.normal(ks[4], (8, 16))


def test_autocast_of_a_gradient_is_refused_naming_the_right_composition():
  params, x = _args()
  with pytest.raises(ValueError, match=r"jax\.grad\(precision\.autocast\(f, recipe\)\)"):
    mp.autocast(jax.grad(_mlp), RECIPE)(params, x)


def test_the_right_composition_has_e5m2_backward_gemms_and_passes_both_checks():
  params, x = _args()
  g = jax.grad(mp.autocast(_mlp, RECIPE))
  prog = lower(g, params, x, platform="cuda")
  assert ("e5m2", "e4m3", "f32") in prog.gemm_signatures("bwd") or (
      "e4m3", "e5m2", "f32") in prog.gemm_signatures("bwd"), prog.gemm_signatures("bwd")
  prog.check(RECIPE)
  mp.audit.audit(g, params, x).check(RECIPE)


def test_both_checks_catch_the_silent_bf16_backward(monkeypatch):
  params, x = _args()
  monkeypatch.setattr(_fp8, "_refuse_inner_backward", lambda config, scopes: None)
  g = mp.autocast(jax.grad(_mlp), RECIPE)   # the old behaviour: fp8 forward, bf16 backward
  prog = lower(g, params, x, platform="cuda")
  assert ("e4m3", "e4m3", "f32") in prog.gemm_signatures("fwd")
  assert set(prog.gemm_signatures("bwd")) == {("bf16", "bf16", "f32")}
  with pytest.raises(mp.audit.PrecisionViolation, match="no bwd fp8 GEMM"):
    prog.check(RECIPE)
  with pytest.raises(mp.audit.PrecisionViolation, match="no backward fp8 GEMM"):
    mp.audit.audit(g, params, x).check(RECIPE)


# ----------------------------------------------------------------------------- state


def _step(params, state, x):
  """A decoding-style step: a bf16 cache, f32 running statistics, an int counter."""
  h = jax.nn.gelu(x @ params["w1"]) @ params["w2"]
  new = {"cache": (state["cache"].astype(h.dtype) + h).astype(jnp.bfloat16),
         "mean": 0.9 * state["mean"] + 0.1 * h.mean(0),
         "count": state["count"] + 1}
  return jnp.tanh(h).sum(), new


def _state_args():
  k = jax.random.split(jax.random.key(3), 3)
  params = {"w1": jax.random.normal(k[0], (8, 16)), "w2": jax.random.normal(k[1], (16, 4))}
  state = {"cache": jnp.zeros((3, 4), jnp.bfloat16), "mean": jnp.zeros((4,)),
           "count": jnp.zeros((), jnp.int32)}
  return params, state, jax.random.normal(k[2], (3, 8))


def _dtypes(tree):
  return jax.tree.map(lambda a: a.dtype, tree)


@pytest.mark.parametrize("recipe", ["bf16_mixed", "p=f32,c=bf16,o=bf16", "fp8_hybrid",
                                    pytest.param("mxfp8", marks=pytest.mark.slow),
                                    pytest.param("f16_mixed", marks=pytest.mark.slow),
                                    pytest.param("pure_bf16", marks=pytest.mark.slow),
                                    pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_state_keeps_its_dtype_and_a_fori_loop_over_the_step_compiles(recipe):
  params, state, x = _state_args()
  want = _dtypes(jax.eval_shape(_step, params, state, x)[1])
  if recipe == "fp8_hybrid":   # delayed scaling: its scaling state is carried too
    g = mp.autocast(_step, recipe, fp8_state=True)
    fp8 = g.init_state(params, state, x)
    def body(i, c):
      (_, new_state), new_fp8 = g(c[0], params, c[1], x)
      return new_fp8, new_state

    carry = (fp8, state)
    (_, new), _ = g(fp8, params, state, x)
  else:
    g = mp.autocast(_step, recipe)
    body = lambda i, s: g(params, s, x)[1]
    carry = state
    _, new = g(params, state, x)
  assert _dtypes(new) == want == _dtypes(state)
  looped = jax.jit(lambda c: jax.lax.fori_loop(0, 3, body, c))(carry)
  looped = looped[1] if recipe == "fp8_hybrid" else looped
  assert _dtypes(looped) == want and int(looped["count"]) == 3
