"""The guarded optimizer updates its donated state in place, with the results it gave when
its selects came after the whole update.

`_previous_guard` below is the guard as it was written before the selects moved to where
each state leaf is defined (precision.optim._select): unscale by division, a separate
all-finite reduction and grad norm, the inner update, then a select of the whole state.
`_previous_kahan_updates` is the Kahan transform as it was before its two outputs each
computed their own update (precision.optim._recompute). Every preset's optimizer, taken
through the library's step (`precision.optim.update_and_apply`, which orders the narrow
state's writes after the params'), is run against them (built by the same
`build_optimizer` with the old pieces swapped in, applied by ``tx.update`` and
`apply_updates`) on grads with injected inf and NaN, and must agree bit for bit.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import precision
from precision import optim as po
from precision.optim import _clip
from precision.optim import _compat
from precision.optim import _find
from precision.optim import _guard
from precision.optim import _kahan
from precision.optim import _select
from precision.optim import _tree
from _asserts import assert_bit_identical

STEPS = 8
# step -> (leaf, flat index, value) injected into the grads of that step
FAULTS = {2: ("w", 5, np.inf), 4: ("b", 1, np.nan), 5: ("w", 0, -np.inf)}
PRESETS = [n for n in precision.PRESETS]


def _previous_guard(inner, loss_scale, axis_name, skip):
  """The guard's update as it was: selects after the inner update (copies the state)."""
  inner = _compat.compat(inner)

  def init_fn(params):
    z = jnp.zeros((), jnp.int32)
    return _guard.GuardState(inner.init(params), loss_scale, z, z, z, z,
                             jnp.zeros((), jnp.float32))

  def update_fn(grads, state, params=None, *, value=None):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32)
                         / state.loss_scale.loss_scale.astype(jnp.float32)
                         if _tree.is_float(g) else g, grads)
    finite = _tree.all_finite(grads)
    if value is not None:
      finite = jnp.logical_and(finite, jnp.all(jnp.isfinite(jnp.asarray(value))))
    if axis_name is not None:
      finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    norm = _clip.global_norm(grads, axis_name)
    updates, inner_state = inner.update(grads, state.inner_state, params)
    if skip:
      updates = jax.tree.map(lambda u: jnp.where(finite, u, _tree.neg_zero_like(u))
                             if _tree.is_float(u) else u, updates)
      inner_state = _tree.select(finite, inner_state, state.inner_state)
    one, zero = jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)
    bad = jnp.where(finite, zero, one)
    return updates, _guard.GuardState(
        inner_state, state.loss_scale.adjust(finite),
        state.skipped_steps + (bad if skip else zero), state.nonfinite_steps + bad,
        jnp.where(finite, state.consecutive_finite + 1, zero),
        jnp.where(finite, zero, state.consecutive_nonfinite + 1), norm)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))


def _previous_kahan_updates(inner):
  """`kahan_updates` as it was: one f32 update `u`, kept for both the new params and the
  new compensation (XLA stores it as an f32 temporary), deltas for `apply_updates`."""
  from precision.optim import _apply, _direct  # pylint: disable=g-import-not-at-top
  inner = _compat.compat(inner)

  def init_fn(params):
    comp = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype) if _tree.is_float(p) else p,
                        params)
    return _kahan.KahanState(comp, inner.init(_tree.cast(params, jnp.float32)))

  def update_fn(grads, state, params=None):
    _, u, inner_state = _direct.inner_update_f32(inner, "kahan_updates", grads,
                                                 state.inner_state, params)

    def one(p, d, c):
      if not _tree.is_float(p) or p.dtype.itemsize >= 4:
        return p, c
      f = p.astype(jnp.float32)
      y = d + c.astype(jnp.float32)
      new = (f + y).astype(p.dtype)
      return new, (y - (new.astype(jnp.float32) - f)).astype(c.dtype)

    pairs = jax.tree.map(one, params, u, state.compensation)
    new_params, comp = jax.tree.transpose(
        jax.tree.structure(params), jax.tree.structure((0, 0)), pairs)
    return _apply.deltas(new_params, params, u), _kahan.KahanState(comp, inner_state)

  return _compat.own(optax.GradientTransformation(init_fn, update_fn))


