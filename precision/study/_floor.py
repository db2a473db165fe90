"""The chaos floor: how far the control moves from itself under the smallest perturbation.

Training is chaotic: two runs that differ in one bit of one initial weight end apart, and
no recipe can be shown closer to the control than that. The floor arm (``floor=True``,
row "<control>-floor") trains the control recipe on the control's own seeds and batches
from initial weights changed by one ulp in one element (`nudge`), as an ordinary cell of
the study; its per-seed differences from the control are the motion no precision recipe
caused. `summarize` states its spread, and the seeds a margin would need against it.

Which element: the first nonzero element (row-major) of the largest floating parameter
(the first such in tree order on a tie), moved one ulp away from zero in its own dtype
(float32, as `Task.init` must return). A zero element is skipped because its next value
is a subnormal, which XLA:CPU flushes to zero: the run would not be perturbed at all.
The choice depends only on the initial weights, so every rerun nudges the same bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from precision.study import _models
from precision.study import _stats
from precision.study._task import Task

SUFFIX = "-floor"


def _pick(leaves) -> tuple[int, int]:
  """(leaf index, flat element index) of the element to nudge."""
  best = None
  for i, (_, leaf) in enumerate(leaves):
    arr = np.asarray(jax.device_get(leaf))
    if not np.issubdtype(arr.dtype, np.floating) or not np.any(arr != 0):
      continue
    if best is None or arr.size > best[1]:
      best = (i, arr.size)
  if best is None:
    raise ValueError("the chaos floor needs a floating parameter with a nonzero element "
                     "to nudge; the model's parameters are all zero or not floating")
  arr = np.asarray(jax.device_get(leaves[best[0]][1])).reshape(-1)
  return best[0], int(np.flatnonzero(arr)[0])


def _nudge_tree(tree: Any) -> tuple[Any, str]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  i, j = _pick(leaves)
  path, leaf = leaves[i]
  arr = np.array(jax.device_get(leaf))
  flat = arr.reshape(-1)
  old = flat[j]
  flat[j] = np.nextafter(old, np.copysign(np.inf, old).astype(arr.dtype))
  where = np.unravel_index(j, arr.shape)
  name = jax.tree_util.keystr(path).removesuffix(".value")  # an NNX Variable's value
  desc = (f"{name}[{', '.join(str(int(w)) for w in where)}]: "
          f"{float(old)!r} -> {float(flat[j])!r} (one {arr.dtype} ulp)")
  new = [l for _, l in leaves]
  new[i] = jnp.asarray(arr, dtype=arr.dtype)
  return jax.tree_util.tree_unflatten(treedef, new), desc


def nudge(model: Any) -> tuple[Any, str]:
  """`model` (what `Task.init` returns) with one ulp changed in one element, and where.

  NNX modules are updated in place (and returned); Linen ``(module, variables)`` pairs
  and param pytrees are returned as new trees.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  kind = _models.model_kind(model)
  if kind == "nnx":
    params, desc = _nudge_tree(nnx.state(model, nnx.Param))
    nnx.update(model, params)
    return model, desc
  if kind == "linen":
    module, variables = model
    variables = dict(variables)
    variables["params"], desc = _nudge_tree(variables["params"])
    return (module, variables), desc
  return _nudge_tree(model)


def nudged_task(task: Task) -> Task:
  """`task` whose ``init(seed)`` returns the nudged model (batches, loss, optimizer and
  evaluation unchanged: the same seed trains on the same data)."""
  init = task.init
  return dataclasses.replace(task, init=lambda seed: nudge(init(seed))[0])


def describe(task: Task) -> str:
  """Where seed 0's nudge lands (the same leaf and element for every seed whose initial
  weights are nonzero there)."""
  return nudge(task.init(0))[1]


def seeds_for_margin(margin: float, spread: float, m: int = 1, alpha: float = _stats.ALPHA,
                     power: float = _stats.TARGET_POWER, max_seeds: int = 1000) -> int | None:
  """Fewest seeds with which TOST at alpha / m shows a recipe with true difference 0
  within +-margin with probability >= power, when one per-seed difference has sd
  `spread`: the smallest n with 1 - 2 P(T'_{n-1, margin sqrt(n) / spread} < t_{1 -
  alpha/m, n-1}) >= power (a lower bound on TOST's power; noncentral t). None when
  spread is 0 or non-finite, or above max_seeds."""
  if not (math.isfinite(spread) and spread > 0):
    return None
  a = alpha / m
  for n in range(2, max_seeds + 1):
    df = n - 1
    crit = _stats._t_quantile(df, 1.0 - a)
    miss = float(_stats._nct_cdf(np.array([df]), np.array([margin * math.sqrt(n) / spread]),
                                 np.array([crit]))[0])
    if 1.0 - 2.0 * miss >= power:
      return n
  return None


def summarize(deltas: Sequence[float], seeds: Sequence[int], control_mean: float | None,
              margin: float | None, nudged: str | None, m: int = 1,
              alpha: float = _stats.ALPHA) -> dict:
  """summary.json's top-level "floor": the floor arm's per-seed differences, their
  spread (rms: the floor's true mean is 0 by construction, so the spread is taken about
  0), its size relative to the control's metric, and, with a margin at or below the
  spread, the flag and the seeds that margin would need."""
  d = np.asarray(deltas, np.float64)
  rms = float(np.sqrt(np.mean(d * d))) if d.size else None
  out = {"deltas": [float(x) for x in d], "paired_seeds": [int(s) for s in seeds],
         "rms": rms, "max_abs": float(np.max(np.abs(d))) if d.size else None,
         "relative": (rms / abs(control_mean) if rms is not None and control_mean else None),
         "nudge": nudged, "margin": margin, "margin_below_floor": None,
         "seeds_for_margin": None}
  if margin is not None and rms is not None:
    out["margin_below_floor"] = bool(margin <= rms)
    out["seeds_for_margin"] = seeds_for_margin(margin, rms, m, alpha)
  return out
