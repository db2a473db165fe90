"""fp8 recipes through precision.autocast, for functions that are not NNX models.

Checked on a plain-JAX MLP ``loss(params, x, y)`` and a Linen model applied inside a
function: which GEMMs run in fp8 (forward E4M3 x E4M3, backward E5M2 cotangent x E4M3;
the first and last GEMM and keep_high_precision scopes in bf16), the loss and gradients
against a hand-written reference built from `precision.fp8.fp8_dot_general` and
`precision.flax.policy_dot_general`, one fp8 GEMM against an ml_dtypes reference,
training, hand-written attention (q.k and p.v stay bf16), an unmodified NNX model,
delayed scaling with explicit state (forward histories and the gradient operand's state
through the cotangent; one state per iteration of a scan over layers, through remat),
loops and branches, errors, and the CUDA lowering.
"""

import contextlib
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import precision as mp
import precision.flax  # noqa: F401  (mp.flax)
from precision.audit import lower

DIMS = (8, 16, 24, 32, 4)   # every layer's kernel has its own shape
DN = (((1,), (0,)), ((), ()))
E4M3, E5M2, BF16 = "float8_e4m3fn", "float8_e5m2", "bfloat16"


def _recipe(**fp8):
  return mp.Recipe("fp8_test", "p=f32,c=bf16,o=f32", fp8=mp.Fp8Config(**fp8))


CURRENT = _recipe(scaling="current")


def _params(seed=0):
  ks = jax.random.split(jax.random.key(seed), len(DIMS))
  return [{"w": jax.random.normal(ks[i], (DIMS[i], DIMS[i + 1])) / np.sqrt(DIMS[i]),
           "b": jnp.full((DIMS[i + 1],), 0.01 * i)} for i in range(len(DIMS) - 1)]


def _data(seed=1, n=6):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, DIMS[0])), jax.random.normal(ky, (n, DIMS[-1]))


def mlp_loss(params, x, y, scoped=False):
  """Written with no dtype in mind; `scoped`: each layer in a jax.named_scope."""
  h = x
  for i, p in enumerate(params):
    with jax.named_scope(f"layer{i}") if scoped else contextlib.nullcontext():
      h = h @ p["w"] + p["b"][None, :]
      if i < len(params) - 1:
        h = jax.nn.relu(h)
  return jnp.mean((h - y) ** 2)


def _dots(jaxpr, out=None):
  """(lhs dtype, rhs dtype, lhs shape, rhs shape, out shape) of every dot_general."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name == "dot_general":
      a, b = e.invars[:2]
      out.append((str(a.aval.dtype), str(b.aval.dtype), tuple(a.aval.shape),
                  tuple(b.aval.shape), tuple(e.outvars[0].aval.shape)))
    for v in e.params.values():
      for q in v if isinstance(v, (tuple, list)) else (v,):
        inner = getattr(q, "jaxpr", q)
        if hasattr(inner, "eqns"):
          _dots(inner, out)
  return out


def _layer_of(dot):
  """The MLP layer a GEMM belongs to: its kernel's shape (or the transpose) is an operand
  or the result (forward, dgrad: operand; wgrad: result)."""
  shapes = set(dot[2:5])
  (layer,) = [k for k in range(len(DIMS) - 1)
              if {(DIMS[k], DIMS[k + 1]), (DIMS[k + 1], DIMS[k])} & shapes]
  return layer


def _layers(fn, *args):
  """{layer: sorted (lhs, rhs) dtype pairs of its GEMMs} of value_and_grad(fn); CPU-only
  f32 copies of the bf16 GEMMs (the policy GEMM's platform branch) left out."""
  found = {}
  for d in _dots(jax.make_jaxpr(jax.value_and_grad(fn))(*args).jaxpr):
    if d[0] != "float32":
      found.setdefault(_layer_of(d), []).append(tuple(sorted(d[:2])))
  return {k: sorted(v) for k, v in found.items()}


def _fp8_layers(fn, *args, layers=None):
  """{layer: sorted dtype pairs of its fp8 GEMMs} of value_and_grad(fn) (or of `layers`,
  a `_layers` result)."""
  out = {}
  for k, pairs in (layers or _layers(fn, *args)).items():
    fp8 = [p for p in pairs if "float8" in p[0] + p[1]]
    if fp8:
      out[k] = fp8
  return out


# Per fp8 layer: one forward E4M3 x E4M3 GEMM and two backward E5M2 x E4M3 GEMMs.
FP8_LAYER = sorted([(E4M3, E4M3), (E4M3, E5M2), (E4M3, E5M2)])


def _ref_loss(params, x, y, fp8_layers=(1, 2), config=CURRENT.fp8):
  """The MLP under the recipe written by hand: the fp8 layers through fp8_dot_general
  (fresh state: current scaling), the others through the policy's bf16 GEMM; the bf16
  GEMM result meets the f32 bias in f32, as autocast promotes it."""
  spec = mp.fp8.Fp8Spec.from_config(config)
  state = {str(i): spec.init_state() for i in fp8_layers}
  return _ref_with_state(params, state, x, y, spec)[0]


def _close(a, b, rtol):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32),
                               rtol=rtol, atol=rtol * float(np.max(np.abs(v)) + 1e-30))


