"""Policy: which dtype parameters live in, computations run in, and outputs leave in.

The string grammar is jmp's (google-deepmind/jmp), extended with fp8 names:

  "p=f32,c=bf16,o=f32"     keys p|params, c|compute, o|output
  "c=bf16"                 params default to f32, compute follows params, output follows compute
  "bf16"                   a bare dtype sets all three

Casts touch floating leaves only: integer, bool and PRNG-key leaves pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from precision._dtypes import is_float

T = TypeVar("T")

# Canonical short name first: str(policy) uses it.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float32): ("f32", "full", "float32"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16", "half"),
    np.dtype(jnp.float64): ("f64", "float64"),
    np.dtype(jnp.float8_e4m3fn): ("e4m3", "float8_e4m3fn"),
    np.dtype(jnp.float8_e5m2): ("e5m2", "float8_e5m2"),
}
_NAME_TO_DTYPE: dict[str, np.dtype] = {
    name: dt for dt, names in _DTYPE_NAMES.items() for name in names
}
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute",
         "o": "output", "output": "output"}


def _accepted_dtypes() -> str:
  return ", ".join(sorted(_NAME_TO_DTYPE))


def parse_dtype(value: Any, name: str = "dtype") -> np.dtype:
  """Parses a dtype name (jmp's aliases plus fp8 names) or a dtype-like into a float np.dtype.

  `name` is the argument the value was given as, named in the error (``param_dtype``).
  None is refused: NumPy reads ``np.dtype(None)`` as float64, which no caller means.

  Note: jmp maps "half" to bf16 on TPU and f16 elsewhere; we always map it to f16 so a
  policy string means the same thing on every backend.

  Raises:
    ValueError: naming `name`, the value and the accepted names, for an unknown name, a
      non-float dtype, None or anything that is not a dtype.
  """
  if isinstance(value, str):
    key = value.strip()
    if key not in _NAME_TO_DTYPE:
      raise ValueError(
          f"{name}={value!r}: unknown dtype; accepted names: {_accepted_dtypes()}")
    return _NAME_TO_DTYPE[key]
  if value is None or isinstance(value, (bool, np.bool_, int, float, complex, bytes)):
    # np.dtype(None) is float64 and np.dtype(3) is an error of NumPy's: never a choice.
    raise ValueError(f"{name}={value!r}: not a dtype; accepted names: {_accepted_dtypes()}")
  try:
    dt = np.dtype(value)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name}={value!r}: not a dtype; accepted names: "
                     f"{_accepted_dtypes()}") from e
  if dt not in _DTYPE_NAMES:
    raise ValueError(
        f"{name}={value!r}: policy dtypes must be floating point formats, got {dt.name!r}; "
        f"accepted: {_accepted_dtypes()}")
  return dt


def dtype_name(dtype: Any) -> str:
  """Canonical short name of a float dtype ("f32", "bf16", "f16", "f64", "e4m3", "e5m2")."""
  return _DTYPE_NAMES[parse_dtype(dtype)][0]


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts every floating leaf of `tree` to `dtype`; other leaves pass through untouched.

  An abstract leaf (`jax.ShapeDtypeStruct`) gets the new dtype, shape and sharding kept:
  what `jax.eval_shape` of the cast gives, so abstract trees plan memory correctly.
  """
  if dtype is None:  # np.dtype(None) would be float64
    raise ValueError("dtype=None; accepted: a float dtype or its name (f32, bf16, ...)")
  try:
    dtype = np.dtype(_NAME_TO_DTYPE.get(dtype, dtype) if isinstance(dtype, str) else dtype)
  except TypeError as e:
    raise ValueError(f"dtype={dtype!r}: not a dtype; accepted: a float dtype or its name "
                     f"({_accepted_dtypes()})") from e

  def cast(x):
    if is_float(x) and x.dtype != dtype:
      if isinstance(x, jax.ShapeDtypeStruct):
        return x.update(dtype=dtype)
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Param / compute / output dtypes of a mixed-precision module (jmp-compatible).

  Examples:
    >>> p = Policy("f32", "bf16", "f32")
    >>> str(p)
    'p=f32,c=bf16,o=f32'
    >>> get_policy(str(p)) == p
    True
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, parse_dtype(getattr(self, field), field))

  def cast_to_param(self, tree: T) -> T:
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    return cast_floating(tree, self.output_dtype)

  def with_param_dtype(self, dtype: Any) -> Policy:
    return dataclasses.replace(self, param_dtype=parse_dtype(dtype, "param_dtype"))

  def with_compute_dtype(self, dtype: Any) -> Policy:
    return dataclasses.replace(self, compute_dtype=parse_dtype(dtype, "compute_dtype"))

  def with_output_dtype(self, dtype: Any) -> Policy:
    return dataclasses.replace(self, output_dtype=parse_dtype(dtype, "output_dtype"))

  @property
  def is_full_precision(self) -> bool:
    f32 = np.dtype(jnp.float32)
    return self.param_dtype == self.compute_dtype == self.output_dtype == f32

  def __str__(self) -> str:
    return (f"p={dtype_name(self.param_dtype)},c={dtype_name(self.compute_dtype)},"
            f"o={dtype_name(self.output_dtype)}")


