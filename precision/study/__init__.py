"""The study: does a precision recipe hold up on YOUR model, what does it save, how sure.

A `Task` is the user's code (init, loss, batches, optimizer, optional evaluate), written
with no precision in mind. `run` trains it under every recipe x seed with fp32 as the
control (each seed gives every recipe the same initial weights and batches), applies
each recipe itself, never stops for a diverged or failed cell, checkpoints every cell so
a killed run continues bit-exactly, runs one slice of the grid per machine (`shard`,
or a Slurm array), and judges each recipe against the control with stated error rates:
a paired test with Holm's correction, an interval, an equivalence verdict at a margin,
power and the seeds needed, time-to-target; with costs (bytes/param, compiled step
memory, interleaved step time) and health beside each verdict.

  python -m precision.study my_task.py:task --recipes fp32,bf16_mixed,f16_mixed \\
      --seeds 5 --steps 200 --out study_out --margin 0.01
  python -m precision.study my_task.py:task ... --seeds auto --max-seeds 12 --margin 0.01

``--seeds auto`` adds rounds of seeds until every recipe is worse, better or holds up
within the margin (a group-sequential rule whose error rates hold under that stopping),
and reports the chaos floor: how far the control moves when one initial weight moves by
one ulp.

Examples:
  >>> import precision.study as study
  >>> result = study.run(task, ["fp32", "bf16_master", "f16_mixed"], seeds=5, steps=200,
  ...                    out="study_out", margin=0.01)
  >>> print(result.table())
  >>> result.verdict("f16_mixed"), result.rows["f16_mixed"]["ci"]
"""

from precision.study._cells import compiled_memory
from precision.study._cells import fingerprint
from precision.study._models import LinenModel
from precision.study._report import Judging
from precision.study._report import StudyResult
from precision.study._report import comparable
from precision.study._config import StudyConfig
from precision.study._config import make_config
from precision.study._config import parse_shard
from precision.study._faults import StudyEnvironmentError
from precision.study._run import report_only
from precision.study._run import run
from precision.study._signals import REQUEUE_EXIT
from precision.study._signals import Stopped
from precision.study._task import HELDOUT_SEED
from precision.study._task import Task
from precision.study._task import load_task

__all__ = [
    "HELDOUT_SEED",
    "Judging",
    "LinenModel",
    "REQUEUE_EXIT",
    "StudyConfig",
    "StudyEnvironmentError",
    "StudyResult",
    "Stopped",
    "Task",
    "comparable",
    "compiled_memory",
    "fingerprint",
    "load_task",
    "make_config",
    "parse_shard",
    "report_only",
    "run",
]
