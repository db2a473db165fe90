"""The explicit-sharding layout of an array's type, for the fp8 GEMMs' reshapes."""

from __future__ import annotations

import jax


def explicit_spec(x) -> tuple | None:
  """The explicit-sharding PartitionSpec entries of x's type (padded with None to its
  rank), or None when it has none."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return None
  return tuple(spec) + (None,) * (x.ndim - len(spec))
