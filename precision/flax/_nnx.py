"""apply_policy: one Policy governs a whole Flax NNX model, in place.

What each layer gets (its policy is the global one unless an override matches it or a
module containing it):

| layer                                  | params      | GEMM operands | accumulate | returns      |
|----------------------------------------|-------------|---------------|------------|--------------|
| Linear, LinearGeneral, Einsum, Conv    | param_dtype | compute_dtype | f32        | compute_dtype|
| Embed (lookup)                         | param_dtype | -             | -          | compute_dtype|
| Embed.attend                           | param_dtype | compute_dtype | f32        | compute_dtype|
| LayerNorm, RMSNorm, GroupNorm,         | param_dtype | statistics, normalisation, scale in f32 | compute_dtype |
|   BatchNorm, InstanceNorm              |             |               |            |              |
| the root module                        |             |               |            | output_dtype |

GEMMs run through `PolicyDotGeneral` / `PolicyConv` assigned to the layer's `dot_general` /
`conv_general_dilated` attribute: both backward GEMMs also take compute-dtype operands and
accumulate in f32 (see `_gemm.py`). Kernels reach the GEMM in their param dtype (the cast
happens inside it), so an f32 kernel's gradient leaves the f32 accumulator unrounded.
Embedding lookups gather in the param dtype and then cast, so the backward scatter-add of
the embedding gradient accumulates in the param dtype, not in bf16.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from precision import ops
from precision._policy import Policy, cast_floating, get_policy
from precision.flax import _overrides
from precision.flax._gemm import PolicyConv, PolicyDotGeneral

_F32 = np.dtype(np.float32)

GEMM_LAYERS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.Embed)
NORM_LAYERS = (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm, nnx.InstanceNorm)


def promote_to_f32(args: tuple, /, *, dtype=None, inexact: bool = True) -> tuple:
  """A norm layer's `promote_dtype`: input and params to f32, so the statistics, rsqrt and
  scale/shift run in f32 (bf16 sums of squares lose small terms)."""
  del dtype, inexact
  return tuple(None if a is None else jnp.asarray(a).astype(_F32) for a in args)


def promote_keep_kernel(args: tuple, /, *, dtype=None, inexact: bool = True) -> tuple:
  """A GEMM layer's `promote_dtype` for (inputs, kernel, bias): inputs and bias go to the
  compute dtype, the kernel stays in its param dtype; the policy GEMM casts it."""
  del inexact
  inputs, kernel, bias = args
  cast = lambda a: None if a is None else jnp.asarray(a).astype(dtype)
  return cast(inputs), kernel, cast(bias)


class PolicyEinsum(nnx.Einsum):
  """nnx.Einsum whose contraction runs through `self.dot_general` (a policy GEMM)."""

  def __call__(self, inputs, einsum_str=None, out_sharding=None):
    einsum_str = (einsum_str if einsum_str is not None else self.einsum_str)
    if einsum_str is None:
      raise ValueError("PolicyEinsum needs einsum_str as a call or constructor argument")
    einsum_str = einsum_str.replace(" ", "")
    self._einsum_str_check(einsum_str)
    bias = self.bias[...] if self.bias is not None else None
    # jnp.einsum promotes its operands together, so both go to the compute dtype here.
    inputs = inputs.astype(self.dtype)
    kernel = self.kernel[...].astype(self.dtype)
    y = jnp.einsum(einsum_str, inputs, kernel, precision=self.precision,
                   _dot_general=self.dot_general)
    y = y.astype(self.dtype)
    if bias is not None:
      shape = self._infer_broadcasted_bias_shape(einsum_str, inputs, kernel)
      y = y + jnp.reshape(bias.astype(self.dtype), shape)
    return y


class PolicyEmbed(nnx.Embed):
  """nnx.Embed that looks up in the param dtype then casts to the compute dtype (so the
  gradient scatter-add accumulates in the param dtype), and whose `attend` is a policy
  GEMM through `self.dot_general`."""

  def __call__(self, inputs, out_sharding=None):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embed inputs must be integers, got {inputs.dtype}")
    table = self.embedding[...]
    if self.num_embeddings == 1:
      out = jnp.broadcast_to(table, inputs.shape + (self.features,))
    else:
      out = jnp.take(table, inputs, axis=0)
    return out.astype(self.dtype)

  def attend(self, query, out_sharding=None):
    table = self.embedding[...]
    # Same contraction as flax's jnp.dot(query, embedding.T).
    return self.dot_general(query, table.T, (((query.ndim - 1,), (0,)), ((), ())),
                            out_sharding=out_sharding)


def _norm_f32(graphdef, base: type, xf, state):
  """The norm layer rebuilt from its state and called on an f32 input (all f32)."""
  return base.__call__(nnx.merge(graphdef, state), xf)


# The VJP of `ops._f32_island`, here rather than shared so that `precision.audit`, which
# names an op by its innermost precision/ops.py frame, keeps reporting these as "norm".
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _norm_island(graphdef, base: type, out_dtype, x, state):
  return _norm_f32(graphdef, base, x.astype(_F32), state).astype(out_dtype)


def _norm_island_fwd(graphdef, base, out_dtype, x, state):
  out = _norm_f32(graphdef, base, x.astype(_F32), state).astype(out_dtype)
  # Residuals: x in its narrow dtype and the params, not the f32 upcast and intermediates.
  return out, (x, state)


def _norm_island_bwd(graphdef, base, out_dtype, res, g):
  x, state = res
  # The upcast is exact and the f32 forward is recomputed with the same ops on the same
  # inputs; jax.vjp differentiates it as plain autodiff of the forward would.
  _, vjp = jax.vjp(functools.partial(_norm_f32, graphdef, base), x.astype(_F32), state)
  dxf, dstate = vjp(g.astype(_F32))
  return dxf.astype(x.dtype), dstate


_norm_island.defvjp(_norm_island_fwd, _norm_island_bwd)


def _f32_norm_class(base: type) -> type:
  """A subclass of a flax norm layer that runs with dtype=f32 (statistics, rsqrt, scale and
  shift all in f32; flax's own `dtype=bf16` path mixes bf16 inputs with f32 statistics)
  and rounds the result once to the policy's compute dtype.

  For an input below f32 the layer is a custom VJP (as the f32 islands of precision.ops):
  its backward pass keeps the input in its own dtype (and the params) instead of the f32
  upcast and f32 intermediates, and recomputes the f32 forward; values and gradients are
  unchanged. BatchNorm (which updates its statistics) and calls with extra arguments
  (masks) keep the plain path."""

  def __call__(self, x, *args, **kwargs):
    c = self.precision_compute_dtype
    if args or kwargs or base is nnx.BatchNorm or not ops._below_f32(x.dtype):
      return base.__call__(self, x, *args, **kwargs).astype(c)
    graphdef, state = nnx.split(self)
    return _norm_island(graphdef, base, c, x, state)

  return type(f"Policy{base.__name__}", (base,), {
      "__call__": __call__, "__module__": __name__,
      "__doc__": f"nnx.{base.__name__} computed in f32, returning the policy compute dtype."})


PolicyLayerNorm = _f32_norm_class(nnx.LayerNorm)
PolicyRMSNorm = _f32_norm_class(nnx.RMSNorm)
PolicyGroupNorm = _f32_norm_class(nnx.GroupNorm)
PolicyBatchNorm = _f32_norm_class(nnx.BatchNorm)
PolicyInstanceNorm = _f32_norm_class(nnx.InstanceNorm)

_POLICY_NORMS = {nnx.LayerNorm: PolicyLayerNorm, nnx.RMSNorm: PolicyRMSNorm,
                 nnx.GroupNorm: PolicyGroupNorm, nnx.BatchNorm: PolicyBatchNorm,
                 nnx.InstanceNorm: PolicyInstanceNorm}

_OUTPUT_CAST_CLASSES: dict[type, type] = {}


def _output_cast_class(base: type) -> type:
  """A subclass of `base` whose __call__ casts floating outputs to the policy output dtype."""
  base = getattr(base, "_precision_output_base", base)
  if base not in _OUTPUT_CAST_CLASSES:
    @functools.wraps(base.__call__)
    def __call__(self, *args, **kwargs):
      return cast_floating(base.__call__(self, *args, **kwargs), self.precision_output_dtype)

    _OUTPUT_CAST_CLASSES[base] = type(base.__name__, (base,), {
        "__call__": __call__, "_precision_output_base": base, "__module__": __name__,
        "__doc__": f"{base.__name__} whose outputs are cast to the policy's output dtype."})
  return _OUTPUT_CAST_CLASSES[base]


def _swap_class(obj: Any, cls: type) -> None:
  # object.__setattr__: NNX's own __setattr__ would record `__class__` as an attribute.
  if type(obj) is not cls:
    object.__setattr__(obj, "__class__", cls)


def _cast_variable(var: nnx.Variable, dtype: np.dtype) -> None:
  value = var.get_value()
  if (hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)
      and value.dtype != dtype):
    var.set_value(value.astype(dtype))


def _configure_layer(layer: nnx.Module, policy: Policy, scope: str, f32_norms: bool) -> None:
  c = policy.compute_dtype
  if isinstance(layer, nnx.Embed):
    if not isinstance(layer, PolicyEmbed):
      _swap_class(layer, PolicyEmbed)
    layer.dtype = c
    layer.dot_general = PolicyDotGeneral(c, scope)
  elif isinstance(layer, nnx.Einsum):
    if not isinstance(layer, PolicyEinsum):
      _swap_class(layer, PolicyEinsum)
    layer.dtype = c
    layer.dot_general = PolicyDotGeneral(c, scope)
  elif isinstance(layer, (nnx.Linear, nnx.LinearGeneral)):
    layer.dtype = c
    layer.promote_dtype = promote_keep_kernel
    layer.dot_general = PolicyDotGeneral(c, scope)
    if isinstance(layer, nnx.LinearGeneral):
      layer.dot_general_cls = None
  elif isinstance(layer, nnx.Conv):
    layer.dtype = c
    layer.promote_dtype = promote_keep_kernel
    layer.conv_general_dilated = PolicyConv(c, scope)
  elif isinstance(layer, NORM_LAYERS) and f32_norms:
    if type(layer) not in _POLICY_NORMS.values():
      base = next(b for b in type(layer).__mro__ if b in _POLICY_NORMS)
      if type(layer) is not base:
        raise ValueError(
            f"{type(layer).__name__} at {scope!r} subclasses {base.__name__}; f32 norms "
            "need the flax class itself (pass f32_norms=False to leave it alone)")
      _swap_class(layer, _POLICY_NORMS[base])
    layer.dtype = _F32
    layer.promote_dtype = promote_to_f32
    layer.precision_compute_dtype = c
  if hasattr(layer, "param_dtype"):
    layer.param_dtype = policy.param_dtype


def apply_policy(module: nnx.Module, policy: Policy | str,
                 overrides: Mapping[Any, Policy | str] | None = None, *,
                 f32_norms: bool = True) -> nnx.Module:
  """Applies a precision Policy to an NNX model in place and returns it.

  Params (nnx.Param) are cast to `param_dtype`; every Linear, LinearGeneral, Einsum, Conv
  and Embed computes in `compute_dtype` with f32 accumulation, forward and backward, and
  returns `compute_dtype`; norm layers compute statistics in f32 (`f32_norms`); the root
  module returns its floating outputs in `output_dtype`. Works on any user module that
  contains these layers; other code in it (e.g. attention scores) should call
  `precision.ops` (einsum, softmax, ...) to follow the policy.

  Args:
    module: the NNX model (modified in place).
    policy: a Policy or a policy string ("p=f32,c=bf16,o=f32").
    overrides: {path pattern or module type: Policy or string}; patterns are fnmatch'ed
      against "/"-joined module paths ("blocks/0/mlp/up"). First match wins; submodules
      inherit. E.g. {"*lm_head*": "f32"}.
    f32_norms: compute norm statistics in f32 (default True).
  Returns:
    `module`.
  Raises:
    ValueError: for a bad policy string, a bad override key or policy, or a pattern that
      matches no module path.

  Examples:
    >>> model = apply_policy(model, "p=f32,c=bf16,o=f32", {"*lm_head*": "f32"})
  """
  if not isinstance(module, nnx.Module):
    raise ValueError(f"apply_policy expects an nnx.Module, got {type(module).__name__}")
  base = get_policy(policy)
  rules = _overrides.parse_overrides(overrides, nnx.Module)
  nodes = list(nnx.iter_graph(module))
  modules = {tuple(p): n for p, n in nodes if isinstance(n, nnx.Module)}
  matched: set = set()
  effective: dict[tuple, Policy] = {}

  def policy_at(path: tuple) -> Policy:
    if path in effective:
      return effective[path]
    node = modules.get(path)
    rule = (_overrides.match(rules, _overrides.path_str(path), node)
            if node is not None and rules else None)
    if rule is not None:
      matched.add(rule.key)
      result = rule.policy
    elif not path:
      result = base
    else:
      result = policy_at(path[:-1])
    effective[path] = result
    return result

  for path in sorted(modules, key=len):
    policy_at(path)
  _overrides.check_all_matched(rules, matched,
                               [_overrides.path_str(p) for p in modules if p])

  for path, node in nodes:
    if isinstance(node, nnx.Param):
      _cast_variable(node, policy_at(tuple(path)[:-1]).param_dtype)
  for path, layer in modules.items():
    _configure_layer(layer, policy_at(path), _overrides.path_str(path), f32_norms)

  if hasattr(type(module), "__call__"):
    _swap_class(module, _output_cast_class(type(module)))
    module.precision_output_dtype = policy_at(()).output_dtype
  return module
