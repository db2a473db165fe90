"""Stochastic rounding on shards draws the bits of the whole array (global flat index).

`index_offset` at the rounding level (XLA reference and Pallas kernel), the optimizer on
ZeRO-style shards inside shard_map against the same optimizer on full leaves, and
`data_parallel` end to end: every element is rounded alike whatever holds it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import precision as mp
from precision import optim
from precision import parallel
from precision.parallel._layout import LeafLayout, flatten_pad, own_shard, unflatten
from precision.rounding import FusedAdamW
from precision.rounding import leaf_seed
from precision.rounding import stochastic_round
from _asserts import assert_bit_identical
from _asserts import bits
from _parallel_worker import LR, loss_fn, make_batches, make_params

N = 8
SEED, STEPS = 3, 3
# Every stochastic-rounding recipe: the preset, and a master copy rounded stochastically
# (no preset has it; `master_weights` is the other transform that rounds with SR).
SR_RECIPES = {
    "bf16_sr": mp.get_recipe("bf16_sr"),
    "bf16_master_sr": mp.Recipe("bf16_master_sr", "p=bf16,c=bf16,o=f32", master_dtype="f32",
                                rounding="stochastic"),
}
SHAPES = {"a": (5, 7), "b": (13,)}  # 35 and 13 elements: neither divides 8


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",))


# --- rounding level ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def x_full():
  # Values between bf16 neighbours (and e4m3's), so every element's bits matter.
  return jnp.asarray(np.random.default_rng(0).normal(size=3000).astype(np.float32))


@pytest.mark.parametrize("impl", ("xla", "pallas"))
@pytest.mark.parametrize("dtype", ("bf16", "e4m3"))
def test_slice_with_offset_matches_whole(x_full, impl, dtype):
  full = stochastic_round(x_full, dtype, key=11, step=4, impl="xla")
  for a, b in ((0, 1000), (1000, 2500), (2500, 3000), (7, 1031)):
    part = stochastic_round(x_full[a:b], dtype, key=11, step=4, impl=impl, index_offset=a)
    assert_bit_identical(part, full[a:b], f"{impl} {dtype} [{a}:{b})")
  # Without the offset a slice gets other bits (else the test above could not fail).
  part0 = stochastic_round(x_full[1000:2500], dtype, key=11, step=4, impl=impl)
  assert (bits(part0) != bits(full[1000:2500])).any()


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_traced_offset_one_compile(x_full, impl):
  k = 375  # 3000 / 8: the shards of data_parallel with 8 devices
  f = jax.jit(lambda x, off: stochastic_round(x, jnp.bfloat16, key=11, step=4, impl=impl,
                                              index_offset=off))
  full = stochastic_round(x_full, jnp.bfloat16, key=11, step=4, impl="xla")
  for r in range(N):
    got = f(x_full[r * k:(r + 1) * k], jnp.uint32(r * k))
    assert_bit_identical(got, full[r * k:(r + 1) * k], f"{impl} shard {r}")
  f(x_full[:k], jnp.int32(5))  # an int32 offset (axis_index's dtype) is accepted too
  assert f._cache_size() == 2  # one trace per offset dtype, not one per offset value


def test_row_slice_of_2d_and_uint32_wrap(x_full):
  x2 = x_full.reshape(60, 50)
  full = stochastic_round(x2, jnp.bfloat16, key=2, step=9)
  got = stochastic_round(x2[12:31], jnp.bfloat16, key=2, step=9, index_offset=12 * 50)
  assert_bit_identical(got, full[12:31])
  # Counters are uint32: offset 2**32 - 5 makes element 5 use index 0.
  for impl in ("xla", "pallas"):
    wrapped = stochastic_round(x_full[:20], jnp.bfloat16, key=2, step=9, impl=impl,
                               index_offset=2 ** 32 - 5)
    plain = stochastic_round(x_full[5:20], jnp.bfloat16, key=2, step=9, impl=impl)
    assert_bit_identical(wrapped[5:], plain, impl)


@pytest.mark.parametrize("bad", (-1, 2 ** 32, 1.5, np.zeros((2,), np.uint32),
                                 np.float32(3.0), True))
def test_bad_offset_raises(x_full, bad):
  for impl in ("xla", "pallas"):
    with pytest.raises(ValueError, match="index_offset"):
      stochastic_round(x_full[:8], jnp.bfloat16, key=0, impl=impl, index_offset=bad)


# --- optimizer level: full leaves on one device vs shards inside shard_map ---------------

def _problem():
  r = np.random.default_rng(5)
  params = {k: jnp.asarray(r.normal(size=s).astype(np.float32)).astype(jnp.bfloat16)
            for k, s in SHAPES.items()}
  # Adam steps of about lr = 1e-3 against weights of about 1 (bf16 ulp 2**-7): each update
  # is a fraction of an ulp, so stochastic rounding decides where every element lands.
  grads = [{k: jnp.asarray((0.01 * r.normal(size=s)).astype(np.float32))
            for k, s in SHAPES.items()} for _ in range(STEPS)]
  layouts = {k: LeafLayout(s, np.dtype(jnp.bfloat16), N) for k, s in SHAPES.items()}
  return params, grads, layouts


def _single_device(tx, params, grads, apply):
  state = tx.init(params)
  for g in grads:
    params, state = apply(tx, g, state, params)
  return params, state


def _sharded(tx, params, grads, layouts, apply, mesh):
  """The same steps inside shard_map, each device on its contiguous padded shard; the
  1-D (per-element) leaves are gathered back to full padded vectors."""

  def body(params, grads):
    shard = lambda t: {k: own_shard(flatten_pad(v, layouts[k]), layouts[k], "data")
                       for k, v in t.items()}
    p = shard(params)
    state = tx.init(p)
    for g in grads:
      p, state = apply(tx, shard(g), state, p)
    gather = lambda v: jax.lax.all_gather(v, "data", tiled=True) if v.ndim == 1 else v
    return jax.tree.map(gather, (p, state))

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  return jax.jit(fn)(params, grads)


def _optax_apply(tx, g, state, p):
  updates, state = tx.update(g, state, p)
  return optim.apply_updates(p, updates), state


def _fused_apply(tx, g, state, p):
  return tx.update(g, state, p)


def _assert_same(full, gathered):
  """Leaf by leaf, bit for bit: per-element leaves after dropping the padding, scalars
  (step counters, flags) as they are. The f32 grad-norm metric is the one leaf left out:
  its psum over ranks adds the squares in another order than the single-device sum."""
  f_leaves = jax.tree.flatten_with_path(full)[0]
  g_leaves = jax.tree.flatten_with_path(gathered)[0]
  assert [p for p, _ in f_leaves] == [p for p, _ in g_leaves]
  compared = 0
  for (path, f), (_, g) in zip(f_leaves, g_leaves):
    name = jax.tree_util.keystr(path)
    if name.endswith("grad_norm"):
      continue
    f, g = np.asarray(f), np.asarray(g)
    if f.ndim:
      lay = LeafLayout(f.shape, f.dtype, N)
      assert g.shape == (lay.padded_size,), name
      g = np.asarray(unflatten(jnp.asarray(g), lay))
      compared += 1
    assert_bit_identical(g, f, name)
  assert compared >= 4  # at least the params and one per-element state leaf per param


@pytest.mark.parametrize("recipe", sorted(SR_RECIPES))
def test_sharded_optimizer_rounds_like_unsharded(mesh, recipe):
  recipe = SR_RECIPES[recipe]
  params, grads, layouts = _problem()
  full = _single_device(optim.build_optimizer(recipe, optax.adamw(1e-3), seed=SEED),
                        params, grads, jax.jit(_optax_apply, static_argnums=0))
  tx = optim.build_optimizer(recipe, optax.adamw(1e-3), seed=SEED, axis_name="data")
  gathered = _sharded(tx, params, grads, layouts, _optax_apply, mesh)
  _assert_same(full, gathered)
  # The updates did reach the bf16 params (else equal params would prove nothing).
  moved = [(bits(f) != bits(p)).any() for f, p in zip(jax.tree.leaves(full[0]),
                                                      jax.tree.leaves(params))]
  assert all(moved)


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_sharded_fused_adamw_rounds_with_global_index(mesh, impl):
  """FusedAdamW(axis_name=...) on shards: each param is the UNSHARDED stochastic rounding
  of its f32 master (leaf i: key leaf_seed(seed, i), last step, flat index in the leaf).

  Checked against the master rather than against a single-device FusedAdamW run: XLA on
  CPU contracts the AdamW multiply-adds into FMAs differently in the two programs (1-ulp
  f32 differences in the moments), which is arithmetic, not rounding.
  """
  params, grads, layouts = _problem()
  # Flat shards have ndim 1: spell out the default decay rule (matrices only).
  mask = {k: len(s) >= 2 for k, s in SHAPES.items()}
  opt = FusedAdamW(learning_rate=1e-3, weight_decay=0.1, seed=SEED, keep_master=True,
                   impl=impl, mask=mask, axis_name="data")
  new_params, state = _sharded(opt, params, grads, layouts, _fused_apply, mesh)
  assert int(state.count) == STEPS
  for i, k in enumerate(sorted(SHAPES)):
    master = unflatten(state.master[k], layouts[k])
    want = stochastic_round(master, jnp.bfloat16, key=leaf_seed(SEED, i), step=STEPS - 1,
                            impl="xla")
    got = unflatten(new_params[k], layouts[k])
    assert_bit_identical(got, want, k)
    assert (bits(got) != bits(params[k])).any(), k


@pytest.mark.parametrize("impl", ("xla", "pallas"))
def test_sharded_fused_recipe_rounds_like_the_unfused_recipe(mesh, impl):
  """A fused recipe's optimizer (build_optimizer(..., axis_name="data") around
  fused_adamw) on ZeRO shards: the same params, moments and guard counters, bit for bit,
  as bf16_sr around optax.adamw on the same shards, and (params) as bf16_sr on whole
  leaves on one device."""
  params, grads, layouts = _problem()
  mask = {k: len(s) >= 2 for k, s in SHAPES.items()}  # flat shards: the rule spelled out
  fused_r = mp.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)
  fused = optim.build_optimizer(
      fused_r, optim.fused_adamw(1e-3, weight_decay=0.1, mask=mask, impl=impl), seed=SEED,
      axis_name="data")
  adamw = optax.adamw(1e-3, weight_decay=0.1, mask=mask)
  unfused = optim.build_optimizer("bf16_sr", adamw, seed=SEED, axis_name="data")
  p_f, s_f = _sharded(fused, params, grads, layouts, _optax_apply, mesh)
  p_u, s_u = _sharded(unfused, params, grads, layouts, _optax_apply, mesh)
  assert_bit_identical(p_f, p_u)
  state = optim._query.find_state(s_f, mp.rounding.FusedAdamWState)
  adam = optim._query.find_state(s_u, optax.ScaleByAdamState)
  assert_bit_identical((state.mu, state.nu), (adam.mu, adam.nu))
  assert_bit_identical(optim.optimizer_metrics(s_f)["skipped_steps"],
                       optim.optimizer_metrics(s_u)["skipped_steps"])
  full, _ = _single_device(optim.build_optimizer("bf16_sr", adamw, seed=SEED), params,
                           grads, jax.jit(_optax_apply, static_argnums=0))
  for k in SHAPES:
    assert_bit_identical(unflatten(p_f[k], layouts[k]), full[k], k)


# --- end to end: data_parallel -----------------------------------------------------------

def test_data_parallel_sr_same_bits_in_every_stage(mesh):
  """bf16_sr, 3 steps: stage 0 (full leaves) and stages 1 and 3 (shards) end bit-identical.

  Measured on this CPU: the fp32 recipe's stage 0 and stage 1 params differ in the last
  bit of one leaf (b2) after 3 steps: an all-reduce and a reduce-scatter add the 8 ranks'
  f32 grads in different orders. bf16_sr computes grads in bf16 and reduces them in f32,
  where a sum of 8 bf16 values is exact (unless their exponents span ~13 binades), so
  its reduced grads agree across stages and any difference left would be the rounding.
  Stages 1 and 3 shard alike, so only stage 0 vs 1-3 tests the global index.
  """
  out = {}
  for stage in (0, 1, 3):
    dp = parallel.data_parallel(loss_fn, optax.adamw(LR), mesh, zero_stage=stage,
                                recipe="bf16_sr", seed=7)
    state = dp.init(make_params())
    for batch in make_batches(STEPS):
      state, _ = dp.step(state, dp.shard_batch(batch))
    out[stage] = jax.tree.map(np.asarray, dp.params(state))
  start = mp.get_recipe("bf16_sr").policy.cast_to_param(
      jax.tree.map(jnp.asarray, make_params()))
  for k in out[0]:
    assert out[0][k].dtype == jnp.bfloat16
    assert (bits(out[0][k]) != bits(start[k])).any(), k
    for stage in (1, 3):
      assert_bit_identical(out[stage][k], out[0][k], f"stage {stage} {k}")


def test_data_parallel_fused_recipe_same_bits_as_bf16_sr_in_every_stage(mesh):
  """data_parallel with a fused recipe (fused_adamw as the inner optimizer), 3 steps:
  stages 0, 1 and 3 end bit-identical to each other and to bf16_sr around optax.adamw."""
  mask = jax.tree.map(lambda a: np.ndim(a) >= 2, make_params())  # explicit for shards
  fused_r = mp.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)

  def train(recipe, inner, stage):
    dp = parallel.data_parallel(loss_fn, inner, mesh, zero_stage=stage, recipe=recipe,
                                seed=7)
    state = dp.init(make_params())
    for batch in make_batches(STEPS):
      state, _ = dp.step(state, dp.shard_batch(batch))
    return jax.tree.map(np.asarray, dp.params(state))

  want = train("bf16_sr", optax.adamw(LR, weight_decay=0.1, mask=mask), 0)
  for stage in (0, 1, 3):
    got = train(fused_r, optim.fused_adamw(LR, weight_decay=0.1, mask=mask), stage)
    assert_bit_identical(got, want, f"stage {stage}")
