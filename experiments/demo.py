"""A real policy applied to a real training step: `python -m experiments.demo`.

Trains a small MLP regression for a few steps under a policy string, printing the dtypes
each stage lives in, the loss, and the swamping fact the recipes exist to fix.
"""

from __future__ import annotations

import argparse

import precision as mp

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from precision import formats  # noqa: E402


def init(key, sizes, dtype):
  keys = jax.random.split(key, len(sizes) - 1)
  return [{"w": (jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(a)).astype(dtype),
           "b": jnp.zeros((b,), dtype)} for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def forward(params, x, policy: mp.Policy):
  params, x = policy.cast_to_compute((params, x))
  for i, layer in enumerate(params):
    x = jnp.dot(x, layer["w"], preferred_element_type=jnp.float32).astype(policy.compute_dtype)
    x = x + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.gelu(x)
  return policy.cast_to_output(x)


def main(argv=None):
  mp.enable_faithful_rounding()  # XLA flags: set here, before the first computation
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--policy", default="p=f32,c=bf16,o=f32")
  ap.add_argument("--steps", type=int, default=50)
  args = ap.parse_args(argv)
  policy = mp.get_policy(args.policy)
  key = jax.random.key(0)
  params = init(key, [16, 64, 64, 1], policy.param_dtype)
  x = jax.random.normal(jax.random.key(1), (256, 16), jnp.float32)
  y = jnp.sin(x.sum(-1, keepdims=True))

  def loss_fn(p):
    pred = forward(p, x, policy).astype(jnp.float32)  # loss in f32
    return jnp.mean(jnp.square(pred - y))

  @jax.jit
  def step(p):
    loss, g = jax.value_and_grad(loss_fn)(p)
    return jax.tree.map(lambda w, gw: (w - 0.05 * gw).astype(w.dtype), p, g), loss

  print(f"policy {policy}: params {policy.param_dtype}, compute {policy.compute_dtype}, "
        f"output {policy.output_dtype}; faithful rounding {mp.faithful_rounding_enabled()}")
  for i in range(args.steps):
    params, loss = step(params)
    if i % 10 == 0 or i == args.steps - 1:
      print(f"step {i:3d}  loss {float(loss):.5f}")
  print("swamping check: bf16 1.0 + 1e-5 == 1.0 ->",
        bool(formats.swamped(1.0, 1e-5, "bf16")))


if __name__ == "__main__":
  main()