# ----------------------------------------------------------------------------- plain JAX


def test_mlp_middle_layers_run_fp8_forward_and_backward():
  params, (x, y) = _params(), _data()
  layers = _layers(mp.autocast(mlp_loss, CURRENT), params, x, y)
  assert _fp8_layers(None, layers=layers) == {1: FP8_LAYER, 2: FP8_LAYER}
  # The first and last layer: bf16 GEMMs in both directions.
  assert layers[0] == layers[3] == [(BF16, BF16)] * 3, layers
  sites = mp.fp8.autocast_gemms(mlp_loss, CURRENT, params, x, y)
  assert [(s.key, s.fp8) for s in sites] == [("0", False), ("1", True), ("2", True),
                                             ("3", False)]
  assert "first GEMM" in sites[0].reason and "last GEMM" in sites[3].reason
  assert [s.rhs_shape for s in sites] == [(DIMS[i], DIMS[i + 1]) for i in range(4)]


def test_mlp_loss_and_grads_equal_the_hand_written_reference():
  params, (x, y) = _params(), _data()
  f = mp.autocast(mlp_loss, CURRENT)
  value, grads = jax.jit(jax.value_and_grad(f))(params, x, y)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(_ref_loss))(params, x, y)
  assert value.dtype == jnp.float32
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  _close(grads, ref_grads, 1e-5)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  # fp8 changes the numbers: the reference is not just the bf16 recipe.
  bf16 = mp.autocast(mlp_loss, "bf16_mixed")(params, x, y)
  assert abs(float(bf16) - float(value)) > 1e-4


def test_one_fp8_gemm_against_an_ml_dtypes_reference():
  """x @ I @ w @ I: the identity GEMMs (first and last, bf16) round to bf16 and change
  nothing else, so the result is the middle fp8 GEMM of bf16(x), rounded to bf16."""
  kx, kw = jax.random.split(jax.random.key(3))
  x = jax.random.normal(kx, (5, 16)) * 3.0
  w = jax.random.normal(kw, (16, 12)) * 0.2
  eye_in, eye_out = jnp.eye(16), jnp.eye(12)
  f = mp.autocast(lambda x, w: (x @ eye_in) @ w @ eye_out, CURRENT)
  got = np.asarray(jax.jit(f)(x, w), np.float32)

  def quantize(a):
    a = np.asarray(a, np.float32)
    scale = np.float32(1.0) / (np.float32(448.0) / np.max(np.abs(a)))  # scale_from_amax
    q = np.clip(a / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32), scale

  xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
  (qx, sx), (qw, sw) = quantize(xb), quantize(w)
  want = ((qx @ qw) * (sx * sw)).astype(ml_dtypes.bfloat16).astype(np.float32)
  # Products of fp8 values are exact in f32; only the summation order may differ, so at
  # most one bf16 rounding step apart.
  np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-6)
  assert np.mean(got == want) > 0.95


