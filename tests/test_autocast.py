"""precision.autocast: the rules on small programs, gradient accuracy, overrides, control
flow, errors; apply_policy / linen_policy specifics that the zoo does not pin down."""

import concurrent.futures
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import precision as mp

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
MIXED = "p=f32,c=bf16,o=f32"


def _gemms(report):
  return [(g.lhs_dtype, g.rhs_dtype, g.acc_dtype, g.out_dtype) for g in report.gemms]


def _rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _bf16_f64(x) -> np.ndarray:
  """x rounded to bf16 (ml_dtypes, round to nearest even), as exact f64 values."""
  return np.asarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), np.float64)


# ----------------------------------------------------------------------------- gradients


def test_bias_and_kernel_gradients_have_f32_accuracy():
  """nnx.Linear(use_bias=True), Flax's default: the bias gradient is summed in f32 and the
  kernel gradient leaves the f32 accumulator unrounded. The reference is the same
  bf16-rounded operands summed exactly in f64; plain Flax with dtype=bf16 is ~1e-3 off."""
  b, d_in, d_out = 256, 32, 16
  x = jax.random.normal(jax.random.key(0), (b, d_in), F32)
  c = jax.random.normal(jax.random.key(1), (b, d_out), F32)  # the output's cotangent
  loss = lambda m: jnp.sum(m(x).astype(F32) * c)

  layer = mp.flax.apply_policy(nnx.Linear(d_in, d_out, rngs=nnx.Rngs(0)), MIXED)
  grads = nnx.grad(loss)(layer)
  # d bias = sum_b c (c arrives in f32: bias + bf16 GEMM result is an f32 add).
  assert grads["bias"][...].dtype == F32
  assert _rel_err(grads["bias"][...], np.sum(np.asarray(c, np.float64), 0)) <= 1e-6
  # d kernel = bf16(x)^T bf16(c): the policy GEMM rounds the cotangent once, f32 accumulate.
  want = _bf16_f64(x).T @ _bf16_f64(c)
  assert _rel_err(grads["kernel"][...], want) <= 1e-6

  # The same layer written by hand with Flax's dtype argument: bias cast to bf16 first, so
  # its gradient is a bf16 sum. The gate can fail.
  hand = nnx.Linear(d_in, d_out, dtype=BF16, rngs=nnx.Rngs(0))
  with jax.numpy_dtype_promotion("standard"):
    hgrads = nnx.grad(loss)(hand)
  assert _rel_err(hgrads["bias"][...], np.sum(np.asarray(c, np.float64), 0)) > 1e-4


def test_einsum_kernel_and_bias_gradients_have_f32_accuracy():
  b, d, h, k = 128, 16, 2, 8
  layer = nnx.Einsum("bd,dhk->bhk", (d, h, k), (h, k), rngs=nnx.Rngs(0))
  mp.flax.apply_policy(layer, MIXED)
  x = jax.random.normal(jax.random.key(0), (b, d), F32)
  c = jax.random.normal(jax.random.key(1), (b, h, k), F32)
  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(F32) * c))(layer)
  want = np.einsum("bd,bhk->dhk", _bf16_f64(x), _bf16_f64(c))
  assert grads["kernel"][...].dtype == F32
  assert _rel_err(grads["kernel"][...], want) <= 1e-6
  assert _rel_err(grads["bias"][...], np.sum(np.asarray(c, np.float64), 0)) <= 1e-6
  # precision.ops.einsum on an f32 kernel: the cast happens inside the GEMM's VJP too.
  w = jax.random.normal(jax.random.key(2), (d, h, k), F32)
  gw = jax.grad(lambda w: jnp.sum(mp.ops.einsum("bd,dhk->bhk", x.astype(BF16), w,
                                                compute_dtype=BF16).astype(F32) * c))(w)
  assert gw.dtype == F32 and _rel_err(gw, want) <= 1e-6


# ----------------------------------------------------------------------------- rules


