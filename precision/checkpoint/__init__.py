"""Orbax save/restore of the full training state of a precision recipe.

A checkpoint holds params, the whole optimizer state (master copy, moments, loss-scale
state, counters), fp8 scaling state, the RNG key data, the step, the data sampler's
position, ``recipe.to_dict()`` and the model config. `restore` brings back exactly what was
saved; ``restore(..., recipe=other, optimizer_for=...)`` converts to another recipe from
the f32 master and says what it converted; a target that does not fit raises
`CheckpointMismatchError` naming the first differing leaf.

Examples:
  >>> from precision import checkpoint
  >>> state = checkpoint.TrainState(params, opt_state, model_state={}, rng=key_data)
  >>> checkpoint.save("/tmp/run", 100, state, recipe=recipe, model_config=cfg.to_dict(),
  ...                 data=sampler_state)
  >>> r = checkpoint.restore("/tmp/run", state)            # exact
  >>> r = checkpoint.restore("/tmp/run", state_fp32, recipe=mp.get_recipe("fp32"),
  ...                        optimizer_for=lambda rc: mp.optim.build_optimizer(rc, inner))
  >>> print(r.converted)
"""

from precision.checkpoint._manager import Checkpointer
from precision.checkpoint._manager import Restored
from precision.checkpoint._manager import TrainState
from precision.checkpoint._manager import restore
from precision.checkpoint._manager import save
from precision.checkpoint._tree import CheckpointMismatchError

__all__ = [
    "CheckpointMismatchError",
    "Checkpointer",
    "Restored",
    "TrainState",
    "restore",
    "save",
]
