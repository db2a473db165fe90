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


# nvfp4 (3-7 s on the shared 2-core machine) runs with the slow set; mxfp8 is its fast
# sibling (the same platform branch around the same GEMMs).
@pytest.mark.parametrize("name", ["mxfp8", pytest.param("nvfp4", marks=pytest.mark.slow)])
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
    run = jax.jit(lambda a, b, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, a, b)))
    out[gemm] = [np.asarray(v) for v in run(a, b, g)]
  for e, bs in zip(out["emulated"], out["block_scaled"]):
    np.testing.assert_array_equal(e, bs)
  # Not a vacuous comparison: the microscaled GEMM is not the f32 product.
  exact = np.asarray(a, np.float64).T @ np.asarray(g, np.float64)
  assert np.max(np.abs(out["emulated"][2] - exact)) > 1e-3


# ----------------------------------------------------------------------------- b. CUDA


@pytest.mark.parametrize("name", [pytest.param("mxfp8", marks=pytest.mark.slow), "nvfp4"])
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


# mxfp8 runs with the slow set; nvfp4, whose tensor scales follow the GEMM, is the fast one.
@pytest.mark.parametrize("name", [pytest.param("mxfp8", marks=pytest.mark.slow), "nvfp4"])
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


# ----------------------------------------------------------------------------- 2D weights
# NVFP4 weights in 16 x 16 tiles (Fp8Config.weight_block_2d), against a numpy + ml_dtypes
# reference of the recipe's formulas (f32 IEEE arithmetic), written here.

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn


def _ref_tiles(x, tile=16):
  """(elements, tile scales, tensor scale) of a [B, R, C] f32 array, 2D tiles over (R, C)."""
  f32 = np.float32
  x = np.asarray(x, f32)
  fin = np.where(np.isfinite(x), np.abs(x), f32(0))
  with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
    ts = np.maximum(f32(np.max(fin)) / f32(2688.0), f32(2.0 ** -110)).astype(f32)
    b, r, c = x.shape
    t = x.reshape(b, r // tile, tile, c // tile, tile)
    tfin = fin.reshape(t.shape)
    amax = tfin.max(axis=(2, 4))
    bad = ~np.all(np.isfinite(t), axis=(2, 4))
    sbf = np.minimum((amax / (f32(6.0) * ts)).astype(f32), f32(448.0))
    sb = np.where(bad, f32(np.nan), sbf).astype(E4M3)
    d = (sb.astype(f32) * ts).astype(f32)[:, :, None, :, None]
    usable = np.isfinite(d) & (d > 0)
    y = np.clip((t / np.where(usable, d, f32(1))).astype(f32), f32(-6), f32(6))
    y = np.where(usable, y, f32(0))
  return y.astype(E2M1).reshape(b, r, c), sb, ts


def _with_amax(x, amax):
  """x scaled so that its largest |value| is exactly `amax`."""
  x = np.asarray(x, np.float64)
  return (x / np.max(np.abs(x)) * amax).astype(np.float32)


def _tile_inputs():
  """>= 100k values: tiles of log-uniform magnitudes over 2**[-40, 0] of the tensor's
  amax (so many tile scales are E4M3 subnormals or underflow), and a tensor of boundary
  tiles. The tensor amax is 2688 * 2**k: XLA:CPU's f32 division is not correctly
  rounded (about one quotient in five by 2688 is 1 ulp off IEEE's), so an exact
  comparison of the f32 tensor scale needs the quotient A / 2688 to be exact."""
  rng = np.random.default_rng(7)
  mag = np.exp2(rng.uniform(-40, 0, (4, 16, 1, 8, 1)))
  spread = np.exp2(rng.uniform(-12, 0, (4, 16, 16, 8, 16)))
  sign = rng.choice([-1.0, 1.0], spread.shape)
  random = _with_amax((sign * mag * spread).reshape(4, 256, 128), 2688.0 * 2.0 ** 20)
  tiles = [np.zeros((16, 16)), -np.zeros((16, 16)), np.full((16, 16), 1e-45),
           np.linspace(1e-45, 1e-39, 256).reshape(16, 16),           # f32 subnormals
           np.full((16, 16), 2688.0),                                # the tensor's amax
           np.linspace(-2688.0, 2688.0, 256).reshape(16, 16)]
  # Ties: a tile of amax 6 has scale 1 (tensor scale 1 from the 2688 tile); its other
  # elements sit at midpoints of the E2M1 grid and round to even.
  ties = np.resize(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25,
                             -1.75, -2.5, -3.5, -5.0, 6.0, -6.0]), (16, 16))
  tiles += [ties, ties * 2.0 ** -3, ties * 448.0 / 6.0 * 4]  # scales 1, 1/8, 298.7->288
  edge = np.linspace(-3, 3, 256).reshape(16, 16)
  for bad in (np.inf, np.nan):
    t = edge.copy()
    t[3, 5] = bad
    tiles.append(t)
  boundary = np.concatenate(tiles, axis=1)[None].astype(np.float32)   # [1, 16, 16 * 11]
  return random, boundary