def _as_before(monkeypatch):
  """The guard and the Kahan transform as they were (see the module docstring)."""
  monkeypatch.setattr(_guard, "_guard", _previous_guard)
  monkeypatch.setattr(_kahan, "kahan_updates", _previous_kahan_updates)


def _params(dtype, n_rows=16):
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.standard_normal((n_rows, 24)), jnp.float32).astype(dtype),
          "b": jnp.asarray(0.1 * rng.standard_normal((24,)), jnp.float32).astype(dtype)}


def _grads(step, params):
  rng = np.random.default_rng(100 + step)
  g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
  if step in FAULTS:
    leaf, i, val = FAULTS[step]
    g[leaf].reshape(-1)[i] = val
  return g


def _optimizer(recipe, inner_fn):
  if recipe.fused:
    return po.build_optimizer(recipe, po.fused_adamw(1e-2, weight_decay=0.1), seed=3)
  return po.build_optimizer(recipe, inner_fn(), seed=3)


def _trajectory(recipe, inner_fn, donate, losses=None):
  """Params and optimizer state after each of STEPS (or len(losses)) jitted, (un)donated
  steps; `losses` are passed as ``value=`` (a spike guard needs them). A donated run takes
  the library's step (`update_and_apply`), an undonated one ``tx.update`` and
  `apply_updates`, as a loop wrote it before."""
  library_step = donate
  tx = _optimizer(recipe, inner_fn)
  params = _params(recipe.policy.param_dtype)

  def step(p, s, g, loss):
    with jax.numpy_dtype_promotion("standard"):
      scale = po.loss_scale_of(s)  # the grads of a scaled loss are `scale` times larger
      g = jax.tree.map(lambda x, q: (x * scale).astype(q.dtype), g, p)
      extra = {} if losses is None else {"value": loss}
      if library_step:
        return po.update_and_apply(tx, g, s, p, **extra)
      u, s = tx.update(g, s, p, **extra)
      return po.apply_updates(p, u), s

  fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  with jax.numpy_dtype_promotion("standard"):
    state = jax.tree.map(jnp.copy, tx.init(params))
  out = []
  for t in range(STEPS if losses is None else len(losses)):
    loss = np.float32(0.0 if losses is None else losses[t])
    params, state = fn(params, state, _grads(t, params), loss)
    out.append(jax.tree.map(np.asarray, (params, state)))
  return out


def _inner_adamw():
  return optax.adamw(1e-2, weight_decay=0.1)


def _recipes():
  out = [precision.get_recipe(n) for n in PRESETS]
  out.append(precision.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True))
  return out


UNSCALED = [r for r in _recipes() if r.loss_scale.kind == "none"]


@pytest.mark.parametrize("recipe", UNSCALED, ids=lambda r: r.name)
def test_every_recipe_bit_identical_to_the_previous_guard(recipe, monkeypatch):
  new = _trajectory(recipe, _inner_adamw, donate=True)
  _as_before(monkeypatch)
  old = _trajectory(recipe, _inner_adamw, donate=False)
  _compare(new, old)


@pytest.mark.parametrize("inner_fn", [_inner_adamw, lambda: optax.sgd(1e-2)],
                         ids=["adamw", "sgd"])
