"""jmp 0.0.4's policy and loss-scale tests, ported to precision's names.

Each test is named after the jmp test it ports. Where precision differs from jmp on
purpose, jmp's own expectation is kept as a strict xfail whose reason names the row of the
table of deliberate differences in docs/jmp_migration.md, and the documented behaviour is
asserted next to it. Everything else passes as jmp's suite does.
"""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp


def deliberate(row: int, what: str, raises=None):
  """jmp's expectation, expected to fail: docs/jmp_migration.md, deliberate difference `row`."""
  return pytest.mark.xfail(strict=True, raises=raises,
                           reason=f"docs/jmp_migration.md, deliberate difference {row}: {what}")


# ----------------------------------------------------------------------------- policies

HALF_DTYPES = (np.float16, jnp.float16, jnp.bfloat16)
FULL_DTYPES = (np.float32, jnp.float32)
DTYPES = HALF_DTYPES + FULL_DTYPES
NUMPYS = (np, jnp)
DTYPES_X_NUMPYS = list(itertools.product(DTYPES, NUMPYS))


def _ids(params):
  return [f"{np.dtype(d).name}-{n.__name__}" for d, n in params]


def _long_name(dtype) -> str:
  return np.dtype(dtype).name  # "float16", "bfloat16", "float32": jmp's long names


def _assert_dtypes_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.dtype(x.dtype) == np.dtype(y.dtype)


@pytest.mark.parametrize("cast", ["cast_to_param", "cast_to_compute", "cast_to_output"])
@pytest.mark.parametrize("dtype,np_", DTYPES_X_NUMPYS, ids=_ids(DTYPES_X_NUMPYS))
def test_policy_cast_to_param_compute_output(cast, dtype, np_):
  policy = mp.Policy(dtype, dtype, dtype)
  field = {"cast_to_param": "param_dtype", "cast_to_compute": "compute_dtype",
           "cast_to_output": "output_dtype"}[cast]
  assert getattr(policy, field) == dtype
  out = getattr(policy, cast)({"a": np_.ones([])})
  _assert_dtypes_equal(out, {"a": np_.ones([], dtype)})
  assert type(out["a"]) is type(np_.ones([], dtype))  # numpy stays numpy, jax stays jax


@pytest.mark.parametrize("dtype,np_", DTYPES_X_NUMPYS, ids=_ids(DTYPES_X_NUMPYS))
def test_policy_with_output_dtype(dtype, np_):
  policy = mp.Policy(np_.float32, np_.float32, np_.float32).with_output_dtype(dtype)
  assert policy.output_dtype == dtype
  assert policy.param_dtype == policy.compute_dtype == np.float32


@pytest.mark.parametrize("name,dtype", [("float16", np.float16), ("float32", np.float32),
                                        ("bfloat16", jnp.bfloat16)])
def test_get_policy(name, dtype):
  policy = mp.get_policy(name)
  assert policy.param_dtype == policy.compute_dtype == policy.output_dtype == dtype


def test_get_policy_almost_dtype():
  with pytest.raises(ValueError, match="unknown dtype"):
    mp.get_policy("compute_float16")


@pytest.mark.parametrize("dtype,np_", DTYPES_X_NUMPYS, ids=_ids(DTYPES_X_NUMPYS))
def test_get_policy_mixed(dtype, np_):
  policy = mp.get_policy(f"c={_long_name(dtype)}")
  assert policy.param_dtype == np_.float32
  assert policy.compute_dtype == policy.output_dtype == dtype


@pytest.mark.parametrize("dtype,np_", DTYPES_X_NUMPYS, ids=_ids(DTYPES_X_NUMPYS))
def test_get_policy_compute(dtype, np_):
  policy = mp.get_policy(f"c={_long_name(dtype)},o=full")
  assert policy.param_dtype == policy.output_dtype == np_.float32
  assert policy.compute_dtype == dtype