def test_gemm_rules_and_result_dtypes():
  x, w = jnp.ones((4, 8), F32), jnp.ones((8, 8), F32)
  f = mp.autocast(lambda x, w: (x @ w, jnp.dot(x.astype(BF16), w.astype(BF16),
                                               preferred_element_type=F32)), MIXED)
  plain, explicit = jax.eval_shape(f, x, w)
  # Output dtype of the function: the policy's (f32); a GEMM that asked for an f32
  # accumulator on bf16 operands keeps it.
  assert plain.dtype == F32 and explicit.dtype == F32
  inner = mp.autocast(lambda x, w: x @ w, "p=f32,c=bf16,o=bf16")
  assert jax.eval_shape(inner, x, w).dtype == BF16
  assert [g[:3] for g in _gemms(mp.audit.audit(f, x, w))] == [
      ("bfloat16", "bfloat16", "float32")] * 2


def test_preferred_element_type_is_honoured_by_policy_gemms():
  # 256 x 256 = 65536 overflows f16 (max 65504) unless the result stays f32.
  a = jnp.full((1, 256), 256.0, F16)
  b = jnp.ones((256, 1), F16)
  dims = (((1,), (0,)), ((), ()))
  dg = mp.flax.PolicyDotGeneral(np.dtype(F16))
  assert np.isinf(float(dg(a, b, dims)[0, 0]))              # result in the compute dtype
  assert float(dg(a, b, dims, preferred_element_type=F32)[0, 0]) == 65536.0
  f = mp.autocast(lambda a, b: jnp.dot(a, b, preferred_element_type=F32), "p=f16,c=f16,o=f32")
  assert float(f(a, b)[0, 0]) == 65536.0


def test_f32_ops_and_promotion_and_explicit_casts():
  def fn(x, w, b):
    h = x @ w                      # bf16 under the policy
    s = jax.nn.softmax(h)          # f32 ops: max, exp, sum, div
    g = jnp.tanh(h) + b[None, :]   # tanh f32; + f32 bias: f32
    r = h.astype(F16)              # an explicit cast is kept
    return s, g, r, h * 2.0        # a weak scalar follows h (bf16)

  x, w, b = jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones((4,))
  s, g, r, h2 = jax.eval_shape(mp.autocast(fn, "p=f32,c=bf16,o=bf16"), x, w, b)
  # Floating results leave in the output dtype; inside, each op kept its own.
  assert {s.dtype, g.dtype, r.dtype, h2.dtype} == {np.dtype(BF16)}
  raw = mp._autocast._api.run(mp._plan.autocast_spec(MIXED), fn, (x, w, b), {})
  assert [o.dtype for o in raw.outputs] == [F32, F32, F16, BF16]
  report = mp.audit.audit(mp.autocast(fn, MIXED), x, w, b)
  f32_ops = {o.primitive: o.dtype for o in report.ops if o.primitive in ("exp", "tanh",
                                                                         "reduce_sum")}
  assert set(f32_ops.values()) == {"float32"} and len(f32_ops) == 3


def test_fp32_ops_choice_is_read():
  fn = lambda x, w: jnp.tanh(x @ w)
  x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
  with_tanh = mp.audit.audit(mp.autocast(fn, MIXED), x, w)
  without = mp.audit.audit(mp.autocast(fn, MIXED, fp32_ops=("softmax",)), x, w)
  assert [o.dtype for o in with_tanh.ops if o.primitive == "tanh"] == ["float32"]
  assert [o.dtype for o in without.ops if o.primitive == "tanh"] == ["bfloat16"]
  recipe = mp.get_recipe("bf16_mixed").replace(fp32_ops=("rms_norm",))
  assert [o.dtype for o in mp.audit.audit(mp.autocast(fn, recipe), x, w).ops
          if o.primitive == "tanh"] == ["bfloat16"]