def test_loss_scaled_recipe_matches_the_previous_guard(inner_fn, monkeypatch):
  """f16_mixed: the skips, the loss scale and the counters are the same bit for bit. The
  params and moments are the same arithmetic, but XLA:CPU contracts multiply-adds into
  FMAs (vfmadd in its object code) fusion by fusion, and the unscaled grads are now fused
  into the update instead of kept in a temporary, so with Adam an element may move by
  one rounding. With plain SGD (one multiply-add per element in both programs) they agree bit
  for bit."""
  recipe = precision.get_recipe("f16_mixed")
  new = _trajectory(recipe, inner_fn, donate=True)
  _as_before(monkeypatch)
  old = _trajectory(recipe, inner_fn, donate=False)
  if inner_fn is _inner_adamw:
    for (p_new, s_new), (p_old, s_old) in zip(new, old):
      g_new = _find.find_state(s_new, _guard.GuardState)
      g_old = _find.find_state(s_old, _guard.GuardState)
      # One rounding of multiply-adds of O(1) terms: within 2.5e-7 absolute (moments near
      # zero cancel, so a relative or ulp bound would not hold).
      for a, b in zip(jax.tree.leaves((p_new, g_new.inner_state)),
                      jax.tree.leaves((p_old, g_old.inner_state))):
        np.testing.assert_allclose(a, b, rtol=0, atol=2.5e-7)
      assert_bit_identical(
          (g_new.loss_scale, g_new.skipped_steps, g_new.nonfinite_steps,
           g_new.consecutive_finite, g_new.consecutive_nonfinite),
          (g_old.loss_scale, g_old.skipped_steps, g_old.nonfinite_steps,
           g_old.consecutive_finite, g_old.consecutive_nonfinite))
    return
  _compare(new, old)


def _compare(new, old):
  for t, ((p_new, s_new), (p_old, s_old)) in enumerate(zip(new, old)):
    assert_bit_identical(p_new, p_old, f"params after step {t}")
    g_new = _find.find_state(s_new, _guard.GuardState)
    g_old = _find.find_state(s_old, _guard.GuardState)
    # The grad norm is the one field that may differ: the same sum of squares, reduced in
    # the order XLA picks for the fused reduction (the previous program summed a
    # materialised square), so within a few ulps; and on a non-finite step NaN (the sum
    # that also decides finiteness), where an inf without a NaN gave inf.
    if t in FAULTS:
      assert np.isnan(g_new.grad_norm) and not np.isfinite(g_old.grad_norm)
    else:
      np.testing.assert_allclose(g_new.grad_norm, g_old.grad_norm, rtol=4e-7)
    assert_bit_identical(_replace_guard_norm(s_new, g_old.grad_norm), s_old,
                         f"optimizer state after step {t}")
  final = po.optimizer_metrics(new[-1][1])
  assert int(final["skipped_steps"]) == int(final["nonfinite_steps"]) == len(FAULTS)


def test_spike_guard_bit_identical_to_selecting_after_the_update(monkeypatch):
  """The spike guard decides inside the non-finite guard (`veto`) and places its selects
  there; selecting the whole inner state after the update (what it did before, and still
  does around a guard nested deeper) gives the same trajectory bit for bit: a spike
  skipped, the non-finite steps skipped, the window and counters alike."""
  recipe = precision.get_recipe("bf16_master").replace(
      name="bf16_master_sg", spike_guard=precision.SpikeGuardConfig(window=8, min_history=4))
  losses = [2.0 - 0.01 * t for t in range(12)]
  losses[9] = 50.0  # a loss spike after the window has filled
  new = _trajectory(recipe, _inner_adamw, donate=True, losses=losses)
  from precision.optim import _spike  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_spike._guard, "takes_veto", lambda tx: False)
  old = _trajectory(recipe, _inner_adamw, donate=False, losses=losses)
  for t, (a, b) in enumerate(zip(new, old)):
    assert_bit_identical(a, b, f"step {t}")
  metrics = po.spike_metrics(new[-1][1])
  assert int(metrics["spike_skipped_steps"]) == 1
  assert int(po.optimizer_metrics(new[-1][1])["nonfinite_steps"]) == len(FAULTS)


def _replace_guard_norm(state, norm):
  def fix(x):
    return x._replace(grad_norm=norm) if isinstance(x, _guard.GuardState) else x
  return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, _guard.GuardState))


