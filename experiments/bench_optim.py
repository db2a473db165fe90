"""Optimizer step time of each precision.optim transform over plain optax.adamw.

`python -m experiments.bench_optim [--quick]` prints, for 1M and 10M parameters, the
median time of one jitted step (update + apply_updates, state donated) of each transform
wrapped around optax.adamw, as a ratio over optax.adamw on f32 params, in one run.
`run(quick)` returns the same figures as a dict. CPU figures unless a GPU is present; the
backend is printed with them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import precision as mp

mp.enable_faithful_rounding()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from precision import optim as po  # noqa: E402


def _transforms():
  adamw = lambda: optax.adamw(1e-3, weight_decay=0.1)
  f32, bf16 = jnp.float32, jnp.bfloat16
  return {
      # name: (transform, param dtype)
      "optax.adamw (f32)": (adamw(), f32),
      "skip_nonfinite (f32)": (po.skip_nonfinite(adamw()), f32),
      "loss_scaling dynamic (f32)": (po.loss_scaling(adamw(), po.DynamicLossScale(2.0 ** 15)), f32),
      "master_weights nearest (bf16)": (po.master_weights(adamw()), bf16),
      "master_weights stochastic (bf16)": (po.master_weights(adamw(), rounding="stochastic"), bf16),
      "remainder_master_weights (bf16)": (po.remainder_master_weights(adamw()), bf16),
      "stochastic_updates (bf16)": (po.stochastic_updates(adamw()), bf16),
      "kahan_updates (bf16)": (po.kahan_updates(adamw()), bf16),
      "f32_update nearest (bf16)": (po.f32_update(adamw()), bf16),
      "moment_dtypes bf16/bf16 (f32)": (po.moment_dtypes(adamw(), bf16, bf16), f32),
      "build_optimizer bf16_master": (po.build_optimizer("bf16_master", adamw()), bf16),
      "build_optimizer f16_mixed": (po.build_optimizer("f16_mixed", adamw()), f32),
  }


def _time_step(tx, n, dtype, repeats, donate=True):
  params = {"w": jax.random.normal(jax.random.key(0), (n // 1024, 1024), jnp.float32).astype(dtype)}
  grads = {"w": jax.random.normal(jax.random.key(1), (n // 1024, 1024), jnp.float32).astype(dtype)}

  def step(p, s, g):
    # optax.adamw itself mixes Python scalars with int32 counts: standard promotion here.
    with jax.numpy_dtype_promotion("standard"):
      po.loss_scale_of(s)  # a training step reads the scale for its loss (synthetic grads here)
      u, s = tx.update(g, s, p)
      return po.apply_updates(p, u), s

  with jax.numpy_dtype_promotion("standard"):
    state = tx.init(params)
  state = jax.tree.map(jnp.copy, state)  # adamw's mu and nu may share one zeros buffer
  fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  params, state = fn(params, state, grads)  # compile + warm up
  jax.block_until_ready(params)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    params, state = fn(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run(quick: bool = False) -> dict:
  """{"backend", "sizes", "seconds": {size: {name: s}}, "ratio": {size: {name: x}}}."""
  sizes = [1 << 20] if quick else [1 << 20, 10 << 20]
  repeats = 3 if quick else 9
  out = {"backend": jax.default_backend(), "sizes": sizes, "seconds": {}, "ratio": {}}
  for n in sizes:
    secs = {name: _time_step(tx, n, dt, repeats) for name, (tx, dt) in _transforms().items()}
    base = secs["optax.adamw (f32)"]
    out["seconds"][n] = secs
    out["ratio"][n] = {k: v / base for k, v in secs.items()}
  # Without donation: the skip guard's select keeps the old state alive, which costs most
  # where plain adamw could update in place (donated); these rows separate the two effects.
  guards = ("optax.adamw (f32)", "skip_nonfinite (f32)", "loss_scaling dynamic (f32)")
  out["no_donation_seconds"], out["no_donation_ratio"] = {}, {}
  for n in sizes:
    secs = {name: _time_step(tx, n, dt, repeats, donate=False)
            for name, (tx, dt) in _transforms().items() if name in guards}
    out["no_donation_seconds"][n] = secs
    out["no_donation_ratio"][n] = {k: v / secs[guards[0]] for k, v in secs.items()}
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="1M params only, 3 repeats")
  res = run(quick=ap.parse_args().quick)
  sizes = res["sizes"]
  print(f"backend: {res['backend']}; median step time, ratio over optax.adamw (f32)")
  head = f"{'transform':36s}" + "".join(f"{f'{n / 2**20:.0f}M ms':>10s}{'ratio':>7s}" for n in sizes)
  print(head)
  for name in res["ratio"][sizes[0]]:
    row = f"{name:36s}"
    for n in sizes:
      row += f"{res['seconds'][n][name] * 1e3:10.2f}{res['ratio'][n][name]:7.2f}"
    print(row)
  print("without donation (params and state not updated in place):")
  for name in res["no_donation_ratio"][sizes[0]]:
    row = f"{name:36s}"
    for n in sizes:
      row += (f"{res['no_donation_seconds'][n][name] * 1e3:10.2f}"
              f"{res['no_donation_ratio'][n][name]:7.2f}")
    print(row)


if __name__ == "__main__":
  main()
