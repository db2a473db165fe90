"""Cross-recipe conversion of a restored training state.

A checkpoint written under recipe A is brought into recipe B from the f32 view of the
weights: the master copy where A keeps one (bf16_master), else A's params upcast to f32
(`precision.optim.master_params`). Then

  * B's params = that f32 master rounded to nearest in B's param dtypes;
  * B's optimizer state = B's optimizer initialised on the f32 master (so a B master copy
    is the saved master bit for bit), every leaf cast to the dtype B's own init gives it;
  * the optax states inside (Adam's count/mu/nu, schedule counts, ...) are carried over
    from A where B has the same optax state types with the same shapes, cast to B's moment
    dtypes, so the learning-rate schedule and moments continue;
  * the rest of B's optimizer state (loss scale, skip counters, stochastic-rounding counter,
    Kahan compensation) starts fresh, as B's optimizer initialises it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precision._policy import dtype_name
from precision._plan import Plan
from precision.checkpoint import _tree
from precision import optim


def _is_optax_state(x: Any) -> bool:
  return (isinstance(x, tuple) and hasattr(x, "_fields")
          and type(x).__module__.split(".")[0] == "optax")


def _cast_like(tree: Any, like: Any) -> Any:
  # copy=True: every leaf in its own buffer (optimizer inits share zero counters), so the
  # converted state can be donated to a jitted step.
  return jax.tree.map(lambda x, t: jnp.array(x, dtype=t.dtype, copy=True), tree, like)


def _carry_optax_states(saved_opt: Any, target_opt: Any) -> tuple[Any, list[str]]:
  """Replaces optax state nodes of target_opt by same-type nodes of saved_opt (in order)."""
  saved_nodes = [n for n in jax.tree.leaves(saved_opt, is_leaf=_is_optax_state)
                 if _is_optax_state(n)]
  leaves, treedef = jax.tree.flatten(target_opt, is_leaf=_is_optax_state)
  used: dict[type, int] = {}
  carried = []
  for i, node in enumerate(leaves):
    if not _is_optax_state(node) or not jax.tree.leaves(node):
      continue
    kind = type(node)
    same = [n for n in saved_nodes if type(n) is kind]
    k = used.get(kind, 0)
    used[kind] = k + 1
    if k >= len(same):
      continue
    src = same[k]
    if _tree.first_difference(_tree.shapes_by_path(src), _tree.shapes_by_path(node),
                              compare_dtype=False) is not None:
      continue
    leaves[i] = _cast_like(src, node)
    carried.append(kind.__name__)
  return jax.tree.unflatten(treedef, leaves), carried


def _dtypes(tree: Any) -> str:
  names = sorted({dtype_name(np.dtype(x.dtype)) for x in jax.tree.leaves(tree)
                  if jnp.issubdtype(x.dtype, jnp.floating)})
  return "/".join(names) or "none"


def convert(saved_params: Any, saved_opt: Any, saved_recipe: Plan, target_params: Any,
            target_opt: Any, recipe: Plan, tx: Any) -> tuple[Any, Any, list[str]]:
  """(params, opt_state, notes) of recipe `recipe` from a state saved under `saved_recipe`.

  target_params / target_opt: abstract (or concrete) trees of recipe `recipe`'s state;
  tx: recipe `recipe`'s optimizer (its `init` builds the new state on the f32 master).
  """

  master = optim.master_params(saved_opt, saved_params)
  master = jax.tree.map(lambda m: jnp.asarray(m).astype(jnp.float32)
                        if jnp.issubdtype(m.dtype, jnp.floating) else m, master)
  params = _cast_like(master, target_params)  # round to nearest into B's param dtypes
  opt = _cast_like(tx.init(master), target_opt)
  opt, carried = _carry_optax_states(saved_opt, opt)
  saved_master = saved_recipe.optimizer_decisions.master_dtype
  master_dtype = recipe.optimizer_decisions.master_dtype
  has_master = saved_master is not None
  source = (f"the {dtype_name(saved_master)} master" if has_master
            else f"the {_dtypes(saved_params)} params upcast to f32")
  notes = [
      f"recipe {saved_recipe.name} -> {recipe.name}",
      f"params: {_dtypes(saved_params)} -> {_dtypes(params)}, rounded to nearest from {source}",
  ]
  if master_dtype is not None:
    notes.append(f"master: {dtype_name(master_dtype)} copy of {source}")
  if carried:
    notes.append(f"optax states carried over (cast to the new dtypes): {', '.join(carried)}")
  notes.append(f"other optimizer state (loss scale, counters, rounding state) "
               f"initialised fresh for {recipe.name}")
  return params, opt, notes
