"""The lowering of the microscaled GEMMs (Fp8Config.micro_gemm): the f32 emulation, or
block-scaled GEMMs (`jax.nn.scaled_matmul`, the CUDA custom call __op$block_scaled_dot)
on the same quantised elements and scales.

No GPU here: the CPU runs `lax.platform_dependent`'s default branch (the emulation), the
CUDA branch is read from a CUDA export's StableHLO, and its numbers are checked by
running `block_scaled_mm` with a numpy/ml_dtypes stand-in for scaled_matmul (the
documented semantics: elements times their block's scale, contracted over the last
axis), against an exact f64 reference.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import precision as mp
from precision.audit import lower
from precision.audit._lowering import BLOCK_SCALED_DOT, gemm_violations, lowered_gemms
from precision.checkpoint._owner import recipe_difference
from precision.fp8 import _microdot as md

DIMS = (32, 64, 64, 64, 32)
ELEMENTS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e2m1": "float4_e2m1fn"}
SCALES = {"mxfp8": "float8_e8m0fnu", "nvfp4": "float8_e4m3fn"}


def _params(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(DIMS) - 1)
  return [jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
          for k, a, b in zip(keys, DIMS[:-1], DIMS[1:])]


def _data():
  kx, ky = jax.random.split(jax.random.key(1))
  return (jax.random.normal(kx, (32, DIMS[0]), jnp.float32),
          jax.random.normal(ky, (32, DIMS[-1]), jnp.float32))


def _loss(ws, x, y):
  for w in ws[:-1]:
    x = jnp.tanh(x @ w)
  return jnp.mean((x @ ws[-1] - y) ** 2)


def _recipe(name, gemm, **fp8):
  base = mp.get_recipe(name)
  return base.replace(name=f"{name}_{gemm}", fp8=dataclasses.replace(
      base.fp8, micro_gemm=gemm, **fp8))


def _cuda(fn, *args):
  return lower(fn, *args, platform="cuda", allow_custom_calls=[BLOCK_SCALED_DOT])


# ----------------------------------------------------------------------------- config


def test_micro_gemm_field_validation_and_round_trip():
  assert mp.Fp8Config().micro_gemm == "auto"
  assert mp.get_recipe("mxfp8").fp8.micro_gemm == "auto"
  with pytest.raises(ValueError, match=r"fp8\.micro_gemm='cudnn'; accepted: auto, "
                                       r"emulated, block_scaled"):
    mp.Fp8Config(scaling="mxfp8", micro_gemm="cudnn")
  with pytest.raises(ValueError, match=r"fp8\.micro_gemm='block_scaled'; accepted: 'auto' "
                                       r"with fp8\.scaling='delayed'"):
    mp.Fp8Config(micro_gemm="block_scaled")
  with pytest.raises(ValueError, match=r"fp8\.micro_gemm=1"):
    mp.Fp8Config(scaling="nvfp4", forward_format="e2m1", backward_format="e2m1",
                 micro_gemm=1)
  # "auto" is not written: every dict written before the field existed is unchanged, and
  # reads back as "auto".
  old = mp.get_recipe("nvfp4")
  assert "micro_gemm" not in old.to_dict()["fp8"]
  assert mp.Recipe.from_dict(old.to_dict()).fp8.micro_gemm == "auto"
  for gemm in ("emulated", "block_scaled"):
    r = _recipe("nvfp4", gemm)
    d = r.to_dict()
    assert d["fp8"]["micro_gemm"] == gemm
    assert mp.Recipe.from_dict(d) == r
    assert "micro_gemm" in recipe_difference(old.replace(name=r.name), r)
  bad = _recipe("mxfp8", "emulated").to_dict()
  bad["fp8"]["micro_gemm"] = "tensor_core"
  with pytest.raises(ValueError, match=r"fp8\.micro_gemm='tensor_core'"):
    mp.Recipe.from_dict(bad)


class _Device:
  def __init__(self, platform, cc):
    self.platform, self.compute_capability = platform, cc


@pytest.mark.parametrize("platform, cc, want", [
    ("cpu", None, "emulated"), ("gpu", "9.0", "emulated"), ("gpu", "10.0", "block_scaled"),
    ("gpu", "12.1", "block_scaled"), ("gpu", "gfx950", "emulated")])
def test_auto_is_block_scaled_only_on_compute_capability_10(monkeypatch, platform, cc, want):
  assert md.resolve_gemm("emulated") == "emulated"
  assert md.resolve_gemm("block_scaled") == "block_scaled"
  monkeypatch.setattr(jax, "devices", lambda *a: [_Device(platform, cc)])
  assert md.resolve_gemm("auto") == want


def test_auto_on_this_cpu_is_the_emulation():
  assert jax.devices()[0].platform == "cpu"
  assert md.resolve_gemm("auto") == "emulated"
  spec = mp.fp8.Fp8Spec.from_config(mp.get_recipe("mxfp8").fp8)
  f = lambda a, b: jnp.sum(mp.fp8.fp8_dot_general(
      a, b, (((1,), (0,)), ((), ())), spec.init_state(), spec, out_dtype=jnp.float32)[0] ** 2)
  prog = _cuda(jax.grad(f, argnums=(0, 1)), jnp.ones((32, 64)), jnp.ones((64, 32)))
  assert [g.signature() for g in prog.gemms] == [("f32", "f32", "f32")] * 3
  assert BLOCK_SCALED_DOT not in prog.text


# ----------------------------------------------------------------------------- a. CPU


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_block_scaled_on_cpu_is_the_emulation_bit_for_bit(name):
  """The CPU runs the platform_dependent default branch: one microscaled GEMM's output
  and both its gradients under "block_scaled" are those of "emulated", bit for bit
  (nvfp4 with its stochastic gradients and Hadamard transform)."""
  ka, kb, kg = jax.random.split(jax.random.key(3), 3)
  a = jax.random.normal(ka, (32, 64), jnp.float32)
  b = jax.random.normal(kb, (64, 32), jnp.float32)
  g = jax.random.normal(kg, (32, 32), jnp.float32)
  out = {}
  for gemm in ("emulated", "block_scaled"):
    spec = mp.fp8.Fp8Spec.from_config(_recipe(name, gemm).fp8)
    f = lambda a, b: mp.fp8.fp8_dot_general(a, b, (((1,), (0,)), ((), ())),
                                            spec.init_state(), spec, out_dtype=jnp.float32)[0]
    y, vjp = jax.vjp(jax.jit(f), a, b)
    out[gemm] = [np.asarray(v) for v in (y, *jax.jit(vjp)(g))]
  for e, bs in zip(out["emulated"], out["block_scaled"]):
    np.testing.assert_array_equal(e, bs)
  # Not a vacuous comparison: the microscaled GEMM is not the f32 product.
  exact = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  assert np.max(np.abs(out["emulated"][2] - exact)) > 1e-3


# ----------------------------------------------------------------------------- b. CUDA


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_cuda_lowering_has_one_block_scaled_gemm_per_selected_gemm(name):
  """Under "block_scaled" each selected GEMM lowers for CUDA to three block-scaled GEMMs
  (forward, dgrad, wgrad) on the recipe's element and scale formats, with the recipe's
  block, and no f32 emulated GEMM remains; under "emulated" none is block-scaled."""
  ws, (x, y) = _params(), _data()
  r = _recipe(name, "block_scaled")
  selected = sum(s.fp8 for s in mp.fp8.autocast_gemms(_loss, r, ws, x, y))
  assert selected == 2  # keep_first_last: the first and last GEMM stay in bf16
  prog = _cuda(jax.grad(mp.autocast(_loss, r)), ws, x, y)
  prog.check(r)
  blocked = [g for g in prog.gemms if g.op == "block_scaled_dot"]
  assert len(blocked) == 3 * selected
  assert sorted(g.direction for g in blocked) == ["bwd"] * 2 * selected + ["fwd"] * selected
  fwd, bwd = ELEMENTS[r.fp8.forward_format], ELEMENTS[r.fp8.backward_format]
  for g in blocked:
    assert f"{name}_gemm" in g.name and g.out_dtype == "float32", g
    assert (g.lhs_scale_dtype, g.rhs_scale_dtype) == (SCALES[name],) * 2, g
    assert g.block == r.fp8.block_size, g
    assert {g.lhs_dtype, g.rhs_dtype} <= {fwd, bwd}, g
  assert not [g for g in prog.gemms if g.op == "dot_general"
              and g.signature() == ("f32", "f32", "f32")]
  assert BLOCK_SCALED_DOT in prog.text
  emulated = _cuda(jax.grad(mp.autocast(_loss, _recipe(name, "emulated"))), ws, x, y)
  emulated.check(_recipe(name, "emulated"))
  assert BLOCK_SCALED_DOT not in emulated.text
  assert len([g for g in emulated.gemms if f"{name}_gemm" in g.name
              and g.signature() == ("f32", "f32", "f32")]) == 3 * selected


def test_mxfp8_e5m2_gradients_reach_the_block_scaled_backward_gemms():
  """backward_format e5m2: the forward block-scaled GEMMs take E4M3 x E4M3, each
  backward one the E5M2 gradient and an E4M3 operand (which side: dgrad lhs, wgrad rhs)."""
  ws, (x, y) = _params(), _data()
  r = _recipe("mxfp8", "block_scaled", backward_format="e5m2")
  prog = _cuda(jax.grad(mp.autocast(_loss, r)), ws, x, y)
  prog.check(r)
  pairs = sorted((g.direction, g.lhs_dtype, g.rhs_dtype) for g in prog.gemms
                 if g.op == "block_scaled_dot")
  e4, e5 = "float8_e4m3fn", "float8_e5m2"
  assert pairs == sorted([("fwd", e4, e4)] * 2 + [("bwd", e5, e4)] * 2
                         + [("bwd", e4, e5)] * 2), pairs


# ----------------------------------------------------------------------------- audit


def test_audit_checks_block_scaled_gemms_against_the_recipe():
  ws, (x, y) = _params(), _data()
  r = _recipe("mxfp8", "block_scaled")
  prog = _cuda(jax.grad(mp.autocast(_loss, r)), ws, x, y)
  prog.check(r)
  prog.check(_recipe("mxfp8", "auto"))   # "auto": either lowering
  found = prog.violations(_recipe("mxfp8", "emulated"))
  assert len(found) == 6 and all("micro_gemm='emulated'" in v for v in found), found
  found = prog.violations(_recipe("mxfp8", "block_scaled", micro_block=16))
  assert len(found) == 6 and all("blocks of 32, expected 16" in v for v in found), found
  found = prog.violations(_recipe("mxfp8", "block_scaled", backward_format="e5m2"))
  assert len(found) == 4 and all("expected e4m3 x e5m2" in v for v in found), found
  # Outside a microscaled recipe a block-scaled GEMM is no recipe GEMM.
  found = prog.violations("fp8_hybrid")
  assert sum("block-scaled GEMM" in v and "outside the microscaled" in v for v in found) == 6
  # The emulation lowered for CUDA is not what "block_scaled" asks of a CUDA program.
  emulated = _cuda(jax.grad(mp.autocast(_loss, _recipe("mxfp8", "emulated"))), ws, x, y)
  found = emulated.violations(r)
  assert len(found) == 6 and all("emulated in f32" in v for v in found), found


def _line(lhs, rhs, lscale, rscale, name):
  return ('    %0 = stablehlo.custom_call @__op$block_scaled_dot(%arg0, %arg1, %arg2, %arg3) '
          f'{{api_version = 2 : i32, backend_config = "{{}}"}} : (tensor<2x8x64x{lhs}>, '
          f'tensor<2x16x64x{rhs}>, tensor<2x8x4x{lscale}>, tensor<2x16x4x{rscale}>) -> '
          f'tensor<2x8x16xf32> loc("{name}")')


def test_audit_reads_the_scale_formats_and_block_of_nvfp4():
  ws, (x, y) = _params(), _data()
  r = _recipe("nvfp4", "block_scaled")
  prog = _cuda(jax.grad(mp.autocast(_loss, r)), ws, x, y)
  prog.check(r)
  found = prog.violations(_recipe("nvfp4", "block_scaled", micro_block=8))
  assert len(found) == 6 and all("blocks of 16, expected 8" in v for v in found), found
  # The nvfp4 GEMMs are not an mxfp8 recipe's (another scope): no microscaled GEMM.
  found = prog.violations(_recipe("mxfp8", "block_scaled"))
  assert sum("outside the microscaled GEMMs" in v for v in found) == 6, found
  assert any("no fwd fp8 GEMM" in v for v in found), found
  # E8M0 scales, or E4M3 elements, in the nvfp4 scope (a forward and a backward GEMM).
  text = "\n".join([
      _line("f4E2M1FN", "f4E2M1FN", "f8E8M0FNU", "f8E8M0FNU", "jit(f)/jvp(nvfp4_gemm)/sm"),
      _line("f8E4M3FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN",
            "jit(f)/transpose(jvp(nvfp4_gemm))/sm")])
  found = gemm_violations(lowered_gemms(text), r, "cuda")
  assert len(found) == 2, found
  assert "scales float8_e8m0fnu x float8_e8m0fnu, expected e4m3 x e4m3" in found[0]
  assert "bwd GEMM elements" in found[1] and "expected float4_e2m1fn x float4_e2m1fn" in found[1]


def test_lowered_gemms_reads_a_block_scaled_custom_call_line():
  line = _line("f4E2M1FN", "f4E2M1FN", "f8E4M3FN", "f8E4M3FN", "jit(f)/nvfp4_gemm/scaled_matmul")
  (g,) = lowered_gemms(line)
  assert (g.op, g.lhs_dtype, g.rhs_dtype, g.out_dtype) == (
      "block_scaled_dot", "float4_e2m1fn", "float4_e2m1fn", "float32")
  assert (g.lhs_scale_dtype, g.rhs_scale_dtype, g.block) == (
      "float8_e4m3fn", "float8_e4m3fn", 16)
  assert g.name == "jit(f)/nvfp4_gemm/scaled_matmul" and g.direction == "fwd"


# ----------------------------------------------------------------------------- c. numbers


def _np_scaled_matmul(a, b, sa, sb, preferred_element_type):
  """scaled_matmul's semantics in numpy: every element times its block's scale (exact
  in f64), contracted over the last axis in f64, then rounded to f32."""
  assert preferred_element_type == jnp.float32

  def values(q, s):
    q = np.asarray(q).astype(np.float64)
    s = np.asarray(s).astype(np.float64)
    return q * np.repeat(s, q.shape[-1] // s.shape[-1], axis=-1)

  return jnp.asarray(np.einsum("bmk,bnk->bmn", values(a, sa), values(b, sb))
                     .astype(np.float32))


def _exact(spec, lhs, rhs):
  """The f64 product of the dequantised operands (lhs rows x contraction, rhs
  contraction x cols), each dequantised exactly in f64 (element * scale * tensor scale)
  with ml_dtypes; and the sum of |terms| bounding the f32 rounding."""
  def values(q):
    e = np.moveaxis(np.asarray(q.elements).astype(np.float64), q.axis, -1)
    s = np.moveaxis(np.asarray(q.scales).astype(np.float64), q.axis, -1)
    v = e * np.repeat(s, e.shape[-1] // s.shape[-1], axis=-1)
    if q.tensor_scale is not None:
      v = v * np.float64(np.asarray(q.tensor_scale))
    return v   # [B, rows-or-cols, C]

  a, b = values(lhs), values(rhs)
  return np.einsum("bmk,bnk->bmn", a, b), np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b))


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_block_scaled_gemms_equal_the_emulation_to_f32_rounding(name):
  """Forward, dgrad and wgrad layouts (the operands micro_bmm quantises, at its axes):
  the block-scaled GEMM (numpy stand-in for scaled_matmul, nvfp4's tensor scales after
  it) and the f32 emulation both equal the exact product of the same quantised values to
  within f32 rounding of the sum (|error| <= (C + 4) * 2**-24 * sum |terms|), and each
  other to twice that."""
  cfg = _recipe(name, "block_scaled").fp8
  spec = md.MicroSpec.from_config(cfg)
  rng = np.random.default_rng(0)
  # Magnitudes far from 1 so that nvfp4's tensor scales matter.
  a = jnp.asarray(rng.standard_normal((2, 64, 96)) * 3e-3, jnp.float32)   # [B, M, K]
  b = jnp.asarray(rng.standard_normal((2, 96, 32)) * 2e4, jnp.float32)    # [B, K, N]
  g = jnp.asarray(rng.standard_normal((2, 64, 32)) * 1e-6, jnp.float32)   # [B, M, N]
  fwd_f, bwd_f = spec.forward_format, spec.backward_format
  q = jax.jit(spec.quantize, static_argnums=(1, 2))
  emulated_mm = jax.jit(lambda lhs, rhs: md._emulated_mm(spec, lhs, rhs))
  cases = {
      "forward": (q(a, 2, fwd_f), q(b, 1, fwd_f)),
      "dgrad": (q(g, 2, bwd_f), q(b, 2, fwd_f)),
      "wgrad": (q(a, 1, fwd_f), q(g, 1, bwd_f)),
  }
  shapes = {"forward": (2, 64, 32), "dgrad": (2, 64, 96), "wgrad": (2, 96, 32)}
  for what, (lhs, rhs) in cases.items():
    blocked = np.asarray(md.block_scaled_mm(lhs, rhs, scaled_matmul=_np_scaled_matmul),
                         np.float64)
    emulated = np.asarray(emulated_mm(lhs, rhs), np.float64)
    exact, size = _exact(spec, lhs, rhs)
    c = lhs.elements.shape[lhs.axis]
    bound = (c + 4) * 2.0 ** -24 * size + np.finfo(np.float32).tiny
    assert blocked.shape == emulated.shape == shapes[what], what
    assert np.all(np.abs(blocked - exact) <= bound), what
    assert np.all(np.abs(emulated - exact) <= bound), what
    assert np.all(np.abs(blocked - emulated) <= 2 * bound), what
    np.testing.assert_allclose(blocked, emulated, rtol=1e-5, atol=1e-6 * np.max(size))
    # Not vacuous: the result is far from zero and the quantisation changed it.
    unq = {"forward": np.asarray(a) @ np.asarray(b),
           "dgrad": np.asarray(g) @ np.swapaxes(np.asarray(b), 1, 2),
           "wgrad": np.swapaxes(np.asarray(a), 1, 2) @ np.asarray(g)}[what]
    assert np.max(np.abs(exact - unq)) > 100 * np.max(np.abs(blocked - exact)), what


def test_block_scaled_mm_multiplies_the_tensor_scales_after_the_gemm():
  """nvfp4: the tensor scales are applied to scaled_matmul's f32 result, lhs's first,
  not folded into the operands (E2M1 elements and E4M3 scales reach the GEMM as
  quantised)."""
  spec = md.MicroSpec.from_config(_recipe("nvfp4", "block_scaled").fp8)
  rng = np.random.default_rng(1)
  q = jax.jit(spec.quantize, static_argnums=(1, 2))
  lhs = q(jnp.asarray(rng.standard_normal((1, 16, 32)) * 1e3, jnp.float32), 2, "e2m1")
  rhs = q(jnp.asarray(rng.standard_normal((1, 32, 16)) * 1e-4, jnp.float32), 1, "e2m1")
  seen = {}

  def spy(a, b, sa, sb, preferred_element_type):
    seen["dtypes"] = tuple(np.dtype(t.dtype) for t in (a, b, sa, sb))
    seen["shapes"] = tuple(t.shape for t in (a, b, sa, sb))
    r = _np_scaled_matmul(a, b, sa, sb, preferred_element_type)
    seen["raw"] = np.asarray(r)
    return r

  out = np.asarray(md.block_scaled_mm(lhs, rhs, scaled_matmul=spy))
  e2m1, e4m3 = np.dtype(ml_dtypes.float4_e2m1fn), np.dtype(ml_dtypes.float8_e4m3fn)
  assert seen["dtypes"] == (e2m1, e2m1, e4m3, e4m3)
  assert seen["shapes"] == ((1, 16, 32), (1, 16, 32), (1, 16, 2), (1, 16, 2))
  ta, tb = np.float32(np.asarray(lhs.tensor_scale)), np.float32(np.asarray(rhs.tensor_scale))
  np.testing.assert_array_equal(out, (seen["raw"] * ta) * tb)