@deliberate(8, "no half_dtype(); 'half' is f16 on every backend", raises=AttributeError)
def test_half_dtype_jmp():
  assert mp.half_dtype() == jnp.float16  # pylint: disable=no-member


def test_half_dtype_documented():
  assert mp.get_policy("half").compute_dtype == jnp.float16
  assert not hasattr(mp, "half_dtype")


def _mixed_tree(half):
  return dict(o=object(), h=jnp.ones([], dtype=half), f=jnp.ones([]),
              i=jnp.ones([], dtype=jnp.int16))


def test_cast_to_full():
  """jmp.cast_to_full(tree) is cast_floating(tree, jnp.float32) (difference 8: no alias)."""
  half_tree = _mixed_tree(jnp.float16)
  full_tree = dict(o=half_tree["o"], h=half_tree["h"].astype(jnp.float32), f=half_tree["f"],
                   i=half_tree["i"])
  out = mp.cast_floating(half_tree, jnp.float32)
  assert out["o"] is half_tree["o"] and out["f"] is half_tree["f"] and out["i"] is half_tree["i"]
  assert out == full_tree
  _assert_dtypes_equal({k: v for k, v in out.items() if k != "o"},
                       {k: v for k, v in full_tree.items() if k != "o"})


def test_cast_to_half():
  """jmp.cast_to_half(tree) is cast_floating(tree, jnp.float16) off TPU (difference 8)."""
  full_tree = _mixed_tree(jnp.float32)
  half_tree = dict(o=full_tree["o"], h=full_tree["h"].astype(jnp.float16),
                   f=full_tree["f"].astype(jnp.float16), i=full_tree["i"])
  out = mp.cast_floating(full_tree, jnp.float16)
  assert out["o"] is full_tree["o"] and out["i"] is full_tree["i"]
  _assert_dtypes_equal({k: v for k, v in out.items() if k != "o"},
                       {k: v for k, v in half_tree.items() if k != "o"})
  assert out == half_tree


@deliberate(7, "str(policy) prints f32 where jmp prints full")
def test_str_jmp():
  assert str(mp.Policy(np.float32, np.float32, np.float32)) == "p=full,c=full,o=full"


@pytest.mark.parametrize("dtype", DTYPES, ids=[np.dtype(d).name for d in DTYPES])
def test_str(dtype):
  policy = mp.Policy(dtype, dtype, dtype)
  for piece in str(policy).split(","):
    assert piece.split("=")[1] == mp.dtype_name(dtype)
  assert mp.dtype_name(dtype) == {"float16": "f16", "bfloat16": "bf16",
                                  "float32": "f32"}[_long_name(dtype)]
  assert mp.get_policy(str(policy)) == policy


@deliberate(9, "abstract leaves are cast, not passed through unchanged")
def test_abstract_leaf_unchanged_jmp():
  leaf = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  assert mp.get_policy("c=bf16").cast_to_compute({"w": leaf})["w"] == leaf


@pytest.mark.parametrize("cast", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_abstract_leaf_cast(cast):
  """Difference 9: a ShapeDtypeStruct gets the target dtype, as jax.eval_shape gives."""
  policy = mp.get_policy("p=bf16,c=f16,o=bf16")
  tree = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32),
          "step": jax.ShapeDtypeStruct((), jnp.int32), "n": None}
  out = getattr(policy, cast)(tree)
  want = jax.eval_shape(getattr(policy, cast), {"w": jnp.zeros((4, 8)),
                                                 "step": jnp.zeros((), jnp.int32), "n": None})
  assert out == want
  assert isinstance(out["w"], jax.ShapeDtypeStruct) and out["step"] is tree["step"]


# -------------------------------------------------------------------------- loss scales


def test_no_op_loss_scale():
  loss_scale = mp.NoOpLossScale()
  tree = {"a": jnp.ones([])}
  assert loss_scale.scale(tree) is tree
  assert loss_scale.unscale(tree) is tree