def test_control_flow_is_recursed_and_carries_keep_dtypes():
  def fn(x, w):
    def body(c, _):
      return jnp.tanh(c @ w), (c @ w).sum()
    c, ys = jax.lax.scan(body, x, None, length=3)
    c = jax.lax.fori_loop(0, 2, lambda i, v: v @ w, c)   # static bounds: a scan
    c = jax.lax.cond(c.sum() > 0, lambda a: a @ w, lambda a: -(a @ w), c)
    c = jax.checkpoint(lambda a: jax.nn.relu(a @ w))(c)
    return jnp.sum(c ** 2) + jnp.sum(ys ** 2)

  x = jax.random.normal(jax.random.key(0), (4, 8), F32)
  w = jax.random.normal(jax.random.key(1), (8, 8), F32) / 3
  plain = jax.jit(jax.value_and_grad(fn, (0, 1)))(x, w)
  same = jax.jit(jax.value_and_grad(mp.autocast(fn, "fp32"), (0, 1)))(x, w)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(same)))
  f = mp.autocast(fn, MIXED)
  report = mp.audit.audit(jax.value_and_grad(f, (0, 1)), x, w)
  assert report.gemms and {g[:3] for g in _gemms(report)} == {
      ("bfloat16", "bfloat16", "float32")}
  report.check(MIXED)
  loss, _ = jax.jit(jax.value_and_grad(f, (0, 1)))(x, w)
  assert abs(float(loss) - float(plain[0])) <= 2e-2 * abs(float(plain[0]))

  # while_loop (forward only): its body is rewritten, its carry keeps the traced f32.
  def loop(x, w):
    return jax.lax.while_loop(lambda v: v[0] < 2, lambda v: (v[0] + 1, v[1] @ w), (0, x))[1]

  report = mp.audit.audit(mp.autocast(loop, MIXED), x, w)
  assert report.has_while and {g[:3] for g in _gemms(report)} == {
      ("bfloat16", "bfloat16", "float32")}
  assert mp.autocast(loop, "p=f32,c=bf16,o=bf16")(x, w).dtype == BF16
  assert mp._autocast._api.run(mp._plan.autocast_spec(MIXED), loop, (x, w),
                               {}).outputs.dtype == F32  # the carry

def test_custom_jvp_rule_is_kept_and_custom_vjp_runs_as_written():
  @jax.custom_vjp
  def own(x, w):
    return x @ w

  own.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
  x, w = jnp.array([[0.0, 1.0, -1.0, 2.0]]), jnp.eye(4)
  f = mp.autocast(lambda x, w: jnp.sum(jax.nn.relu(x @ w)) + jnp.sum(own(x, w)), MIXED)
  gx = jax.grad(f)(x, w)
  # relu's custom JVP (derivative 0 at 0) survives the rewrite; own() adds 1.
  np.testing.assert_array_equal(np.asarray(gx), [[1.0, 2.0, 1.0, 2.0]])
  report = mp.audit.audit(jax.grad(f, (0, 1)), x, w)
  assert ("float32", "float32", "float32", "float32") in _gemms(report)  # inside own()
  assert ("bfloat16", "bfloat16", "float32", "float32") in _gemms(report)


# ----------------------------------------------------------------------------- overrides


def test_overrides_by_named_scope_and_module_type():
  def fn(x, w):
    with jax.named_scope("head"):
      y = x @ w
    return jnp.sum((x @ w) * y)

  x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
  report = mp.audit.audit(jax.grad(mp.autocast(fn, MIXED, {"head": "f32"}), 1), x, w)
  by_scope = {g.scope: g.lhs_dtype for g in report.gemms}
  assert by_scope["head"] == "float32" and "bfloat16" in by_scope.values()
  with pytest.raises(ValueError, match="'haed'.*'head'"):
    mp.autocast(fn, MIXED, {"haed": "f32"})(x, w)

  class Net(nnx.Module):
    def __init__(self):
      self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.b = nnx.Einsum("bd,de->be", (4, 4), rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.b(self.a(x))

  net = mp.flax.apply_policy(Net(), MIXED, {nnx.Linear: "f32"})
  report = mp.audit.audit(lambda m, x: m(x), net, x)
  assert {g.scope.split("/")[0]: g.lhs_dtype for g in report.gemms} == {
      "a": "float32", "b": "bfloat16"}


def test_module_scopes_and_type_overrides_in_another_thread():
  """NNX module paths (and so overrides by module type and the audit's scopes) come from a
  hook registered once at import: a trace in a worker thread sees them too."""

  class Net(nnx.Module):
    def __init__(self):
      self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
      return self.b(self.a(x))

  def scopes():
    net = mp.flax.apply_policy(Net(), MIXED, {"b": "f32"})
    report = mp.audit.audit(lambda m, x: m(x), net, jnp.ones((2, 4)))
    return {g.scope.split("/")[0]: g.lhs_dtype for g in report.gemms}

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    in_thread = pool.submit(scopes).result()
  assert in_thread == scopes() == {"a": "bfloat16", "b": "float32"}


def test_linen_overrides_types_and_bad_pattern():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4, name="head")(nn.Dense(4, name="body")(x))

  x = jnp.ones((2, 4))
  with mp.flax.linen_policy(MIXED, {nn.Dense: "f32"}):
    v = Net().init(jax.random.key(0), x)
    report = mp.audit.audit(lambda v, x: Net().apply(v, x), v, x)
  assert {g.lhs_dtype for g in report.gemms} == {"float32"}
  with pytest.raises(ValueError, match="hed"):
    with mp.flax.linen_policy(MIXED, {"hed": "f32"}):
      Net().apply(v, x)