def test_mlp_trains_20_sgd_steps():
  params, (x, y) = _params(), _data(n=16)
  vg = jax.jit(jax.value_and_grad(mp.autocast(mlp_loss, CURRENT)))
  losses = []
  for _ in range(20):
    value, grads = vg(params, x, y)
    losses.append(float(value))
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("scaling", ["per_channel", "block"])
def test_other_stateless_scalings(scaling):
  """The same routing (the gradients' path is checked under current scaling above and
  fp8_dot_general's own per-scaling backward in tests/test_fp8.py): the loss equals the
  reference's, and the backward GEMMs are fp8."""
  params, (x, y) = _params(), _data()
  r = _recipe(scaling=scaling, activation_block=(1, 8), weight_block=(8, 8))
  f = mp.autocast(mlp_loss, r)
  np.testing.assert_allclose(jax.jit(f)(params, x, y),
                             jax.jit(lambda *a: _ref_loss(*a, config=r.fp8))(params, x, y),
                             rtol=1e-6)
  assert [s.fp8 for s in mp.fp8.autocast_gemms(mlp_loss, r, params, x, y)] == [
      False, True, True, False]
  fp8_dots = [d for d in _dots(jax.make_jaxpr(jax.grad(f))(params, x, y).jaxpr)
              if "float8" in d[0] + d[1]]
  assert {tuple(sorted(d[:2])) for d in fp8_dots} == {(E4M3, E4M3), (E4M3, E5M2)}


# ----------------------------------------------------------------------------- selection


def test_keep_high_precision_matches_named_scopes():
  params, (x, y) = _params(), _data()
  fn = lambda p, x, y: mlp_loss(p, x, y, scoped=True)
  kept = _recipe(scaling="current", keep_high_precision=("*layer2*",))
  assert set(_fp8_layers(mp.autocast(fn, kept), params, x, y)) == {1}
  sites = {s.scope: s for s in mp.fp8.autocast_gemms(fn, kept, params, x, y)}
  assert set(sites) == {"layer0", "layer1", "layer2", "layer3"}
  assert "'*layer2*'" in sites["layer2"].reason and sites["layer1"].key == "1:layer1"
  # Numbers: layer 2 as the bf16 policy GEMM.
  np.testing.assert_allclose(jax.jit(mp.autocast(fn, kept))(params, x, y),
                             jax.jit(_ref_loss, static_argnames="fp8_layers")(
                                 params, x, y, fp8_layers=(1,)), rtol=1e-6)
  # A scope prefix matches too, as override patterns do.
  outer = lambda p, x, y: _in_scope("block", fn, p, x, y)
  r = _recipe(scaling="current", keep_high_precision=("block",))
  assert not any(s.fp8 for s in mp.fp8.autocast_gemms(outer, r, params, x, y))


def _in_scope(name, fn, *args):
  with jax.named_scope(name):
    return fn(*args)


def test_keep_first_last_off_and_overrides():
  params, (x, y) = _params(), _data()
  fn = lambda p, x, y: mlp_loss(p, x, y, scoped=True)
  every = _recipe(scaling="current", keep_first_last=False)
  assert set(_fp8_layers(mp.autocast(fn, every), params, x, y)) == {0, 1, 2, 3}
  np.testing.assert_allclose(jax.jit(mp.autocast(fn, every))(params, x, y),
                             jax.jit(_ref_loss, static_argnames="fp8_layers")(
                                 params, x, y, fp8_layers=(0, 1, 2, 3)), rtol=1e-6)
  # An override gives layer1 its own policy (f32): no fp8 there.
  f = mp.autocast(fn, CURRENT, {"layer1": "p=f32,c=f32"})
  assert set(_fp8_layers(f, params, x, y)) == {2}
  sites = mp.fp8.autocast_gemms(fn, CURRENT, params, x, y, overrides={"layer1": "p=f32,c=f32"})
  assert "override" in sites[1].reason and not sites[1].fp8


def test_attention_batched_gemms_stay_in_the_compute_dtype():
  """Attention written by hand (einsum, jax.nn.softmax): the projections are fp8 (but the
  first, q, and the last, the head), q.k and p.v (two activations) are not."""
  ks = jax.random.split(jax.random.key(6), 6)
  d = 8
  params = {n: jax.random.normal(k, (d, d)) / np.sqrt(d)
            for n, k in zip(("q", "k", "v", "o", "head"), ks)}
  x = jax.random.normal(ks[5], (2, 5, d))

  def fn(params, x):
    q, k, v = (jnp.einsum("bsd,de->bse", x, params[n]) for n in "qkv")
    probs = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(d), axis=-1)
    o = jnp.einsum("bqk,bkd->bqd", probs, v)
    return jnp.mean(jnp.einsum("bsd,de->bse", o @ params["o"], params["head"]) ** 2)

  sites = mp.fp8.autocast_gemms(fn, CURRENT, params, x)
  assert [s.fp8 for s in sites] == [False, True, True, False, False, True, False]
  assert "first" in sites[0].reason and "last" in sites[6].reason
  assert all("activations" in sites[i].reason for i in (3, 4))
  value, grads = jax.jit(jax.value_and_grad(mp.autocast(fn, CURRENT)))(params, x)
  assert np.isfinite(float(value)) and all(g.dtype == jnp.float32 for g in grads.values())


