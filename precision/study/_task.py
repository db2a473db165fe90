"""`Task`: the user's training problem, as plain functions the study calls.

A task says what to train and how to measure it; it says nothing about precision. The
study applies every recipe itself (`precision.flax.apply_recipe` for NNX models,
`precision.autocast` for Linen modules and param pytrees, `build_optimizer` around the
task's optimizer, the recipe's loss scaling and skipping), so the same task file answers
"does this recipe hold up on my model" for every recipe.

`load_task("path/to/file.py:NAME")` (or "package.module:NAME") imports a task from a file
the way the CLI does: NAME is a `Task` or a function of no arguments returning one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Iterable, Iterator

import optax

# Seeds of the study are small integers; the default held-out batches come from this
# stream of `batches`, which no training cell uses.
HELDOUT_SEED = 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class Task:
  """A training problem written with no precision in mind.

  Attributes:
    init: ``init(seed) -> model`` in float32: an `nnx.Module`, a Linen ``(module,
      variables)`` pair, or a pytree of param arrays. Every recipe starts from the same
      f32 weights of a seed; the study casts them to the recipe's param dtype.
    loss: ``loss(model, batch) -> scalar``: a floating scalar array (the mean over the
      batch). For NNX `model` is the module (running under the recipe); for Linen a
      `precision.study.LinenModel` (call it like ``module.apply`` without variables:
      ``model(x, train=model.training)``; its `rngs` streams and mutable collections
      are handled by the study); for a param pytree, the params.
    batches: ``batches(seed) -> iterator of batches`` (any pytree of arrays). It must
      yield the same sequence every time it is called with the same seed: a resumed
      cell replays it to its position, and every recipe of a seed sees the same data.
    optimizer: an optax GradientTransformation (e.g. ``optax.adamw(1e-3)``). The
      recipe's master weights, moment dtypes, loss scaling and non-finite skipping are
      added around it by the study.
    evaluate: ``evaluate(model) -> float``, lower is better, called on the trained model
      outside jit (NNX: the module under its recipe; Linen: a LinenModel with
      ``training=False`` applying under the recipe; params: the params in the recipe's
      param dtype, run as your code runs them). None (default): the mean of `loss` over
      the held-out batches, computed under the recipe with the model in evaluation mode
      (NNX ``model.eval()``, LinenModel ``training=False``).
    eval_batches: ``eval_batches() -> iterable of batches`` held out for the default
      evaluation. None: the first `n_eval_batches` batches of ``batches(HELDOUT_SEED)``,
      a stream no training cell reads.
    n_eval_batches: batches of the default held-out stream (when `eval_batches` is None).
    rng_streams: Linen rng names given a fresh key each step (``"dropout"``); the key of
      step t is ``fold_in(key(seed), t)``, the same for every recipe of a seed.
    name: shown in reports.

  Examples:
    >>> task = precision.study.Task(
    ...     init=lambda seed: MLP(rngs=nnx.Rngs(seed)),
    ...     loss=lambda model, b: optax.l2_loss(model(b["x"]), b["y"]).mean(),
    ...     batches=make_batches, optimizer=optax.adam(1e-3))
  """

  init: Callable[[int], Any]
  loss: Callable[[Any, Any], Any]
  batches: Callable[[int], Iterable[Any]]
  optimizer: optax.GradientTransformation
  evaluate: Callable[[Any], float] | None = None
  eval_batches: Callable[[], Iterable[Any]] | None = None
  n_eval_batches: int = 4
  rng_streams: tuple[str, ...] = ("dropout",)
  name: str = "task"

  def __post_init__(self):
    for field in ("init", "loss", "batches"):
      if not callable(getattr(self, field)):
        raise ValueError(f"Task.{field}={getattr(self, field)!r}; accepted: a callable "
                         f"({_SIGNATURES[field]})")
    for field in ("evaluate", "eval_batches"):
      v = getattr(self, field)
      if v is not None and not callable(v):
        raise ValueError(f"Task.{field}={v!r}; accepted: None or a callable "
                         f"({_SIGNATURES[field]})")
    if not isinstance(self.optimizer, optax.GradientTransformation):
      raise ValueError(f"Task.optimizer={self.optimizer!r}; accepted: an optax "
                       "GradientTransformation, e.g. optax.adamw(1e-3)")
    n = self.n_eval_batches
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"Task.n_eval_batches={n!r}; accepted: an integer >= 1")
    streams = self.rng_streams
    if isinstance(streams, str):
      streams = (streams,)
    if not isinstance(streams, (tuple, list)) or not all(isinstance(s, str) and s
                                                         for s in streams):
      raise ValueError(f"Task.rng_streams={self.rng_streams!r}; accepted: a tuple of "
                       "non-empty rng names, e.g. ('dropout',)")
    object.__setattr__(self, "rng_streams", tuple(streams))
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Task.name={self.name!r}; accepted: a non-empty string")

  def bisect_replay(self, recipe, checkpoint, step, seed, steps, restore_checked):
    """What `precision.numerics.bisect` replays for this task: the cell of `recipe` whose
    checkpoint directory is `checkpoint`, from its `step` (precision.study._bisect_cell).
    numerics sits below the study and calls this rather than importing the study."""
    # In the function: _bisect_cell builds on the study's programs, which import this
    # module (the one import of the study's that cannot be at module level).
    from precision.study import _bisect_cell  # pylint: disable=g-import-not-at-top
    return _bisect_cell.prepare(self, recipe, checkpoint, step, seed, steps,
                                restore_checked)

  def held_out(self) -> list[Any]:
    """The held-out batches of the default evaluation, as a list."""
    if self.eval_batches is not None:
      out = list(self.eval_batches())
    else:
      out = []
      for batch in self.batches(HELDOUT_SEED):
        out.append(batch)
        if len(out) == self.n_eval_batches:
          break
    if not out:
      raise ValueError("Task: the held-out batches are empty (eval_batches() or "
                       f"batches({HELDOUT_SEED}) yielded nothing); accepted: at least one")
    return out


_SIGNATURES = {
    "init": "init(seed) -> f32 model",
    "loss": "loss(model, batch) -> scalar",
    "batches": "batches(seed) -> iterator of batches",
    "evaluate": "evaluate(model) -> float",
    "eval_batches": "eval_batches() -> iterable of batches",
}


def batch_stream(task: Task, seed: int, skip: int = 0) -> Iterator[Any]:
  """``iter(task.batches(seed))`` advanced past its first `skip` batches (a resume)."""
  it = iter(task.batches(seed))
  for i in range(skip):
    try:
      next(it)
    except StopIteration:
      raise ValueError(f"Task.batches({seed}) ended after {i} batches while resuming at "
                       f"batch {skip}; accepted: an iterator of at least `steps` "
                       "batches") from None
  return it


def load_task(ref: str) -> Task:
  """The Task named by "FILE.py:NAME" or "package.module:NAME".

  NAME is a `Task` or a function of no arguments returning one. A file is imported as a
  module of its own (its folder is put first on sys.path while it imports, so it can
  import its neighbours).

  Raises:
    ValueError: a reference without ":NAME", a file or module that does not exist or
      fails to import, a NAME it does not define, or a NAME that is no Task.
  """
  if not isinstance(ref, str) or ":" not in ref:
    raise ValueError(f"task {ref!r}; accepted: FILE.py:NAME or package.module:NAME, "
                     "NAME a precision.study.Task or a function returning one")
  where, name = ref.rsplit(":", 1)
  if where.endswith(".py") or os.sep in where:
    path = os.path.abspath(where)
    if not os.path.isfile(path):
      raise ValueError(f"task {ref!r}: no file {where}")
    mod_name = "_precision_study_task_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    try:
      sys.modules[mod_name] = module
      spec.loader.exec_module(module)
    finally:
      sys.path.remove(os.path.dirname(path))
  else:
    try:
      module = importlib.import_module(where)
    except ImportError as e:
      raise ValueError(f"task {ref!r}: cannot import {where} ({e})") from None
  if not hasattr(module, name):
    raise ValueError(f"task {ref!r}: {where} defines no {name!r}")
  obj = getattr(module, name)
  if not isinstance(obj, Task) and callable(obj):
    obj = obj()
  if not isinstance(obj, Task):
    raise ValueError(f"task {ref!r}: {name} is a {type(obj).__name__}; accepted: a "
                     "precision.study.Task or a function of no arguments returning one")
  return obj