# ----------------------------------------------------------------------------- front ends


def test_subclassed_layer_keeps_its_class_code_and_attributes():
  import _zoo
  model = _zoo.GemmaStyleLM(rngs=nnx.Rngs(0))
  mp.flax.apply_recipe(model, "bf16_mixed")
  assert type(model.embed) is _zoo.ScaledEmbed and model.embed.embed_dim == _zoo.D
  tokens = jnp.zeros((1, 4), jnp.int32)
  with jax.numpy_rank_promotion("allow"):
    plain = _zoo.GemmaStyleLM(rngs=nnx.Rngs(0)).embed(tokens)
  # The subclass's own __call__ (the sqrt(d) scale) still runs.
  np.testing.assert_allclose(np.asarray(plain), np.asarray(
      nnx.Embed(_zoo.VOCAB, _zoo.D, rngs=nnx.Rngs(0))(tokens)) * np.sqrt(_zoo.D), rtol=1e-6)


def test_nnx_state_updates_under_bf16_keep_their_dtype():
  model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
                         nnx.BatchNorm(8, use_running_average=False, rngs=nnx.Rngs(0)))
  mp.flax.apply_policy(model, MIXED)
  x = jax.random.normal(jax.random.key(0), (16, 4))
  model(x)
  mean = model.layers[1].mean[...]
  assert mean.dtype == F32 and float(jnp.abs(mean).sum()) > 0


def test_linen_bf16_init_is_the_f32_init_rounded():
  model = nn.Sequential([nn.Dense(16), nn.LayerNorm(), nn.Dense(4)])
  x = jnp.ones((2, 8))
  f32 = model.init(jax.random.key(3), x)["params"]
  with mp.flax.linen_policy("p=bf16,c=bf16,o=f32"):
    bf16 = model.init(jax.random.key(3), x)["params"]
  for a, b in zip(jax.tree.leaves(f32), jax.tree.leaves(bf16)):
    assert b.dtype == BF16
    np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16), np.asarray(b))


# ----------------------------------------------------------------------------- errors


def test_fp8_compute_dtype_and_fp8_recipe_are_refused_clearly():
  with pytest.raises(ValueError, match="fp8 recipe"):
    mp.autocast(lambda x: x, "p=f32,c=e4m3")
  with pytest.raises(ValueError, match="fp8 recipe"):
    mp.flax.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "p=f32,c=e4m3")
  with pytest.raises(ValueError, match="fp8 recipe"):
    mp.flax.policy_dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (((1,), (0,)), ((), ())),
                               jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match="override .*blocks.*fp8 recipe"):
    mp.autocast(lambda x: x, MIXED, {"blocks": "p=f32,c=e5m2"})
  # fp8_hybrid's delayed scaling needs explicit state (tests/test_fp8_autocast.py).
  with pytest.raises(ValueError, match=r"delayed scaling.*fp8_state=True.*scaling='current'"):
    mp.autocast(lambda x: x, "fp8_hybrid")
  with pytest.raises(ValueError, match="unknown op name.*'softmx'"):
    mp.autocast(lambda x: x, MIXED, fp32_ops=("softmx",))
