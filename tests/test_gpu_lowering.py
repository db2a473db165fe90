"""The GPU (and TPU) program of every recipe, lowered on this CPU: GEMM dtypes and kernels.

``jax.export.export(jax.jit(f), platforms=["cuda"])`` lowers the whole program for a GPU
on a CPU-only machine; nothing runs. In the StableHLO every ``stablehlo.dot_general``
names its operand and result element types, and every compiled Pallas kernel is a Triton
custom call (`precision.rounding.TRITON_CUSTOM_CALL`). The CPU branch of the policy GEMMs
(an f32 upcast, `lax.platform_dependent`) is not in a CUDA lowering, so the dtypes read
here are the GPU's.

Checked: the tiny GPT's jitted training step (experiments.trainlib, as training runs it)
under every preset recipe, lowered for CUDA and for TPU: every GEMM's operands and result
dtypes (bf16 x bf16 -> f32, f16 x f16 -> f32, f32 x f32 -> f32 for fp32 only; fp8_hybrid:
E4M3 x E4M3 -> f32 forward, E5M2 gradient x E4M3 -> f32 backward, bf16 for the layers fp8
keeps in high precision), the checker catching a deliberately wrong policy, and the
Pallas kernels (stochastic rounding to the 4 targets, FusedAdamW with and without master,
bf16_sr's optimizer) lowering to Triton for CUDA.

TPU (measured with jax 0.10.2): the training steps lower for TPU with the same GEMM
dtypes, and `impl="auto"` (the XLA reference off a GPU) and the interpret-mode kernels
lower too. The compiled Pallas kernels (``interpret=False``) do not lower for TPU
(Mosaic). With their Triton compiler params the error is ``ValueError: Compiler params
for platform gpu cannot be used for tpu lowering.`` once the Triton lowering is
registered in the process (after any GPU lowering), else a bare ``AssertionError`` in
Mosaic's `pallas_call_tpu_lowering_rule` (``isinstance(compiler_params,
tpu_core.CompilerParams)``). Without compiler params, Mosaic needs a TPU to read its
generation: ``ValueError: Unsupported TPU device kind: cpu``; `jax.sharding
.use_abstract_mesh` with an `AbstractDevice(device_kind="TPU v5 lite", platform="tpu")`
gets past that, and Mosaic then fails in its `load` lowering with a bare
``NotImplementedError``: the kernels use masked loads (`pallas.triton.load(...,
mask=...)`, for the partial last block), which Mosaic does not implement. A TPU kernel
would need full, padded 2-D blocks instead.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import precision as mp
import precision.flax  # noqa: F401  (mp.flax)
from experiments import trainlib
from models import gpt as gpt_lib
from precision.audit import lower
from precision.rounding import FusedAdamW
from precision.rounding import SUPPORTED
from precision.rounding import TRITON_CUSTOM_CALL
from precision.rounding import stochastic_round
from precision.rounding import stochastic_round_pallas

BATCH, SEQ = 2, 16
TRITON = [TRITON_CUSTOM_CALL]
F32 = ("f32", "f32", "f32")
# Expected (lhs, rhs, out) per recipe, written out rather than derived from the recipe
# objects: the checker below derives its rules from the recipe; these do not.
EXPECTED = {
    "fp32": {"fwd": {F32}, "bwd": {F32}},
    "f16_mixed": {"fwd": {("f16", "f16", "f32")}, "bwd": {("f16", "f16", "f32")}},
    # fp8: forward E4M3 x E4M3; backward the E5M2 gradient against the E4M3 operand
    # (operand order differs between dgrad and wgrad, so the pair is sorted); lm_head and
    # the attention GEMMs stay bf16 (keep_high_precision, and no fp8 layer).
    "fp8_hybrid": {"fwd": {("e4m3", "e4m3", "f32"), ("bf16", "bf16", "f32")},
                   "bwd": {("e4m3", "e5m2", "f32"), ("bf16", "bf16", "f32")}},
}
# mxfp8 / nvfp4: the GEMMs are emulated on the dequantised block-scaled operands, f32 x f32
# in both directions (named "mxfp8_gemm" / "nvfp4_gemm"); lm_head and attention stay bf16.
for _name in ("mxfp8", "nvfp4"):
  EXPECTED[_name] = {"fwd": {F32, ("bf16", "bf16", "f32")},
                     "bwd": {F32, ("bf16", "bf16", "f32")}}
for _name in ("bf16_mixed", "bf16_master", "bf16_sr", "bf16_kahan", "pure_bf16"):
  EXPECTED[_name] = {"fwd": {("bf16", "bf16", "f32")}, "bwd": {("bf16", "bf16", "f32")}}


def test_expected_covers_every_preset():
  assert set(EXPECTED) == set(mp.PRESETS)


def _cfg(recipe):
  return trainlib.TrainConfig(recipe=recipe, model="tiny", steps=4, batch=BATCH, seq=SEQ,
                              warmup=1, progress=False)


@pytest.fixture(scope="module")
def steps():
  """recipe -> (run, state): the tiny GPT's jitted training step and its fresh state."""
  cache = {}

  def get(recipe):
    if recipe not in cache:
      cache[recipe] = trainlib.init_state(_cfg(recipe))
    return cache[recipe]

  return get