def test_convolutions_and_loops():
  """Convolutions stay bf16; a GEMM in a scan body is fp8 under current scaling (and not
  a first/last candidate), in the compute dtype under delayed scaling (stated)."""
  w_in, w_loop, w_out = jnp.full((4, 8), 0.1), jnp.full((8, 8), 0.05), jnp.full((8, 2), 0.1)
  kernel = jnp.full((3, 1, 1), 0.2)

  def fn(x):
    h = x @ w_in
    h = jax.lax.conv_general_dilated(h[:, None, :], kernel, (1,), "SAME")[:, 0, :]
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w_loop), None), h, None, length=3)
    return jnp.sum(h @ w_out)

  x = jnp.ones((2, 4))
  dots = _dots(jax.make_jaxpr(jax.grad(mp.autocast(fn, CURRENT)))(x).jaxpr)
  fp8 = [d for d in dots if "float8" in d[0] + d[1]]
  assert len(fp8) == 3 and all((8, 8) in d[2:5] for d in fp8), fp8  # the loop's GEMM
  assert {(d[0], d[1]) for d in fp8} == {(E4M3, E4M3), (E5M2, E4M3)}
  sites = mp.fp8.autocast_gemms(fn, CURRENT, x)
  assert [s.fp8 for s in sites] == [False, True, False]
  convs = [e for e in jax.make_jaxpr(mp.autocast(fn, CURRENT))(x).jaxpr.eqns
           if e.primitive.name == "custom_vjp_call"]
  assert convs  # the conv is the policy's custom-VJP bf16 convolution, not fp8
  # Delayed scaling: the scan's GEMM has one state per iteration; a while loop's GEMM
  # (no static trip count) stays in the compute dtype, and says why.
  delayed = _recipe(scaling="delayed")
  assert [s.fp8 for s in mp.fp8.autocast_gemms(fn, delayed, x)] == [False, True, False]

  def with_while(x):
    h = x @ w_in
    h = jax.lax.fori_loop(0, jnp.int32(3), lambda i, c: jnp.tanh(c @ w_loop), h)
    return jnp.sum(h @ w_out)

  sites = mp.fp8.autocast_gemms(with_while, delayed, x)
  assert not sites[1].fp8 and "while body" in sites[1].reason, sites
  assert mp.fp8.autocast_gemms(with_while, CURRENT, x)[1].fp8

  def with_cond(x):
    h = x @ w_in
    h = jax.lax.cond(jnp.sum(x) > 0, lambda h: jnp.tanh(h @ w_loop), jnp.tanh, h)
    return jnp.sum(h @ w_out)

  assert mp.fp8.autocast_gemms(with_cond, CURRENT, x)[1].fp8
  # Delayed: the branch's GEMM has state; it moves when the branch runs, else stays.
  assert [s.fp8 for s in mp.fp8.autocast_gemms(with_cond, delayed, x)] == [False, True, False]
  vg = jax.jit(mp.value_and_grad(mp.autocast(with_cond, delayed, fp8_state=True)))
  state = mp.fp8.init_state(with_cond, delayed, x)
  _, _, taken = vg(state, x)
  _, _, skipped = vg(state, -x)
  assert float(taken["1"].lhs.amax_history[0]) > 0 and float(taken["1"].grad.amax_history[0]) > 0
  _close(skipped, state, 0.0)


# ----------------------------------------------------------------------------- Linen


class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(DIMS[1], name="stem")(x)
    for i in (2, 3):
      x = nn.Dense(DIMS[i], name=f"mid{i}")(jax.nn.relu(x))
    return nn.Dense(DIMS[4], name="head")(jax.nn.relu(x))


def _linen():
  model = LinenMLP()
  x, y = _data()
  variables = model.init(jax.random.key(0), x)

  def loss(variables, x, y):
    return jnp.mean((model.apply(variables, x) - y) ** 2)

  return loss, variables, x, y


