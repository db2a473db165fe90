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