@pytest.fixture(scope="module")
def lowered(steps):
  """(recipe, platform) -> LoweredProgram of that recipe's training step."""
  cache = {}

  def get(recipe, platform):
    if (recipe, platform) not in cache:
      run, state = steps(recipe)
      tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
      cache[recipe, platform] = lower(
          run.step_fn, state.params, state.model_state, state.opt_state, tokens,
          platform=platform, allow_custom_calls=TRITON if platform == "cuda" else ())
    return cache[recipe, platform]

  return get


def _signatures(prog, direction):
  """{(lhs, rhs, out)} of one direction, the backward operand pair sorted."""
  out = set()
  for g in prog.gemms:
    if g.direction == direction:
      lhs, rhs, res = g.signature()
      if direction == "bwd":
        lhs, rhs = sorted((lhs, rhs))
      out.add((lhs, rhs, res))
  return out


# The microscaled recipes' lowerings (about 10 s each) run with the slow set; their GEMM
# formats are also read per site by tests/test_fp8_conformance.py.
_MICRO_SLOW = {r: pytest.mark.slow for r in ("mxfp8", "nvfp4")}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=_MICRO_SLOW.get(r, ()))
                                    for r in mp.PRESETS])
def test_training_step_gemm_dtypes(lowered, recipe, platform):
  prog = lowered(recipe, platform)
  n = collections.Counter(g.direction for g in prog.gemms)
  # Every GEMM of the step is there: each forward GEMM has its two backward ones.
  assert n["fwd"] > 0 and n["bwd"] == 2 * n["fwd"], n
  assert {g.op for g in prog.gemms} == {"dot_general"}  # the GPT has no convolution
  for direction in ("fwd", "bwd"):
    assert _signatures(prog, direction) == EXPECTED[recipe][direction], (
        direction, prog.gemm_signatures())
  prog.check(recipe)  # the checker agrees


def test_fp8_hybrid_gemms_by_layer(lowered):
  """fp8 where it belongs: every fp8 forward GEMM has its two E5M2 backward GEMMs, and
  the lm_head (kept in high precision) runs bf16 in both directions."""
  prog = lowered("fp8_hybrid", "cuda")
  fp8 = collections.Counter(g.direction for g in prog.gemms if g.is_fp8)
  assert fp8["fwd"] > 0 and fp8["bwd"] == 2 * fp8["fwd"], fp8
  assert all("float8_e5m2" in (g.lhs_dtype, g.rhs_dtype)
             for g in prog.gemms if g.is_fp8 and g.direction == "bwd")
  head = [g for g in prog.gemms if "lm_head" in g.name]
  assert collections.Counter(g.direction for g in head) == {"fwd": 1, "bwd": 2}
  assert {g.signature() for g in head} == {("bf16", "bf16", "f32")}


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=_MICRO_SLOW.get(r, ()))
                                    for r in mp.PRESETS])
