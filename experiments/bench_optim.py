"""Optimizer update time and transient memory of each recipe's optimizer, side by side.

`python -m experiments.bench_optim [--quick] [--repeats R]` prints, for 10M parameters
(1M with --quick), one jitted step (update + apply_updates, params and state donated) of
every preset's `build_optimizer` around optax.adamw and of the transforms it is made of,
as the median over R interleaved rounds (each round times every row once, in a new
shuffled order, so slow drifts of the machine and a row's place in the round hit every
row alike) of the row's time over the baseline's in that round. The baseline is a
hand-written f32-master AdamW on bf16 params, written as a training loop would; a second
ratio is over `master_weights(optax.adamw)` without any guard, the library's own update
less the guard. Beside each ratio: the compiled program's temporary memory
(`memory_analysis().temp_size_in_bytes`) per parameter, the transient memory the step
needs beyond its donated arguments. `run(quick)` returns the same figures as a dict.
CPU figures unless a GPU is present; the backend is printed with them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import precision as mp

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from precision import optim as po  # noqa: E402

BASELINE = "hand-written f32 master (bf16)"
UNGUARDED = "master_weights, no guard (bf16)"  # the library's own update without a guard
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.1


class _HandMaster:
  """AdamW on an f32 master with bf16 params, no guard: the arithmetic of
  ``master_weights(optax.adamw)`` written out, as a training loop would by hand."""

  def init(self, params):
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return (jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.copy, zeros), master)

  def step(self, params, state, grads):
    count, mu, nu, master = state
    count = count + 1
    c = count.astype(jnp.float32)
    bc1, bc2 = 1 - jnp.float32(B1) ** c, 1 - jnp.float32(B2) ** c

    def one(g, m, v, w):
      g = g.astype(jnp.float32)
      m = B1 * m + (1 - B1) * g
      v = B2 * v + (1 - B2) * g * g
      w = w - LR * ((m / bc1) / (jnp.sqrt(v / bc2) + EPS) + WD * w)
      return m, v, w

    out = jax.tree.map(one, grads, mu, nu, master)
    mu, nu, master = (jax.tree.map(lambda t, i=i: t[i], out,
                                   is_leaf=lambda t: isinstance(t, tuple)) for i in range(3))
    return jax.tree.map(lambda w, p: w.astype(p.dtype), master, params), (count, mu, nu, master)


def _adamw():
  return optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def _rows():
  """name -> (optax transform or _HandMaster, param dtype)."""
  f32, bf16 = jnp.float32, jnp.bfloat16
  rows = {
      BASELINE: (_HandMaster(), bf16),
      "optax.adamw (f32)": (_adamw(), f32),
      "master_weights, no guard (bf16)": (po.master_weights(_adamw()), bf16),
      "optax.apply_if_finite (f32)": (optax.apply_if_finite(_adamw(), 10), f32),
      "skip_nonfinite (f32)": (po.skip_nonfinite(_adamw()), f32),
      "loss_scaling dynamic (f32)": (po.loss_scaling(_adamw(), po.DynamicLossScale(2.0 ** 15)), f32),
      "moment_dtypes bf16/bf16, no guard (bf16)": (po.moment_dtypes(_adamw(), bf16, bf16), bf16),
      "kahan_updates, no guard (bf16)": (po.kahan_updates(_adamw()), bf16),
  }
  for name in ("fp32", "bf16_mixed", "bf16_master", "bf16_sr", "bf16_kahan", "pure_bf16",
               "f16_mixed"):
    recipe = mp.get_recipe(name)
    rows[f"build_optimizer {name}"] = (po.build_optimizer(recipe, _adamw()),
                                       recipe.policy.param_dtype)
  fused = mp.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)
  rows["build_optimizer bf16_sr fused=True"] = (
      po.build_optimizer(fused, po.fused_adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)), bf16)
  spiky = mp.get_recipe("bf16_master").replace(name="bf16_master_sg",
                                               spike_guard=mp.SpikeGuardConfig())
  rows["build_optimizer bf16_master + spike_guard"] = (po.build_optimizer(spiky, _adamw()), bf16)
  return rows


def _prepare(tx, n, dtype, donate=True):
  """(jitted step, compiled temp bytes, [params, state, grads]) for `tx` on n params."""
  shape = (n // 1024, 1024)
  params = {"w": jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)}
  grads = {"w": jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)}
  if isinstance(tx, _HandMaster):
    step, state = tx.step, tx.init(params)
  else:
    def step(p, s, g):
      # optax mixes Python scalars with int32 counts: standard promotion here.
      with jax.numpy_dtype_promotion("standard"):
        po.loss_scale_of(s)  # a training step reads the scale for its loss
        extra = {"value": jnp.zeros((), jnp.float32)} if isinstance(
            tx, optax.GradientTransformationExtraArgs) else {}
        # The library's step: update, apply_updates, state writes ordered after the params'.
        return po.update_and_apply(tx, g, s, p, **extra)

    with jax.numpy_dtype_promotion("standard"):
      state = tx.init(params)
  state = jax.tree.map(jnp.copy, state)  # adamw's mu and nu may share one zeros buffer
  with jax.numpy_dtype_promotion("standard"):
    fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    temp = fn.lower(params, state, grads).compile().memory_analysis().temp_size_in_bytes
    params, state = fn(params, state, grads)  # compile + warm up
  jax.block_until_ready(params)
  return fn, temp, [params, state, grads]


def _time_once(fn, args):
  t0 = time.perf_counter()
  with jax.numpy_dtype_promotion("standard"):
    args[0], args[1] = fn(*args)
  jax.block_until_ready(args[:2])
  return time.perf_counter() - t0


def _interleaved(prepared, repeats, baseline, second=None):
  """{name: (median seconds, median ratio over the baseline's time in the same round,
  the same over `second`'s time or None)}."""
  times = {k: [] for k in prepared}
  names = list(prepared)
  order = random.Random(0)
  for _ in range(repeats):
    # A new order each round: a row's place in the round (after which row, how long
    # after the last allocation) moves its time by up to 2x here, so no row keeps one.
    order.shuffle(names)
    for k in names:
      fn, _, args = prepared[k]
      times[k].append(_time_once(fn, args))
  ratio = lambda ts, ref: statistics.median([t / b for t, b in zip(ts, times[ref])])
  return {k: (statistics.median(ts), ratio(ts, baseline),
              ratio(ts, second) if second else None) for k, ts in times.items()}


def run(quick: bool = False, repeats: int | None = None) -> dict:
  """{"backend", "sizes", "repeats", "baseline", "unguarded", "seconds": {size: {name: s}},
  "ratio": {size: {name: x}} (over the baseline), "ratio_over_unguarded" (over
  master_weights without a guard, from the same rounds), "temp_bytes_per_param": {size:
  {name: b}}, "no_donation_ratio", "no_donation_temp_bytes_per_param"}."""
  sizes = [1 << 20] if quick else [10 << 20]
  repeats = repeats or (5 if quick else 15)
  out = {"backend": jax.default_backend(), "sizes": sizes, "repeats": repeats,
         "baseline": BASELINE, "unguarded": UNGUARDED, "seconds": {}, "ratio": {},
         "ratio_over_unguarded": {}, "temp_bytes_per_param": {},
         "no_donation_ratio": {}, "no_donation_temp_bytes_per_param": {}}
  for n in sizes:
    prepared = {k: _prepare(tx, n, dt) for k, (tx, dt) in _rows().items()}
    res = _interleaved(prepared, repeats, BASELINE, UNGUARDED)
    out["seconds"][n] = {k: s for k, (s, _, _) in res.items()}
    out["ratio"][n] = {k: r for k, (_, r, _) in res.items()}
    out["ratio_over_unguarded"][n] = {k: r for k, (_, _, r) in res.items()}
    out["temp_bytes_per_param"][n] = {k: p[1] / n for k, p in prepared.items()}
    del prepared
    # Without donation the update cannot write in place: these rows show what donation
    # buys once the guard no longer keeps the old state alive.
    undonated = {k: _prepare(tx, n, dt, donate=False) for k, (tx, dt) in _rows().items()
                 if k in (BASELINE, "skip_nonfinite (f32)", "build_optimizer bf16_master")}
    res = _interleaved(undonated, repeats, BASELINE)
    out["no_donation_ratio"][n] = {k: r for k, (_, r, _) in res.items()}
    out["no_donation_temp_bytes_per_param"][n] = {k: p[1] / n for k, p in undonated.items()}
  return out


def main():
  mp.enable_faithful_rounding()  # XLA flags: set here, before the first computation
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="1M params, 5 rounds")
  ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (15)")
  args = ap.parse_args()
  res = run(quick=args.quick, repeats=args.repeats)
  print(f"backend: {res['backend']}; {res['repeats']} interleaved rounds; ratio: median over "
        f"rounds of the row's step time over {res['baseline']!r} in the same round; temp: "
        "compiled temporary bytes per parameter")
  for n in res["sizes"]:
    print(f"{n / 2**20:.0f}M params{'':29s}{'ms':>9s}{'ratio':>8s}{'/unguarded':>11s}"
          f"{'temp B/param':>14s}")
    for k in res["ratio"][n]:
      print(f"  {k:44s}{res['seconds'][n][k] * 1e3:9.2f}{res['ratio'][n][k]:8.2f}"
            f"{res['ratio_over_unguarded'][n][k]:11.2f}"
            f"{res['temp_bytes_per_param'][n][k]:14.2f}")
    print("  without donation (ratio over the donated baseline's round is not comparable: "
          "over the undonated baseline):")
    for k, r in res["no_donation_ratio"][n].items():
      print(f"  {k:44s}{'':9s}{r:8.2f}{res['no_donation_temp_bytes_per_param'][n][k]:14.2f}")


if __name__ == "__main__":
  main()
