"""fp8 metrics (saturation/underflow counters per GEMM) and data-parallel agreement."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from precision.fp8._dot import OPERANDS, Fp8DotState
from precision.fp8._nnx import fp8_modules

_MAX_REDUCED = ("amax_history", "scale")
_SUM_REDUCED = ("saturated", "underflowed")


def fp8_metrics(module: Any) -> dict[str, jax.Array]:
  """Counters and scales of every fp8 GEMM in an NNX module, or in the fp8 state of an
  autocast function ({site key: Fp8DotState}, `precision.fp8.init_state`), as f32 scalars.

  Keys: ``"{layer path or site key}/{op}_{stat}"`` for op in lhs, rhs, grad and stat in
  saturated (elements clipped to the fp8 max at the last step), underflowed (nonzero
  elements that became zero), amax (the last step's per-tensor amax), scale (the scale
  used); plus totals ``"fp8/saturated"``, ``"fp8/underflowed"`` and ``"fp8/gemms"``.
  A site in a scan body (state per iteration) reports its iterations' sum of counts and
  max of amax and scale. Gradient entries are those of the last step whose gradient
  state was stored (`precision.value_and_grad`, `merge_grad_state`).
  Safe inside jit (no host sync): values are arrays.
  """
  out: dict[str, jax.Array] = {}
  total = {k: jnp.zeros((), jnp.float32) for k in _SUM_REDUCED}
  if isinstance(module, Mapping) and all(isinstance(v, Fp8DotState) for v in module.values()):
    mods = [(key, lambda op, st=st: getattr(st, op)) for key, st in module.items()]
  else:
    # pylint: disable-next=protected-access
    mods = [(name, m._operand_state) for name, m in fp8_modules(module)]
  for name, state_of in mods:
    prefix = f"{name}/" if name else ""
    for op in OPERANDS:
      st = state_of(op)
      out[f"{prefix}{op}_saturated"] = jnp.sum(st.saturated)
      out[f"{prefix}{op}_underflowed"] = jnp.sum(st.underflowed)
      out[f"{prefix}{op}_amax"] = jnp.max(st.amax_history[..., 0])
      out[f"{prefix}{op}_scale"] = jnp.max(st.scale)
      total["saturated"] = total["saturated"] + out[f"{prefix}{op}_saturated"]
      total["underflowed"] = total["underflowed"] + out[f"{prefix}{op}_underflowed"]
  out["fp8/saturated"] = total["saturated"]
  out["fp8/underflowed"] = total["underflowed"]
  out["fp8/gemms"] = jnp.asarray(len(mods), jnp.float32)
  return out


def _leaf_name(path) -> str:
  for key in reversed(path):
    if isinstance(key, jax.tree_util.DictKey):
      return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name not in ("value", "raw_value"):
      return key.name
  return ""


def sync_fp8_state(state: Any, axis_name: Any) -> Any:
  """Makes fp8 scaling state agree across data-parallel ranks; call inside shard_map/pmap.

  Amax histories and scales are max-reduced over `axis_name` (every rank then derives the
  same delayed scale from the same history: the largest amax any rank saw, so no rank's
  data saturates where another's would not); saturation/underflow counts are summed. Run
  it on the new state at the end of each step, e.g.
  ``nnx.update(model, sync_fp8_state(nnx.state(model, Fp8State), "data"))``.
  `precision.parallel.data_parallel(..., fp8_state=True)` does it in every step.

  Args:
    state: `nnx.state(model, precision.fp8.Fp8State)`, a Linen fp8 collection, or an
      Fp8DotState / OperandState pytree; leaves are recognised by their field names.
    axis_name: the data-parallel mapped axis.
  """

  def reduce(path, x):
    name = _leaf_name(path)
    if name.endswith(_MAX_REDUCED):
      return lax.pmax(x, axis_name)
    if name.endswith(_SUM_REDUCED):
      return lax.psum(x, axis_name)
    raise ValueError(f"sync_fp8_state: leaf {jax.tree_util.keystr(path)!r} is not fp8 state; "
                     f"accepted leaf names end with {_MAX_REDUCED + _SUM_REDUCED}")

  return jax.tree_util.tree_map_with_path(reduce, state)
