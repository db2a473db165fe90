"""Every public module of precision/ (no path component starting with "_", package
__init__s included) declares `__all__`, and every name it lists exists there."""

from __future__ import annotations

import importlib
import pathlib

import pytest

import precision

ROOT = pathlib.Path(precision.__file__).parent


def _public_modules() -> list[str]:
  out = []
  for path in sorted(ROOT.rglob("*.py")):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__main__":   # a script (python -m), not a module to import
      continue
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if not any(p.startswith("_") for p in parts):
      out.append(".".join(parts))
  return out


def test_the_walk_sees_the_public_modules():
  mods = _public_modules()
  assert {"precision", "precision.fp8", "precision.optim", "precision.ops",
          "precision.formats", "precision.study"} <= set(mods)
  assert not any("._" in m for m in mods)


@pytest.mark.parametrize("name", _public_modules())
def test_public_module_declares_all(name):
  module = importlib.import_module(name)
  names = getattr(module, "__all__", None)
  assert isinstance(names, (list, tuple)), f"{name} has no __all__"
  assert len(set(names)) == len(names), f"{name}.__all__ repeats a name"
  missing = [n for n in names if not hasattr(module, n)]
  assert not missing, f"{name}.__all__ lists names it does not have: {missing}"
