"""precision.flax.apply_recipe with an fp8 recipe on an NNX MoE whose experts call
`lax.ragged_dot` (the zoo's Mixtral block: plain expert params, no layer to replace).

The model's fp8 layers run its dense fp8 GEMMs; its grouped expert GEMMs run fp8 under
the mark, one scale per expert group (`precision.fp8._grouped`, checked against NumPy in
tests/test_moe.py): E4M3 x E4M3 forward and E4M3/E5M2 backward in the CUDA lowering, and
the values those of `precision.autocast` on the same model, bit for bit.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import precision as mp
from precision.audit import lower
import _zoo
from _asserts import assert_bit_identical

D = 16


def _loss(model, x):
  y, aux = model(x)
  return jnp.mean(y ** 2) + 0.01 * aux


def _x():
  return jax.random.normal(jax.random.key(1), (2, 8, D))


def test_apply_recipe_fp8_runs_the_ragged_experts_in_fp8_in_the_cuda_lowering():
  model = mp.flax.apply_recipe(_zoo.MixtralMoE(D, 2 * D, rngs=nnx.Rngs(0)), "fp8_hybrid")
  graphdef, params = nnx.split(model)
  loss = lambda p, x: _loss(nnx.merge(graphdef, p), x)
  prog = lower(jax.value_and_grad(loss), params, _x(), platform="cuda")
  experts = [g for g in prog.gemms if "ragged_dot" in g.name]
  fwd = {g.signature() for g in experts if g.direction == "fwd"}
  bwd = {tuple(sorted(g.signature()[:2])) + g.signature()[2:] for g in experts
         if g.direction == "bwd"}
  assert fwd == {("e4m3", "e4m3", "f32")}, fwd     # the three expert GEMMs (were bf16)
  assert bwd == {("e4m3", "e5m2", "f32")}, bwd     # their dlhs and drhs
  prog.check("fp8_hybrid")


def test_apply_recipe_fp8_experts_equal_autocast_bit_for_bit():
  """Router kept out of fp8 and no first/last rule, so that both run the same GEMMs: the
  marked model's loss and gradients equal autocast's on the unmarked model."""
  recipe = mp.get_recipe("fp8_hybrid").replace(fp8=mp.Fp8Config(
      scaling="current", keep_first_last=False, keep_high_precision=("router*",)))
  x = _x()
  plain = _zoo.MixtralMoE(D, 2 * D, rngs=nnx.Rngs(0))
  # The model an argument of the autocast function: its module paths are the scopes
  # keep_high_precision matches (as under the mark).
  want = nnx.value_and_grad(mp.autocast(_loss, recipe))(plain, x)
  marked = mp.flax.apply_recipe(_zoo.MixtralMoE(D, 2 * D, rngs=nnx.Rngs(0)), recipe)
  got = nnx.value_and_grad(_loss)(marked, x)
  assert_bit_identical(got, want)
  # The experts did run fp8 (not the bf16 policy GEMM, which differs).
  bf16 = mp.autocast(_loss, "bf16_mixed")(plain, x)
  assert float(got[0]) != float(bf16)
