"""The "router" f32 op: an MoE router's GEMM, top-k and gating in f32 under autocast.

A router GEMM is one whose result reaches a routing decision (a top_k or argmax whose
indices dispatch tokens) through dtype-polymorphic, promoting or f32 ops
(precision._autocast._router). With "router" among the recipe's fp32_ops it runs
f32 x f32 -> f32 forward and backward while the expert GEMMs stay compute x compute -> f32,
read from the program lowered for CUDA; bf16 logits that tie route tokens differently from
fp32, f32 logits route them as fp32 does; fp32 stays bit-identical; an override on the
router's scope governs it; an argmax for a metric makes no router.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import precision as mp
from precision.audit import lower
import _zoo
from _asserts import assert_bit_identical

T, D, H, E, K = 16, 8, 16, 4, 2
ROUTER_OPS = mp.DEFAULT_FP32_OPS + ("router",)


def _moe(params, x):
  """The issue's sorted-dispatch MoE with top-k routing: returns (loss, expert choices)."""
  with jax.named_scope("router"):
    logits = x @ params["router"]
  top, experts = lax.top_k(logits, K)
  weights = jax.nn.softmax(top, axis=-1)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat)
  token = order // K
  sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
  h = jax.nn.gelu(lax.ragged_dot(x[token], params["w1"], sizes))
  ys = lax.ragged_dot(h, params["w2"], sizes) * weights.reshape(-1)[order][:, None]
  out = jnp.zeros_like(x).at[token].add(ys)
  return jnp.mean(out ** 2), experts


def _args():
  k = jax.random.split(jax.random.key(0), 4)
  params = {"router": jax.random.normal(k[0], (D, E)),
            "w1": jax.random.normal(k[1], (E, D, H)) / np.sqrt(D),
            "w2": jax.random.normal(k[2], (E, H, D)) / np.sqrt(H)}
  return params, jax.random.normal(k[3], (T, D))


def _grad(fp32_ops, overrides=None, recipe="bf16_mixed"):
  f = mp.autocast(_moe, recipe, fp32_ops=fp32_ops, overrides=overrides)
  return jax.grad(lambda p, x: f(p, x)[0])


def _split(prog, marker):
  """(signatures of the GEMMs whose name holds `marker`, of the others) by direction."""
  mine = {(g.direction, g.signature()) for g in prog.gemms if marker in g.name}
  rest = {(g.direction, g.signature()) for g in prog.gemms if marker not in g.name}
  return mine, rest


def test_router_gemm_is_f32_and_experts_bf16_in_the_cuda_lowering():
  params, x = _args()
  prog = lower(_grad(ROUTER_OPS), params, x, platform="cuda")
  router, rest = _split(prog, "router")
  # forward x @ r and its gradient GEMM for r (x's is dead code to jax.grad over params)
  assert router == {("fwd", ("f32", "f32", "f32")), ("bwd", ("f32", "f32", "f32"))}, router
  assert rest == {("fwd", ("bf16", "bf16", "f32")), ("bwd", ("bf16", "bf16", "f32"))}, rest
  assert any("ragged_dot_general" in g.name for g in prog.gemms)
  # Without the op the router is bf16 like every other GEMM (the test can fail).
  router, _ = _split(lower(_grad(mp.DEFAULT_FP32_OPS), params, x, platform="cuda"), "router")
  assert {s for _, s in router} == {("bf16", "bf16", "f32")}, router


def test_an_override_on_the_router_scope_governs_it():
  params, x = _args()
  prog = lower(_grad(ROUTER_OPS, {"router*": "p=f32,c=bf16,o=f32"}), params, x,
               platform="cuda")
  router, _ = _split(prog, "router")
  assert {s for _, s in router} == {("bf16", "bf16", "f32")}, router


def _tied():
  """Router weights whose logits for experts 0 and 1 differ in f32 (1 vs 1 + 2**-10 on
  a row of ones) but round to one bf16 value: bf16 top-k takes the lower index."""
  params, x = _args()
  r = np.zeros((D, E), np.float32)
  r[0, 0], r[0, 1], r[0, 2], r[0, 3] = 1.0, 1.0 + 2.0 ** -10, -1.0, -2.0
  x = np.zeros((T, D), np.float32)
  x[:, 0] = 1.0
  return {**params, "router": jnp.asarray(r)}, jnp.asarray(x)


