"""Every private JAX/Flax name the library relies on still exists in the installed versions."""

import pytest

from precision import _compat


@pytest.mark.parametrize("module,attribute", _compat.PRIVATE_NAMES,
                         ids=[f"{m}.{a}" for m, a in _compat.PRIVATE_NAMES])
def test_private_name_exists(module, attribute):
  assert callable(_compat.resolve(module, attribute)) or isinstance(
      _compat.resolve(module, attribute), type)


def test_missing_name_is_named():
  with pytest.raises(_compat.MissingPrivateName, match="jax._src.lax.lax._no_such_rule"):
    _compat.resolve("jax._src.lax.lax", "_no_such_rule")
  with pytest.raises(_compat.MissingPrivateName, match="no_such_module.x"):
    _compat.resolve("no_such_module", "x")


def test_no_private_import_outside_compat():
  """Private JAX/Flax names are reached through precision._compat only."""
  import pathlib
  import re
  root = pathlib.Path(_compat.__file__).parent
  pattern = re.compile(r"jax\._src|from jax\._src|nn\.linear\._|flax\.[\w.]*\._[a-z]")
  offenders = [f"{p.relative_to(root.parent)}:{i + 1}"
               for p in root.rglob("*.py") if p.name != "_compat.py"
               for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
  assert not offenders, offenders
