"""A researcher's task with no Flax at all: a param pytree and a loss function, the way
Haiku- or Equinox-style code hands its params around (`loss(params, batch)`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision.study import Task

D_IN, HIDDEN, BATCH = 8, 16, 16
_W = np.random.default_rng(7).standard_normal((D_IN, 1)).astype(np.float32)


def init(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (D_IN, HIDDEN)) / np.sqrt(D_IN),
          "b1": jnp.zeros((HIDDEN,)),
          "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
          "b2": jnp.zeros((1,))}


def loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def batches(seed):
  rng = np.random.default_rng(seed)
  while True:
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    yield {"x": x, "y": np.sin(x @ _W).astype(np.float32)}


task = Task(init=init, loss=loss, batches=batches, optimizer=optax.adam(1e-2),
            name="params-mlp")