def test_routing_decisions_equal_fp32s_where_bf16_logits_tie():
  params, x = _tied()
  want = np.asarray(_moe(params, x)[1])
  assert (want[:, 0] == 1).all(), want[:3]
  bf16 = np.asarray(mp.autocast(_moe, "bf16_mixed")(params, x)[1])
  assert (bf16[:, 0] == 0).all(), bf16[:3]  # the tie, broken by index
  got = np.asarray(mp.autocast(_moe, "bf16_mixed", fp32_ops=ROUTER_OPS)(params, x)[1])
  np.testing.assert_array_equal(got, want)


def test_fp32_with_the_router_op_is_bit_identical():
  params, x = _args()
  f = lambda p, x: _moe(p, x)[0]
  want = jax.value_and_grad(f)(params, x)
  got = jax.value_and_grad(mp.autocast(f, "fp32", fp32_ops=ROUTER_OPS))(params, x)
  assert_bit_identical(got, want)


def test_an_argmax_for_a_metric_makes_no_router():
  def f(w, x):
    logits = x @ w
    acc = jnp.mean(jnp.argmax(logits, -1) == 0)
    return jnp.mean(logits ** 2), acc

  w, x = jnp.ones((D, E)), jnp.ones((T, D))
  prog = lower(mp.autocast(f, "bf16_mixed", fp32_ops=ROUTER_OPS), w, x, platform="cuda")
  assert {g.signature() for g in prog.gemms} == {("bf16", "bf16", "f32")}


