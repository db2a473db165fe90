"""Direction-specific autocast overrides ({scope: {"fwd": policy, "bwd": policy}}): the
CUDA lowering's GEMM dtypes per layer and direction, and gradients equal to a reference
computed by hand (numpy, float64 sums of the stated roundings) for a custom-VJP backward
(autocast(f) differentiated) and for a traced backward (autocast(jax.grad(f))); the
parser's refusals and the Plan's view of such overrides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import precision as mp
from precision import _gemm
from precision._autocast import _rules
from precision.audit import lowered_gemms

F32 = "p=f32,c=f32,o=f32"
F16 = np.dtype(np.float16)
# The hand reference sums in float64 what XLA sums in f32 (other order, other rounding):
# the gradients agree to a few f32 ulps; a direction left in f16 would differ by ~1e-3.
RTOL = 2e-5


def loss(p, x, c):
  with jax.named_scope("l0"):
    h = x @ p["w0"]
  h = jax.nn.relu(h)
  with jax.named_scope("l1"):
    h = h @ p["w1"]
  return jnp.sum(h * c)


def _args():
  k = jax.random.split(jax.random.key(0), 4)
  p = {"w0": jax.random.normal(k[0], (16, 32), jnp.float32) * np.float32(0.3),
       "w1": jax.random.normal(k[1], (32, 4), jnp.float32) * np.float32(0.3)}
  x = jax.random.normal(k[2], (8, 16), jnp.float32)
  c = jax.random.normal(k[3], (8, 4), jnp.float32)
  return p, x, c


def _f16(a) -> np.ndarray:
  """`a` rounded to f16, as float64."""
  return np.asarray(a, np.float32).astype(F16).astype(np.float64)


def _f32(a) -> np.ndarray:
  return np.asarray(np.asarray(a, np.float64).astype(np.float32), np.float64)


def reference(p, x, c, fwd0: str, bwd0: str) -> dict:
  """Gradients of `loss` under f16_mixed with l0's forward GEMM in `fwd0` and its
  backward GEMM in `bwd0` ("f16" or "f32"), l1 in f16 both ways, by hand."""
  w0, w1, x, c = (np.asarray(a, np.float64) for a in (p["w0"], p["w1"], x, c))
  # l0 forward: f16 operands, f32 accumulator rounded to f16; or f32 throughout.
  a0 = _f32(_f16(x) @ _f16(w0)) if fwd0 == "f16" else _f32(x @ w0)
  h0 = _f16(a0) if fwd0 == "f16" else a0
  r0 = np.maximum(h0, 0.0)
  # l1: f16 GEMM; its output's cotangent is c rounded to f16 (the output is f16).
  g1 = _f16(c)
  dw1 = _f32(_f16(r0).T @ g1)
  dr0 = _f32(g1 @ _f16(w1).T)
  g0 = dr0 * (h0 > 0)
  # l0 backward: the cotangent and the original f32 input, or both rounded to f16.
  dw0 = _f32(x.T @ g0) if bwd0 == "f32" else _f32(_f16(x).T @ _f16(g0))
  return {"w0": dw0, "w1": dw1}


def _gemms(fn, *args):
  """{(scope, direction): [(lhs, rhs, out) short dtypes]} of fn's CUDA lowering."""
  out: dict = {}
  for g in lowered_gemms(jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)):
    scope = next(s for s in _rules.scope_of(g.name)[0].split("/") if s in ("l0", "l1"))
    out.setdefault((scope, g.direction), []).append(g.signature())
  return out


def _check(grads, want):
  for k in ("w0", "w1"):
    assert grads[k].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grads[k], np.float64), want[k], rtol=RTOL,
                               atol=1e-6)


@pytest.mark.parametrize("override,fwd0,bwd0", [
    ({"bwd": F32}, "f16", "f32"),
    ({"fwd": F32}, "f32", "f16"),
])
def test_one_direction_of_a_layer_in_f32(override, fwd0, bwd0):
  p, x, c = _args()
  grad = jax.grad(mp.autocast(loss, "f16_mixed", overrides={"l0": override}))
  gemms = _gemms(grad, p, x, c)
  sig = {"f16": ("f16", "f16", "f32"), "f32": ("f32", "f32", "f32")}
  assert gemms[("l0", "fwd")] == [sig[fwd0]]
  assert gemms[("l0", "bwd")] == [sig[bwd0]]   # x is not differentiated: dw0 only
  # l1 unchanged: its two f16 gradient GEMMs (the loss is linear in l1's output, so
  # the gradient needs no l1 forward GEMM: XLA drops it).
  assert gemms[("l1", "bwd")] == [sig["f16"]] * 2 and ("l1", "fwd") not in gemms
  want = reference(p, x, c, fwd0, bwd0)
  _check(jax.jit(grad)(p, x, c), want)
  # The test can fail: l0 left in f16 both ways gives other gradients (dw0 from f16
  # operands; dw1 from l1's f16 inputs, rounded from another l0 forward).
  other = reference(p, x, c, "f16", "f16")
  assert max(np.max(np.abs(other[k] - want[k]) / (np.abs(want[k]) + 1e-3))
             for k in want) > 10 * RTOL