def _linen_as_params(variables):
  v = variables["params"]
  return [{"w": v[n]["kernel"], "b": v[n]["bias"]} for n in ("stem", "mid2", "mid3", "head")]


def test_linen_model_inside_a_function():
  loss, variables, x, y = _linen()
  f = mp.autocast(loss, CURRENT)
  assert _fp8_layers(f, variables, x, y) == {1: FP8_LAYER, 2: FP8_LAYER}
  sites = mp.fp8.autocast_gemms(loss, CURRENT, variables, x, y)
  assert [(s.scope, s.fp8) for s in sites] == [
      ("LinenMLP/stem", False), ("LinenMLP/mid2", True), ("LinenMLP/mid3", True),
      ("LinenMLP/head", False)]

  def ref(variables, x, y):   # relu before the layer, as LinenMLP writes it
    params = _linen_as_params(variables)
    spec = mp.fp8.Fp8Spec.from_config(CURRENT.fp8)
    h = x
    for i, p in enumerate(params):
      if i:
        h = jnp.maximum(h, 0.0)
      if i in (1, 2):
        z, _ = mp.fp8.fp8_dot_general(h, p["w"], DN, spec.init_state(), spec,
                                      out_dtype=jnp.bfloat16)
      else:
        z = mp.flax.policy_dot_general(h, p["w"], DN, jnp.bfloat16)
      h = z.astype(jnp.float32) + p["b"][None, :]
    return jnp.mean((h - y) ** 2)

  vg = jax.jit(jax.value_and_grad(f))
  value, grads = vg(variables, x, y)
  ref_value, ref_grads = jax.jit(jax.value_and_grad(ref))(variables, x, y)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  _close(grads, ref_grads, 1e-5)
  # Trains; a keep pattern on a Linen module name is honoured.
  first = float(value)
  for _ in range(20):
    value, grads = vg(variables, x, y)
    variables = jax.tree.map(lambda p, g: p - 0.1 * g, variables, grads)
  assert float(value) < 0.8 * first
  kept = _recipe(scaling="current", keep_high_precision=("*mid3",))
  assert set(_fp8_layers(mp.autocast(loss, kept), variables, x, y)) == {1}