@pytest.mark.parametrize("cls,scale", [(mp.StaticLossScale, 2), (mp.StaticLossScale, 3),
                                       (mp.StaticLossScale, 4), (mp.DynamicLossScale, 2.),
                                       (mp.DynamicLossScale, 3.), (mp.DynamicLossScale, 4.)])
def test_static_loss_scale(cls, scale):
  loss_scale = cls(scale)
  tree = {"a": jnp.array(1.)}
  scaled_tree = {"a": jnp.array(1. * scale)}
  assert loss_scale.scale(tree) == scaled_tree
  assert loss_scale.unscale(scaled_tree) == tree


def test_static_empty_trees_noop():
  assert jax.tree.leaves(mp.NoOpLossScale()) == []


@deliberate(3, "the static scale is an f32 leaf, not metadata; 4: a zero scale is refused",
            raises=ValueError)
def test_static_empty_trees_static_jmp():
  assert jax.tree.leaves(mp.StaticLossScale(0)) == []


def test_static_empty_trees_static_documented():
  (leaf,) = jax.tree.leaves(mp.StaticLossScale(2))
  assert leaf.dtype == jnp.float32 and float(leaf) == 2.0
  with pytest.raises(ValueError, match="finite and > 0"):
    mp.StaticLossScale(0)
  assert mp.NoOpLossScale().loss_scale.dtype == jnp.float32


def test_dynamic_loss_scale_no_warnings():
  with warnings.catch_warnings(record=True) as logged:
    warnings.simplefilter("always")
    mp.DynamicLossScale(2. ** 15)
  assert not logged


@deliberate(1, "only the scale is positional", raises=TypeError)
def test_dynamic_loss_scale_tree_jmp_positional():
  mp.DynamicLossScale(jnp.ones([]), jnp.zeros([], jnp.int32), 2000, 2)


def test_dynamic_loss_scale_tree():
  """Difference 2: three leaves, the third the hysteresis counter."""
  scale = jnp.ones([])
  counter = jnp.zeros([], jnp.int32)
  loss_scale = mp.DynamicLossScale(scale, growth_tracker=counter, growth_interval=2000,
                                   growth_factor=2)
  leaves = jax.tree.leaves(loss_scale)
  assert leaves[:2] == [scale, counter] and leaves[0] is scale and leaves[1] is counter
  assert len(leaves) == 3 and int(leaves[2]) == loss_scale.hysteresis == 1
  assert jax.tree.map(lambda x: x, loss_scale) == loss_scale


@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
  grads_finite = jnp.bool_(True)
  loss_scale = mp.DynamicLossScale(jnp.float32(10), growth_tracker=jnp.int32(0),
                                   growth_interval=period, growth_factor=factor)
  for i in range(1, period):
    loss_scale = loss_scale.adjust(grads_finite)
    assert loss_scale.loss_scale == 10
    assert loss_scale.growth_tracker == i
    assert loss_scale.growth_interval == period
    assert loss_scale.growth_factor == factor
  # The loss scale wraps.
  loss_scale = loss_scale.adjust(grads_finite)
  assert loss_scale.loss_scale == 10 * factor
  assert loss_scale.growth_tracker == 0
  assert loss_scale.growth_interval == period
  assert loss_scale.growth_factor == factor


