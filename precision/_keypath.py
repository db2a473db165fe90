"""Key paths as text, one home for the package: "blocks/0/attn/kernel".

Two kinds of path meet here: jax key paths (`jax.tree_util.tree_flatten_with_path`: DictKey,
GetAttrKey, SequenceKey, FlattenedIndexKey) and the plain tuples of names and indices of
`nnx.iter_modules` / `nnx.to_flat_state`. A jax key gives its key, name or index; any other
entry its `str`.
"""

from __future__ import annotations

from typing import Any, Iterable


def key_name(key: Any) -> str:
  """'kernel' for DictKey('kernel') / GetAttrKey('kernel'), '0' for SequenceKey(0), and
  ``str(key)`` for a plain name or index."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr) and not isinstance(key, (str, int)):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: Iterable[Any], *, drop: tuple[str, ...] = ()) -> str:
  """The path's names joined by "/", leaving out the names in `drop` (e.g. NNX's
  "value")."""
  names = (key_name(k) for k in path)
  return "/".join(n for n in names if n not in drop)


__all__ = ["key_name", "path_str"]
