"""Groups of GEMMs that precision.numerics.bisect promotes: a scope's forward or backward
GEMMs ("l0:fwd", "l0:bwd"), or both (the plain scope "l0")."""

from __future__ import annotations

from typing import Iterable

DIRECTIONS = ("fwd", "bwd")
_WORDS = {"fwd": "forward", "bwd": "backward"}


def group(scope: str, direction: str) -> str:
  """The group of `scope`'s GEMMs of `direction`: "l0:bwd"."""
  return f"{scope}:{direction}"


def split_group(g: str) -> tuple[str, str | None]:
  """"l0:bwd" -> ("l0", "bwd"); a plain scope "l0" -> ("l0", None) (both directions)."""
  scope, sep, direction = g.rpartition(":")
  return (scope, direction) if sep and direction in DIRECTIONS else (g, None)


def expand(groups: Iterable[str]) -> tuple:
  """Groups with each plain scope split into its forward and backward groups, adjacent
  (halving then narrows to a scope before it narrows to a direction)."""
  out = []
  for g in groups:
    scope, direction = split_group(g)
    out.extend([group(scope, d) for d in DIRECTIONS] if direction is None else [g])
  return tuple(dict.fromkeys(out))


def describe_group(g: str) -> str:
  """"'l0' backward GEMMs" for "l0:bwd"."""
  scope, direction = split_group(g)
  return f"{scope!r} {_WORDS[direction]} GEMMs" if direction else f"{scope!r} GEMMs"