@pytest.mark.parametrize("period,factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor):
  grads_finite = jnp.bool_(False)
  init = 10.0
  loss_scale = mp.DynamicLossScale(jnp.asarray(init), growth_tracker=jnp.int32(0),
                                   growth_interval=period, growth_factor=factor,
                                   backoff_factor=1 / factor)
  assert init / factor ** 100 < 1  # covers max(1, S)
  for i in range(100):
    loss_scale = loss_scale.adjust(grads_finite)
    np.testing.assert_allclose(loss_scale.loss_scale, max(1, init / factor ** (i + 1)),
                               rtol=1e-5)
    assert loss_scale.growth_tracker == 0
    assert loss_scale.growth_interval == period
    assert loss_scale.growth_factor == factor


def _explicit_min(period, factor, min_loss_scale):
  grads_finite = jnp.bool_(False)
  init = 10.0
  loss_scale = mp.DynamicLossScale(jnp.asarray(init), growth_tracker=jnp.int32(0),
                                   growth_interval=period, growth_factor=factor,
                                   backoff_factor=1 / factor,
                                   min_scale=jnp.asarray(min_loss_scale))
  assert init / factor ** 100 < 1  # covers max(min_scale, S)
  for i in range(100):
    loss_scale = loss_scale.adjust(grads_finite)
    np.testing.assert_allclose(loss_scale.loss_scale,
                               max(min_loss_scale, init / factor ** (i + 1)), rtol=1e-5)
    assert loss_scale.growth_tracker == 0
    assert loss_scale.growth_interval == period
    assert loss_scale.growth_factor == factor


@pytest.mark.parametrize("period,factor,min_loss_scale", [(20, 2, .3125), (30, 3, .37)])
def test_dynamic_loss_scale_explicit_min_loss_scale(period, factor, min_loss_scale):
  _explicit_min(period, factor, min_loss_scale)


@deliberate(4, "min_scale must be > 0", raises=ValueError)
def test_dynamic_loss_scale_explicit_min_loss_scale_zero_jmp():
  _explicit_min(5., 2., 0.)


def test_dynamic_loss_scale_explicit_min_loss_scale_zero_documented():
  with pytest.raises(ValueError, match="min_scale=0.0"):
    mp.DynamicLossScale(10.0, growth_interval=5., min_scale=jnp.asarray(0.))
  assert mp.DynamicLossScale(10.0, growth_interval=5.).growth_interval == 5  # integral float


@pytest.mark.parametrize("flag", [jnp.array([True, False]), jnp.ones([1], bool), 0.5,
                                  jnp.float32(1.0), jnp.int32(1), None])
@pytest.mark.parametrize("cls", [mp.NoOpLossScale, lambda: mp.StaticLossScale(2.0),
                                 lambda: mp.DynamicLossScale(2.0)])
def test_dynamic_loss_scale_adjust_requires_scalar_input(cls, flag):
  """Empty in jmp; here (difference 6) every loss scale refuses all but a bool scalar."""
  with pytest.raises(ValueError, match="accepted: a bool scalar"):
    cls().adjust(flag)
  for ok in (True, np.bool_(False), jnp.bool_(True)):
    cls().adjust(ok)


@deliberate(5, "an integer scale raises ValueError instead of warning")
def test_dynamic_loss_scale_raises_type_error_on_int_loss_scale_jmp():
  with pytest.warns(Warning, match="Expected floating type for loss_scale"):
    mp.DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))


def test_dynamic_loss_scale_raises_type_error_on_int_loss_scale():
  with pytest.raises(ValueError, match="dtype int32; accepted: a floating dtype"):
    mp.DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))


@deliberate(5, "settings are numbers: an int min_scale array is read, without a warning")
def test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale_jmp():
  with pytest.warns(Warning, match="Expected floating type for min_loss_scale"):
    mp.DynamicLossScale(jnp.asarray(1, dtype=jnp.float32),
                        min_scale=jnp.asarray(1, dtype=jnp.int32))


