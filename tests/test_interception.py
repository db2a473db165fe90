"""Trace-time interception of user classes (precision._intercept) leaves no class changed,
and the policy's module scopes and inspect's, traced at once in two threads on instances
of one class, each see only their own calls."""

import copy
import pickle
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import precision as mp
from precision import _intercept

F32 = jnp.float32


def _net_class(before_head=lambda: None):
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.body = nnx.Linear(8, 16, rngs=rngs)
      self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      h = jnp.tanh(self.body(x))
      before_head()
      return self.head(h)

  return Net


def _user_methods(*classes):
  return {(cls, m): cls.__dict__.get(m) for cls in classes for m in ("__call__", "attend")}


def test_apply_recipe_and_a_call_leave_the_class_and_other_instances_as_written():
  Net = _net_class()
  user_call = Net.__dict__["__call__"]
  before = _user_methods(Net, nnx.Linear, nnx.Embed)
  other = Net(nnx.Rngs(1))
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), "bf16_mixed")
  x = jnp.ones((2, 8), F32)
  assert model(x).dtype == F32
  mp.audit.audit(lambda m, x: m(x), model, x)
  mp.numerics.inspect(lambda m, x: m(x), "bf16_mixed", other, x)
  assert _user_methods(Net, nnx.Linear, nnx.Embed) == before
  assert type(other) is Net and type(other).__call__ is user_call
  assert type(Net(nnx.Rngs(2))).__call__ is user_call
  assert type(model.body) is nnx.Linear   # submodules keep their classes
  # The marked instance alone takes a subclass: isinstance and its name hold.
  assert isinstance(model, Net) and type(model).__name__ == "Net"
  assert _intercept.original(type(model), "__call__") is not user_call
  # The unmarked instance still runs as written: f32 GEMMs, no autocast.
  report = mp.audit.audit(lambda m, x: m(x), other, x)
  assert {g.lhs_dtype for g in report.gemms} == {"float32"}


def test_intercepting_counts_nested_users_and_restores_owner_methods():
  class Base:
    def __call__(self, x):
      return x + 1

  class Child(Base):
    pass

  seen = []

  def handle(tag):
    def h(module, call, args, kwargs):
      seen.append(tag)
      return call(*args, **kwargs)
    return h

  user = Base.__dict__["__call__"]
  with _intercept.intercepting([Child], ["__call__"], handle("outer")):
    assert "__call__" not in Child.__dict__   # the owner is wrapped, once
    with _intercept.intercepting([Base, Child], ["__call__"], handle("inner")):
      assert Child()(1) == 2
      assert Base()(1) == 2   # "outer" was entered for Child only
    assert Base.__dict__["__call__"] is not user
  assert Base.__dict__["__call__"] is user and "__call__" not in Child.__dict__
  assert seen == ["inner", "outer", "inner"]   # the last entered runs first
  Child()(1)
  assert len(seen) == 3   # outside every context: as written


@pytest.mark.parametrize("policy_first", [True, False])
def test_policy_and_inspect_traced_at_once_on_one_class(policy_first):
  """One thread traces a marked model (the policy's scopes: head overridden to f32),
  the other inspects an unmarked instance of the same class; both are inside their
  traces at once (a barrier between the body and the head), and the first to start
  ends while the other still runs."""
  barrier = threading.Barrier(2)
  first_done = threading.Event()
  first = "policy" if policy_first else "inspect"

  def before_head():
    name = threading.current_thread().name
    if name in ("policy", "inspect"):
      barrier.wait(timeout=60)
      if name != first:
        first_done.wait(timeout=60)

  Net = _net_class(before_head)
  before = _user_methods(Net, nnx.Linear)
  x = jnp.ones((2, 8), F32)
  plan = mp.bind("bf16_mixed", overrides={"head": "f32"})
  model = mp.flax.apply_recipe(Net(nnx.Rngs(0)), plan)
  plain = Net(nnx.Rngs(1))
  results = {}

  def policy():
    report = mp.audit.audit(jax.grad(lambda m, x: jnp.sum(m(x))), model, x)
    return sorted({(g.scope, g.direction, g.lhs_dtype) for g in report.gemms})

  def inspect():
    report = mp.numerics.inspect(jax.grad(lambda m, x: jnp.sum(m(x))), "bf16_mixed",
                                 plain, x)
    return sorted({(r.scope, r.direction, r.dtype) for r in report.rows
                   if r.role != "out"})

  def run(name, fn):
    try:
      results[name] = fn()
    except Exception as e:  # pylint: disable=broad-except
      results[name] = e
    finally:
      if name == first:
        first_done.set()

  threads = [threading.Thread(target=run, args=(n, f), name=n)
             for n, f in (("policy", policy), ("inspect", inspect))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=180)
  assert results["policy"] == [
      ("body", "bwd", "bfloat16"), ("body", "fwd", "bfloat16"),
      ("head", "bwd", "float32"), ("head", "fwd", "float32")], results["policy"]
  assert results["inspect"] == [
      ("body", "bwd", "bfloat16"), ("body", "fwd", "bfloat16"),
      ("head", "bwd", "bfloat16"), ("head", "fwd", "bfloat16")], results["inspect"]
  assert _user_methods(Net, nnx.Linear) == before


class _Picklable(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def test_a_marked_model_pickles_and_copies_as_a_marked_model():
  model = mp.flax.apply_recipe(_Picklable(nnx.Rngs(0)), "bf16_mixed")
  x = jnp.ones((2, 4), F32)
  for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
    assert type(copied) is type(model) and isinstance(copied, _Picklable)
    assert mp.flax.spec_of(copied) == mp.flax.spec_of(model)
    np.testing.assert_array_equal(np.asarray(copied(x)), np.asarray(model(x)))
  assert type(_Picklable(nnx.Rngs(1))).__call__ is _Picklable.__dict__["__call__"]