@pytest.mark.parametrize("inner_fn", [
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    lambda: optax.lamb(1e-2),
    lambda: optax.adafactor(1e-2),
], ids=["clip_adam", "lamb", "adafactor"])
@pytest.mark.parametrize("name", ["bf16_master", "bf16_kahan", "pure_bf16"])
def test_non_elementwise_optimizers_bit_identical(inner_fn, name, monkeypatch):
  """Optimizers with reductions inside (global-norm clip, LAMB's trust ratio, Adafactor's
  factored moments) keep their results under the moved selects, under Kahan's update
  recomputed from the new state, and under the ordered narrow moments."""
  recipe = precision.get_recipe(name)
  new = _trajectory(recipe, inner_fn, donate=True)
  _as_before(monkeypatch)
  old = _trajectory(recipe, inner_fn, donate=False)
  for t, ((p_new, s_new), (p_old, s_old)) in enumerate(zip(new, old)):
    assert_bit_identical(p_new, p_old, f"params after step {t}")
    if t not in FAULTS:
      assert_bit_identical(s_new, s_old, f"optimizer state after step {t}")


def test_skip_unless_eager_and_fallback_agree_with_the_traced_path():
  """Eager calls and updates with side effects take the select-after path; the results
  are the traced path's, bit for bit, skipped or not."""
  params = _params(jnp.float32)
  tx = optax.adam(1e-2)
  state = tx.init(params)
  grads = jax.tree.map(jnp.asarray, _grads(0, params))
  seen = []

  def with_effect(g, s, p):  # a host callback: the traced jaxpr has effects
    jax.debug.callback(lambda c: seen.append(int(c)), s[0].count)
    return tx.update(g, s, p)

  run = lambda update: jax.jit(lambda o, g, s, p: _select.skip_unless(o, update, g, s, p))
  with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int counts
    _effects_and_eager(run, tx, with_effect, grads, state, params)
  jax.effects_barrier()
  assert seen == [0, 0]


def _effects_and_eager(run, tx, with_effect, grads, state, params):
  for ok in (True, False):
    okay = jnp.asarray(ok)
    traced = run(tx.update)(okay, grads, state, params)
    assert_bit_identical(run(with_effect)(okay, grads, state, params), traced)
    # Eagerly: update's own result and select (XLA:CPU evaluates optax's helpers op by op
    # there, which may move an element by an ulp against any jitted program).
    u, s = tx.update(grads, state, params)
    want = (u, s) if ok else (jax.tree.map(lambda x: jnp.full_like(x, -0.0), u), state)
    assert_bit_identical(_select.skip_unless(okay, tx.update, grads, state, params), want)
    if not ok:
      assert_bit_identical(traced[1], state)
      assert all(np.all(np.signbit(u)) and np.all(u == 0) for u in jax.tree.leaves(traced[0]))


# --- the compiled program: no copy of a state buffer, no temporaries ----------------------

N_ROWS = 256  # 256 x 1024 + 1024 params: large enough for XLA to pick its large-array path


def _compiled(recipe_name, ordered=True):
  """The compiled step of `recipe_name` ("name" or "name+variant") on N_ROWS x 1024 + 1024
  params, donated; `ordered`: the library's step, else ``tx.update`` + `apply_updates`."""
  name, _, variant = recipe_name.partition("+")
  spike = variant == "spike_guard"
  recipe = precision.get_recipe(name)
  if spike:
    recipe = recipe.replace(name=recipe_name, spike_guard=precision.SpikeGuardConfig())
  if variant == "fused":
    recipe = recipe.replace(name=recipe_name, fused=True)
    tx = po.build_optimizer(recipe, po.fused_adamw(1e-3, weight_decay=0.1))
  else:
    tx = po.build_optimizer(recipe, optax.adamw(1e-3, weight_decay=0.1))
  dt = recipe.policy.param_dtype
  params = {"w": jnp.zeros((N_ROWS, 1024), dt), "b": jnp.zeros((1024,), dt)}
  extra = {"value": jnp.zeros((), jnp.float32)} if spike else {}
  step = _update_step(tx, ordered=ordered, **extra)

  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
  n = sum(x.size for x in jax.tree.leaves(params))
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
  return compiled, n


