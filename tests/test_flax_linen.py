"""precision.flax.linen_policy on Linen models: the issue-3 gates for Linen."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision.flax import linen_policy
import _models as M
from _asserts import assert_bit_identical

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


def test_recipe_and_plan_entry_points(params, tokens):
  model = M.LinenAttentionLM()

  def signatures(policy):
    def fwd(p, t):
      with linen_policy(policy):
        return model.apply(p, t)
    return mp.audit.audit(fwd, params, tokens)

  assert signatures("bf16_mixed").gemm_signatures() == signatures(MIXED).gemm_signatures()
  report = signatures(mp.bind("bf16_mixed", overrides={"lm_head": "f32"}))
  assert [g.scope for g in report.gemms if g.lhs_dtype == "float32"] == [
      "LinenAttentionLM/lm_head"]
  with pytest.raises(ValueError, match="fp8 GEMMs"):
    with linen_policy("fp8_hybrid"):
      pass
  with pytest.raises(ValueError, match="already bound"):
    with linen_policy(mp.bind("bf16_mixed"), {"lm_head": "f32"}):
      pass


class _TrainNet(nn.Module):
  """Dense -> BatchNorm -> Dropout -> Dense, the mode given by a keyword: `train`, or
  `deterministic` (Flax's own spelling) with `use_deterministic=True`."""
  use_deterministic: bool = False

  @nn.compact
  def __call__(self, x, scale=1.0, *, train: bool = True, deterministic: bool = False):
    if self.use_deterministic:
      train = not deterministic
    x = nn.Dense(16)(x) * scale
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(4)(x)


@pytest.mark.parametrize("use_deterministic", [False, True])
def test_keyword_arguments_mutable_and_rngs_reach_the_module(use_deterministic):
  net = _TrainNet(use_deterministic)
  x = jax.random.normal(jax.random.key(1), (8, 5), F32)
  mode = ((lambda train: {"deterministic": not train}) if use_deterministic
          else (lambda train: {"train": train}))

  def run(under):
    with jax.numpy_dtype_promotion("standard"):
      with (linen_policy(under) if under else contextlib.nullcontext()):
        v = net.init({"params": jax.random.key(0), "dropout": jax.random.key(2)}, x,
                     **mode(False))
        y_train, new = net.apply(v, x, 2.0, mutable=["batch_stats"],
                                 rngs={"dropout": jax.random.key(3)}, **mode(True))
        y_eval = net.apply(v, x, scale=jnp.asarray(2.0, F32), **mode(False))  # an array
        y_eval_new = net.apply({**v, **new}, x, **mode(False))
    return v, y_train, new, y_eval, y_eval_new

  ref, lib = run(None), run("fp32")
  for a, b in zip(ref, lib):
    assert_bit_identical(a, b)
  _, y_train, new, y_eval, _ = lib
  assert not np.array_equal(np.asarray(y_train), np.asarray(y_eval))  # the modes differ
  assert not np.array_equal(np.asarray(new["batch_stats"]["BatchNorm_0"]["mean"]), 0)
