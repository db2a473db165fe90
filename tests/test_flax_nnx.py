"""precision.flax.apply_policy on NNX models (run under precision.autocast): dtypes, the
audit of every GEMM, overrides, the compiled program against hand-written Flax."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import precision as mp
from precision.flax import _scopes
from precision.flax import apply_policy, apply_recipe
import _models as M
from _asserts import assert_bit_identical

BF16, F32 = jnp.bfloat16, jnp.float32
MIXED = "p=f32,c=bf16,o=f32"


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(0), (2, 9), 0, 64)


def _loss_and_grads(model, loss_fn, *args, promotion="strict"):
  graphdef, state = nnx.split(model)

  def step(state, *a):
    with jax.numpy_dtype_promotion(promotion):
      return jax.value_and_grad(lambda st: loss_fn(nnx.merge(graphdef, st), *a))(state)

  return jax.jit(step), state


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_fp32_policy_bit_identical(kind, tokens):
  if kind == "mlp":
    x = jax.random.normal(jax.random.key(1), (4, 16), F32)
    y = jax.random.normal(jax.random.key(2), (4, 8), F32)
    ref, lib, args, loss = (M.MLP(rngs=nnx.Rngs(0), handwritten=F32), M.MLP(rngs=nnx.Rngs(0)),
                            (x, y), M.mlp_loss)
  else:
    ref, lib, args, loss = (M.AttentionLM(rngs=nnx.Rngs(0), handwritten=F32),
                            M.AttentionLM(rngs=nnx.Rngs(0)), (tokens,), M.lm_loss)
  apply_policy(lib, "f32")
  f_ref, s_ref = _loss_and_grads(ref, loss, *args, promotion="standard")
  f_lib, s_lib = _loss_and_grads(lib, loss, *args)
  (l0, g0), (l1, g1) = f_ref(s_ref, *args), f_lib(s_lib, *args)
  assert_bit_identical(l0, l1)
  assert_bit_identical(nnx.to_pure_dict(g0), nnx.to_pure_dict(g1))
  fwd = lambda m, x: nnx.jit(lambda m, x: m(x))(m, x)
  with jax.numpy_dtype_promotion("standard"):
    out_ref = fwd(ref, args[0])
  assert np.array_equal(np.asarray(out_ref), np.asarray(fwd(lib, args[0])))


@pytest.fixture(scope="module")
def bf16_lm():
  model = M.AttentionLM(rngs=nnx.Rngs(0))
  return apply_policy(model, MIXED)


def test_bf16_layers_and_dtypes(bf16_lm, tokens):
  assert bf16_lm(tokens).dtype == F32  # output_dtype
  assert bf16_lm.blocks[0].qkv.kernel.get_value().dtype == F32  # param_dtype
  # Nothing replaced: the classes and layer attributes are the user's own. The marked
  # instance alone takes a subclass of its class; the class itself is as written.
  assert isinstance(bf16_lm, M.AttentionLM) and type(bf16_lm).__name__ == "AttentionLM"
  assert M.AttentionLM.__call__.__code__.co_filename == M.__file__   # the user's code
  assert type(M.AttentionLM(rngs=nnx.Rngs(1))) is M.AttentionLM
  assert type(bf16_lm.blocks[0].qkv) is nnx.Linear
  assert bf16_lm.blocks[0].qkv.dot_general is jax.lax.dot_general
  assert mp.flax.policy_of(bf16_lm) == mp.get_policy(MIXED)
  assert mp.flax.spec_of(bf16_lm).policy == mp.get_policy(MIXED)
  # Only the marked instance runs under the policy: a submodule called on its own, or
  # another instance of the class, is plain Flax.
  assert bf16_lm.blocks[0].qkv(jnp.ones((1, 32), F32)).dtype == F32
  other = M.AttentionLM(rngs=nnx.Rngs(0))
  assert mp.flax.policy_of(other) is None
  assert np.array_equal(np.asarray(other(tokens)),
                        np.asarray(M.AttentionLM(rngs=nnx.Rngs(0))(tokens)))
  pure = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), "p=bf16,c=bf16,o=f32")
  assert {v.dtype for v in jax.tree.leaves(nnx.to_pure_dict(nnx.state(pure, nnx.Param)))} == {
      np.dtype(BF16)}


def test_bf16_audit_every_gemm_bf16_f32_accumulate(bf16_lm, tokens):
  step, state = _loss_and_grads(bf16_lm, M.lm_loss, tokens)
  report = mp.audit.audit(step, state, tokens)
  sigs = report.gemm_signatures()
  assert set(sigs) == {("bf16", "bf16", "f32", "f32")}
  assert sum(sigs.values()) == 21  # 7 GEMMs forward, 14 backward
  assert report.gemm_signatures("bwd") == {("bf16", "bf16", "f32", "f32"): 14}
  islands = report.island_dtypes()
  for op in ("norm", "softmax", "cross_entropy"):
    assert islands[op] == {"f32"}, (op, islands)
  report.check(MIXED)
  text = str(report)
  assert "precision map" in text and "bf16 x bf16 in, f32 accumulate" in text


def test_handwritten_flax_backward_is_mixed(tokens):
  # jax issue 34330: hand-written Flax runs backward GEMMs as f32 x bf16.
  hw = M.AttentionLM(rngs=nnx.Rngs(0), handwritten=BF16)
  step, state = _loss_and_grads(hw, M.lm_loss, tokens, promotion="standard")
  report = mp.audit.audit(step, state, tokens)
  mixed = [g for g in report.gemms if g.lhs_dtype != g.rhs_dtype]
  assert len(mixed) >= 10 and all(g.direction == "bwd" for g in mixed)
  with pytest.raises(ValueError, match="expected bf16"):
    report.check(MIXED)


def test_bf16_step_executes_and_grads_in_param_dtype(bf16_lm, tokens):
  # Regression: XLA:CPU cannot run every bf16 x bf16 -> f32 dot layout (attention backward);
  # the policy GEMM's CPU branch must make the whole step execute.
  step, state = _loss_and_grads(bf16_lm, M.lm_loss, tokens)
  loss, grads = step(state, tokens)
  assert loss.dtype == F32 and np.isfinite(loss)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(F32)}


def test_override_one_layer_to_f32(tokens):
  model = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), MIXED,
                       {"*lm_head*": "f32", nnx.Embed: MIXED})
  step, state = _loss_and_grads(model, M.lm_loss, tokens)
  report = mp.audit.audit(step, state, tokens)
  f32 = [g for g in report.gemms if g.lhs_dtype == "float32"]
  assert len(f32) == 3 and {g.scope for g in f32} == {"lm_head"}
  assert {g.direction for g in f32} == {"fwd", "bwd"}
  others = [g for g in report.gemms if g.scope != "lm_head"]
  assert len(others) == 18 and all(g.lhs_dtype == g.rhs_dtype == "bfloat16" for g in others)
  report.check(MIXED, {"*lm_head*": "f32"})
  with pytest.raises(ValueError, match="lm_head"):
    report.check(MIXED)


def test_compiled_hlo_vs_handwritten(bf16_lm, tokens):
  hw = M.AttentionLM(rngs=nnx.Rngs(0), handwritten=BF16)
  stats = []
  for model, promo in ((bf16_lm, "strict"), (hw, "standard")):
    step, state = _loss_and_grads(model, M.lm_loss, tokens, promotion=promo)
    stats.append(M.hlo_stats(step.lower(state, tokens).compile().as_text()))
  ours, hand = stats
  assert ours["dots"] == hand["dots"] == 21
  assert ours["dot_flops"] == hand["dot_flops"]
  # Stated constant: at most 4 more converts than the hand-written model (measured: fewer).
  assert ours["converts"] <= hand["converts"] + 4, (ours, hand)


def test_bf16_logits_close_to_f32(tokens):
  f32 = M.AttentionLM(rngs=nnx.Rngs(0))
  bf16 = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), MIXED)
  a = np.asarray(f32(tokens), np.float64)
  b = np.asarray(bf16(tokens), np.float64)
  rel = np.mean(np.abs(a - b)) / np.mean(np.abs(a))
  assert rel <= 1e-2, rel
  assert rel > 0  # the bf16 path really ran in bf16


def test_bad_override_and_policy_raise(tokens):
  model = M.AttentionLM(rngs=nnx.Rngs(0))
  # A pattern matching no module path may name a jax.named_scope of the model's code: a
  # typo is reported at the call, with the scopes the call has.
  apply_policy(model, MIXED, {"*lm_haed*": "f32"})
  with pytest.raises(ValueError, match="lm_haed.*matched no scope.*lm_head"):
    jax.eval_shape(model, tokens)
  model = M.AttentionLM(rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="bf17"):
    apply_policy(model, "p=f32,c=bf17")
  with pytest.raises(ValueError, match="blocks"):
    apply_policy(model, MIXED, {"blocks/*": "p=f32,c=nope"})
  with pytest.raises(ValueError, match="42"):
    apply_policy(model, MIXED, {42: "f32"})


def test_conv_einsum_embed_attend_gradients():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
      self.ein = nnx.Einsum("bhwc,cd->bhwd", (4, 5), (5,), rngs=rngs)
      self.emb = nnx.Embed(7, 5, rngs=rngs)

    def __call__(self, x):
      h = self.ein(self.conv(x))
      return self.emb.attend(h)

  net = apply_policy(Net(nnx.Rngs(0)), MIXED)
  x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3), F32)
  loss = lambda m, x: jnp.mean(m(x).astype(F32) ** 2)
  step, state = _loss_and_grads(net, loss, x)
  report = mp.audit.audit(step, state, x)
  assert len(report.gemms) == 9
  assert {(g.lhs_dtype, g.rhs_dtype, g.acc_dtype) for g in report.gemms} == {
      ("bfloat16", "bfloat16", "float32")}
  _, grads = step(state, x)
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  ref = Net(nnx.Rngs(0))
  assert np.allclose(np.asarray(net(x)), np.asarray(ref(x)), rtol=0.05, atol=0.05)


def test_apply_recipe_without_fp8(tokens):
  model = apply_recipe(M.AttentionLM(rngs=nnx.Rngs(0)), "bf16_master")
  assert model.blocks[0].up.kernel.get_value().dtype == BF16
  assert model(tokens).dtype == mp.get_recipe("bf16_master").policy.output_dtype
  with pytest.raises(ValueError):
    apply_recipe(model, 3)


class _WithRngs(nnx.Module):
  """An MLP holding RNG state: a Dropout (called deterministic or not) and an nnx.Rngs its
  __call__ never draws from."""

  def __init__(self, deterministic):
    rngs = nnx.Rngs(0)
    self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
    self.spare = nnx.Rngs(2)
    self.deterministic = deterministic

  def __call__(self, x):
    return self.down(self.drop(jax.nn.relu(self.up(x)), deterministic=self.deterministic))


def _functional_grads(model, x, y):
  """loss, grads and the new non-param state through the functional pattern: split, then
  jax.grad of a loss that merges the params with `rest` closed over. A Dropout that draws
  needs the merged variables to belong to the grad trace (copy=True): flax refuses to
  advance an outer trace's RngCount, with or without the library."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    m = nnx.merge(graphdef, p, rest, copy=not model.deterministic)
    return jnp.mean((m(x) - y) ** 2), nnx.state(m, nnx.Not(nnx.Param))

  (value, new_rest), grads = jax.value_and_grad(loss, has_aux=True)(params)
  key_data = lambda t: jax.tree.map(
      lambda v: jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
      else v, t)
  return value, grads, key_data(new_rest)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "dropout"])
