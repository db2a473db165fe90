"""linen_policy: the same Policy for Flax Linen models, as a context manager.

Built on `flax.linen.intercept_methods`. While the context is active, every Linen module
call is intercepted and the layer runs under the policy that applies to its path:

| layer                          | params (created at init) | GEMM                                  | returns       |
|--------------------------------|--------------------------|---------------------------------------|---------------|
| Dense, DenseGeneral            | param_dtype              | policy dot_general, fwd + bwd         | compute_dtype |
| Conv, ConvLocal                | param_dtype              | policy conv, fwd + bwd                | compute_dtype |
| Einsum                         | param_dtype              | compute operands, f32 acc (fwd only)* | compute_dtype |
| Embed / Embed.attend           | param_dtype              | lookup in param dtype / policy GEMM   | compute_dtype |
| LayerNorm, RMSNorm, GroupNorm, | param_dtype              | statistics in f32                     | compute_dtype |
|   BatchNorm, InstanceNorm      |                          |                                       |               |
| the root module                |                          |                                       | output_dtype  |

* Linen's Einsum calls jnp.einsum directly, with no dot_general hook: its backward GEMMs
  follow JAX's transpose rule (an f32 cotangent times a compute-dtype operand), which
  `precision.audit` reports.

Linen modules are frozen dataclasses; the interceptor sets the layer's dtype fields on the
bound instance for the duration of the one call and restores them afterwards (the bound
instance is private to this apply/init). Linen already names each module in JAX's name
stack ("Model/lm_head"), so `precision.audit` attributes GEMMs to Linen paths as well.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax
import numpy as np

from precision import _compat
from precision._policy import Policy, cast_floating, get_policy
from precision.flax import _overrides
from precision.flax._gemm import PolicyConv, PolicyDotGeneral
from precision.flax._nnx import promote_keep_kernel

_F32 = np.dtype(np.float32)
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm, nn.InstanceNorm)
_LAYERS = (nn.Dense, nn.DenseGeneral, _compat.linen_conv_base(), nn.Einsum, nn.Embed) + _NORMS


def _promote_keep_kernel_linen(*args, dtype=None, inexact=True):
  # Linen's promote_dtype is variadic: (inputs, kernel, bias).
  return list(promote_keep_kernel(tuple(args), dtype=dtype, inexact=inexact))


@contextlib.contextmanager
def _fields(module: nn.Module, **values) -> Iterator[None]:
  """Temporarily sets dataclass fields of a bound (frozen) Linen module."""
  old = {k: getattr(module, k) for k in values}
  for k, v in values.items():
    object.__setattr__(module, k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      object.__setattr__(module, k, v)


def _module_path(module: nn.Module) -> tuple:
  try:
    return tuple(module.path)
  except (ValueError, AttributeError):
    return ()


@contextlib.contextmanager
def linen_policy(policy: Policy | str, overrides: Mapping[Any, Policy | str] | None = None,
                 *, f32_norms: bool = True) -> Iterator[Policy]:
  """Runs Linen `init`/`apply` calls inside the context under a precision Policy.

  `init` creates the standard layers' params in `param_dtype`; GEMM layers compute in
  `compute_dtype` with f32 accumulation (backward included), norms compute statistics in
  f32, and the root module returns `output_dtype`. `overrides` as in `apply_policy`
  ({path pattern or module type: policy}, fnmatch on "/"-joined Linen module paths, first
  match wins, submodules inherit).

  Raises:
    ValueError: for a bad policy or override on entry; on a clean exit, for an override
      pattern that matched no module called inside the context.

  Examples:
    >>> with linen_policy("p=f32,c=bf16,o=f32"):
    ...   params = model.init(key, x)
    ...   logits = model.apply(params, x)
  """
  base = get_policy(policy)
  rules = _overrides.parse_overrides(overrides, nn.Module)
  matched: set = set()
  seen_paths: list[str] = []

  def policy_of(module: nn.Module) -> Policy:
    node = module
    while isinstance(node, nn.Module):
      rule = _overrides.match(rules, _overrides.path_str(_module_path(node)), node)
      if rule is not None:
        matched.add(rule.key)
        return rule.policy
      node = node.parent
    return base

  def interceptor(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if method == "setup" and isinstance(module, _LAYERS):
      # setup-style layers (Embed) create their params here.
      with _fields(module, param_dtype=policy_of(module).param_dtype):
        return next_fun(*args, **kwargs)
    if method not in ("__call__", "attend"):
      return next_fun(*args, **kwargs)
    path = _module_path(module)
    scope = _overrides.path_str(path)
    if scope and scope not in seen_paths:
      seen_paths.append(scope)
    pol = policy_of(module)
    c, p = pol.compute_dtype, pol.param_dtype
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
      with _fields(module, dtype=c, param_dtype=p, dot_general=PolicyDotGeneral(c),
                   dot_general_cls=None, promote_dtype=_promote_keep_kernel_linen):
        out = next_fun(*args, **kwargs)
    elif isinstance(module, _compat.linen_conv_base()):
      with _fields(module, dtype=c, param_dtype=p, conv_general_dilated=PolicyConv(c),
                   conv_general_dilated_cls=None, promote_dtype=_promote_keep_kernel_linen):
        out = next_fun(*args, **kwargs)
    elif isinstance(module, nn.Einsum):
      with _fields(module, dtype=c, param_dtype=p, preferred_element_type=_F32):
        out = next_fun(*args, **kwargs).astype(c)
    elif isinstance(module, nn.Embed):
      if method == "attend":
        (query,) = args
        table = module.embedding
        return PolicyDotGeneral(c)(query, table.T,
                                          (((query.ndim - 1,), (0,)), ((), ())))
      # Lookup in the param dtype, then cast: the gradient scatter-add stays in param dtype.
      with _fields(module, dtype=p, param_dtype=p):
        out = next_fun(*args, **kwargs).astype(c)
    elif isinstance(module, _NORMS):
      if f32_norms and args:
        x = args[0]
        args = (x.astype(_F32),) + tuple(args[1:])  # f32 statistics and normalisation
      # dtype=f32: statistics, rsqrt, scale and shift in f32 (flax's dtype=bf16 path mixes
      # bf16 inputs with f32 statistics); the result is rounded once to the compute dtype.
      with _fields(module, dtype=_F32 if f32_norms else c, param_dtype=p):
        if p == _F32:
          out = next_fun(*args, **kwargs)
        else:
          # Linen's _normalize multiplies the f32 statistics by a param-dtype scale without
          # a cast, which strict promotion rejects; standard promotion keeps it in f32.
          with jax.numpy_dtype_promotion("standard"):
            out = next_fun(*args, **kwargs)
      out = out.astype(c)
    else:
      out = next_fun(*args, **kwargs)
    if not path and method == "__call__":
      out = cast_floating(out, pol.output_dtype)
    return out

  with nn.intercept_methods(interceptor):
    yield base
  _overrides.check_all_matched(rules, matched, seen_paths)
