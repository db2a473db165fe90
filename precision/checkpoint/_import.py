"""Bring a checkpoint written by plain Orbax into a precision recipe.

`import_orbax(path, target, recipe, optimizer=tx)` reads the params of a model saved with
``ocp.StandardCheckpointer``, ``ocp.PyTreeCheckpointer`` or an ``ocp.CheckpointManager``
(any item name, as Flax's examples write: ``default``, ``state``, ...) and returns the
training state under `recipe`:

  * the f32 view: the checkpoint's values as f32 (bit for bit when they are f32; bf16/f16
    values widen exactly; f64 values round to nearest, which the notes say);
  * params: that f32 view rounded to nearest into the target's param dtypes (the dtypes
    the recipe's policy gave the target model);
  * optimizer state: `optimizer.init` on the f32 view (a master copy, where the recipe
    keeps one, is the checkpoint's f32 values bit for bit), every leaf cast to the dtype
    the recipe's own init gives it; everything else (moments, loss scale, counters)
    fresh;
  * model state (fp8 scaling) and RNG: the target's.

Where the params sit in the saved tree is found by matching the target's param paths:
the tree itself (``nnx.state(model)``, a params dict), or a subtree such as ``params/``
(a Flax TrainState); `params_path` says it explicitly. Nothing on disk is created or
changed, and every problem is an error naming the path, the leaf and the expected vs
found shape and dtype.
"""

from __future__ import annotations

import os
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision._policy import dtype_name
from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision.checkpoint import _orbax
from precision.checkpoint import _tree
from precision.checkpoint._errors import CheckpointMismatchError
from precision.checkpoint._errors import NoCheckpointError
from precision.checkpoint._manager import TrainState
from precision.checkpoint._manager import check_directory

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class Imported(NamedTuple):
  """What `import_orbax` returns.

  state: the TrainState under `recipe`. recipe: that recipe. path: the Orbax item
  directory read. step: the CheckpointManager step it came from (None for a plain item).
  params_path: where the params sat in the saved tree ("" for the root). notes: what was
  done (dtypes, leaves of the checkpoint left unused, values rounded).
  """

  state: TrainState
  recipe: Recipe
  path: str
  step: int | None
  params_path: str
  notes: tuple[str, ...]


def _subdirs(path: str) -> list[str]:
  return sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)))


def _find_item(path: str, item: str | None, step: int | None) -> tuple[str, int | None]:
  """(item directory, step) for a plain item, a CheckpointManager step or its root."""
  if not os.path.exists(path):
    raise NoCheckpointError(f"No Orbax checkpoint at {path}: the path does not exist")
  if not os.path.isdir(path):
    raise ValueError(f"{path} is a file; an Orbax checkpoint is a directory")
  if _orbax.is_item(path):
    if item is not None or step is not None:
      raise ValueError(f"{path} is a single Orbax item; item={item!r} / step={step!r} "
                       "apply to a CheckpointManager directory")
    return path, None
  steps = sorted(int(n) for n in _subdirs(path) if re.fullmatch(r"[0-9]+", n))
  if steps and not any(_orbax.is_item(os.path.join(path, n)) for n in _subdirs(path)):
    # A CheckpointManager root: its step folders hold the items.
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"step={step!r} is not a step of the CheckpointManager directory "
                       f"{path}; steps: {steps}")
    found, _ = _find_item(os.path.join(path, str(step)), item, None)
    return found, step
  if step is not None:
    raise ValueError(f"step={step!r}: {path} is not a CheckpointManager root (no numeric "
                     "step folders)")
  items = [n for n in _subdirs(path) if _orbax.is_item(os.path.join(path, n))]
  if item is not None:
    if item not in items:
      raise ValueError(f"item={item!r} is not an Orbax PyTree item of {path}; items: "
                       f"{items or 'none'}")
    items = [item]
  if not items:
    raise ValueError(f"{path} is not an Orbax checkpoint: no _METADATA or manifest.ocdbt "
                     "in it or in a sub-folder (an item of a CheckpointManager step)")
  if len(items) > 1:
    raise ValueError(f"{path} holds several Orbax items ({', '.join(items)}); say which "
                     "one holds the params with item=")
  parent = os.path.basename(os.path.normpath(path))
  return os.path.join(path, items[0]), int(parent) if parent.isdigit() else None