def test_nvfp4_2d_tiles_match_the_reference():
  from precision.fp8 import _microscale as ms  # pylint: disable=g-import-not-at-top
  random, boundary = _tile_inputs()
  assert random.size >= 100_000
  quant = jax.jit(lambda x: ms.nvfp4_quantize_2d(x, axes=(1, 2)))
  for x in (random, boundary, random * np.float32(2.0 ** -90)):
    q, sb, ts = quant(jnp.asarray(x))
    rq, rsb, rts = _ref_tiles(x)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), rq.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sb).view(np.uint8), rsb.view(np.uint8))
    assert np.float32(np.asarray(ts)) == rts
  q, sb, _ = quant(jnp.asarray(boundary))
  sb = np.asarray(sb).astype(np.float32)[0]
  assert np.isnan(sb[0, 9]) and np.isnan(sb[0, 10])
  np.testing.assert_array_equal(sb[0, 4:9], [448.0, 448.0, 1.0, 0.125, 288.0])
  vals = np.asarray(q).astype(np.float32)[0, :, 96:112]   # the ties tile
  np.testing.assert_array_equal(vals[0, :14], [0, 1, 1, 2, 2, 4, 4, -0, -1, -1, -2, -2, -4, -4])
  # Tiles over (axes 0, 2) of a [R, B, C] array are those of the transposed layout.
  q2, sb2, _ = jax.jit(lambda x: ms.nvfp4_quantize_2d(x, axes=(0, 2)))(
      jnp.asarray(np.swapaxes(random, 0, 1)))
  rq, rsb, _ = _ref_tiles(random)
  np.testing.assert_array_equal(np.swapaxes(np.asarray(q2), 0, 1).view(np.uint8),
                                rq.view(np.uint8))
  np.testing.assert_array_equal(np.swapaxes(np.asarray(sb2), 0, 1).view(np.uint8),
                                rsb.view(np.uint8))
  with pytest.raises(ValueError, match="tile=16 does not divide the length 8"):
    ms.nvfp4_quantize_2d(jnp.ones((16, 8)))


def test_weight_block_2d_field():
  nv = dict(scaling="nvfp4", forward_format="e2m1", backward_format="e2m1")
  assert mp.Fp8Config(**nv).weight_block_2d is False
  c = mp.Fp8Config(**nv, weight_block_2d=True)
  assert c.to_dict()["weight_block_2d"] is True
  assert mp.Fp8Config.from_dict(c.to_dict()) == c
  assert "weight_block_2d" not in mp.Fp8Config(**nv).to_dict()
  with pytest.raises(ValueError, match=r"fp8\.weight_block_2d=True; accepted: false with "
                                       r"fp8\.scaling='mxfp8'"):
    mp.Fp8Config(scaling="mxfp8", weight_block_2d=True)
  with pytest.raises(ValueError, match=r"fp8\.weight_block_2d=1; accepted: true or false"):
    mp.Fp8Config(**nv, weight_block_2d=1)


def test_2d_weight_is_the_same_values_forward_and_dgrad():
  """The weight quantised for the forward GEMM (contraction K) and for dgrad
  (contraction N) is one tensor of values with 2D tiles, two different ones without; the
  GEMMs of one microscaled dot multiply exactly those values."""
  nv = _recipe("nvfp4", "emulated", hadamard_wgrad=False, stochastic_gradients=False).fp8
  rng = np.random.default_rng(3)
  a = jnp.asarray(rng.standard_normal((1, 32, 64)), jnp.float32)
  w = jnp.asarray(_with_amax(rng.standard_normal((1, 64, 48)) * np.exp2(
      rng.integers(-6, 6, (1, 64, 48))), 2688.0 * 2.0 ** -4))   # an exact tensor scale
  g = jnp.asarray(rng.standard_normal((1, 32, 48)), jnp.float32)
  read = {}
  for two_d in (True, False):
    spec = md.MicroSpec.from_config(dataclasses.replace(nv, weight_block_2d=two_d))
    read[two_d] = [np.asarray(v) for v in jax.jit(lambda w: [
        spec.dequantize(spec.quantize_weight(w, axis)) for axis in (1, 2)])(w)]
  np.testing.assert_array_equal(read[True][0], read[True][1])
  assert not np.array_equal(read[False][0], read[False][1])
  # The forward GEMM and dgrad of a 2D-tiled dot multiply exactly these values (to f32
  # rounding of their sums), not the 1D weights.
  spec = md.MicroSpec.from_config(dataclasses.replace(nv, weight_block_2d=True))

  @jax.jit
  def run(a, w, g):
    out, vjp = jax.vjp(lambda a, w: md.micro_dot(a, w, spec, jnp.float32), a, w)
    return (out, vjp(g)[0], spec.fake_quantize(a, 2, "e2m1"),
            spec.fake_quantize(g, 2, "e2m1"))

  out, da, fa, fg = (np.asarray(v, np.float64) for v in run(a, w, g))
  w2d, w1d = read[True][0].astype(np.float64), read[False][1].astype(np.float64)
  for got, lhs, rhs, other in ((out, fa, w2d, read[False][0].astype(np.float64)),
                               (da, fg, np.swapaxes(w2d, 1, 2), np.swapaxes(w1d, 1, 2))):
    bound = 70 * 2.0 ** -24 * (np.abs(lhs) @ np.abs(rhs))
    assert np.all(np.abs(got - lhs @ rhs) <= bound)
    assert not np.all(np.abs(got - lhs @ other) <= bound)
  # The 2D values are the reference's 16x16-tile quantisation.
  rq, rsb, rts = _ref_tiles(np.asarray(w))
  want = (rq.astype(np.float32) * np.repeat(np.repeat(
      (rsb.astype(np.float32) * rts).astype(np.float32), 16, 1), 16, 2)).astype(np.float32)
  np.testing.assert_array_equal(read[True][0], want)


def test_2d_weights_lower_to_block_scaled_gemms():
  ws, (x, y) = _params(), _data()
  r = _recipe("nvfp4", "block_scaled", weight_block_2d=True)
  prog = _cuda(jax.grad(mp.autocast(_loss, r)), ws, x, y)
  prog.check(r)
  assert len([g for g in prog.gemms if g.op == "block_scaled_dot"]) == 6
