"""The chaos floor: how far the control moves from itself under the smallest perturbation.

Training is chaotic: two runs that differ in one bit of one initial weight end apart, and
no recipe can be shown closer to the control than that. The floor arm (``floor=True``,
row "<control>-floor") trains the control recipe on the control's own seeds and batches
from initial weights changed by one ulp in one element (`nudge`), as an ordinary cell of
the study; its per-seed differences from the control are the motion no precision recipe
caused. `summarize` states its spread, and the seeds a margin would need against it.

Which element: of the nonzero elements of the floating parameters, the one whose gradient
of ``task.loss`` on the seed's first batch (``next(iter(task.batches(seed)))``, the batch
its first step trains on) is largest in magnitude (the first in tree order, then
row-major, on a tie), moved one ulp away from zero in its own dtype (float32, as
`Task.init` must return). The gradient is taken in float32 as the loss is written (no
recipe applied), at the initial weights, with a Linen model's rng streams keyed as the
first step's (``fold_in(key(seed), 0)``).

Why the gradient: the element must take part in training, or the floor run is the
control bit for bit and the floor reads exactly 0. Size is no such proof: the largest
parameter of a language model is its embedding, whose rows of tokens no batch contains
(byte 0 in a text corpus) never receive a gradient and never reach the loss. A nonzero
gradient on the first batch says the loss depends on the element at the first step, so
the nudge reaches the first update. The choice depends only on the seed's initial weights
and first batch, so a rerun nudges the same bit; a seed's element may differ from
another seed's (`describe` names seed 0's). A zero element is never chosen: its next value
is a subnormal, which XLA:CPU flushes to zero, and the run would not be perturbed at all.
A model with no such element (every gradient zero or non-finite on the first batch) is
refused with a ValueError: its floor would measure nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from precision.study import _models
from precision.study import _stats
from precision.study._task import Task

SUFFIX = "-floor"
# The rule that picks the nudged element, recorded in the study's identity: floor cells
# of a study started under another rule (the first nonzero element of the largest
# parameter, before) are other runs, and such a study is not continued.
RULE = "largest first-batch gradient"


def _floating(x) -> bool:
  return jnp.issubdtype(getattr(x, "dtype", np.float32), jnp.floating)


def _gradients(fn: Callable[[Any], Any], params: Any) -> list[np.ndarray | None]:
  """Per leaf of `params` (flattened): the f32 gradient of ``fn(params)`` for a floating
  leaf (None for the others, which are held fixed)."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  idx = [i for i, x in enumerate(leaves) if _floating(x)]

  def of_floating(fl):
    full = list(leaves)
    for i, x in zip(idx, fl):
      full[i] = x
    return jnp.asarray(fn(jax.tree_util.tree_unflatten(treedef, full)), jnp.float32)

  grads = jax.jit(jax.grad(of_floating))([jnp.asarray(leaves[i]) for i in idx])
  out: list[np.ndarray | None] = [None] * len(leaves)
  for i, g in zip(idx, grads):
    out[i] = np.asarray(jax.device_get(g), np.float32)
  return out


def _pick(leaves, grads, seed) -> tuple[int, int, float]:
  """(leaf index, flat element index, |gradient|) of the element to nudge."""
  best = None
  for i, ((_, leaf), g) in enumerate(zip(leaves, grads)):
    if g is None:
      continue
    arr = np.asarray(jax.device_get(leaf)).reshape(-1)
    score = np.abs(g.reshape(-1))
    # Zero elements (their next value is a subnormal) and non-finite gradients never win.
    score = np.where((arr != 0) & np.isfinite(score), score, np.float32(-1))
    j = int(np.argmax(score)) if score.size else 0
    if score.size and score[j] > 0 and (best is None or score[j] > best[2]):
      best = (i, j, float(score[j]))
  if best is None:
    raise ValueError(f"the chaos floor needs a nonzero floating parameter element whose "
                     f"gradient on seed {seed}'s first batch is nonzero and finite, to "
                     "nudge; every such gradient of the model's loss is zero or non-finite")
  return best


def _nudge_tree(tree: Any, grads, seed) -> tuple[Any, str]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  i, j, g = _pick(leaves, grads, seed)
  path, leaf = leaves[i]
  arr = np.array(jax.device_get(leaf))
  flat = arr.reshape(-1)
  old = flat[j]
  flat[j] = np.nextafter(old, np.copysign(np.inf, old).astype(arr.dtype))
  where = np.unravel_index(j, arr.shape)
  name = jax.tree_util.keystr(path).removesuffix(".value")  # an NNX Variable's value
  desc = (f"{name}[{', '.join(str(int(w)) for w in where)}]: "
          f"{float(old)!r} -> {float(flat[j])!r} (one {arr.dtype} ulp; the largest "
          f"gradient on seed {seed}'s first batch, {g:.3g})")
  new = [l for _, l in leaves]
  new[i] = jnp.asarray(arr, dtype=arr.dtype)
  return jax.tree_util.tree_unflatten(treedef, new), desc


def nudge(model: Any, loss: Callable[[Any, Any], Any], batch: Any, seed: int = 0,
          rng_streams: tuple[str, ...] = ("dropout",)) -> tuple[Any, str]:
  """`model` (what `Task.init` returns) with one ulp changed in one element, and where.

  The element is the nonzero one whose gradient of ``loss(model, batch)`` is largest in
  magnitude (module docstring); `seed` keys a Linen model's rng streams as the study's
  first step of that seed does. NNX modules are updated in place (and returned); Linen
  ``(module, variables)`` pairs and param pytrees are returned as new trees.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from flax.core import unfreeze  # pylint: disable=g-import-not-at-top
  kind = _models.model_kind(model)
  if kind == "nnx":
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # merge builds a new module: the gradient's forward leaves `model` (its rng counters)
    # as it was.
    grads = _gradients(lambda p: loss(nnx.merge(graphdef, p, rest), batch), params)
    params, desc = _nudge_tree(params, grads, seed)
    nnx.update(model, params)
    return model, desc
  if kind == "linen":
    module, variables = model
    variables = dict(variables)
    rest = {k: v for k, v in unfreeze(variables).items() if k != "params"}
    rng = jax.random.fold_in(jax.random.key(seed), 0)  # the study's key of step 0
    grads = _gradients(lambda p: loss(_models.LinenModel(module, p, rest, rng, True,
                                                         tuple(rng_streams)), batch),
                       variables["params"])
    variables["params"], desc = _nudge_tree(variables["params"], grads, seed)
    return (module, variables), desc
  return _nudge_tree(model, _gradients(lambda p: loss(p, batch), model), seed)


def nudge_seed(task: Task, seed: int) -> tuple[Any, str]:
  """``task.init(seed)`` nudged at the element of the largest gradient on seed's first
  batch, and where."""
  batch = next(iter(task.batches(seed)))
  return nudge(task.init(seed), task.loss, batch, seed, task.rng_streams)


def nudged_task(task: Task) -> Task:
  """`task` whose ``init(seed)`` returns the nudged model (batches, loss, optimizer and
  evaluation unchanged: the same seed trains on the same data)."""
  return dataclasses.replace(task, init=lambda seed: nudge_seed(task, seed)[0])


def describe(task: Task) -> str:
  """Where seed 0's nudge lands (another seed's may differ: each seed's element is the one
  of the largest gradient on its own first batch)."""
  return nudge_seed(task, 0)[1]


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
