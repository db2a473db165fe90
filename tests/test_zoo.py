"""Conformance of the policy mechanism on models we did not write (tests/_zoo.py).

For every model of the zoo (one of them, explicit_sharding_nnx, traced and lowered under a
2-device mesh with Explicit axes and `out_sharding=` annotations), unmodified, with the
recipe applied from outside in one line:
  * fp32 is bit-identical to the plain model: loss, every gradient, updated batch_stats;
  * bf16_mixed and f16_mixed: every GEMM / convolution of the forward AND backward pass is
    compute x compute -> f32 in the program lowered for CUDA (read from its StableHLO: a
    dot algorithm of another dtype would show as converts to it; the CPU branch of the
    policy GEMMs upcasts by design, so dtypes are never read from a CPU run), whatever
    dtypes the model's code chose itself;
  * bf16_mixed: the f32 ops (softmax, norms, exp/log/tanh/logistic, sums, the sums of
    the backward pass included) compute in f32 even where the model cast to bf16 itself,
    `check(policy)` passes on the differentiated program, and the loss is within 1e-2
    (relative) of fp32.
Models with an evaluation mode (Flax's ImageNet ResNet, trained under shard_map with
`BatchNorm(axis_name="batch")`): `apply(v, x, train=False)` reaches the model and reads
the running statistics, fp32 bit for bit, below f32 with compute x compute -> f32 GEMMs.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision.audit import lower
import _zoo
from _asserts import assert_bit_identical

MIXED = "p=f32,c=bf16,o=f32"


def lowered_gemms(fn, *args) -> list[tuple[str, str, str, str]]:
  """(op, lhs, rhs, result) short dtype names of every dot_general / convolution of `fn`
  lowered for CUDA (precision.audit.lower: jax.export works on a CPU-only machine)."""
  return [(g.op, *g.signature()) for g in lower(fn, *args, platform="cuda").gemms]


@functools.lru_cache(maxsize=None)
def built(name, recipe):
  return _zoo.CASES[name](recipe)


@functools.lru_cache(maxsize=None)
def value_and_grads(name, recipe):
  b = built(name, recipe)
  with b.context():
    (loss, aux), grads = jax.jit(jax.value_and_grad(b.loss, has_aux=True))(b.params)
  return loss, aux, grads


# Cases whose compilations take over ~5 s in a test: run with -m slow.
SLOW_FP32 = {"bf16_configured_nnx", "train_keywords_linen", "transformer_haiku",
             "imagenet_resnet_batch_axis_linen", "mixtral_ragged_moe_nnx",
             "switch_capacity_moe_linen"}
SLOW_F32_OPS = {"train_keywords_linen", "transformer_haiku", "imagenet_resnet_batch_axis_linen",
                "mixtral_ragged_moe_nnx", "switch_capacity_moe_linen"}
SLOW_LOWERING = {"transformer_haiku", "imagenet_resnet_batch_axis_linen",
                 "mixtral_ragged_moe_nnx"}
# Cases run under shard_map: its body is lowered without the enclosing name stack, so the
# lowering has no "transpose(" to tell backward GEMMs by.
BODY_WITHOUT_NAME_STACK = {"imagenet_resnet_batch_axis_linen"}


def _cases(slow=frozenset()):
  return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in _zoo.CASES]


@pytest.mark.parametrize("name", _cases(SLOW_FP32))
def test_fp32_recipe_bit_identical_to_plain_model(name):
  plain, lib = value_and_grads(name, None), value_and_grads(name, "fp32")
  assert_bit_identical(lib[0], plain[0], "loss")
  assert_bit_identical(lib[2], plain[2], "gradients")
  assert_bit_identical(lib[1], plain[1], "updated state (batch_stats, RNG, Haiku/Equinox "
                       "state) or None")


@pytest.mark.parametrize("recipe", ["bf16_mixed", "f16_mixed"])
@pytest.mark.parametrize("name", _cases(SLOW_LOWERING))
def test_every_gemm_forward_and_backward_is_compute_f32_on_cuda(name, recipe):
  compute = {"bf16_mixed": "bf16", "f16_mixed": "f16"}[recipe]
  b = built(name, recipe)
  with b.context():
    prog = lower(jax.value_and_grad(b.loss, has_aux=True), b.params, platform="cuda")
  gemms = [(g.op, *g.signature()) for g in prog.gemms]
  assert gemms, "no GEMM found in the lowered program"
  wrong = [g for g in gemms if g[1:] != (compute, compute, "f32")]
  assert not wrong, (f"{len(wrong)} of {len(gemms)} GEMMs are not {compute} x {compute} "
                     f"-> f32: {wrong}")
  prog.check(recipe)
  if name in BODY_WITHOUT_NAME_STACK:
    # The backward GEMMs are those the differentiated program has beyond the forward's.
    with b.context():
      forward = lower(lambda p: b.loss(p)[0], b.params, platform="cuda").gemms
    assert len(gemms) > len(forward), (len(gemms), len(forward))
  else:
    # Forward and backward GEMMs both there (the lowering keeps JAX's name stacks).
    assert prog.gemm_signatures("fwd") and prog.gemm_signatures("bwd")


@pytest.mark.parametrize("name", _cases(SLOW_F32_OPS))
def test_bf16_f32_ops_check_and_loss(name):
  b = built(name, "bf16_mixed")
  with b.context():
    report = mp.audit.audit(jax.grad(lambda p: b.loss(p)[0]), b.params)
  report.check(MIXED)
  f32_prims = mp._plan.autocast_spec("bf16_mixed").fp32_primitives
  below = [o for o in report.ops if o.primitive in f32_prims and o.dtype != "float32"]
  assert not below, below
  # Every model exercises some of them (softmax, norms, activations, the loss).
  assert any(o.primitive in f32_prims for o in report.ops)
  ref, got = value_and_grads(name, None)[0], value_and_grads(name, "bf16_mixed")[0]
  assert got.dtype == jnp.float32
  assert abs(float(got) - float(ref)) <= 1e-2 * abs(float(ref)), (float(ref), float(got))
  # Gradients keep the param dtype (f32 params: f32 gradients).
  grads = value_and_grads(name, "bf16_mixed")[2]
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  # State keeps its tree and dtypes (a bf16 cache stays bf16, f32 statistics f32).
  state, plain_state = value_and_grads(name, "bf16_mixed")[1], value_and_grads(name, None)[1]
  assert jax.tree.structure(state) == jax.tree.structure(plain_state)
  assert [x.dtype for x in jax.tree.leaves(state)] == [
      x.dtype for x in jax.tree.leaves(plain_state)]


def test_lowered_gemm_reader_sees_a_wrong_policy():
  """The reader is able to fail: a GEMM left in f32 and one accumulating in bf16 show up."""
  x = jnp.ones((4, 8), jnp.float32)
  w = jnp.ones((8, 8), jnp.float32)
  f32_gemm = lowered_gemms(lambda x, w: x @ w, x, w)
  assert f32_gemm == [("dot_general", "f32", "f32", "f32")]
  bf16_acc = lowered_gemms(lambda x, w: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16), x, w)
  assert bf16_acc == [("dot_general", "bf16", "bf16", "bf16")]
  # Under the policy: forward and both backward GEMMs.
  f = mp.autocast(lambda x, w: jnp.sum(x @ w), MIXED)
  assert lowered_gemms(jax.value_and_grad(f, (0, 1)), x, w) == [("dot_general", "bf16", "bf16", "f32")] * 3


# Cases with an evaluation mode (Built.evaluate); each builds the plain model too (slow).
EVALUATED = [n for n in _zoo.CASES if n.endswith("_batch_axis_linen")]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp32", "bf16_mixed", "f16_mixed"])
@pytest.mark.parametrize("name", EVALUATED)
def test_evaluation_mode_reaches_the_model_and_reads_running_statistics(name, recipe):
  """`apply(v, x, train=False)` outside the batch axis: only the keyword makes BatchNorm
  read its running statistics instead of averaging over an axis that is not bound there.
  fp32 is the plain model bit for bit; below f32 the evaluation's GEMMs are compute x
  compute -> f32 and its outputs near the plain model's."""
  plain, lib = built(name, None), built(name, recipe)
  state, plain_state = value_and_grads(name, recipe)[1], value_and_grads(name, None)[1]
  with lib.context():
    got = jax.jit(lib.evaluate)(lib.params, state)
    fresh = jax.jit(lib.evaluate)(lib.params, jax.tree_util.tree_map_with_path(
        lambda p, a: (jnp.zeros_like if p[-1].key == "mean" else jnp.ones_like)(a), state))
  with plain.context():
    ref = jax.jit(plain.evaluate)(plain.params, plain_state)
  assert got.dtype == ref.dtype == jnp.float32
  # It reads the statistics of one training step, not those of init (mean 0, var 1).
  assert not np.array_equal(np.asarray(got), np.asarray(fresh))
  if recipe == "fp32":
    assert_bit_identical(got, ref, "evaluation outputs")
    return
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0.1, atol=0.05)
  compute = {"bf16_mixed": "bf16", "f16_mixed": "f16"}[recipe]
  with lib.context():
    gemms = lowered_gemms(lib.evaluate, lib.params, state)
  assert gemms and all(g[1:] == (compute, compute, "f32") for g in gemms), gemms