def _large_copies(hlo_text):
  """Copies of a parameter-sized buffer in an HLO module's text."""
  return [line for line in hlo_text.splitlines()
          if re.search(r"= \w+\[(\d+,)*\d{3,}[\d,]*\]\S* copy\(", line)]


# Every recipe's step (`update_and_apply`) updates its state in place: pure_bf16's bf16
# moments, which the param update reads at their old f32 value, are written after the
# params (`order_after`). bf16_kahan is tested on its own below.
IN_PLACE = ["fp32", "bf16_mixed", "bf16_master", "bf16_sr", "pure_bf16", "f16_mixed",
            "fp8_hybrid", "bf16_master+spike_guard", "bf16_sr+fused"]


@pytest.mark.parametrize("name", IN_PLACE)
def test_guarded_update_is_in_place(name):
  compiled, n = _compiled(name)
  text = compiled.as_text()
  assert not _large_copies(text), _large_copies(text)[:3]
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= n, f"{temp / n:.2f} bytes/param of temporaries"
  # Every donated buffer is aliased to its output (input_output_alias in the header).
  assert "input_output_alias" in text.splitlines()[0]


def test_without_the_order_pure_bf16_copies_its_moments():
  """The check above can fail: ``tx.update`` + `apply_updates` without `order_after` keeps
  the old bf16 mu and nu of both leaves alive past their in-place write (four copies, 4
  bytes/param)."""
  compiled, n = _compiled("pure_bf16", ordered=False)
  assert len(_large_copies(compiled.as_text())) == 4
  assert compiled.memory_analysis().temp_size_in_bytes >= 4 * n


def test_kahan_update_keeps_one_copy_of_the_params():
  """bf16_kahan: the new params and the new compensation each read both old buffers (the
  param, the compensation), so one of them must outlive the other's in-place write
  unless one loop writes both (a multi-output fusion, which XLA:CPU does not form here).
  What is left is that one bf16 copy, 2 bytes/param: the f32 update is recomputed by each
  output (`_recompute`) instead of kept (the transform as it was held 8 bytes/param)."""
  compiled, n = _compiled("bf16_kahan")
  copies = _large_copies(compiled.as_text())
  # One copy per param leaf (w and b), of the params, in bf16.
  assert len(copies) == 2 and all(" bf16[" in c and "copy(%p_" in c for c in copies), copies
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= 2 * n + 4096, f"{temp / n:.2f} bytes/param"


def test_previous_kahan_kept_the_update():
  import unittest.mock  # pylint: disable=g-import-not-at-top
  with unittest.mock.patch.object(_kahan, "kahan_updates", _previous_kahan_updates):
    compiled, n = _compiled("bf16_kahan")
  assert compiled.memory_analysis().temp_size_in_bytes >= 8 * n


def test_previous_guard_copied_the_state():
  """The measurement above can fail: the guard as it was copies mu, nu and the master."""
  import unittest.mock  # pylint: disable=g-import-not-at-top
  with unittest.mock.patch.object(_guard, "_guard", _previous_guard):
    compiled, n = _compiled("bf16_master")
  assert len(_large_copies(compiled.as_text())) >= 3
  assert compiled.memory_analysis().temp_size_in_bytes >= 4 * n


# --- the CUDA lowering: donated buffers aliased, and nothing but its own new value reads
# --- an old state buffer (what lets XLA update it in place without a copy) -------------


def _update_step(tx, ordered=True, **extra):
  """One optimizer step as a training loop writes it (reads the scale first): the
  library's `update_and_apply`, or (not `ordered`) ``tx.update`` + `apply_updates`;
  `extra` goes to ``tx.update`` (a spike guard's ``value=``)."""

  def step(p, s, g):
    with jax.numpy_dtype_promotion("standard"):
      po.loss_scale_of(s)
      if ordered:
        return po.update_and_apply(tx, g, s, p, **extra)
      u, s = tx.update(g, s, p, **extra)
      return po.apply_updates(p, u), s

  return step