def _find_prefix(saved: dict, target: dict, path: str, params_path: str | None) -> str:
  """The prefix of the saved leaf paths under which every target param path exists."""
  names = list(target)
  if params_path is not None:
    prefix = params_path.strip("/")
    prefix = prefix + "/" if prefix else ""
    missing = [p for p in names if prefix + p not in saved]
    if missing:
      shape, dtype = target[missing[0]]
      raise CheckpointMismatchError(
          f"{path}: leaf '{prefix}{missing[0]}' (the target's {shape} {dtype}) is not in "
          f"the checkpoint (params_path={params_path!r})")
    return prefix
  first = names[0]
  candidates = sorted({s[:len(s) - len(first)] for s in saved
                       if s == first or s.endswith("/" + first)}, key=len)
  full = [c for c in candidates if all(c + p in saved for p in names)]
  if len(full) == 1:
    return full[0]
  if "" in full:
    return ""
  named = [c for c in full if c.rstrip("/").rsplit("/", 1)[-1] == "params"]
  if len(named) == 1:
    return named[0]
  if full:
    raise ValueError(f"{path}: the target's params match several subtrees "
                     f"({', '.join(repr(c.rstrip('/')) for c in full)}); say which with "
                     "params_path=")
  best = candidates[0] if candidates else ""
  missing = next(p for p in names if best + p not in saved)
  shape, dtype = target[missing]
  example = ", ".join(f"'{s}'" for s in list(saved)[:3])
  raise CheckpointMismatchError(
      f"{path}: leaf '{best}{missing}' (the target's {shape} {dtype}) is not in the "
      f"checkpoint, which holds {len(saved)} leaves such as {example}")


def _templates(node: Any, prefix: list[str]) -> Any:
  """The part of the saved tree to read: the subtree at `prefix` (dict keys along the
  way), its leaves as numpy templates."""
  if prefix and isinstance(node, dict) and prefix[0] in node:
    return {prefix[0]: _templates(node[prefix[0]], prefix[1:])}

  def leaf(m):
    if hasattr(m, "shape") and hasattr(m, "dtype"):
      return np.zeros(m.shape, m.dtype)
    return m

  return jax.tree.map(leaf, node, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))


