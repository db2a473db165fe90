"""A researcher's own task, written outside the library: an NNX MLP with biases and
LayerNorm on a synthetic regression (a fixed random teacher network plus noise)."""

import numpy as np
import optax
import jax.numpy as jnp
from flax import nnx

from precision.study import Task

D_IN, HIDDEN, D_OUT, BATCH = 16, 32, 4, 32
_TEACHER = np.random.default_rng(1234).standard_normal((D_IN, D_OUT)).astype(np.float32)


class MLP(nnx.Module):
  def __init__(self, *, rngs):
    self.fc1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
    self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
    self.fc2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

  def __call__(self, x):
    h = nnx.gelu(self.norm(self.fc1(x)))
    h = h + nnx.gelu(self.fc2(h))
    return self.out(h)


def batches(seed):
  rng = np.random.default_rng(seed)
  while True:
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    y = np.tanh(x @ _TEACHER) + 0.05 * rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    yield {"x": x, "y": y}


def loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


task = Task(init=lambda seed: MLP(rngs=nnx.Rngs(seed)), loss=loss, batches=batches,
            optimizer=optax.adamw(3e-3), name="nnx-mlp")


def bad_loss_task():
  """A task whose loss is not a scalar (the per-example losses)."""
  return Task(init=task.init, loss=lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2, axis=-1),
              batches=batches, optimizer=optax.adamw(3e-3), name="bad-loss")
