"""Whose dtype wins under autocast, on code that chose dtypes of its own.

The rule (docs/architecture.md, "Whose dtype wins"):
  * a scope whose policy computes in f32 (the `fp32` recipe; an f32 override) runs the
    code as written: bit-identical to the plain code, its own bf16 casts and GEMM
    algorithms included;
  * under a lower-precision compute dtype the recipe governs every GEMM (operands in the
    compute dtype, f32 accumulation, precision re-derived for those operands), a GEMM that
    asked for an f32 result gets it, and the recipe's fp32 ops (and the backward sums of
    broadcasts) run in f32 whatever the code cast to;
  * results are cast to the output dtype except state (new values of arguments, or the
    positions `state_outputs` names), which keeps its traced dtypes; constants come back
    as jax.Arrays.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import precision as mp
from precision.audit import lower
import _zoo
from _asserts import assert_bit_identical

BF16 = np.dtype(jnp.bfloat16)


def _user():
  return _zoo.user_code()


@functools.lru_cache(maxsize=None)
def _attention_case():
  params = _zoo.own_bf16_init(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (2, _zoo.T, 16))
  labels = jax.random.randint(jax.random.key(2), (2,), 0, 10)
  return params, x, labels


def _cuda_mlir(fn, *args) -> str:
  return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def _algorithms(mlir: str) -> set[str]:
  """The operand precision types of every dot algorithm the lowered program names."""
  return {line.split("lhs_precision_type = ")[1].split(",")[0]
          for line in mlir.splitlines() if "lhs_precision_type" in line}


# ----------------------------------------------------------------------------- fp32


def test_fp32_recipe_is_the_identity_on_code_with_its_own_bf16():
  """The code casts to bf16 around jax.nn.dot_product_attention: under fp32 the lowered
  program is the plain one (its GEMMs bf16 x bf16 with the algorithm it picked), not
  re-run in f32. (Bit-identical values and gradients: tests/test_zoo.py's
  own_bf16_attention_jax.)"""
  params, x, labels = _attention_case()
  f = _zoo.own_bf16_attention_loss
  with _user():
    want = lower(jax.value_and_grad(f), params, x, labels, platform="cuda")
    got = lower(jax.value_and_grad(mp.autocast(f, "fp32")), params, x, labels,
                platform="cuda")
    mlir = _cuda_mlir(jax.value_and_grad(mp.autocast(f, "fp32")), params, x, labels)
  assert [g.signature() for g in got.gemms] == [g.signature() for g in want.gemms]
  assert ("bf16", "bf16", "f32") in {g.signature() for g in got.gemms}
  assert _algorithms(mlir) == {"bf16"}, _algorithms(mlir)


def test_f32_override_is_the_opt_out_for_code_that_means_its_casts():
  """An override giving a scope the f32 policy runs that scope as written: inside
  `jax.named_scope("attention")` the code's own bf16 attention GEMMs keep their bf16
  operands and dot algorithm under f16_mixed, while the projections outside run f16."""

  def loss(params, x, labels):
    b, t, _ = x.shape
    split = lambda h: h.reshape(b, t, _zoo.HEADS, -1)
    q, k, v = (split(x @ params[n]) for n in ("wq", "wk", "wv"))
    with jax.named_scope("attention"):
      o = jax.nn.dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                       v.astype(jnp.bfloat16), is_causal=True)
    return _zoo._xent(o.reshape(b, t, -1).astype(jnp.float32).mean(1) @ params["wo"], labels)

  params, x, labels = _attention_case()
  g = mp.autocast(loss, "f16_mixed", overrides={"attention": "f32"})
  with _user():
    prog = lower(g, params, x, labels, platform="cuda")
    mlir = _cuda_mlir(g, params, x, labels)
  inside = {g_.signature() for g_ in prog.gemms if "attention" in g_.name}
  outside = {g_.signature() for g_ in prog.gemms if "attention" not in g_.name}
  assert inside == {("bf16", "bf16", "f32"), ("bf16", "bf16", "bf16")}, inside
  assert outside == {("f16", "f16", "f32")}, outside
  assert _algorithms(mlir) == {"bf16"}


# ----------------------------------------------------------------------------- GEMMs


@pytest.mark.parametrize("recipe,compute", [("f16_mixed", "f16"), ("bf16_mixed", "bf16")])
def test_gemm_precision_is_rederived_for_the_operands_autocast_feeds(recipe, compute):
  """dot_product_attention's BF16_BF16_F32 algorithm is not kept on the recast operands:
  no GEMM of forward or backward converts f16 operands back to bf16."""
  params, x, labels = _attention_case()
  g = jax.value_and_grad(mp.autocast(_zoo.own_bf16_attention_loss, recipe))
  with _user():
    prog = lower(g, params, x, labels, platform="cuda")
    mlir = _cuda_mlir(g, params, x, labels)
  assert {gm.signature() for gm in prog.gemms} == {(compute, compute, "f32")}
  assert _algorithms(mlir) <= {compute}, _algorithms(mlir)


def _bf16_products_in_f32(a, b):
  """a @ b of the operands rounded to bf16, accumulated exactly (float64)."""
  r = lambda v: np.asarray(v, np.float32).astype(BF16).astype(np.float64)
  return r(a) @ r(b)


@pytest.mark.parametrize("how", ["highest", "preferred_f32"])
def test_gemm_that_asked_for_an_f32_result_gives_f32(how):
  a = jax.random.normal(jax.random.key(3), (8, 64))
  b = jax.random.normal(jax.random.key(4), (64, 8))
  if how == "highest":   # f32 operands with precision=HIGHEST
    f = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  else:                  # the code's own bf16 operands, an f32 accumulator asked for
    f = lambda a, b: jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32)
  got = np.asarray(mp.autocast(f, "bf16_mixed")(a, b), np.float64)
  want = _bf16_products_in_f32(a, b)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # Not rounded to bf16 on the way: most results are not bf16 values.
  assert np.mean(got.astype(np.float32).astype(BF16).astype(np.float64) != got) > 0.9


def test_plain_f32_gemm_still_gives_the_compute_dtype():
  """The contrast: `a @ b` (jnp's preferred_element_type equals its f32 operands' dtype,
  no precision) returns the compute dtype under bf16_mixed."""
  a = jnp.ones((4, 8))
  out = jax.eval_shape(mp.autocast(lambda a: (a @ a.T) * 1.0, "p=f32,c=bf16,o=bf16"), a)
  assert out.dtype == BF16
  mixed = mp.autocast(lambda a: jnp.sum(a @ a.T), "bf16_mixed")
  assert "bf16[4,4]" in str(jax.make_jaxpr(mixed)(a))


# ----------------------------------------------------------------------------- f32 ops


def test_fp32_ops_and_backward_sums_win_over_a_bf16_configured_model():
  """Flax layers given dtype=bfloat16 (biases cast to bf16 by Flax) under bf16_mixed: the
  bias and LayerNorm-scale gradients are summed in f32, softmax and norms run in f32:
  check() passes on the differentiated program."""
  with _user():
    model = nnx.Linear(16, 8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    norm = nnx.LayerNorm(8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (32, 16))

  def loss(model, norm, x):
    return jnp.mean(jax.nn.softmax(norm(model(x)).astype(jnp.float32)))

  g = lambda m, n, x: nnx.grad(mp.autocast(loss, "bf16_mixed"), argnums=(0, 1))(m, n, x)
  with _user():
    report = mp.audit.audit(g, model, norm, x)
  report.check("bf16_mixed")
  sums = [o for o in report.ops if o.primitive == "reduce_sum"]
  assert sums and {o.dtype for o in sums} == {"float32"}, [(o.dtype, o.scope) for o in sums]


# ----------------------------------------------------------------------------- results


def _stateful(params, state, x):
  """A step with state of its own dtypes: a bf16 cache, f32 running statistics, an int
  counter; returns (out, new_state)."""
  h = x @ params["w"]
  new = {"cache": (state["cache"] + h).astype(jnp.bfloat16),
         "mean": 0.9 * state["mean"] + 0.1 * h.mean(0),
         "count": state["count"] + 1}
  return jnp.tanh(h), new


def _state_args():
  params = {"w": jax.random.normal(jax.random.key(6), (8, 4))}
  state = {"cache": jnp.zeros((3, 4), jnp.bfloat16), "mean": jnp.zeros((4,)),
           "count": jnp.zeros((), jnp.int32)}
  return params, state, jax.random.normal(jax.random.key(7), (3, 8))


def test_state_outputs_keep_their_traced_dtypes_and_round_trip_a_loop():
  params, state, x = _state_args()
  g = mp.autocast(_stateful, "p=f32,c=bf16,o=bf16", state_outputs=1)
  with _user():
    out, new = g(params, state, x)
    # The state is a loop carry: its dtypes must come back as they went in.
    body = lambda i, s: g(params, s, x)[1]
    looped = jax.lax.fori_loop(0, 3, body, state)
  assert out.dtype == BF16                                  # the result: the output dtype
  assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)
  assert int(looped["count"]) == 3
  # By default the new value of an argument is state too; state_outputs=() declares
  # none, and every floating result takes the output dtype (bf16 mean).
  with _user():
    _, auto = mp.autocast(_stateful, "p=f32,c=bf16,o=bf16")(params, state, x)
    _, cast = mp.autocast(_stateful, "p=f32,c=bf16,o=bf16", state_outputs=())(
        params, state, x)
  assert jax.tree.map(lambda a: a.dtype, auto) == jax.tree.map(lambda a: a.dtype, state)
  assert cast["mean"].dtype == BF16
  with _user():
    plain = jax.jit(_stateful)(params, state, x)
    fp32 = jax.jit(mp.autocast(_stateful, "fp32", state_outputs=(1,)))(params, state, x)
  assert_bit_identical(fp32, plain, "fp32 with state outputs")


def test_state_outputs_refused_clearly():
  params, state, x = _state_args()
  for bad in (-1, True, "1", (0, "x")):
    with pytest.raises(ValueError, match="state_outputs"):
      mp.autocast(_stateful, "bf16_mixed", state_outputs=bad)
  with _user(), pytest.raises(ValueError, match="state_outputs=.*returned a tuple of 2"):
    mp.autocast(_stateful, "bf16_mixed", state_outputs=2)(params, state, x)
  with _user(), pytest.raises(ValueError, match="not a tuple"):
    mp.autocast(lambda x: x * 2.0, "bf16_mixed", state_outputs=0)(x)


def test_constant_outputs_come_back_as_arrays():
  def step(x, count):
    return x * 2.0, jnp.array(False), count * 0, jnp.zeros((2,), jnp.int32)

  x, count = jnp.ones((3,)), jnp.ones((), jnp.int32)
  plain = step(x, count)
  got = mp.autocast(step, "fp32")(x, count)
  assert [type(v) for v in got] == [type(v) for v in plain]
  assert all(isinstance(v, jax.Array) for v in got)
  assert_bit_identical(got, plain, "constants")


def test_haiku_transform_with_state_round_trips():
  hk = pytest.importorskip("haiku")

  def forward(x, is_training=True):
    h = jax.nn.relu(hk.Linear(16)(x))
    h = hk.BatchNorm(True, True, 0.9)(h, is_training)
    cache = hk.get_state("cache", (4, 16), jnp.bfloat16, init=jnp.zeros)
    hk.set_state("cache", (cache + h).astype(jnp.bfloat16))
    return hk.Linear(4)(h)

  f = hk.transform_with_state(forward)
  x = jax.random.normal(jax.random.key(8), (4, 8))
  with _user():
    params, state = f.init(jax.random.key(0), x)
    want = jax.jit(f.apply)(params, state, None, x)
    got = jax.jit(mp.autocast(f.apply, "fp32", state_outputs=1))(params, state, x=x,
                                                                     rng=None)
    _, new = mp.autocast(f.apply, "p=f32,c=bf16,o=bf16", state_outputs=1)(
        params, state, None, x)
  assert_bit_identical(got, want, "fp32 output and state")
  assert jax.tree.map(lambda a: a.dtype, new) == jax.tree.map(lambda a: a.dtype, state)


def test_equinox_state_under_filter_jit_keeps_its_tree():
  eqx = pytest.importorskip("equinox")
  model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")

  def step(model, state, x):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        x, state)

  x = jax.random.normal(jax.random.key(9), (8, 4))
  with _user():
    want = eqx.filter_jit(step)(model, state, x)
    got = eqx.filter_jit(mp.autocast(step, "fp32", state_outputs=1))(model, state, x)
  assert_bit_identical(got, want, "fp32 output and eqx.nn.State")


# ----------------------------------------------------------------------------- overrides


class _InlineHead(nnx.Module):
  """An f32 head written inline under a jax.named_scope, not as a submodule."""

  def __init__(self, rngs):
    self.body = nnx.Linear(8, 16, rngs=rngs)
    self.w_head = nnx.Param(jax.random.normal(rngs.params(), (16, 4)) / 4.0)

  def __call__(self, x):
    h = jax.nn.gelu(self.body(x))
    with jax.named_scope("logits_head"):
      return h @ self.w_head[...]


def test_apply_recipe_accepts_overrides_on_named_scopes():
  with _user():
    model = _InlineHead(nnx.Rngs(0))
  mp.flax.apply_recipe(model, "bf16_mixed", overrides={"logits_head": "f32"})
  x = jnp.ones((2, 8))
  with _user():
    report = mp.audit.audit(lambda m, x: m(x), model, x)
  by_scope = {g.scope.split("/")[-1]: (g.lhs_dtype, g.rhs_dtype, g.out_dtype)
              for g in report.gemms}
  assert by_scope["logits_head"] == ("float32", "float32", "float32"), by_scope
  assert by_scope["body"] == ("bfloat16", "bfloat16", "float32"), by_scope
  # A pattern matching neither a module path nor a scope of the call is a typo.
  with _user():
    typo = _InlineHead(nnx.Rngs(0))
  mp.flax.apply_recipe(typo, "bf16_mixed", overrides={"logit_head": "f32"})
  with _user(), pytest.raises(ValueError, match="'logit_head' matched no scope"):
    typo(x)
  # A module type that matches no module is still refused when the model is marked.
  with pytest.raises(ValueError, match="matched no module"):
    mp.flax.apply_recipe(_InlineHead(nnx.Rngs(0)), "bf16_mixed",
                         overrides={nnx.Conv: "f32"})


# ----------------------------------------------------------------------------- fp8


@pytest.mark.slow
def test_fp8_on_nnx_scan_over_layers_has_the_layer_axis_and_trains():
  """apply_recipe(model, "fp8_hybrid") on blocks made by nnx.vmap and run by nnx.scan:
  each block's fp8 scaling state has the layer axis (one state per layer), the model
  trains (finite, falling loss) and every layer's histories record its own amaxes."""
  import optax  # pylint: disable=g-import-not-at-top
  n = 3
  with _user():
    model = _zoo.ScanOverLayers(n, nnx.Rngs(0))
  mp.flax.apply_recipe(model, "fp8_hybrid")
  fp8 = nnx.state(model.blocks, mp.fp8.Fp8State)
  shapes = {tuple(jax.tree.leaves(v)[0].shape) for _, v in nnx.to_flat_state(fp8)}
  assert shapes and all(s[:1] == (n,) for s in shapes), shapes
  x = jax.random.normal(jax.random.key(10), (32, 8))
  y = jax.random.normal(jax.random.key(11), (32, 4))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    loss, grads = mp.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  with _user():
    losses = [float(step(model, opt)) for _ in range(8)]
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
  dot = model.blocks.linear.dot_general
  history = np.asarray(dot.lhs_amax_history[...])
  assert history.shape[0] == n and np.all(history.max(axis=1) > 0)
  assert len({float(h) for h in history.max(axis=1)}) == n   # one state per layer
  assert np.all(np.asarray(dot.grad_scale[...]) != 1.0)       # the gradient state moved