def test_backward_override_reaches_a_traced_backward():
  # autocast(jax.grad(f)): the backward GEMMs are in the traced program, in l0's
  # transpose scope; they take l0's "bwd" policy, its forward GEMM the base one.
  p, x, c = _args()
  g = mp.autocast(jax.grad(loss), "f16_mixed", overrides={"l0": {"bwd": F32}})
  gemms = _gemms(g, p, x, c)
  assert gemms[("l0", "fwd")] == [("f16", "f16", "f32")]
  assert gemms[("l0", "bwd")] == [("f32", "f32", "f32")]
  assert gemms[("l1", "bwd")] == [("f16", "f16", "f32")] * 2
  _check(jax.jit(g)(p, x, c), reference(p, x, c, "f16", "f32"))
  base = mp.autocast(jax.grad(loss), "f16_mixed")
  assert _gemms(base, p, x, c)[("l0", "bwd")] == [("f16", "f16", "f32")]


@pytest.mark.slow  # ~6 s; the dot_general cases above are the fast ones
def test_backward_dtype_of_a_policy_conv():
  # The conv custom VJP: an f16 forward convolution, f32 backward ones on the original
  # operands (checked against lax's own f32 gradients of the f32 operands).
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (2, 9, 3), jnp.float32)
  w = jax.random.normal(k[1], (3, 3, 5), jnp.float32)
  ct = jax.random.normal(k[2], (2, 7, 5), jnp.float32)
  dn = ("NWC", "WIO", "NWC")

  def f(x, w):
    y = _gemm.policy_conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=dn,
                                          compute_dtype=jnp.float16)
    return y

  def g(x, w):
    params = _gemm._canonical_conv_params(x, w, window_strides=(1,), padding="VALID",
                                          dimension_numbers=dn)
    y = _gemm.policy_conv(x, w, params, jnp.float16, backward_dtype=jnp.float32)
    return jnp.sum(y * ct)

  dx, dw = jax.jit(jax.grad(g, (0, 1)))(x, w)
  ref = jax.grad(lambda a, b: jnp.sum(lax.conv_general_dilated(
      a, b, (1,), "VALID", dimension_numbers=dn, precision=lax.Precision.HIGHEST) * ct),
      (0, 1))(x, w)
  np.testing.assert_allclose(np.asarray(dx), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(ref[1]), rtol=1e-5, atol=1e-5)
  # The forward result holds f16 values (in f32, so that the cotangent stays f32).
  params = _gemm._canonical_conv_params(x, w, window_strides=(1,), padding="VALID",
                                        dimension_numbers=dn)
  out = _gemm.policy_conv(x, w, params, jnp.float16, backward_dtype=jnp.float32)
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), np.asarray(f(x, w), np.float32))
  sigs = lambda fn: [s.signature() for s in lowered_gemms(
      jax.export.export(jax.jit(fn), platforms=["cuda"])(x, w))]
  assert sigs(g) == [("f16", "f16", "f32")]
  # (g is linear in y: its gradient needs no forward convolution.)
  assert sigs(jax.grad(g, (0, 1))) == [("f32", "f32", "f32")] * 2


@pytest.mark.parametrize("value,match", [
    ({}, "has no key; accepted: a policy, or a mapping with key \"fwd\" and/or \"bwd\""),
    ({"back": F32}, r"unknown key\(s\) \['back'\]"),
    ({"bwd": "f99"}, "bad 'bwd' policy 'f99'"),
])
def test_bad_directional_overrides_are_refused(value, match):
  with pytest.raises(ValueError, match=match):
    mp.bind("f16_mixed", overrides={"l0": value})
  with pytest.raises(ValueError, match=match):
    mp.autocast(loss, "f16_mixed", overrides={"l0": value})


def test_plan_shows_and_rebinds_directional_overrides():
  plan = mp.bind("f16_mixed", overrides={"l0": {"bwd": F32}, "l1": "f32"})
  assert plan.overrides == {"l0": {"bwd": mp.get_policy(F32)}, "l1": mp.get_policy("f32")}
  assert "overrides {'l0': {'bwd': 'p=f32,c=f32,o=f32'}, 'l1': 'p=f32,c=f32,o=f32'}" in (
      str(plan))
  again = mp.bind("f16_mixed", overrides=plan.overrides)
  assert again.autocast_spec == plan.autocast_spec
  # A pattern matching no scope is refused for a one-direction rule too.
  p, x, c = _args()
  with pytest.raises(ValueError, match="'l9'.*matched no scope"):
    mp.autocast(loss, "f16_mixed", overrides={"l9": {"bwd": F32}})(p, x, c)


def test_nnx_model_marked_with_directional_overrides():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l0 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.l0(x)

  x = jnp.ones((2, 4), jnp.float32)
  plan = mp.bind("f16_mixed", overrides={"l0": {"bwd": F32}})
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan)
  assert model.l0.kernel[...].dtype == jnp.float32   # the "fwd" (here: base) param dtype
  # Under the same plan the trace applies the directions itself.
  sigs = [g.signature() for g in lowered_gemms(jax.export.export(
      jax.jit(lambda x: jax.grad(lambda x: jnp.sum(jnp.tanh(mp.autocast(
          lambda m, x: m(x), plan)(model, x))))(x)), platforms=["cuda"])(x))]
  assert sigs == [("f16", "f16", "f32"), ("f32", "f32", "f32")]
  # Called directly, the marked model runs under its plan: the same GEMMs.
  sigs = [g.signature() for g in lowered_gemms(jax.export.export(jax.jit(jax.grad(
      lambda x: jnp.sum(jnp.tanh(model(x))))), platforms=["cuda"])(x))]
  assert sigs == [("f16", "f16", "f32"), ("f32", "f32", "f32")]
  # A trace without overrides of a model it closes over would adopt them per module,
  # which has no direction.
  with pytest.raises(ValueError, match="direction-specific overrides"):
    mp.autocast(lambda x: model(x), "f16_mixed")(x)
