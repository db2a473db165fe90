"""`TrainState`: the arrays of a training run, one type for checkpoints and data parallel.

`precision.checkpoint` saves and restores it; `precision.parallel.DataParallel` carries it
through its steps (with `layout` set: params and optimizer state sharded over devices) and
converts it to and from the device-count-free form a checkpoint holds
(`DataParallel.state_for_checkpoint` / `state_from_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["params", "opt_state", "model_state", "rng"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
  """Everything of a training run that lives in arrays (a pytree; `layout` is static).

  Attributes:
    params: the trainable params (e.g. ``nnx.state(model, nnx.Param)``), in the recipe's
      param dtype. In a data-parallel state at ZeRO stage 3, flat padded shards.
    opt_state: the optimizer state (`precision.optim.build_optimizer`'s). In a
      data-parallel state at ZeRO stages 1-3, built on flat padded shards.
    model_state: the model's other variables, e.g. the fp8 scaling state
      (``nnx.state(model, precision.fp8.Fp8State)``) or its RNG state (the typed keys and
      counters of an nnx.Rngs or Dropout: ``nnx.state(model, nnx.Not(nnx.Param))``); any
      pytree, {} or None if none.
    rng: PRNG key data (``jax.random.key_data(key)``, uint32) or a typed key
      (``jax.random.key``); None if the run keeps none. A checkpoint holds typed keys as
      their key data and restores them as keys of the same impl.
    layout: None for a state in full shapes (what a checkpoint holds); a
      `precision.parallel.ParamLayout` for a `DataParallel` state sharded over devices,
      which `precision.checkpoint` refuses: save ``dp.state_for_checkpoint(state)``.

  Built positionally like the NamedTuple it replaces, ``TrainState(params, opt_state,
  model_state, rng)``; `_replace` is kept, and `fp8_state` reads `model_state` (the
  name data-parallel states used).

  Examples:
    >>> state = TrainState(params, opt_state, {}, jax.random.key_data(jax.random.key(0)))
    >>> state = state._replace(params=new_params)
  """

  params: Any
  opt_state: Any
  model_state: Any = None
  rng: Any = None
  layout: Any = None

  def _replace(self, **changes: Any) -> TrainState:
    """A copy with `changes` (field name -> value), as NamedTuple._replace."""
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise ValueError(f"TrainState._replace({', '.join(unknown)}=...); accepted fields: "
                       "params, opt_state, model_state, rng, layout")
    return dataclasses.replace(self, **changes)

  @property
  def fp8_state(self) -> Any:
    """`model_state` under the name data-parallel states used for it (fp8 scaling)."""
    return self.model_state


__all__ = ["TrainState"]
