"""params_mlp's task with every batch taking PACE_S seconds to arrive, as a slow data
loader's do: the same numbers (and results), but a cell of a dozen steps runs long enough
for a test to signal it mid-run."""

import time

from precision.study import Task

import params_mlp  # pylint: disable=import-error  (loaded from this folder)

PACE_S = 0.1


def batches(seed):
  for batch in params_mlp.batches(seed):
    time.sleep(PACE_S)
    yield batch


task = Task(init=params_mlp.init, loss=params_mlp.loss, batches=batches,
            optimizer=params_mlp.task.optimizer, name="paced-mlp")