def _cuda_module(recipe_name, ordered=True):
  recipe = precision.get_recipe(recipe_name)
  tx = po.build_optimizer(recipe, optax.adamw(1e-3, weight_decay=0.1))
  dt = recipe.policy.param_dtype
  params = {"w": jnp.zeros((64, 32), dt), "b": jnp.zeros((32,), dt)}

  step = _update_step(tx, ordered=ordered)

  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
    # Stochastic rounding lowers to a Pallas (Triton) kernel on CUDA.
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(step, donate_argnums=(0, 1)), platforms=["cuda"],
                                 disabled_checks=[triton])(params, state, params)
  return exported.mlir_module()


def _read_after_write(module_text):
  """Donated array arguments of `main` whose old value reaches a result other than the
  one it is aliased to without passing through that result's value, where the aliased
  result is not computed from that other result (so nothing orders the read before the
  overwrite: XLA copies the old buffer). Calls count as reading all operands."""
  main = module_text[module_text.index("func.func public @main"):]
  main = main[:main.index("\n  } loc(")]
  header, body = main.split("{\n", 1)[0], main.split(") {\n", 1)[1]
  aliased = {int(a): int(o) for a, o in re.findall(
      r"%arg(\d+): tensor<\d[^>]*> \{[^}]*tf\.aliasing_output = (\d+)", header)}
  deps = []  # (defined names, operand names) in program order
  returned = None
  for line in body.splitlines():
    line = line.split(" loc(")[0].strip()
    if line.startswith("return ") or line.startswith("stablehlo.return "):
      returned = re.findall(r"%[\w#.]+", line.split(":")[0])
      continue
    m = re.match(r"((?:%[\w#.]+(?::\d+)?,?\s*)+)=\s*(.*)", line)
    if m:
      names = [n.split(":")[0] for n in re.findall(r"%[\w#.]+(?::\d+)?", m.group(1))]
      deps.append((names, re.findall(r"%[\w.]+", m.group(2))))
  assert returned is not None
  bad = []
  results = {r.split("#")[0] for r in returned}
  for arg, out in aliased.items():
    sink = returned[out].split("#")[0]
    before = _ancestors(deps, sink)
    # A result the sink is computed from is complete (written to its own buffer) before
    # the sink overwrites the argument: what is computed from it does not read the
    # argument again.
    done = results & before
    tainted = {f"%arg{arg}"}
    for names, operands in deps:
      if any(o.split("#")[0] in tainted - done for o in operands):
        tainted.update(n.split("#")[0] for n in names if n.split("#")[0] != sink)
    leaks = [k for k, r in enumerate(returned) if k != out and r.split("#")[0] in tainted
             and r.split("#")[0] not in before]
    if leaks:
      bad.append((arg, out, leaks))
  return bad


def _ancestors(deps, name):
  """The values `name` is computed from (transitively), in `_read_after_write`'s deps."""
  made_by = {}
  for names, operands in deps:
    for n in names:
      made_by[n.split("#")[0]] = [o.split("#")[0] for o in operands]
  seen, todo = set(), [name]
  while todo:
    for o in made_by.get(todo.pop(), []):
      if o not in seen:
        seen.add(o)
        todo.append(o)
  return seen


@pytest.mark.parametrize("name", ["bf16_master", "f16_mixed", "bf16_sr", "pure_bf16"])
def test_cuda_lowering_aliases_state_and_reads_it_once(name):
  text = _cuda_module(name)
  assert text.count("tf.aliasing_output") >= 6  # params, master/moments, counters
  assert _read_after_write(text) == []


def test_cuda_lowering_of_kahan_keeps_only_the_params_old_value():
  """bf16_kahan on CUDA: every state buffer is read before its overwrite, except the one
  the two outputs share (see test_kahan_update_keeps_one_copy_of_the_params): the old
  params reach the new compensation, which is ordered after the params."""
  text = _cuda_module("bf16_kahan")
  bad = _read_after_write(text)
  assert [arg for arg, _, _ in bad] == [0, 1], bad  # the params' two leaves (b, w)


