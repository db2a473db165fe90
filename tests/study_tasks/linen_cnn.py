"""A researcher's own Linen task: a small convolutional classifier with BatchNorm and
Dropout taking a `train` keyword, on synthetic 8x8 images (class = brightest quadrant)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from precision.study import Task

BATCH, CLASSES = 16, 4


class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dense(32)(x)
    x = nn.Dropout(0.1, deterministic=not train)(x)
    x = nn.relu(x)
    return nn.Dense(CLASSES)(x)


def batches(seed):
  rng = np.random.default_rng(seed)
  while True:
    x = rng.standard_normal((BATCH, 8, 8, 1)).astype(np.float32)
    label = rng.integers(0, CLASSES, BATCH)
    for i, c in enumerate(label):
      r, q = divmod(int(c), 2)
      x[i, 4 * r:4 * r + 4, 4 * q:4 * q + 4] += 1.5
    yield {"x": x, "label": label.astype(np.int32)}


def init(seed):
  module = Net()
  variables = module.init(jax.random.key(seed), jnp.zeros((1, 8, 8, 1)), train=False)
  return module, variables


def loss(model, batch):
  logits = model(batch["x"], train=model.training)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def make_task():
  return Task(init=init, loss=loss, batches=batches, optimizer=optax.adam(3e-3),
              name="linen-cnn")