@pytest.mark.slow
def test_fp8_on_linen_nn_scan_over_layers_has_the_layer_axis_and_trains():
  """A Linen model whose blocks are an `nn.scan` (of an `nn.remat`'d block) under
  "fp8_hybrid" through `precision.value_and_grad` with explicit state: the scanned GEMM is
  one site whose delayed-scaling state has the layer axis (one amax history per layer),
  its forward and both backward GEMMs lower to fp8 inside the scan, the model trains
  (finite, falling loss), and layer 0's newest lhs amax is the max |input| of that
  layer's GEMM (a bf16_mixed reference: everything before it runs in the compute dtype)."""
  import optax  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  n = 3
  model = _zoo.LinenScanOverLayers(n)
  x = jax.random.normal(jax.random.key(10), (32, 8))
  y = jax.random.normal(jax.random.key(11), (32, 4))
  with _user():
    params = model.init(jax.random.key(0), x)["params"]
  assert params["blocks"]["Dense_0"]["kernel"].shape == (n, 16, 16)

  def loss(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  with _user():
    sites = mp.fp8.autocast_gemms(loss, "fp8_hybrid", params, x, y)
    state = mp.fp8.init_state(loss, "fp8_hybrid", params, x, y)
  assert [s.fp8 for s in sites] == [False, True, False]  # first and last kept in bf16
  key = sites[1].key
  assert sorted(state) == [key] and "blocks/Dense_0" in key
  assert {a.shape[0] for a in jax.tree.leaves(state)} == {n}  # the layer axis
  vg = mp.value_and_grad(mp.autocast(loss, "fp8_hybrid", fp8_state=True))
  with _user():
    prog = lower(vg, state, params, x, y, platform="cuda")
  scanned = sorted(g.signature() for g in prog.gemms if "blocks/Dense_0" in g.name)
  assert scanned == [("e4m3", "e4m3", "f32")] * 2 + [("e5m2", "e4m3", "f32")] * 2, scanned

  # Layer 0's input: Dense in (bf16 x bf16 -> f32, rounded to bf16) then the LayerNorm.
  def layer0_input(params, x):
    h = nn.Dense(16).apply({"params": params["Dense_0"]}, x)
    ln = jax.tree.map(lambda a: a[0], params["blocks"]["LayerNorm_0"])
    return nn.LayerNorm().apply({"params": ln}, h)

  with _user():
    want = float(jnp.max(jnp.abs(mp.autocast(layer0_input, "bf16_mixed")(params, x))))
  step, opt = jax.jit(vg), optax.adam(1e-2)
  opt_state, losses, amax0 = opt.init(params), [], None
  with _user():
    for _ in range(10):
      value, grads, state = step(state, params, x, y)
      amax0 = float(state[key].lhs.amax_history[0, 0]) if amax0 is None else amax0
      updates, opt_state = opt.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      losses.append(float(value))
  assert amax0 == want, (amax0, want)  # the same ops on the same values: exact
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
  for op in ("lhs", "rhs", "grad"):
    newest = np.asarray(getattr(state[key], op).amax_history[:, 0])
    assert np.all(newest > 0) and len(set(newest.tolist())) == n, (op, newest)
    # Ten steps recorded in each layer's history, nothing before them.
    filled = np.asarray(getattr(state[key], op).amax_history) > 0
    assert np.all(filled.sum(axis=1) == 10), (op, filled.sum(axis=1))
