"""`find_state`: a node of one type in an optimizer state.

It imports no transformation, so any of them can search a state with it. `_guard`'s
`check_nonfinite_streak` still reaches it as `_query.find_state` (a function-level import,
and `_query` imports `_guard`): importing it from here instead opens that circle
(tests/test_imports.py lists it as known).
"""

from __future__ import annotations

from typing import Any

import jax


def find_state(opt_state: Any, kind: type) -> Any:
  """The first node of type `kind` in `opt_state` (depth first, leftmost), or None.

  The search stops at a match, so of nested matches the outermost is returned.
  """
  nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
  return next((n for n in nodes if isinstance(n, kind)), None)