def test_rng_state_under_jax_grad_of_the_functional_pattern(deterministic):
  """A model holding RNG state it does not use in this call (a deterministic Dropout, an
  unused nnx.Rngs) differentiates under apply_recipe through split/merge inside jax.grad:
  autocast writes back only the variables the call changed (here none, or the Dropout's
  counter), never the untouched ones of the outer trace. fp32: loss, grads and the RNG
  streams bit-identical to the plain model; bf16_mixed: the streams advance alike."""
  x = jax.random.normal(jax.random.key(1), (4, 16), F32)
  y = jax.random.normal(jax.random.key(2), (4, 8), F32)
  ref = _functional_grads(_WithRngs(deterministic), x, y)
  lib = _functional_grads(apply_recipe(_WithRngs(deterministic), "fp32"), x, y)
  assert_bit_identical(lib, ref)
  rest = ref[2]
  assert int(rest["drop"]["rngs"]["count"][...]) == (0 if deterministic else 1)
  assert int(rest["spare"]["default"]["count"][...]) == 0
  if not deterministic:  # the Dropout drew a mask: the loss is not the deterministic one
    assert float(ref[0]) != float(_functional_grads(_WithRngs(True), x, y)[0])
  value, grads, bf16_rest = _functional_grads(apply_recipe(_WithRngs(deterministic),
                                                           "bf16_mixed"), x, y)
  assert np.isfinite(float(value))
  assert_bit_identical(bf16_rest, rest)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype(F32)}