# ----------------------------------------------------------------------------- MoE

MOE_CASES = ["mixtral_ragged_moe_nnx", "switch_capacity_moe_linen"]


def moe_recipe(name):
  """The preset, with the router kept out of fp8 as MoE trainers keep it (its 4 experts
  are no whole block of 32 under mxfp8 either)."""
  r = mp.get_recipe(name)
  if r.fp8 is None:
    return r
  keep = r.fp8.keep_high_precision + ("*router*",)
  return dataclasses.replace(r, fp8=dataclasses.replace(r.fp8, keep_high_precision=keep))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [p for p in mp.PRESETS if p != "fp32"])
@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_models_follow_every_recipe_in_the_cuda_lowering(name, recipe):
  """Every preset on the two MoE models (fp32 and the zoo's bf16/f16 checks run above):
  the lowered training step passes the recipe's check, and every expert GEMM (the
  ragged_dot grouped GEMMs, the capacity einsums) runs in the compute dtype with f32
  accumulation forward and backward, except where an fp8 recipe takes them: under
  apply_recipe the NNX model's ragged_dot experts run fp8 with one scale per expert group
  (E4M3 forward, E4M3 x E5M2 backward; mxfp8 emulated on its dequantised blocks, f32 x
  f32 in the `mxfp8_gemm` scope; nvfp4, whose scales are not defined per group, leaves
  them in the compute dtype), while Linen's linen_policy applies the recipe's policy."""
  r = moe_recipe(recipe)
  b = _zoo.CASES[name](r)
  with b.context():
    prog = lower(jax.value_and_grad(b.loss, has_aux=True), b.params, platform="cuda")
  prog.check(r if name.endswith("_nnx") else dataclasses.replace(r, fp8=None))
  compute = {"bfloat16": "bf16", "float16": "f16"}[np.dtype(r.policy.compute_dtype).name]
  # The grouped GEMMs; the capacity einsums over the expert axis (dispatch, the two
  # expert GEMMs, combine), named by their subscripts.
  marker = "ragged_dot_general" if name.endswith("_nnx") else "SwitchMoE_0/e"
  experts = [g for g in prog.gemms if marker in g.name]
  assert experts and {g.direction for g in experts} == {"fwd", "bwd"}, [
      g.name for g in prog.gemms]
  scaling = r.fp8.scaling if r.fp8 is not None and name.endswith("_nnx") else None
  if scaling in (None, "nvfp4"):
    assert {g.signature() for g in experts} == {(compute, compute, "f32")}, experts[:3]
  elif scaling == "mxfp8":
    assert all("mxfp8_gemm" in g.name for g in experts), [g.name for g in experts]
    assert {g.signature() for g in experts} == {("f32", "f32", "f32")}, experts[:3]
  else:
    fwd = {g.signature() for g in experts if g.direction == "fwd"}
    bwd = {tuple(sorted(g.signature()[:2])) + g.signature()[2:] for g in experts
           if g.direction == "bwd"}
    assert fwd == {("e4m3", "e4m3", "f32")} and bwd == {("e4m3", "e5m2", "f32")}, (fwd, bwd)