def test_only_stochastic_rounding_recipes_run_triton_kernels(lowered, steps, recipe):
  """bf16_sr's optimizer rounds with the Pallas kernel on a GPU: one Triton kernel per
  parameter shape, writing the bf16 bit patterns of every leaf. No other preset has a
  kernel (their GEMMs are XLA's)."""
  prog = lowered(recipe, "cuda")
  kernels = [c for c in prog.custom_calls if c.target == TRITON_CUSTOM_CALL]
  if mp.get_recipe(recipe).rounding != "stochastic":
    assert kernels == []
    return
  _, state = steps(recipe)
  sizes = {int(np.prod(p.shape)) for p in jax.tree.leaves(state.params)}
  assert {c.name for c in kernels} == {"stochastic_round_bf16"}
  assert {c.results for c in kernels} == {(f"uint16[{n}]",) for n in sizes}
  assert lowered(recipe, "tpu").custom_calls == ()  # off a GPU: the XLA reference


# --- the checker fails a wrong policy ------------------------------------------------------

def _gpt_grad_program(recipe, overrides=None):
  """The gradient of the tiny GPT's loss under `recipe` (with policy `overrides`, the
  public way to set a layer's policy), lowered for CUDA."""
  model = gpt_lib.GPT(gpt_lib.get_config("tiny"), rngs=nnx.Rngs(0))
  mp.flax.apply_recipe(model, recipe, overrides)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, tokens):
    return gpt_lib.loss_fn(nnx.merge(graphdef, params, rest), tokens)

  return lower(jax.grad(loss), params, jnp.zeros((BATCH, SEQ + 1), jnp.int32),
               platform="cuda")


def test_checker_flags_a_layer_left_in_f32():
  """bf16_mixed with the lm_head deliberately left in f32: exactly its three GEMMs
  (forward, and the two backward) are reported, by name; the same model without the
  override passes."""
  _gpt_grad_program("bf16_mixed").check("bf16_mixed")
  prog = _gpt_grad_program("bf16_mixed", {"*lm_head*": "f32"})
  found = prog.violations("bf16_mixed")
  assert len(found) == 3, found
  assert all("f32 x f32 -> f32, expected bf16 x bf16" in v and "lm_head" in v for v in found)
  with pytest.raises(mp.PrecisionViolation, match="lm_head"):
    prog.check("bf16_mixed")


def test_checker_flags_bf16_accumulation_and_wrong_formats(lowered):
  x = jnp.ones((8, 32), jnp.bfloat16)
  w = jnp.ones((32, 16), jnp.bfloat16)
  # A GEMM whose result is bf16: no f32 accumulator (what a dot without
  # preferred_element_type lowers to).
  plain = lower(lambda x, w: jnp.dot(x, w), x, w, platform="cuda")
  assert [g.signature() for g in plain.gemms] == [("bf16", "bf16", "bf16")]
  (v,) = plain.violations("bf16_mixed")
  assert v.startswith("GEMM result bf16")
  policy = lower(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, w,
                 platform="cuda")
  assert policy.violations("bf16_mixed") == []
  # fp8 rules: a bf16 program is missing both fp8 directions; the fp8 program read
  # against an all-E4M3 config has the wrong backward format; against bf16_mixed every
  # fp8 GEMM is out of place.
  missing = lowered("bf16_mixed", "cuda").violations("fp8_hybrid")
  assert [v for v in missing if "no fwd fp8" in v or "no bwd fp8" in v] == missing
  assert len(missing) == 2
  fp8 = lowered("fp8_hybrid", "cuda")
  all_e4m3 = mp.get_recipe("fp8_hybrid").replace(
      name="fp8_e4m3", fp8=mp.Fp8Config(backward_format="e4m3"))
  wrong_bwd = fp8.violations(all_e4m3)
  n8 = collections.Counter(g.direction for g in fp8.gemms if g.is_fp8)
  assert len(wrong_bwd) == n8["bwd"] and all("fp8 bwd GEMM" in v for v in wrong_bwd)
  assert len(fp8.violations("bf16_mixed")) == n8["fwd"] + n8["bwd"]


# --- Pallas kernels -------------------------------------------------------------------------

X = np.random.default_rng(0).normal(size=(3, 1000)).astype(np.float32)