def test_unmodified_nnx_model_passed_to_autocast():
  """An NNX model written without the library, called inside the function: its module
  paths are the scopes; its Linear layers' GEMMs go fp8 except the first and last."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(DIMS[i], DIMS[i + 1], rngs=rngs)
                              for i in range(len(DIMS) - 1)])

    def __call__(self, x):
      for layer in self.layers[:-1]:
        x = jax.nn.relu(layer(x))
      return self.layers[-1](x)

  net, (x, y) = Net(nnx.Rngs(0)), _data()
  loss = lambda m, x, y: jnp.mean((m(x) - y) ** 2)
  sites = mp.fp8.autocast_gemms(loss, CURRENT, net, x, y)
  assert [(s.scope, s.fp8) for s in sites] == [
      (f"layers/{i}", i in (1, 2)) for i in range(len(DIMS) - 1)]
  dots = _dots(jax.make_jaxpr(mp.autocast(loss, CURRENT))(net, x, y).jaxpr)
  assert sum(d[0] == d[1] == E4M3 for d in dots) == 2


# ----------------------------------------------------------------------------- delayed


def _ref_with_state(params, state, x, y, spec):
  """The MLP with explicit fp8 state per middle layer: (loss, new state)."""
  h, new = x, {}
  for i, p in enumerate(params):
    key = str(i)
    if key in state:
      z, new[key] = mp.fp8.fp8_dot_general(h, p["w"], DN, state[key], spec,
                                           out_dtype=jnp.bfloat16)
    else:
      z = mp.flax.policy_dot_general(h, p["w"], DN, jnp.bfloat16)
    h = z.astype(jnp.float32) + p["b"][None, :]
    if i < len(params) - 1:
      h = jnp.maximum(h, 0.0)
  return jnp.mean((h - y) ** 2), new


def test_delayed_scaling_with_explicit_state():
  params, (x, y) = _params(), _data()
  recipe = _recipe(scaling="delayed", amax_history_len=4)
  spec = mp.fp8.Fp8Spec.from_config(recipe.fp8)
  state = mp.fp8.init_state(mlp_loss, recipe, params, x, y)
  assert sorted(state) == ["1", "2"]
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state))
  assert state["1"].lhs.amax_history.shape == (4,)
  g = mp.autocast(mlp_loss, recipe, fp8_state=True)
  assert jax.tree.map(jnp.shape, g.init_state(params, x, y)) == jax.tree.map(jnp.shape, state)
  vg = jax.jit(mp.value_and_grad(mp.autocast(mlp_loss, recipe, fp8_state=True)))
  ref_vg = jax.jit(jax.value_and_grad(
      lambda p, s: _ref_with_state(p, s, x, y, spec), argnums=(0, 1), has_aux=True))
  ref_state = state
  for step in range(3):
    value, grads, state = vg(state, params, x, y)
    (ref_value, ref_new), (ref_grads, ref_cts) = ref_vg(params, ref_state)
    ref_state = {k: v._replace(grad=ref_cts[k].grad) for k, v in ref_new.items()}
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    _close(grads, ref_grads, 1e-5)
    _close(state, ref_state, 1e-6)
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  # Histories hold the three steps' amaxes (index 0 newest, Transformer Engine's roll).
  for key in state:
    for op in ("lhs", "rhs", "grad"):
      hist = np.asarray(getattr(state[key], op).amax_history)
      assert np.all(hist[[0, 2, 3]] > 0) and hist[1] == 0, (key, op, hist)
  assert float(state["1"].grad.scale) != 1.0 and float(state["1"].lhs.scale) != 1.0


def test_delayed_state_per_scan_iteration_and_through_remat():
  """A scan over stacked layers, each layer's GEMM under jax.checkpoint: one state per
  layer (leading axis = scan length), equal to a hand-written scan of fp8_dot_general
  over (kernel, state) pairs, gradient state through the cotangent included."""
  n_layers = 3
  ks = jax.random.split(jax.random.key(4), 3)
  params = (jax.random.normal(ks[0], (4, 8)),
            jax.random.normal(ks[1], (n_layers, 8, 8)) / np.sqrt(8),
            jax.random.normal(ks[2], (8, 2)) / np.sqrt(8))
  x, y = jax.random.normal(jax.random.key(5), (5, 4)), jnp.zeros((5, 2))

  def loss(params, x, y):
    w_in, ws, w_out = params
    layer = lambda h, w: (jnp.tanh(jax.checkpoint(lambda h, w: h @ w)(h, w)), None)
    h, _ = jax.lax.scan(layer, x @ w_in, ws)
    return jnp.mean((h @ w_out - y) ** 2)

  recipe = _recipe(scaling="delayed", amax_history_len=2)
  spec = mp.fp8.Fp8Spec.from_config(recipe.fp8)
  state = mp.fp8.init_state(loss, recipe, params, x, y)
  assert list(state) == ["1"] and state["1"].grad.amax_history.shape == (n_layers, 2)
  assert state["1"].rhs.scale.shape == (n_layers,)

  def ref(params, st):
    w_in, ws, w_out = params
    bf16 = lambda a, b: mp.flax.policy_dot_general(a, b, DN, jnp.bfloat16)

    def layer(h, w_st):
      z, new = mp.fp8.fp8_dot_general(h, w_st[0], DN, w_st[1], spec, out_dtype=jnp.bfloat16)
      return jnp.tanh(z.astype(jnp.float32)), new

    # The scan carry keeps its traced dtype (f32), as autocast keeps loop carries.
    h, new = jax.lax.scan(layer, bf16(x, w_in).astype(jnp.float32), (ws, st["1"]))
    return jnp.mean((bf16(h, w_out).astype(jnp.float32) - y) ** 2), {"1": new}

  vg = jax.jit(mp.value_and_grad(mp.autocast(loss, recipe, fp8_state=True)))
  ref_vg = jax.jit(jax.value_and_grad(ref, argnums=(0, 1), has_aux=True))
  ref_state = state
  for _ in range(3):
    value, grads, state = vg(state, params, x, y)
    (ref_value, ref_new), (ref_grads, ref_cts) = ref_vg(params, ref_state)
    ref_state = {"1": ref_new["1"]._replace(grad=ref_cts["1"].grad)}
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    _close(grads, ref_grads, 1e-4)
    _close(state, ref_state, 1e-5)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
  # Every layer has its own, nonzero, history.
  hist = np.asarray(state["1"].grad.amax_history)
  assert np.all(hist > 0) and len(set(hist[:, 0].tolist())) == n_layers
  m = mp.fp8.fp8_metrics(state)   # per site: iterations' max amax, summed counts
  assert float(m["1/grad_amax"]) == float(hist[:, 0].max()) and float(m["fp8/gemms"]) == 1
  assert float(m["fp8/saturated"]) == float(sum(
      np.sum(getattr(state["1"], op).saturated) for op in ("lhs", "rhs", "grad")))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(8, name="fc")(h)), None


class _ScannedLinen(nn.Module):
  """Linen's own lifted transforms: nn.scan over nn.remat blocks (stacked params)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(8, name="stem")(x)
    blocks = nn.scan(nn.remat(_Block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)
    h, _ = blocks(name="blocks")(h, None)
    return nn.Dense(2, name="head")(h)


def test_delayed_state_for_linen_scan_over_remat_blocks():
  model, (x, y) = _ScannedLinen(), _data()
  x, y = x[:, :5], y[:, :2]
  variables = model.init(jax.random.key(0), x)
  loss = lambda v, x, y: jnp.mean((model.apply(v, x) - y) ** 2)
  sites = mp.fp8.autocast_gemms(loss, "fp8_hybrid", variables, x, y)
  assert [(s.key, s.fp8) for s in sites] == [
      ("0:_ScannedLinen/stem", False), ("1:_ScannedLinen/blocks/fc", True),
      ("2:_ScannedLinen/head", False)]
  state = mp.fp8.init_state(loss, "fp8_hybrid", variables, x, y)
  assert state["1:_ScannedLinen/blocks/fc"].rhs.amax_history.shape == (3, 1024)
  value, grads, state = jax.jit(mp.value_and_grad(
      mp.autocast(loss, "fp8_hybrid", fp8_state=True)))(
      state, variables, x, y)
  st = state["1:_ScannedLinen/blocks/fc"]
  assert np.isfinite(float(value)) and np.all(np.asarray(st.grad.amax_history[:, 0]) > 0)
  kernel = variables["params"]["blocks"]["fc"]["kernel"]
  np.testing.assert_allclose(st.rhs.amax_history[:, 0], jnp.max(jnp.abs(kernel), axis=(1, 2)),
                             rtol=0)  # each layer's own kernel amax, in f32


def test_delayed_scaling_trains_and_state_survives_jit():
  params, (x, y) = _params(), _data(n=16)
  vg = jax.jit(mp.value_and_grad(mp.autocast(mlp_loss, "fp8_hybrid", fp8_state=True)))
  state = mp.fp8.init_state(mlp_loss, "fp8_hybrid", params, x, y)
  losses = []
  for _ in range(20):
    value, grads, state = vg(state, params, x, y)
    losses.append(float(value))
    params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses
  assert float(state["2"].grad.amax_history[0]) > 0


def test_fp8_state_under_plain_jax_value_and_grad():
  """The documented pattern without the helper: differentiate w.r.t. the state too and
  merge; a GEMM outside the differentiated value keeps its gradient state."""
  params, (x, y) = _params(), _data()
  recipe = _recipe(scaling="delayed", amax_history_len=2)
  g = mp.autocast(mlp_loss, recipe, fp8_state=True)
  assert list(inspect.signature(g).parameters)[:3] == ["fp8_state", "params", "x"]
  state = g.init_state(params, x, y)
  (value, new), (grads, cts) = jax.jit(jax.value_and_grad(g, (1, 0), has_aux=True))(
      state, params, x, y)
  merged = mp.fp8.merge_grad_state(new, cts)
  assert float(merged["1"].grad.amax_history[0]) > 0
  # A skipped step's state rolls back bit for bit (a plain pytree).
  _close(mp.fp8.rollback_fp8_state(merged, state, jnp.bool_(True)), state, 0.0)
  # Without differentiation: forward state new, gradient state unchanged.
  out, fwd_only = jax.jit(g)(state, params, x, y)
  np.testing.assert_allclose(out, value, rtol=0)
  assert float(fwd_only["1"].lhs.amax_history[0]) > 0
  assert float(fwd_only["1"].grad.amax_history[0]) == 0
  zero = jax.tree.map(jnp.zeros_like, cts)
  kept = mp.fp8.merge_grad_state(fwd_only, zero)
  assert float(kept["1"].grad.scale) == float(state["1"].grad.scale)
  # The helper with aux and several argnums: the same numbers.
  with_aux = lambda p, x, y: (mlp_loss(p, x, y), jnp.sum(x))
  vg = jax.jit(mp.value_and_grad(mp.autocast(with_aux, recipe, fp8_state=True), argnums=(0, 1),
                                 has_aux=True))
  (value2, aux), (grads2, gx), merged2 = vg(state, params, x, y)
  np.testing.assert_allclose(value2, value, rtol=1e-6)
  np.testing.assert_allclose(aux, jnp.sum(x), rtol=1e-6)
  _close(grads2, grads, 1e-5)
  _close(merged2, merged, 1e-6)
  assert gx.shape == x.shape


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_bad_value_and_the_fix():
  params, (x, y) = _params(), _data()
  with pytest.raises(ValueError, match=r"delayed scaling.*fp8_state=True.*"
                                       r"Fp8Config\(scaling='current'\)"):
    mp.autocast(mlp_loss, "fp8_hybrid")
  with pytest.raises(ValueError, match="fp8_state=True with 'bf16_mixed'.*no fp8 GEMMs"):
    mp.autocast(mlp_loss, "bf16_mixed", fp8_state=True)
  with pytest.raises(ValueError, match="fp8_state=1; accepted: True or False"):
    mp.autocast(mlp_loss, CURRENT, fp8_state=1)
  with pytest.raises(ValueError, match=r"fp8\.keep_first_last='yes'; accepted: true or false"):
    mp.Fp8Config(keep_first_last="yes")
  with pytest.raises(ValueError, match="no fp8 GEMMs"):
    mp.fp8.init_state(mlp_loss, "bf16_mixed", params, x, y)
  g = mp.autocast(mlp_loss, "fp8_hybrid", fp8_state=True)
  state = g.init_state(params, x, y)
  with pytest.raises(ValueError, match=r"missing \['2'\], unknown none.*init_state"):
    g({"1": state["1"]}, params, x, y)
  with pytest.raises(ValueError, match="fp8 state NoneType.*init_state"):
    g(None, params, x, y)
  short = dict(state, **{"1": mp.fp8.Fp8Spec.from_config(
      mp.Fp8Config(amax_history_len=3)).init_state()})
  with pytest.raises(ValueError, match=r"state\['1'\]\.lhs\.amax_history has shape \(3,\); "
                                       r"accepted: \(1024,\)"):
    g(short, params, x, y)
  with pytest.raises(ValueError, match="same keys"):
    mp.fp8.merge_grad_state(state, {"1": state["1"]})
  with pytest.raises(ValueError, match="argnums=-1"):
    mp.value_and_grad(mp.autocast(mlp_loss, "fp8_hybrid", fp8_state=True), argnums=-1)
  with pytest.raises(ValueError, match="recipe=None"):
    mp.fp8.init_state(mlp_loss, None, params, x, y)


# ----------------------------------------------------------------------------- lowering


def test_cuda_lowering_has_fp8_dots():
  """The program a GPU would run: E4M3 x E4M3 forward GEMMs and E5M2 gradient GEMMs for
  the middle layers only; bf16 x bf16 -> f32 for the first and last."""
  params, (x, y) = _params(), _data()
  step = jax.jit(mp.value_and_grad(mp.autocast(mlp_loss, "fp8_hybrid", fp8_state=True)))
  state = mp.fp8.init_state(mlp_loss, "fp8_hybrid", params, x, y)
  prog = lower(step, state, params, x, y, platform="cuda")
  sigs = {}
  for gemm in prog.gemms:
    pair = tuple(sorted(gemm.signature()[:2]))
    sigs.setdefault(gemm.direction, set()).add(pair + (gemm.signature()[2],))
  assert sigs["fwd"] == {("e4m3", "e4m3", "f32"), ("bf16", "bf16", "f32")}, sigs
  assert sigs["bwd"] == {("e4m3", "e5m2", "f32"), ("bf16", "bf16", "f32")}, sigs
  n_fp8 = sum(g.is_fp8 for g in prog.gemms)
  assert n_fp8 == 2 * 3  # two middle layers: one forward and two backward GEMMs each
