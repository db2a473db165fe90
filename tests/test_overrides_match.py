"""One override matcher: `audit.check` and autocast agree on which override governs each
GEMM (nested and overlapping patterns), and a pattern that matches nothing is reported."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import precision as mp
from precision import _overrides
from precision.audit import _report

F32 = jnp.float32
BASE = "p=f32,c=bf16,o=f32"
# Nested ("blocks/0" holds "blocks/*/mlp") and overlapping ("*down" and "blocks/*/mlp"
# both cover blocks/i/mlp/down: the deeper scope decides) patterns; "blocks/0" and
# "blocks/*/mlp" name a block and an MLP, never a GEMM's own scope.
OVERRIDES = {"blocks/0": "f32", "blocks/*/mlp": "p=f32,c=f16,o=f32", "*down": "f32",
             "head": {"bwd": "f32"}}
# Which override governs each GEMM's scope, written out by hand: (fwd, bwd) compute dtype.
EXPECTED = {
    "blocks/0/attn": ("float32", "float32"),      # "blocks/0"
    "blocks/0/mlp/up": ("float16", "float16"),    # "blocks/*/mlp" (deeper than blocks/0)
    "blocks/0/mlp/down": ("float32", "float32"),  # "*down" (deeper than blocks/*/mlp)
    "blocks/1/attn": ("bfloat16", "bfloat16"),    # none: the base
    "blocks/1/mlp/up": ("float16", "float16"),    # "blocks/*/mlp"
    "blocks/1/mlp/down": ("float32", "float32"),  # "*down"
    "head": ("bfloat16", "float32"),              # "head", its backward only
}


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(8, 16, rngs=rngs)
    self.down = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


class Block(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.Linear(8, 8, rngs=rngs)
    self.mlp = Mlp(rngs)

  def __call__(self, x):
    return self.mlp(self.attn(x))


class Net(nnx.Module):
  def __init__(self, rngs):
    self.blocks = nnx.List([Block(rngs), Block(rngs)])
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _loss(model, x):
  return jnp.sum(model(x))


@pytest.fixture(scope="module")
def report():
  plan = mp.bind("bf16_mixed", overrides=OVERRIDES)
  model = mp.flax.apply_policy(Net(nnx.Rngs(0)), plan)
  return mp.audit.audit(jax.grad(_loss), model, jnp.ones((2, 8), F32))


def test_check_and_autocast_agree_on_the_governing_override(report):
  plan = mp.bind("bf16_mixed", overrides=OVERRIDES)
  seen = {}
  for g in report.gemms:
    # What ran (autocast's choice) is what the check expects (the shared matcher).
    expected = np.dtype(_report.governing_policy(plan.policy, plan.autocast_spec.rules,
                                                 g).compute_dtype).name
    assert (g.lhs_dtype, g.rhs_dtype) == (expected, expected), (g.scope, g.direction)
    seen.setdefault(g.scope, set()).add((g.direction, g.lhs_dtype))
  want = {s: {("fwd", f), ("bwd", b)} for s, (f, b) in EXPECTED.items()}
  assert seen == want
  report.check(plan)                          # every GEMM where its override puts it
  report.check(BASE, OVERRIDES)
  with pytest.raises(mp.audit.PrecisionViolation, match="blocks/0/mlp/up"):
    report.check(BASE)                        # without the overrides: f16/f32 offend


def test_governing_is_the_deepest_scope_then_the_first_rule():
  rules = _overrides.parse_overrides({"a/*": "f32", "a/b": "f16", "*c": "bf16"})
  name = lambda scope, d="fwd": getattr(_overrides.governing(rules, scope, {}, d).rule,
                                        "key", None)
  assert name("a/b/c") == "a/*"      # the deepest scope "a/b/c": "a/*" is given first
  assert name("a/b/x") == "a/*"
  assert name("a/b") == "a/*"
  assert name("x/a/b") is None       # patterns match the whole scope, from its start
  assert name("x/c/y") == "*c"       # "x/c" (a prefix) matches "*c"
  assert _overrides.match_counts(rules, ["a/b", "x/c/y", "z"]) == {"a/*": 1, "a/b": 0,
                                                                   "*c": 1}


def test_a_pattern_matching_no_module_is_reported_at_apply_and_refused_at_the_call():
  model = Net(nnx.Rngs(0))
  with pytest.warns(_overrides.UnmatchedOverrideWarning,
                    match=r"'zz\*', '\*haed\*' matched no module path.*closest to "
                          r"'\*haed\*': 'head'.*'\*down': 2"):
    mp.flax.apply_policy(model, BASE, {"zz*": "f32", "*haed*": "f32", "*down": "f32"})
  with pytest.raises(ValueError, match=r"'zz\*', '\*haed\*' matched no scope.*closest to "
                                       r"'\*haed\*': 'head'"):
    model(jnp.ones((2, 8), F32))


def test_a_pattern_naming_a_named_scope_warns_at_apply_and_runs():
  class Inline(nnx.Module):
    def __init__(self, rngs):
      self.w = nnx.Param(jnp.ones((8, 4), F32))

    def __call__(self, x):
      with jax.named_scope("logits"):
        return x @ self.w[...]

  model = Inline(nnx.Rngs(0))
  with pytest.warns(_overrides.UnmatchedOverrideWarning, match="'logits'"):
    mp.flax.apply_policy(model, BASE, {"logits": "f32"})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = model(jnp.ones((2, 8), F32))           # the scope exists: no error at the call
  report = mp.audit.audit(lambda m, x: m(x), model, jnp.ones((2, 8), F32))
  assert {g.lhs_dtype for g in report.gemms} == {"float32"}
  assert out.dtype == F32
