"""precision.checkpoint: exact round trip, keep-last-K, mismatch errors, recipe conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
import precision.optim  # noqa: F401
from precision import checkpoint
from _asserts import assert_bit_identical

INNER = optax.adamw(1e-2)


def _tx(recipe):
  return mp.optim.build_optimizer(recipe, INNER, seed=3)


def _params(recipe, d=8):
  k1, k2 = jax.random.split(jax.random.key(0))
  p = {"w": jax.random.normal(k1, (d, 4), jnp.float32),
       "b": jax.random.normal(k2, (4,), jnp.float32)}
  return mp.get_recipe(recipe).policy.cast_to_param(p)


def _trained(recipe, steps=3, d=8):
  """A state after a few real updates, so master, moments and counters are non-trivial."""
  recipe = mp.get_recipe(recipe)
  tx, params = _tx(recipe), _params(recipe, d)
  opt = tx.init(params)
  for i in range(steps):
    grads = jax.tree.map(lambda x: (jnp.ones_like(x) * (0.1 * (i + 1))).astype(x.dtype), params)
    scale = mp.optim.loss_scale_of(opt)
    grads = jax.tree.map(lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype), grads)
    updates, opt = tx.update(grads, opt, params)
    params = mp.optim.apply_updates(params, updates)
  rng = jax.random.key_data(jax.random.key(5))
  return checkpoint.TrainState(params, opt, {}, rng)


@pytest.mark.parametrize("name", ["fp32", "bf16_master", "f16_mixed"])
def test_round_trip_is_exact(tmp_path, name):
  recipe = mp.get_recipe(name)
  state = _trained(recipe)
  checkpoint.save(tmp_path, 7, state, recipe=recipe, model_config={"d": 8},
                  data={"seed": 1, "step": 7}, extra={"note": "x"})
  fresh = checkpoint.TrainState(_params(recipe), _tx(recipe).init(_params(recipe)), {},
                                jax.random.key_data(jax.random.key(0)))
  r = checkpoint.restore(tmp_path, fresh)
  assert_bit_identical(r.state, state)
  assert type(r.state.opt_state) is type(state.opt_state)
  assert r.step == 7 and r.recipe == recipe and r.saved_recipe == recipe
  assert r.data == {"seed": 1, "step": 7} and r.extra == {"note": "x"}
  assert r.model_config == {"d": 8} and r.converted == ()


def test_keeps_last_k_and_restores_a_chosen_step(tmp_path):
  recipe = mp.get_recipe("fp32")
  ckpt = checkpoint.Checkpointer(tmp_path, keep=2)
  states = {}
  for step in (1, 2, 3):
    states[step] = _trained(recipe, steps=step)
    ckpt.save(step, states[step], recipe=recipe)
  assert ckpt.steps() == [2, 3]
  assert_bit_identical(ckpt.restore(states[1], step=2).state, states[2])
  with pytest.raises(ValueError, match=r"step=1 has no checkpoint.*\[2, 3\]"):
    ckpt.restore(states[1], step=1)
  ckpt.close()
  with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
    checkpoint.restore(tmp_path / "empty", states[1])


def test_mismatch_names_first_differing_leaf_and_config_field(tmp_path):
  recipe = mp.get_recipe("fp32")
  checkpoint.save(tmp_path, 1, _trained(recipe), recipe=recipe, model_config={"d": 8})
  other = _trained(recipe, steps=1, d=6)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"leaf 'params/w': checkpoint has \(8, 4\) float32, the target "
                           r"expects \(6, 4\) float32; model config field 'd': checkpoint 8, "
                           r"target 6"):
    checkpoint.restore(tmp_path, other, model_config={"d": 6})
  # Same shapes, different config: still refused, naming the field.
  with pytest.raises(checkpoint.CheckpointMismatchError, match="field 'd': checkpoint 8"):
    checkpoint.restore(tmp_path, _trained(recipe, steps=1), model_config={"d": 9})
  # Right shapes, wrong dtypes (a bf16_master target without saying recipe=): refused.
  bf = _trained("bf16_master", steps=1)
  with pytest.raises(checkpoint.CheckpointMismatchError, match="leaf '"):
    checkpoint.restore(tmp_path, bf)
  with pytest.raises(ValueError, match="optimizer_for"):
    checkpoint.restore(tmp_path, bf, recipe=mp.get_recipe("bf16_master"))


@pytest.mark.parametrize("src,dst", [("bf16_master", "fp32"), ("bf16_master", "bf16_sr"),
                                     ("fp32", "bf16_master")])
def test_cross_recipe_restore_converts_from_the_master(tmp_path, src, dst):
  src_r, dst_r = mp.get_recipe(src), mp.get_recipe(dst)
  saved = _trained(src_r)
  checkpoint.save(tmp_path, 3, saved, recipe=src_r)
  master = mp.optim.master_params(saved.opt_state, saved.params)
  target = checkpoint.TrainState(_params(dst_r), _tx(dst_r).init(_params(dst_r)), {},
                                 saved.rng)
  r = checkpoint.restore(tmp_path, target, recipe=dst_r, optimizer_for=_tx)
  assert r.recipe == dst_r and r.saved_recipe == src_r
  assert any(f"{src} -> {dst}" in n for n in r.converted)
  assert any("ScaleByAdamState" in n for n in r.converted)
  # Params: the f32 master rounded to nearest into the target's param dtype.
  assert_bit_identical(r.state.params, dst_r.policy.cast_to_param(master))
  # A target master copy is the saved f32 view bit for bit. Without one (fp32, bf16_sr)
  # the state holds no master, and the f32 view of the target is its params: the saved
  # master itself for f32 params, its bf16 rounding for bf16 params.
  masters = [n for n in jax.tree.leaves(r.state.opt_state, is_leaf=lambda x: isinstance(
      x, mp.optim.MasterState)) if isinstance(n, mp.optim.MasterState)]
  if dst_r.master_dtype is not None:
    assert len(masters) == 1
    assert_bit_identical(masters[0].master, master)
  else:
    assert masters == []
    upcast = jax.tree.map(lambda x: x.astype(jnp.float32), dst_r.policy.cast_to_param(master))
    assert_bit_identical(mp.optim.master_params(r.state.opt_state, r.state.params), upcast)
    if dst_r.policy.param_dtype == jnp.float32:
      assert_bit_identical(r.state.params, master)
  # Adam's moments carry over.
  find = lambda s: [n for n in jax.tree.leaves(s, is_leaf=lambda x: isinstance(
      x, optax.ScaleByAdamState)) if isinstance(n, optax.ScaleByAdamState)][0]
  assert_bit_identical(find(r.state.opt_state).mu, find(saved.opt_state).mu)
  # dtypes are what the target recipe's own init gives, and training continues finitely.
  dtypes = lambda s: [(x.shape, x.dtype) for x in jax.tree.leaves(s)]
  assert jax.tree.structure(r.state.opt_state) == jax.tree.structure(target.opt_state)
  assert dtypes(r.state.opt_state) == dtypes(target.opt_state)
  tx = _tx(dst_r)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), r.state.params)
  updates, _ = tx.update(grads, r.state.opt_state, r.state.params)
  new = mp.optim.apply_updates(r.state.params, updates)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new))


def test_import_orbax_finds_the_params_and_names_every_problem(tmp_path):
  """Plain Orbax writers (StandardCheckpointer, PyTreeCheckpointer, CheckpointManager),
  params at the root or under 'params'; bad input named, nothing created."""
  import orbax.checkpoint as ocp
  recipe = mp.get_recipe("bf16_master")
  tx = _tx(recipe)
  values = {"w": jnp.arange(32, dtype=jnp.float32).reshape(8, 4) / 7.0,
            "b": jnp.full((4,), 1 / 3, jnp.float32)}
  params = _params(recipe)
  target = checkpoint.TrainState(params, tx.init(params), {}, jax.random.key_data(
      jax.random.key(0)))
  with ocp.StandardCheckpointer() as std:
    std.save(tmp_path / "flax_state", {"params": values, "opt_state": optax.adam(1e-3).init(
        values), "step": 3})
  ocp.PyTreeCheckpointer().save(tmp_path / "pytree", values)
  mgr = ocp.CheckpointManager(tmp_path / "mgr")
  for step in (1, 2):
    mgr.save(step, args=ocp.args.StandardSave(values))
  mgr.wait_until_finished()
  mgr.close()
  for path, kw, where, step in ((tmp_path / "flax_state", {}, "params", None),
                                (tmp_path / "pytree", {}, "", None),
                                (tmp_path / "mgr", {}, "", 2),
                                (tmp_path / "mgr", {"step": 1}, "", 1),
                                (tmp_path / "mgr" / "1", {"item": "default"}, "", 1)):
    imp = checkpoint.import_orbax(path, target, recipe, optimizer=tx, **kw)
    assert (imp.params_path, imp.step) == (where, step)
    master = mp.optim.master_params(imp.state.opt_state, imp.state.params)
    assert_bit_identical(master, values)                                 # bit for bit
    assert_bit_identical(imp.state.params, recipe.policy.cast_to_param(values))
    assert [x.dtype for x in jax.tree.leaves(imp.state.opt_state)] == [
        x.dtype for x in jax.tree.leaves(target.opt_state)]
  # Problems: each names the path and what is wrong.
  bad_target = target._replace(params={"w": jnp.zeros((8, 5), jnp.bfloat16),
                                       "b": params["b"]})
  int_target = target._replace(params={"w": jnp.zeros((8, 4), jnp.int32), "b": params["b"]})
  cases = [
      (tmp_path / "missing", target, {}, FileNotFoundError, "No Orbax checkpoint at .*"
       "missing: the path does not exist"),
      (tmp_path, target, {}, ValueError, r"holds several Orbax items \(flax_state, pytree\)"),
      (tmp_path / "mgr", target, {"step": 9}, ValueError, r"step=9 is not a step.*\[1, 2\]"),
      (tmp_path / "mgr" / "1", target, {"item": "state"}, ValueError,
       r"item='state' is not an Orbax PyTree item.*items: \['default'\]"),
      (tmp_path / "pytree", bad_target, {}, checkpoint.CheckpointMismatchError,
       r"pytree: leaf 'w': checkpoint has \(8, 4\) float32, the target expects \(8, 5\) "
       "bfloat16"),
      (tmp_path / "pytree", int_target, {}, checkpoint.CheckpointMismatchError,
       r"leaf 'w': checkpoint has \(8, 4\) float32, the target expects \(8, 4\) int32"),
      (tmp_path / "flax_state", target, {"params_path": "model"},
       checkpoint.CheckpointMismatchError, r"leaf 'model/b' \(the target's \(4,\) bfloat16\) "
       "is not in the checkpoint"),
      (tmp_path / "pytree", target._replace(params={"v": params["w"]}), {},
       checkpoint.CheckpointMismatchError, r"leaf 'v' .* is not in the checkpoint, which "
       "holds 2 leaves"),
  ]
  for path, tgt, kw, err, match in cases:
    with pytest.raises(err, match=match):
      checkpoint.import_orbax(path, tgt, recipe, optimizer=tx, **kw)
  assert not (tmp_path / "missing").exists()


def test_one_train_state_type_with_the_paths_of_the_earlier_namedtuple(tmp_path):
  """precision.TrainState is the one state type (checkpoint, parallel), and a checkpoint
  item written from the earlier NamedTuple TrainState (the same field names) restores
  into it: Orbax and the checksums key leaves by path, and the paths are the same."""
  from typing import Any, NamedTuple  # pylint: disable=g-import-not-at-top
  from precision.checkpoint import _integrity, _orbax, _tree

  class EarlierTrainState(NamedTuple):
    params: Any
    opt_state: Any
    model_state: Any
    rng: Any

  assert checkpoint.TrainState is mp.TrainState is mp.parallel.TrainState
  state = _trained("bf16_master")
  earlier = EarlierTrainState(state.params, state.opt_state, state.model_state, state.rng)
  assert _integrity.array_digests(earlier) == _integrity.array_digests(state)
  _orbax.save_item(str(tmp_path / "item"), earlier)
  got = _orbax.restore_item(str(tmp_path / "item"), _tree.to_abstract(state), "item")
  assert isinstance(got, mp.TrainState)
  assert_bit_identical(got, state)
  moved = state._replace(rng=state.rng + 1)                  # NamedTuple's API kept
  assert moved.params is state.params and int(moved.rng[0]) == int(state.rng[0]) + 1
  with pytest.raises(ValueError, match="accepted fields"):
    state._replace(fp8=1)


# ------------------------------------------------------------------ PRNG keys (nnx.Rngs)


class _DropoutMLP(nnx.Module):
  """An MLP with a Dropout and an nnx.Rngs it never draws from: typed PRNG keys (key<fry>)
  and uint32 counters in its non-param state."""

  def __init__(self, seed):
    rngs = nnx.Rngs(seed)
    self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=nnx.Rngs(seed + 1))
    self.spare = nnx.Rngs(seed + 2)

  def __call__(self, x):
    return self.down(self.drop(jax.nn.relu(self.up(x))))


def _dropout_run(seed, recipe):
  """(graphdef, TrainState of a fresh _DropoutMLP with a typed key as rng, jitted step)."""
  tx = _tx(recipe)
  graphdef, params, rest = nnx.split(_DropoutMLP(seed), nnx.Param, ...)
  state = checkpoint.TrainState(params, tx.init(params), rest, jax.random.key(seed + 3))

  @jax.jit
  def step(state, x, y):
    def loss(p):
      # copy=True: the merged model's variables belong to this trace, so Dropout may
      # advance its RngCount inside jax.grad (flax refuses it on outer-trace variables).
      m = nnx.merge(graphdef, p, state.model_state, copy=True)
      return jnp.mean((m(x) - y) ** 2), nnx.state(m, nnx.Not(nnx.Param))

    (_, rest), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    updates, opt = tx.update(grads, state.opt_state, state.params)
    return state._replace(params=mp.optim.apply_updates(state.params, updates),
                          opt_state=opt, model_state=rest,
                          rng=jax.random.fold_in(state.rng, 1))

  return graphdef, state, step


def test_dropout_model_resumes_bit_exact_through_a_checkpoint(tmp_path):
  """N steps straight == N/2 steps, save, restore into a fresh model's state (other seed:
  every leaf differs), N/2 steps: params, moments, the Dropout's RNG key and counter, the
  unused Rngs and the typed rng key, bit for bit."""
  import json  # pylint: disable=g-import-not-at-top

  recipe = mp.get_recipe("fp32")
  _, state0, step = _dropout_run(0, recipe)
  rng = np.random.default_rng(0)
  batches = [(rng.standard_normal((4, 8), np.float32), rng.standard_normal((4, 4), np.float32))
             for _ in range(4)]
  straight = state0
  for x, y in batches:
    straight = step(straight, x, y)
  half = state0
  for x, y in batches[:2]:
    half = step(half, x, y)
  checkpoint.save(tmp_path, 2, half, recipe=recipe)

  _, target, _ = _dropout_run(1, recipe)
  r = checkpoint.restore(tmp_path, target)
  assert_bit_identical(r.state, half)
  resumed = r.state
  for x, y in batches[2:]:
    resumed = step(resumed, x, y)
  assert_bit_identical(resumed, straight)
  rest = straight.model_state
  assert int(rest["drop"]["rngs"]["count"][...]) == 4      # one draw per step
  assert int(rest["spare"]["default"]["count"][...]) == 0  # never drawn
  # The checksums record each key as the key it is; the Orbax item holds uint32 data.
  arrays = json.loads((tmp_path / "2" / "integrity.json").read_text())["arrays"]
  assert arrays["model_state/drop/rngs/key"] == {
      **arrays["model_state/drop/rngs/key"], "dtype": "key<fry>", "shape": [],
      "key_impl": "threefry2x32"}
  assert arrays["model_state/drop/rngs/count"]["dtype"] == "uint32"
  from precision.checkpoint import _orbax  # pylint: disable=g-import-not-at-top
  held = _orbax.item_tree(str(tmp_path / "2" / "state"), "item")
  key_meta = held["model_state"]["drop"]["rngs"]["key"]
  key_meta = key_meta.get("value", key_meta) if isinstance(key_meta, dict) else key_meta
  assert (tuple(key_meta.shape), np.dtype(key_meta.dtype)) == ((2,), np.uint32)


def test_keys_restore_into_shape_dtype_structs_and_other_impls_do_not_fit(tmp_path):
  recipe = mp.get_recipe("fp32")
  _, state, _ = _dropout_run(0, recipe)
  checkpoint.save(tmp_path, 1, state, recipe=recipe)
  _, target, _ = _dropout_run(5, recipe)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
  assert abstract.rng.dtype == jax.random.key(0).dtype
  r = checkpoint.restore(tmp_path, abstract)
  assert_bit_identical(r.state, state)
  assert jax.dtypes.issubdtype(r.state.model_state["drop"]["rngs"]["key"][...].dtype,
                               jax.dtypes.prng_key)
  # Replicated on a mesh (the key data's sharding follows the key's), and through a
  # cross-recipe restore, which carries the model state over as it is.
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  r = checkpoint.restore(tmp_path, abstract, mesh=mesh)
  assert_bit_identical(r.state, state)
  assert r.state.rng.sharding.is_fully_replicated and len(r.state.rng.sharding.device_set) > 1
  bf16 = mp.get_recipe("bf16_master")
  params = bf16.policy.cast_to_param(target.params)
  r = checkpoint.restore(tmp_path, target._replace(params=params,
                                                   opt_state=_tx(bf16).init(params)),
                         recipe=bf16, optimizer_for=_tx)
  assert r.converted and r.state.params["up"]["kernel"][...].dtype == jnp.bfloat16
  assert_bit_identical((r.state.model_state, r.state.rng), (state.model_state, state.rng))
  # A key restores into keys of the impl it was saved with; another impl, or raw uint32
  # key data, does not fit, and the error names the leaf and both dtypes.
  rbg = target._replace(rng=jax.random.key(0, impl="rbg"))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"leaf 'rng': checkpoint has \(\) key<fry>, the target expects "
                           r"\(\) key<rbg>"):
    checkpoint.restore(tmp_path, rbg)
  raw = target._replace(rng=jax.random.key_data(target.rng))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"leaf 'rng': checkpoint has \(\) key<fry>, the target expects "
                           r"\(2,\) uint32"):
    checkpoint.restore(tmp_path, raw)