def test_dynamic_loss_scale_int_min_loss_scale():
  ls = mp.DynamicLossScale(jnp.asarray(1, dtype=jnp.float32),
                           min_scale=jnp.asarray(1, dtype=jnp.int32))
  assert ls.min_scale == 1.0 and isinstance(ls.min_scale, float)


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
  assert mp.all_finite(None)
  assert mp.all_finite({})
  assert not mp.all_finite({"a": jnp.array(non_finite)})
  assert not mp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
  assert not mp.all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
  assert mp.all_finite({"a": jnp.ones([]), "b": jnp.ones([])})
  # Beyond jmp's test: Python numbers count, integer and bf16 leaves too.
  assert not mp.all_finite({"a": float(non_finite)})
  assert not mp.all_finite({"i": jnp.arange(3), "h": jnp.array([1, non_finite], jnp.bfloat16)})
  assert mp.all_finite({"i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16)})
  assert mp.all_finite({"a": jnp.ones([])}).dtype == jnp.bool_


def test_select_tree():
  a = {"a": jnp.ones([]), "b": jnp.zeros([])}
  b = {"a": jnp.zeros([]), "b": jnp.ones([])}
  assert mp.select_tree(jnp.bool_(True), None, None) is None
  assert mp.select_tree(jnp.bool_(False), None, None) is None
  assert mp.select_tree(jnp.bool_(True), a, b) == a
  assert mp.select_tree(jnp.bool_(False), a, b) == b


@deliberate(6, "ValueError, not AssertionError", raises=ValueError)
def test_select_tree_rejects_non_scalar_jmp():
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    mp.select_tree(jnp.ones([1]), None, None)


@pytest.mark.parametrize("pred", [jnp.ones([1]), jnp.array([True]), 1.0, jnp.float32(1)])
def test_select_tree_rejects_non_scalar(pred):
  with pytest.raises(ValueError, match="select_tree pred.*accepted: a bool scalar"):
    mp.select_tree(pred, None, None)


def test_select_tree_rejects_mismatched_leaves_and_keeps_dtypes():
  a = {"w": jnp.ones(3, jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"\['w'\] is bfloat16\[3\] in on_true but float32\[3\]"):
    mp.select_tree(True, a, {"w": jnp.zeros(3, jnp.float32)})
  with pytest.raises(ValueError, match="equal dtypes and shapes"):
    mp.select_tree(True, a, {"w": jnp.zeros(2, jnp.bfloat16)})
  out = jax.jit(mp.select_tree)(jnp.bool_(False), a, {"w": jnp.full(3, jnp.nan, jnp.bfloat16)})
  assert out["w"].dtype == jnp.bfloat16 and bool(jnp.isnan(out["w"]).all())


# ----------------------------------------------------------------------------- interop


def test_get_policy_accepts_a_jmp_policy():
  jmp = pytest.importorskip("jmp")
  for text in ("p=f32,c=bf16,o=f32", "p=f32,c=f16", "bf16"):
    assert mp.get_policy(jmp.get_policy(text)) == mp.get_policy(text)
  assert mp.Recipe("r", mp.get_policy(jmp.get_policy("c=bf16"))).policy == mp.get_policy(
      "c=bf16")
  with pytest.raises(ValueError, match=r"policy=3; accepted: .*a jmp\.Policy"):
    mp.get_policy(3)


@pytest.mark.parametrize("make", [
    lambda: mp.DynamicLossScale(jnp.asarray(2.0 ** 15)),           # a weakly typed f32
    lambda: mp.DynamicLossScale(jnp.float32(2.0 ** 15), growth_tracker=jnp.asarray(0)),
    lambda: mp.DynamicLossScale(np.float32(2.0 ** 15), hysteresis_tracker=jnp.asarray(1)),
    lambda: mp.StaticLossScale(jnp.asarray(128.0)),
], ids=["dynamic-weak-f32", "dynamic-weak-counter", "dynamic-np", "static-weak-f32"])
def test_jitted_step_with_an_array_loss_scale_traces_once(make):
  traces = []

  @jax.jit
  def step(loss_scale, x):
    traces.append(None)
    g = loss_scale.unscale(loss_scale.scale(x))
    return loss_scale.adjust(mp.all_finite(g)), g

  loss_scale, x = make(), jnp.ones((3,), jnp.float32)
  for _ in range(3):
    loss_scale, _ = step(loss_scale, x)
  assert len(traces) == 1
  assert not any(leaf.weak_type for leaf in jax.tree.leaves(make()))