def test_cuda_lowering_of_pure_bf16_without_the_order_reads_old_moments():
  """The ordering is what makes pure_bf16 pass: without `order_after`, the old bf16
  moments reach the new params with nothing ordering that read before their overwrite."""
  text = _cuda_module("pure_bf16", ordered=False)
  assert len({arg for arg, _, _ in _read_after_write(text)}) >= 4  # mu and nu of b and w


def test_cuda_lowering_of_the_previous_guard_read_old_state():
  """The check above can fail: with the selects after the update, the params are computed
  from the old moments and master (their unselected new values)."""
  import unittest.mock  # pylint: disable=g-import-not-at-top
  with unittest.mock.patch.object(_guard, "_guard", _previous_guard):
    bad = _read_after_write(_cuda_module("bf16_master"))
  assert len({arg for arg, _, _ in bad}) >= 3, bad


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("keep_master", [False, True])
def test_fused_adamw_skips_inside_its_pass(impl, keep_master):
  """`FusedAdamW.update(..., apply=False)`: moments, master and count come back bit for
  bit from the fused pass itself (the Pallas kernel interpreted on a CPU), and apply=True
  takes the unguarded step."""
  from precision.rounding import FusedAdamW  # pylint: disable=g-import-not-at-top
  opt = FusedAdamW(learning_rate=1e-2, weight_decay=0.1, seed=5, keep_master=keep_master,
                   impl=impl, interpret=True if impl == "pallas" else None)
  params = _params(jnp.bfloat16)
  with jax.numpy_dtype_promotion("standard"):
    state = po.fused_adamw(1e-2, keep_master=keep_master).init(params)
  grads = jax.tree.map(jnp.asarray, _grads(1, params))
  for _ in range(2):  # a second step so that the moments are not zeros
    params, state = jax.jit(opt.update)(grads, state, params)
  skipped = jax.jit(opt.update)(grads, state, params, jnp.asarray(False))[1]
  assert_bit_identical(skipped, state)
  taken = jax.jit(opt.update)(grads, state, params, jnp.asarray(True))
  plain = jax.jit(opt.update)(grads, state, params)
  # The same arithmetic in two programs (XLA:CPU contracts multiply-adds per fusion, see
  # above); inside the guard the fused recipe is bit-identical to bf16_sr
  # (tests/test_fused_adamw.py) and to the previous guard (above).
  for a, b in zip(jax.tree.leaves(taken[1]), jax.tree.leaves(plain[1])):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("name", ["bf16_master", "f16_mixed", "pure_bf16"])
