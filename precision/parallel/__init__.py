"""Data parallelism and ZeRO-1/2/3 with shard_map, in one process or many.

`data_parallel(loss_fn, tx, mesh, zero_stage=..., recipe=...)` builds a jitted, donated
train step whose every collective runs in the dtype the Recipe states; at stage 3 with
`gather="layer"` a model marks its layers (`gathered_layer`, `call_layer`) and params are
gathered layer by layer, re-gathered in backward; `data_parallel_pmap`
runs stages 0-1 under `jax.pmap` with the same numbers; `MemoryReport` and
`CollectiveReport` give per-device bytes held and moved per step.

The state is `precision.TrainState` (also `precision.checkpoint.TrainState`);
`DataParallel.state_for_checkpoint` / `state_from_checkpoint` convert it to and from the
full form a checkpoint holds, which resumes on any device count.
"""

from precision._state import TrainState
from precision.parallel._collectives import Reduction
from precision.parallel._collectives import all_reduce_mean
from precision.parallel._collectives import gather_view
from precision.parallel._collectives import reduce_scatter_mean
from precision.parallel._collectives import replicated_view
from precision.parallel._data_parallel import DataParallel
from precision.parallel._data_parallel import data_parallel
from precision.parallel._fsdp import GATHER_MODES
from precision.parallel._fsdp import ShardedParam
from precision.parallel._fsdp import call_layer
from precision.parallel._fsdp import gather
from precision.parallel._fsdp import gathered_layer
from precision.parallel._layout import LeafLayout
from precision.parallel._layout import ParamLayout
from precision.parallel._pmap import PmapDataParallel
from precision.parallel._pmap import data_parallel_pmap
from precision.parallel._report import Collective
from precision.parallel._report import CollectiveReport
from precision.parallel._report import MemoryReport
from precision.parallel._report import collective_report
from precision.parallel._report import zero_formula
from precision.parallel._step import ZERO_STAGES

__all__ = [
    "Collective",
    "CollectiveReport",
    "DataParallel",
    "GATHER_MODES",
    "LeafLayout",
    "MemoryReport",
    "ParamLayout",
    "PmapDataParallel",
    "Reduction",
    "ShardedParam",
    "TrainState",
    "ZERO_STAGES",
    "all_reduce_mean",
    "call_layer",
    "collective_report",
    "data_parallel",
    "data_parallel_pmap",
    "gather",
    "gather_view",
    "gathered_layer",
    "reduce_scatter_mean",
    "replicated_view",
    "zero_formula",
]