def test_zoo_mixtral_router_is_f32_under_autocast():
  """The zoo's Mixtral MoE block (nnx.Linear router, top-2, ragged_dot SwiGLU experts and
  a load-balancing loss), unmodified, its training step under autocast."""
  model = _zoo.MixtralMoE(D, 2 * D, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  x = jax.random.normal(jax.random.key(1), (2, T // 2, D))

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params)(x)
    return jnp.mean(y ** 2) + 0.01 * aux

  prog = lower(jax.grad(mp.autocast(loss, "bf16_mixed", fp32_ops=ROUTER_OPS)), params, x,
               platform="cuda")
  # The expert GEMMs are the grouped ones; the router (an nnx.Linear: no name scope) is
  # the only dense GEMM: x @ r forward, the gradient GEMM for r backward.
  experts, router = _split(prog, "ragged_dot_general")
  assert router == {("fwd", ("f32", "f32", "f32")), ("bwd", ("f32", "f32", "f32"))}, router
  assert experts == {("fwd", ("bf16", "bf16", "f32")), ("bwd", ("bf16", "bf16", "f32"))}, experts


def test_zoo_mixtral_decoder_under_apply_recipe_keeps_its_routers_in_f32():
  """The zoo's Mixtral-style decoder, the recipe applied with precision.flax.apply_recipe
  and "router" among its fp32_ops: the two layers' routers f32 forward and backward, every
  other GEMM (attention, projections, experts, head) bf16 x bf16 -> f32."""
  r = mp.get_recipe("bf16_mixed").replace(fp32_ops=ROUTER_OPS)
  assert mp.Recipe.from_dict(r.to_dict()) == r
  b = _zoo.mixtral_style(r)
  with b.context():
    prog = lower(jax.value_and_grad(b.loss, has_aux=True), b.params, platform="cuda")
  router = [g for g in prog.gemms if "/router/" in g.name]
  assert {g.signature() for g in router} == {("f32", "f32", "f32")}, router
  assert sum(g.direction == "fwd" for g in router) == 2, router
  rest = {g.signature() for g in prog.gemms if "/router/" not in g.name}
  assert rest == {("bf16", "bf16", "f32")}, rest


def test_sub_operands_give_each_loop_body_the_operands_it_takes():
  """The container walk the router finder and the fp8 site finder share: a while's cond
  takes its own consts and the carry (not the body's consts), its body the body's consts
  and the carry; a cond's branches every operand but the index (checked by the avals)."""
  from precision._autocast import _fp8

  def f(a, b, x):
    x = lax.while_loop(lambda c: jnp.sum(c * a) < 1e3, lambda c: c * b[0], x)
    return lax.cond(x[0] > 0, lambda y, z: y + z[0], lambda y, z: y - z[0], x, b)

  a, b, x = jnp.ones(()) * 2, jnp.ones((3, 2)), jnp.ones((2,))
  eqns = {e.primitive.name: e for e in jax.make_jaxpr(f)(a, b, x).jaxpr.eqns}
  for name in ("while", "cond"):
    eqn = eqns[name]
    for k, sub, _ in _fp8.sub_jaxprs(eqn):
      got = [v.aval for v in _fp8.sub_operands(eqn, k, eqn.invars)]
      assert got == [v.aval for v in sub.invars], (name, k, got)


def _layers(stacked, x):
  """Two MoE layers scanned over (the backward pass is a second scan)."""
  def body(h, p):
    return h + _moe(p, h)[0], None
  return jnp.sum(lax.scan(body, x, stacked)[0])


def _layout(kind):
  params, x = _args()
  if kind == "scan":
    return _layers, (jax.tree.map(lambda a: jnp.stack([a, a]), params), x)
  if kind == "remat":
    return (lambda p, x: jax.checkpoint(lambda p, x: _moe(p, x)[0])(p, x)), (params, x)
  return (lambda p, x: _moe(p, x)[0]), (params, x)


def _by_router(prog):
  """Counter of (in the router's scope, direction, signature) over the GEMMs."""
  return collections.Counter(("router" in g.name, g.direction, g.signature())
                             for g in prog.gemms)


@pytest.mark.parametrize("kind", ["plain", "scan", "remat"])
def test_router_gradient_gemms_are_f32_when_autocast_takes_the_gradient(kind):
  """autocast(jax.grad(f)): the router's forward GEMM and both its gradient GEMMs (x's
  and r's: jax.grad over both) f32 x f32 -> f32 in the CUDA lowering, every other GEMM
  bf16 x bf16 -> f32 - the GEMMs jax.grad(autocast(f)) gives, in a scan over layers and
  under remat too."""
  f, args = _layout(kind)
  inner = mp.autocast(jax.grad(f, argnums=(0, 1)), "bf16_mixed", fp32_ops=ROUTER_OPS)
  got = _by_router(lower(inner, *args, platform="cuda"))
  outer = jax.grad(mp.autocast(f, "bf16_mixed", fp32_ops=ROUTER_OPS), argnums=(0, 1))
  assert got == _by_router(lower(outer, *args, platform="cuda")), got
  f32, bf16 = ("f32", "f32", "f32"), ("bf16", "bf16", "f32")
  assert {(d, s) for r, d, s in got if r} == {("fwd", f32), ("bwd", f32)}, got
  assert got[(True, "bwd", f32)] == 2, got  # the dlhs and the drhs
  assert {s for r, _, s in got if not r} == {bf16}, got
  # Without the op the router's gradient GEMMs are bf16 (the test can fail).
  plain = _by_router(lower(mp.autocast(jax.grad(f, argnums=(0, 1)), "bf16_mixed"), *args,
                           platform="cuda"))
  assert {s for r, _, s in plain if r} == {bf16}, plain


def test_fp32_router_op_on_a_function_that_takes_its_gradient_is_bit_identical():
  f, args = _layout("plain")
  g = jax.grad(f, argnums=(0, 1))
  assert_bit_identical(mp.autocast(g, "fp32", fp32_ops=ROUTER_OPS)(*args), g(*args))


def test_router_gradients_without_a_traceback_to_match_are_refused(monkeypatch):
  """Where the router's gradient GEMMs cannot be told apart (no traceback on its GEMM),
  autocast(jax.grad(f)) is refused in one line naming the composition that works."""
  from precision._autocast import _router
  monkeypatch.setattr(_router, "_frames", lambda eqn: None)
  f, args = _layout("plain")
  with pytest.raises(ValueError, match=r"jax.grad\(precision.autocast\(f, recipe") as e:
    mp.autocast(jax.grad(f), "bf16_mixed", fp32_ops=ROUTER_OPS)(*args)
  assert "\n" not in str(e.value)
  mp.autocast(f, "bf16_mixed", fp32_ops=ROUTER_OPS)(*args)  # its own forward: no refusal
