"""Deprecated names: one warning format, and keyword arguments under an old name.

A deprecated public name keeps working, bit for bit, and warns once per call site
(Python's default filter) with a DeprecationWarning naming the call that replaces it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns that `old` is deprecated in favour of the call `new`."""
  warnings.warn(f"{old} is deprecated and will be removed; call {new}", DeprecationWarning,
                stacklevel=stacklevel)


def renamed_keyword(old: str, new: str, where: str) -> Callable[[Callable], Callable]:
  """Decorator: the keyword argument `old` of function `where` is accepted as `new`, with a
  DeprecationWarning; both at once is a ValueError naming them."""

  def decorate(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
      if old in kwargs:
        if new in kwargs:
          raise ValueError(f"{where}: both {old}= and {new}= given; accepted: {new}= only "
                           f"({old}= is its deprecated name)")
        warn(f"{where}({old}=...)", f"{where}({new}=...)")
        kwargs[new] = kwargs.pop(old)
      return fn(*args, **kwargs)

    return wrapped

  return decorate


__all__ = ["renamed_keyword", "warn"]