def _jmp_policy_type() -> type | None:
  # jmp is not a dependency: a jmp.Policy can only exist once the user imported jmp.
  jmp = sys.modules.get("jmp")
  return getattr(jmp, "Policy", None) if jmp is not None else None


def get_policy(policy: str | Policy) -> Policy:
  """Parses a policy string in jmp's grammar (plus fp8 dtype names); a Policy passes
  through; a `jmp.Policy` becomes the Policy of its three dtypes.

  Raises:
    ValueError: naming the policy, the bad token and what is accepted, for an empty
      string, an unknown key or dtype, a duplicated key, a non-float dtype or a value that
      is no string, Policy or jmp.Policy.

  Examples:
    >>> str(get_policy("p=f32,c=bf16"))
    'p=f32,c=bf16,o=bf16'
    >>> str(get_policy(jmp.get_policy("p=f32,c=bf16,o=f32")))
    'p=f32,c=bf16,o=f32'
  """
  if isinstance(policy, Policy):
    return policy
  jmp_policy = _jmp_policy_type()
  if jmp_policy is not None and isinstance(policy, jmp_policy):
    return Policy(policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  if not isinstance(policy, str):
    raise ValueError(f"policy={policy!r}; accepted: a policy string ('p=f32,c=bf16,o=f32' "
                     "or a bare dtype), a Policy or a jmp.Policy")
  text = policy.strip()
  if not text:
    raise ValueError(
        f"policy={policy!r}: Empty policy string; expected e.g. 'p=f32,c=bf16,o=f32' or a "
        f"bare dtype ({_accepted_dtypes()})")
  if "=" not in text:
    dt = parse_dtype(text, "policy")
    return Policy(dt, dt, dt)
  found: dict[str, np.dtype] = {}
  for part in text.split(","):
    if part.count("=") != 1:
      raise ValueError(
          f"policy={policy!r}: bad part {part!r}; expected KEY=DTYPE with KEY one of "
          f"{', '.join(_KEYS)}")
    key, value = (s.strip() for s in part.split("="))
    if key not in _KEYS:
      raise ValueError(
          f"policy={policy!r}: Unknown key {key!r}; accepted keys: {', '.join(_KEYS)}")
    field = _KEYS[key]
    if field in found:
      raise ValueError(f"policy={policy!r}: Duplicated key {key!r} ({field})")
    try:
      found[field] = parse_dtype(value, key)
    except ValueError as e:
      raise ValueError(f"policy={policy!r}: {e}") from None
  param = found.get("param", np.dtype(jnp.float32))
  compute = found.get("compute", param)
  output = found.get("output", compute)
  return Policy(param, compute, output)