def test_apply_policy_takes_a_recipe_or_plan_for_its_policy(tokens):
  by_name = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), "bf16_mixed")
  by_string = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), MIXED)
  assert mp.flax.policy_of(by_name) == mp.flax.policy_of(by_string) == mp.get_policy(MIXED)
  assert mp.flax.spec_of(by_name).recipe == mp.get_recipe("bf16_mixed")
  assert np.array_equal(np.asarray(by_name(tokens)), np.asarray(by_string(tokens)))
  plan = mp.bind("pure_bf16", overrides={"lm_head": "f32"})
  by_plan = apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), plan)
  assert mp.flax.spec_of(by_plan) == plan.autocast_spec
  assert by_plan.lm_head.kernel.get_value().dtype == F32
  assert by_plan.blocks[0].qkv.kernel.get_value().dtype == BF16
  with pytest.raises(ValueError, match="fp8 GEMMs.*apply_recipe"):
    apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), "fp8_hybrid")
  with pytest.raises(ValueError, match="'bf16_mixd' is neither a dtype nor a preset.*bf16_mixed"):
    apply_policy(M.AttentionLM(rngs=nnx.Rngs(0)), "bf16_mixd")


def test_two_threads_tracing_at_once_keep_their_scopes_and_restore_the_classes():
  barrier, first_done = threading.Barrier(2), threading.Event()

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 16, rngs=rngs)
      self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      barrier.wait(timeout=60)      # both traces have installed their module scopes
      y = self.head(jnp.tanh(self.body(x)))
      if threading.current_thread().name == "second":
        first_done.wait(timeout=60)  # the first trace ends while this one runs
      return y

  before = {cls: dict(cls.__dict__).get("__call__") for cls in (Net, nnx.Linear)}
  x = jnp.ones((2, 8), F32)
  results = {}

  def trace(name):
    try:
      fn = mp.autocast(lambda m, x: jnp.sum(m(x)), MIXED, {nnx.Linear: "f32"})
      report = mp.audit.audit(jax.grad(fn), Net(nnx.Rngs(0)), x)
      results[name] = {(g.scope.split("/")[0], g.lhs_dtype) for g in report.gemms}
    except Exception as e:  # pylint: disable=broad-except
      results[name] = e
    finally:
      if name == "first":
        first_done.set()

  threads = [threading.Thread(target=trace, args=(n,), name=n) for n in ("first", "second")]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  for name in ("first", "second"):
    assert results[name] == {("body", "float32"), ("head", "float32")}, (name, results[name])
  assert {cls: dict(cls.__dict__).get("__call__") for cls in (Net, nnx.Linear)} == before


def test_marking_a_model_while_its_class_is_traced_leaves_the_class_as_written():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
      return self.lin(x)

  user_call = Net.__dict__["__call__"]
  # As when another thread's trace has Net intercepted while this one marks a model.
  with _scopes.module_scopes([Net(nnx.Rngs(0))], {}, {}):
    model = apply_policy(Net(nnx.Rngs(1)), MIXED)
  assert Net.__dict__["__call__"] is user_call
  assert isinstance(model, Net) and type(Net(nnx.Rngs(2))).__call__ is user_call
  x = jnp.ones((2, 4), F32)
  report = mp.audit.audit(lambda m, x: m(x), model, x)
  assert report.gemm_signatures() == {("bf16", "bf16", "f32", "f32"): 1}