def test_zero_sharded_update_is_in_place(name):
  """The optimizer on ZeRO shards (`axis_name`, inside shard_map over 8 devices, as
  precision.parallel runs it): the norm and finiteness psum-ed, and still no copy of a
  state shard and no temporaries the size of the shards."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  recipe = precision.get_recipe(name)
  mesh = jax.make_mesh((8,), ("data",))
  tx = po.build_optimizer(recipe, optax.adamw(1e-3, weight_decay=0.1), axis_name="data")
  dt = recipe.policy.param_dtype
  n = 8 * 32768
  params = {"w": jnp.zeros((n,), dt)}

  local = _update_step(tx)

  with jax.numpy_dtype_promotion("standard"):
    state = jax.eval_shape(tx.init, jax.tree.map(lambda x: x[: n // 8], params))
  # Array leaves are sharded along the axis, scalars replicated (precision.parallel's
  # layout of the flat optimizer state).
  spec = lambda t: jax.tree.map(lambda x: P("data") if x.ndim else P(), t)
  sharding = lambda x: jax.sharding.NamedSharding(mesh, P("data") if x.ndim else P())
  shard = lambda t, k=1: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((x.shape[0] * k,) if x.ndim else (), x.dtype,
                                     sharding=sharding(x)), t)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec(params), spec(state), spec(params)),
                     out_specs=(spec(params), spec(state)))
  compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(
      shard(params), shard(state, 8), shard(params)).compile()
  text = compiled.as_text()
  assert not _large_copies(text), _large_copies(text)[:3]
  assert "all-reduce" in text  # the sum of squares, across the shards
  assert compiled.memory_analysis().temp_size_in_bytes <= n


# --- the pieces: order_after and update_twice change no value ---------------------------


def _edge_bits(dtype, shape):
  """Every bit pattern class of `dtype` (zeros of both signs, subnormals, inf, NaN
  payloads) among random words, in `shape`."""
  width = np.dtype(dtype).itemsize
  rng = np.random.default_rng(7)
  words = rng.integers(0, 2 ** (8 * width), size=int(np.prod(shape)), dtype=np.uint64)
  edges = [0, 1 << (8 * width - 1), 1, (1 << (8 * width)) - 1,
           0x7F80 if width == 2 else 0x7C, 0x7FC1 if width == 2 else 0x7F]
  words[:min(6, words.size)] = edges[:words.size]
  uint = {1: np.uint8, 2: np.uint16}[width]
  return jnp.asarray(words.astype(uint).view(dtype).reshape(shape))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn,
                                   jnp.float8_e5m2])
def test_order_after_changes_no_bit(dtype):
  """Narrow leaves of a params-mirroring subtree come back bit for bit (NaN payloads,
  -0.0, subnormals), jitted and eagerly; wider leaves and other subtrees are the same
  objects; a single-array params tree and an empty one work too."""
  params = {"w": _edge_bits(jnp.bfloat16, (64, 8)), "b": _edge_bits(jnp.bfloat16, (8,))}
  state = (jnp.zeros((), jnp.int32),
           {"w": _edge_bits(dtype, (64, 8)), "b": _edge_bits(dtype, (8,))},
           {"w": jnp.ones((64, 8), jnp.float32), "b": jnp.ones((8,), jnp.float32)},
           [_edge_bits(dtype, (3,))])
  for fn in (po.order_after, jax.jit(po.order_after)):
    out = fn(state, params)
    assert_bit_identical(out, state)
  out = po.order_after(state, params)
  assert out[2]["w"] is state[2]["w"] and out[3][0] is state[3][0]
  assert out[1]["w"] is not state[1]["w"]  # the narrow mirror leaf was re-expressed
  single = jax.jit(po.order_after)(state[1]["w"], params["w"])
  assert_bit_identical(single, state[1]["w"])
  assert po.order_after(state, {}) is state


def test_order_after_on_nnx_state():
  """The mirror of an NNX model's params (optax state built on ``nnx.state(model,
  nnx.Param)``) is found and ordered; values unchanged."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
  params = nnx.state(model, nnx.Param)
  tx = po.moment_dtypes(optax.adam(1e-3), jnp.bfloat16, jnp.bfloat16)
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
  jaxpr = jax.make_jaxpr(po.order_after)(state, params)
  assert sum(e.primitive.name == "population_count" for e in jaxpr.eqns) == 4  # mu, nu x 2
  assert_bit_identical(jax.jit(po.order_after)(state, params), state)


@pytest.mark.parametrize("inner_fn", [
    lambda: optax.adamw(1e-2, weight_decay=0.1),
    lambda: optax.lamb(1e-2),
    lambda: optax.adafactor(1e-2),
    lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
], ids=["adamw", "lamb", "adafactor", "nesterov"])
def test_update_twice_recomputes_the_same_bits(inner_fn):
  """The second evaluation (from the new state, read back opaque) gives the first's
  updates bit for bit, jitted; eagerly the update runs once."""
  from precision.optim import _recompute  # pylint: disable=g-import-not-at-top
  tx = inner_fn()
  params = _params(jnp.float32)
  grads = jax.tree.map(jnp.asarray, _grads(1, params))
  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
    _, state = tx.update(grads, state, params)  # moments that are not zeros
    u, new, again = jax.jit(lambda g, s, p: _recompute.update_twice(tx.update, g, s, p))(
        grads, state, params)
    want_u, want_state = jax.jit(tx.update)(grads, state, params)
    eager = _recompute.update_twice(tx.update, grads, state, params)
  assert_bit_identical(again, u)
  assert_bit_identical((u, new), (want_u, want_state))
  assert eager[2] is eager[0]