def import_orbax(path: str | os.PathLike, target: TrainState, recipe: Recipe | str | Plan, *,
                 optimizer: Any, item: str | None = None, step: int | None = None,
                 params_path: str | None = None) -> Imported:
  """The training state under `recipe` from the params of a plain Orbax checkpoint.

  Args:
    path: a directory written by ``ocp.StandardCheckpointer`` / ``ocp.PyTreeCheckpointer``
      (the item itself), a CheckpointManager step folder, or a CheckpointManager root
      (its newest step, or `step`).
    target: a TrainState built for `recipe` (e.g. by the training script's init): its
      params give the structure, shapes and dtypes; its model state and RNG are kept.
    recipe: the Recipe, preset name or Plan to train under.
    optimizer: the recipe's optax transformation (`precision.optim.build_optimizer`):
      initialised fresh on the checkpoint's f32 values.
    item: the item name within a CheckpointManager step, when it holds several.
    step: the CheckpointManager step to read (default: the newest).
    params_path: where the params sit in the saved tree, e.g. "params" (default: found).

  Returns:
    Imported(state, recipe, path, step, params_path, notes).

  Raises:
    NoCheckpointError (a FileNotFoundError) for a missing path (nothing is created);
    ValueError for a directory that is not an Orbax checkpoint or is ambiguous;
    CheckpointMismatchError (a ValueError) naming the path, the leaf and the expected vs
    found shape and dtype; CheckpointError when Orbax cannot read the arrays.

  Examples:
    >>> tx = precision.optim.build_optimizer("bf16_master", optax.adamw(3e-4))
    >>> imp = precision.checkpoint.import_orbax("/ckpts/run7", state, "bf16_master",
    ...                                         optimizer=tx)
    >>> imp.state.params, imp.notes
  """
  plan = as_plan(recipe)  # the recipe's decisions, bound once
  recipe = plan.recipe
  if not isinstance(target, TrainState):
    raise ValueError(f"target must be a precision.checkpoint.TrainState, got "
                     f"{type(target).__name__}")
  if not hasattr(optimizer, "init"):
    raise ValueError(f"optimizer={optimizer!r}; accepted: the recipe's optax "
                     "GradientTransformation (precision.optim.build_optimizer)")
  path = check_directory(path, "path")
  item_dir, step = _find_item(path, item, step)
  what = f"Orbax checkpoint {item_dir}"
  saved_tree = _orbax.item_tree(item_dir, what)
  saved = _tree.shapes_by_path(saved_tree)
  abstract = _tree.to_abstract(target.params)
  wanted = _tree.shapes_by_path(abstract)
  if not wanted:
    raise ValueError("target.params holds no arrays")
  prefix = _find_prefix(saved, wanted, item_dir, params_path)
  for p, (shape, dtype) in wanted.items():
    s_shape, s_dtype = saved[prefix + p]
    float_ok = dtype.name in _FLOATS and s_dtype.name in _FLOATS
    if s_shape != shape or not (float_ok or s_dtype == dtype):
      raise CheckpointMismatchError(
          f"{what}: leaf '{prefix}{p}': checkpoint has {s_shape} {s_dtype}, the target "
          f"expects {shape} {dtype}")
  item_tree = _templates(saved_tree, [k for k in prefix.strip("/").split("/") if k])
  got = _orbax.restore_partial(item_dir, item_tree, what)
  got = _flatten(got)
  notes = [f"params read from {item_dir}"
           + (f" under '{prefix.rstrip('/')}'" if prefix else "")]
  rounded = [p for p in wanted if got[prefix + p].dtype == np.float64]
  if rounded:
    notes.append(f"{len(rounded)} f64 leaves rounded to nearest f32 (e.g. '{rounded[0]}')")

  def f32_view(p, x):
    v = got[prefix + _tree.leaf_path(p)]
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.asarray(v.astype(np.float32) if v.dtype != np.float32 else v)
    return jnp.asarray(v)

  master = jax.tree_util.tree_map_with_path(f32_view, abstract)
  # copy=True: every leaf in its own buffer, so the state can be donated to a jitted step.
  cast_like = lambda tree, like: jax.tree.map(
      lambda x, t: jax.device_put(jnp.array(x, dtype=t.dtype, copy=True),
                                  getattr(t, "sharding", None)), tree, like)
  params = cast_like(master, abstract)
  opt_like = jax.eval_shape(optimizer.init, abstract)
  opt_state = cast_like(optimizer.init(master), opt_like)
  unused = [s for s in saved if not (s.startswith(prefix) and s[len(prefix):] in wanted)]
  notes.append(f"params: {_dtypes(saved, prefix, wanted)} -> "
               f"{'/'.join(sorted({dtype_name(d) for _, d in _floats(wanted)})) or 'none'} "
               f"(recipe {recipe.name}, rounded to nearest)")
  master_dtype = plan.optimizer_decisions.master_dtype
  if master_dtype is not None:
    notes.append(f"master: {dtype_name(master_dtype)} copy of the checkpoint's values")
  notes.append("optimizer state initialised fresh; model state and RNG of the target")
  if unused:
    notes.append(f"{len(unused)} checkpoint leaves are not params of the target and were "
                 f"left unread or unused (e.g. '{unused[0]}')")
  state = TrainState(params, opt_state, target.model_state, target.rng)
  return Imported(state, recipe, item_dir, step, prefix.rstrip("/"), tuple(notes))


def _flatten(tree: Any) -> dict[str, Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_tree.leaf_path(p): np.asarray(v) for p, v in leaves}


def _floats(shapes: dict) -> list:
  return [(p, d) for p, (_, d) in shapes.items() if d.name in _FLOATS]


def _dtypes(saved: dict, prefix: str, wanted: dict) -> str:
  names = sorted({dtype_name(saved[prefix + p][1]) for p, (_, d) in wanted.items()
                  if saved[prefix + p][1].name in _FLOATS})
  return "/".join(names) or "none"
