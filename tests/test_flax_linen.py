"""precision.flax.linen_policy on Linen models: the issue-3 gates for Linen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision.flax import linen_policy
import _models as M

BF16, F32 = jnp.bfloat16, jnp.float32
MIXED = "p=f32,c=bf16,o=f32"


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(0), (2, 9), 0, 64)


def _lm_loss(model, params, tokens):
  logits = model.apply(params, tokens[:, :-1])
  return mp.ops.cross_entropy(logits, tokens[:, 1:])


def _step(model, policy, promotion="strict"):
  def step(params, tokens):
    with jax.numpy_dtype_promotion(promotion):
      if policy is None:
        return jax.value_and_grad(lambda p: _lm_loss(model, p, tokens))(params)
      with linen_policy(policy):
        return jax.value_and_grad(lambda p: _lm_loss(model, p, tokens))(params)
  return jax.jit(step)


@pytest.fixture(scope="module")
def params(tokens):
  return M.LinenAttentionLM().init(jax.random.key(0), tokens)


def test_fp32_policy_bit_identical(params, tokens):
  ref = _step(M.LinenAttentionLM(handwritten=F32), None, "standard")(params, tokens)
  lib = _step(M.LinenAttentionLM(), "f32")(params, tokens)
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(lib)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_init_creates_params_in_param_dtype(tokens):
  with linen_policy("p=bf16,c=bf16,o=f32"):
    params = M.LinenAttentionLM().init(jax.random.key(0), tokens)
    logits = M.LinenAttentionLM().apply(params, tokens)
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(BF16)}
  assert logits.dtype == F32


def test_bf16_audit_and_check(params, tokens):
  report = mp.audit.audit(_step(M.LinenAttentionLM(), MIXED), params, tokens)
  assert report.gemm_signatures() == {("bf16", "bf16", "f32", "f32"): 21}
  islands = report.island_dtypes()
  assert islands["norm"] == islands["softmax"] == islands["cross_entropy"] == {"f32"}
  report.check(MIXED)


def test_override_and_bad_pattern(params, tokens):
  model = M.LinenAttentionLM()

  def fwd(p, t, overrides):
    with linen_policy(MIXED, overrides):
      return model.apply(p, t)

  report = mp.audit.audit(lambda p, t: fwd(p, t, {"lm_head": "f32"}), params, tokens)
  f32 = [g for g in report.gemms if g.lhs_dtype == "float32"]
  assert [g.scope for g in f32] == ["LinenAttentionLM/lm_head"]
  with pytest.raises(ValueError, match="lm_haed"):
    fwd(params, tokens, {"*lm_haed*": "f32"})
  with pytest.raises(ValueError, match="bf17"):
    with linen_policy("c=bf17"):
      pass


def test_bf16_logits_close_to_f32_and_mlp(params, tokens):
  a = np.asarray(M.LinenAttentionLM().apply(params, tokens), np.float64)
  with linen_policy(MIXED):
    b = np.asarray(M.LinenAttentionLM().apply(params, tokens), np.float64)
  rel = np.mean(np.abs(a - b)) / np.mean(np.abs(a))
  assert 0 < rel <= 1e-2, rel
  x = jax.random.normal(jax.random.key(1), (4, 16), F32)
  with linen_policy(MIXED):
    p = M.LinenMLP().init(jax.random.key(0), x)
    y = M.LinenMLP().apply(p, x)
  assert y.dtype == F32 and {v.dtype for v in jax.tree.leaves(p)} == {np.dtype(F32)}