# Every target from f32, and the fp8 targets from bf16 too (the inputs they accept).
KERNEL_CASES = [(t, "f32") for t in SUPPORTED] + [("e4m3", "bf16"), ("e5m2", "bf16")]


def test_kernel_cases_cover_every_target():
  assert set(SUPPORTED) == {"bf16", "f16", "e4m3", "e5m2"}


@pytest.mark.parametrize("target,in_dtype", KERNEL_CASES)
def test_stochastic_rounding_kernels_lower_to_triton(target, in_dtype):
  x = jnp.asarray(X).astype(jnp.bfloat16 if in_dtype == "bf16" else jnp.float32)
  bits = "uint8" if target in ("e4m3", "e5m2") else "uint16"
  for impl in ("pallas", "auto"):
    prog = lower(lambda x: stochastic_round(x, target, key=7, step=3, impl=impl), x,
                 platform="cuda", allow_custom_calls=TRITON)
    (call,) = prog.custom_calls
    assert call.target == TRITON_CUSTOM_CALL and call.name == f"stochastic_round_{target}"
    assert call.operands == ("uint32[4]", f"{in_dtype}[3000]")
    assert call.results == (f"{bits}[3000]",)
    # The same function lowered for the CPU or a TPU: interpret mode / XLA, no kernel.
    for other in ("cpu", "tpu"):
      assert lower(lambda x: stochastic_round(x, target, key=7, step=3, impl=impl), x,
                   platform=other).custom_calls == ()


def test_interpret_switch():
  """``interpret=True`` keeps a CUDA lowering kernel-free (interpret mode);
  ``interpret=False`` forces the compiled kernel for every platform, so lowering it for
  the CPU fails, as Pallas says it must."""
  x = jnp.asarray(X)
  interp = lower(lambda x: stochastic_round_pallas(x, "bf16", 0, interpret=True), x,
                 platform="cuda")
  assert interp.custom_calls == ()
  forced = lambda x: stochastic_round(x, "bf16", 0, impl="pallas", interpret=False)
  assert len(lower(forced, x, platform="cuda", allow_custom_calls=TRITON).custom_calls) == 1
  with pytest.raises(ValueError, match="interpret mode"):
    lower(forced, x, platform="cpu")
  with pytest.raises(ValueError, match="interpret"):
    stochastic_round(x, "bf16", 0, impl="xla", interpret=False)
  with pytest.raises(ValueError, match="interpret"):
    stochastic_round(x, "bf16", 0, impl="pallas", interpret="yes")
  with pytest.raises(ValueError, match="interpret"):
    FusedAdamW(1e-3, impl="xla", interpret=True)


@pytest.mark.parametrize("keep_master", [False, True], ids=["no_master", "master"])
@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_fused_adamw_lowers_to_triton(keep_master, impl):
  params = {"w": jnp.ones((64, 32), jnp.bfloat16), "b": jnp.zeros((32,), jnp.float16)}
  opt = FusedAdamW(1e-3, keep_master=keep_master, impl=impl)
  state = opt.init(params)
  prog = lower(opt.update, params, state, params, platform="cuda", allow_custom_calls=TRITON)
  calls = {c.name: c for c in prog.custom_calls}
  assert set(calls) == {"adamw_sr_bf16", "adamw_sr_f16"}
  assert {c.target for c in prog.custom_calls} == {TRITON_CUSTOM_CALL}
  w = calls["adamw_sr_bf16"]
  # Reads keys, scalars, grad, (master or param bits), mu, nu; writes param bits, mu, nu
  # (and the master), each exactly once.
  w_in = "f32[2048]" if keep_master else "uint16[2048]"
  assert w.operands == ("uint32[4]", "f32[8]", "bf16[2048]", w_in, "f32[2048]", "f32[2048]")
  assert w.results == ("uint16[2048]",) + ("f32[2048]",) * (3 if keep_master else 2)
  # TPU: "auto" is the XLA reference there and "pallas" interpret mode; both lower.
  tpu = lower(opt.update, params, state, params, platform="tpu")
  assert tpu.custom_calls == () and tpu.gemms == ()
