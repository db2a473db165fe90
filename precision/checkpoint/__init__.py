"""Orbax save/restore of the full training state of a precision recipe.

A checkpoint holds params, the whole optimizer state (master copy, moments, loss-scale
state, counters), fp8 scaling state, the RNG state (key data, and typed PRNG keys such as
an nnx.Rngs' or a Dropout's, restored as keys of their impl), the step, the data sampler's
position, ``recipe.to_dict()``, the model config, the seed and the run id, with a SHA-256
of every file and every array. `restore` verifies them and brings back exactly what was
saved, falling back to the newest intact step (with a `CheckpointFallbackWarning` and
`Restored.skipped`) when newer ones are damaged; ``restore(..., recipe=other,
optimizer_for=...)`` converts to another recipe from the f32 master and says what it
converted; a target that does not fit raises `CheckpointMismatchError` naming the first
differing leaf. One process writes a directory at a time, and only the run it belongs to;
a reader beside it (an evaluator) gets the newest complete step, even while the writer's
rotation deletes the one being read.
`import_orbax` brings in a checkpoint written by plain Orbax.

Examples:
  >>> from precision import checkpoint
  >>> state = checkpoint.TrainState(params, opt_state, model_state={}, rng=key_data)
  >>> checkpoint.save("/tmp/run", 100, state, recipe=recipe, model_config=cfg.to_dict(),
  ...                 seed=0, data=sampler_state)
  >>> r = checkpoint.restore("/tmp/run", state)            # exact, verified
  >>> r = checkpoint.restore("/tmp/run", state_fp32, recipe=mp.get_recipe("fp32"),
  ...                        optimizer_for=lambda rc: mp.optim.build_optimizer(rc, inner))
  >>> print(r.converted)
  >>> imported = checkpoint.import_orbax("/path/to/orbax_ckpt", state, recipe, optimizer=tx)

What the checksums are for: the SHA-256 digests in each step's ``integrity.json`` detect
accidental damage (a flipped byte, a truncated or missing file, a cut copy, a stray
edit), not tampering. They are not a signature: anyone who can write the directory can
change a file and rewrite its digest too, so they say nothing about who wrote a
checkpoint. Restore only checkpoints from a source you trust, or sign them: with
``save(..., key=secret)`` each step also carries an HMAC-SHA256 of its manifest, and
``restore(..., key=secret)`` passes over (`CheckpointAuthenticityError`) any step that
is unsigned, signed with another key or changed since. What restore does guard
against on its own: names in a manifest never reach outside their step folder (no
``..``, no absolute path), symbolic links are never followed (step folders, files, the
lock, the run record), files of a newer format are refused (`CheckpointFormatError`:
every file carries its format number and the writing version), and steps without
checksums are restored only with ``allow_unverified=True``. Any path works, including
one with ``[``, ``]``, ``*``, ``?`` or spaces (Orbax would read those as a pattern; they
are handed to it so that no character is one).

`TrainState` is `precision.TrainState`, the one state type of the package: a
`precision.parallel.DataParallel` state is saved as ``dp.state_for_checkpoint(state)``
(full shapes, any device count resumes it) and handed back with
``dp.state_from_checkpoint(restored.state)``.
"""

from precision._state import TrainState
from precision.checkpoint._errors import CheckpointAuthenticityError
from precision.checkpoint._errors import CheckpointDamagedError
from precision.checkpoint._errors import CheckpointError
from precision.checkpoint._errors import CheckpointFallbackWarning
from precision.checkpoint._errors import CheckpointFormatError
from precision.checkpoint._errors import CheckpointLockedError
from precision.checkpoint._errors import CheckpointMismatchError
from precision.checkpoint._errors import CheckpointOwnershipError
from precision.checkpoint._errors import CheckpointUnverifiedWarning
from precision.checkpoint._errors import CheckpointWarning
from precision.checkpoint._errors import CheckpointWriteError
from precision.checkpoint._errors import NoCheckpointError
from precision.checkpoint._import import Imported
from precision.checkpoint._import import import_orbax
from precision.checkpoint._manager import Checkpointer
from precision.checkpoint._manager import Restored
from precision.checkpoint._manager import restore
from precision.checkpoint._manager import save
from precision.checkpoint._owner import RunRecord

__all__ = [
    "CheckpointAuthenticityError",
    "CheckpointDamagedError",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointOwnershipError",
    "CheckpointUnverifiedWarning",
    "CheckpointWarning",
    "CheckpointWriteError",
    "Checkpointer",
    "Imported",
    "NoCheckpointError",
    "Restored",
    "RunRecord",
    "TrainState",
    "import_orbax",
    "restore",
    "save",
]
