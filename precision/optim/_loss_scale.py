"""Loss scales as pytrees: NoOpLossScale, StaticLossScale, DynamicLossScale, and their type.

A drop-in for jmp's loss scales (`docs/jmp_migration.md` maps jmp's fields to ours and
lists every deliberate difference with its reason). Each class is a frozen dataclass whose
state (the scale, the counters) are pytree leaves and whose settings (factors, interval,
floor, ceiling, hysteresis) are static metadata. Flatten/unflatten are generated from the
dataclass fields, so none can be forgotten (jmp's hand-written `tree_flatten` drops
`min_loss_scale`, which then silently resets after any jit or tree_map).

Construction validates every value; unflattening does not: it rebuilds the object from
whatever leaves it is given (tracers, `jax.ShapeDtypeStruct`, the output of any
`jax.tree.map`), untouched, as JAX requires of a pytree.

Dtypes never drift: a Python number becomes an f32 scale; an array scale (f16, bf16, f32)
keeps its dtype through `adjust`, which computes in f32 and rounds the new scale once to
that dtype. Counters keep their integer dtype (int32 by default). So a jitted step or a
`lax.scan` carrying the loss scale sees the same dtypes every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from precision import _dtypes
from precision.optim import _tree

_F32 = jnp.float32
_F32_MAX = float(np.finfo(np.float32).max)


@runtime_checkable
class LossScale(Protocol):
  """What the optimizer guard needs of a loss scale (jmp's `LossScale`, as a protocol).

  Any pytree with these four members works with `precision.optim.loss_scaling`; the three
  classes here implement it. `isinstance(x, LossScale)` checks the members are present.

  Attributes:
    loss_scale: the current scale, a floating scalar array.
  """

  @property
  def loss_scale(self) -> jax.Array:
    ...

  def scale(self, tree: Any) -> Any:
    """`tree` multiplied by the scale (floating leaves)."""

  def unscale(self, tree: Any) -> Any:
    """`tree` unscaled: each floating leaf in f32 times the f32 reciprocal of the scale
    (GradScaler's unscale; exactly the quotient for a power-of-two scale)."""

  def adjust(self, grads_finite: Any) -> LossScale:
    """The loss scale for the next step, given a bool scalar: were all grads finite."""


def _register(cls, data: tuple[str, ...]):
  """Registers a frozen dataclass as a pytree: `data` fields are leaves, the rest static.

  Unflatten bypasses `__init__` (no validation, no conversion): JAX unflattens with
  tracers, `object()` sentinels, ShapeDtypeStructs and the outputs of arbitrary tree maps,
  which must come back exactly as given.
  """
  names = tuple(f.name for f in dataclasses.fields(cls))
  meta = tuple(n for n in names if n not in data)
  assert set(data) <= set(names), (cls, data)

  def flatten_with_keys(x):
    return ([(jax.tree_util.GetAttrKey(n), getattr(x, n)) for n in data],
            tuple(getattr(x, n) for n in meta))

  def flatten(x):
    return [getattr(x, n) for n in data], tuple(getattr(x, n) for n in meta)

  def unflatten(aux, leaves):
    obj = object.__new__(cls)
    for n, v in zip(data, leaves):
      object.__setattr__(obj, n, v)
    for n, v in zip(meta, aux):
      object.__setattr__(obj, n, v)
    return obj

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls


def _is_concrete(x: Any) -> bool:
  """A value whose contents can be read now (not a tracer or an abstract stand-in)."""
  if isinstance(x, (int, float, np.ndarray, np.generic)):
    return True
  return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _strong(value: Any) -> jax.Array:
  """`value` as an array of its own dtype, never weakly typed. `jnp.asarray(2.0 ** 15)`
  is a weak f32; `adjust` returns strong arrays, so a jitted step taking the scale would
  see another input type on its second call and trace again."""
  return jax.lax.convert_element_type(value, np.dtype(value.dtype))


def _scale_array(value: Any, where: str) -> jax.Array:
  """Validates a user-given scale: a Python number (-> f32) or a floating scalar array
  (dtype kept); finite and > 0 whenever its value is known."""
  if isinstance(value, bool) or not (isinstance(value, (int, float))
                                     or hasattr(value, "dtype")):
    raise ValueError(f"{where}={value!r}; accepted: a Python number or a floating scalar "
                     "array, finite and > 0")
  if isinstance(value, (int, float)):
    arr = jnp.asarray(value, _F32)
  else:
    if not jnp.issubdtype(value.dtype, jnp.floating):
      # jmp only warns; an integer scale cannot back off by 0.5 without rounding to 0.
      raise ValueError(f"{where} has dtype {np.dtype(value.dtype).name}; accepted: a "
                       "floating dtype (f16, bf16, f32) or a Python number")
    if np.shape(value) != ():
      raise ValueError(f"{where} has shape {np.shape(value)}; accepted: a scalar")
    arr = _strong(value)
  if _is_concrete(arr):
    v = float(np.asarray(arr, np.float64))
    if not (np.isfinite(v) and v > 0):
      raise ValueError(f"{where}={v!r}; must be finite and > 0")
  return arr


def _counter_array(value: Any, where: str) -> jax.Array:
  """Validates a user-given counter: a Python int (-> int32) or an integer scalar array
  (dtype kept), >= 0 whenever its value is known."""
  if isinstance(value, bool) or not (isinstance(value, int) or hasattr(value, "dtype")):
    raise ValueError(f"{where}={value!r}; accepted: a Python int or an integer scalar array")
  if isinstance(value, int):
    arr = jnp.asarray(value, jnp.int32)
  else:
    if not jnp.issubdtype(value.dtype, jnp.integer) or np.shape(value) != ():
      raise ValueError(f"{where} has dtype {np.dtype(value.dtype).name} and shape "
                       f"{np.shape(value)}; accepted: an integer scalar")
    arr = _strong(value)
  if _is_concrete(arr) and int(np.asarray(arr)) < 0:
    raise ValueError(f"{where}={int(np.asarray(arr))}; must be >= 0")
  return arr


def _setting(value: Any, where: str, kind: type) -> float | int:
  """A static setting as a Python float or int; concrete 0-d arrays are accepted (jmp
  passes `min_loss_scale` as one), integral floats for integer settings too."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(f"{where} is traced; settings are static: pass a Python number")
  try:
    v = float(np.asarray(value, np.float64))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{where}={value!r}; accepted: a real number") from e
  if kind is int:
    if v != int(v):
      raise ValueError(f"{where}={value!r}; accepted: an integer")
    return int(v)
  return v


def check_grads_finite(grads_finite: Any) -> jax.Array:
  """`grads_finite` as a bool scalar array, or ValueError (see `_tree.bool_scalar`)."""
  return _tree.bool_scalar(grads_finite, "adjust(grads_finite)")


def _scale_leaf(x: Any, scale: jax.Array) -> Any:
  # Scale floating leaves in f32: an f16 loss times 2**15 can overflow f16, and f32 holds
  # every f16/bf16 value exactly. Integer and other leaves pass through, as in `unscale`.
  if _dtypes.is_float(x):
    return x.astype(_F32) * scale.astype(_F32)
  return x


def _unscale_leaf(g: Any, scale: jax.Array) -> Any:
  # Unscale in f32 whatever the grad dtype: an f16 grad divided in f16 could overflow or
  # lose bits; f32 holds every f16/bf16 value exactly and the result feeds the f32 update.
  # Multiplied by the f32 reciprocal, as PyTorch's GradScaler unscales: for a power-of-two
  # scale (every dynamic scale with power-of-two settings, the presets' among them) 1/s is
  # exact and g * (1/s) IS g / s, bit for bit; for another scale it can differ from the
  # quotient in the last bit. A multiply, unlike a division, is cheap enough for XLA to
  # fuse into every consumer of the unscaled grads instead of keeping them as a temporary.
  if _dtypes.is_float(g):
    return g.astype(_F32) * (jnp.ones((), _F32) / scale.astype(_F32))
  return g


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """No loss scaling: `scale` and `unscale` return the tree itself; `loss_scale` is f32 1.

  Examples:
    >>> NoOpLossScale().scale({"a": 1.0})
    {'a': 1.0}
  """

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), _F32)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale(self, tree: Any) -> Any:
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    check_grads_finite(grads_finite)
    return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale.

  Args:
    loss_scale: a Python number (stored as f32) or a floating scalar array (dtype kept);
      finite and > 0.

  `scale` and `unscale` multiply the floating leaves in f32 by the scale / its f32
  reciprocal and return f32;
  other leaves pass through.

  Examples:
    >>> ls = StaticLossScale(1024.0)
    >>> float(ls.unscale(ls.scale(jnp.asarray(3.0, jnp.bfloat16))))
    3.0
  """

  loss_scale: jax.Array

  def __post_init__(self):
    object.__setattr__(self, "loss_scale", _scale_array(self.loss_scale,
                                                        "StaticLossScale.loss_scale"))

  def scale(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: _scale_leaf(x, self.loss_scale), tree)

  def unscale(self, tree: Any) -> Any:
    return jax.tree.map(lambda g: _unscale_leaf(g, self.loss_scale), tree)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    check_grads_finite(grads_finite)
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scale (PyTorch GradScaler's rule, with Megatron's hysteresis and floor).

  After each step, given whether all grads were finite:
    * non-finite: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; when it reaches 0 the
      scale backs off: ``scale = max(scale * backoff_factor, min_scale)``. The tracker is
      only refilled by a growth, so it counts the non-finite steps since the last growth
      (Megatron's rule), not consecutive ones.
    * finite: ``growth_tracker += 1``; when it reaches `growth_interval` it resets to 0,
      ``hysteresis_tracker = hysteresis`` and the scale grows by `growth_factor`, at most to
      `max_scale`, unless the grown scale would not be finite in the scale's dtype (then it
      stays, as GradScaler).
  With ``hysteresis=1`` and a `min_scale` that is never reached this is exactly GradScaler.
  The arithmetic runs in f32 and the new scale is rounded once to the scale's own dtype.

  Args:
    loss_scale: the starting scale: a Python number (stored as f32) or a floating scalar
      array (f16, bf16, f32: its dtype is kept); finite and > 0. e.g. 2**15.
    growth_tracker, hysteresis_tracker: state, keyword only; default 0 and `hysteresis`
      (int32), or integer scalar arrays whose dtype is kept.
    growth_factor (>= 1), backoff_factor (in (0, 1]), growth_interval (>= 1), min_scale,
      max_scale (0 < min_scale <= max_scale <= f32 max), hysteresis (>= 1): keyword-only
      settings, static pytree metadata.

  Examples:
    >>> ls = DynamicLossScale(2.0 ** 15, growth_interval=2000)
    >>> ls = ls.adjust(jnp.asarray(False))      # overflow: scale halves
    >>> float(ls.loss_scale)
    16384.0
  """

  loss_scale: jax.Array
  _: dataclasses.KW_ONLY
  growth_tracker: jax.Array = 0  # finite steps since the last growth or overflow
  hysteresis_tracker: jax.Array | None = None  # overflows left before a back-off
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = 1.0
  max_scale: float = _F32_MAX
  hysteresis: int = 1

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    name = type(self).__name__
    for k in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
      set_(k, _setting(getattr(self, k), f"{name}.{k}", float))
    for k in ("growth_interval", "hysteresis"):
      set_(k, _setting(getattr(self, k), f"{name}.{k}", int))
    if not self.growth_factor >= 1.0:
      raise ValueError(f"{name}.growth_factor={self.growth_factor!r}; must be >= 1")
    if not 0.0 < self.backoff_factor <= 1.0:
      raise ValueError(f"{name}.backoff_factor={self.backoff_factor!r}; must be in (0, 1]")
    if self.growth_interval < 1 or self.hysteresis < 1:
      raise ValueError(f"{name}.growth_interval={self.growth_interval!r} and hysteresis="
                       f"{self.hysteresis!r}; both must be >= 1")
    if not 0.0 < self.min_scale <= self.max_scale <= _F32_MAX:
      raise ValueError(f"{name}.min_scale={self.min_scale!r}, max_scale={self.max_scale!r}; "
                       f"need 0 < min_scale <= max_scale <= f32 max ({_F32_MAX:g})")
    set_("loss_scale", _scale_array(self.loss_scale, f"{name}.loss_scale"))
    set_("growth_tracker", _counter_array(self.growth_tracker, f"{name}.growth_tracker"))
    if self.hysteresis_tracker is None:
      set_("hysteresis_tracker", jnp.asarray(self.hysteresis, jnp.int32))
    set_("hysteresis_tracker",
         _counter_array(self.hysteresis_tracker, f"{name}.hysteresis_tracker"))

  def scale(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: _scale_leaf(x, self.loss_scale), tree)

  def unscale(self, tree: Any) -> Any:
    return jax.tree.map(lambda g: _unscale_leaf(g, self.loss_scale), tree)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """The next scale and counters (same dtypes); `grads_finite` is a bool scalar (traced
    is fine), anything else raises ValueError."""
    finite = check_grads_finite(grads_finite)
    dtype = jnp.asarray(self.loss_scale).dtype
    s = jnp.asarray(self.loss_scale).astype(_F32)
    gt, ht = jnp.asarray(self.growth_tracker), jnp.asarray(self.hysteresis_tracker)
    g_one, g_zero = jnp.ones((), gt.dtype), jnp.zeros((), gt.dtype)
    h_one, h_zero = jnp.ones((), ht.dtype), jnp.zeros((), ht.dtype)
    # Overflow branch (Megatron): the scale backs off once `hysteresis` overflows are spent.
    hyst_left = ht - h_one
    backed = jnp.maximum(s * _F32(self.backoff_factor), _F32(self.min_scale)).astype(dtype)
    s_bad = jnp.where(hyst_left <= 0, backed, s.astype(dtype))
    # Finite branch (GradScaler): grow after `growth_interval` finite steps, unless the grown
    # scale is not finite in the scale's own dtype (an f16 scale stops below 65504).
    grown_count = gt + g_one
    grow = grown_count >= self.growth_interval
    grown = s * _F32(self.growth_factor)
    g = jnp.minimum(grown, _F32(self.max_scale)).astype(dtype)
    g = jnp.where(jnp.isfinite(grown.astype(dtype)), g, s.astype(dtype))
    s_good = jnp.where(grow, g, s.astype(dtype))
    return dataclasses.replace(
        self,
        loss_scale=jnp.where(finite, s_good, s_bad),
        growth_tracker=jnp.where(finite, jnp.where(grow, g_zero, grown_count), g_zero),
        hysteresis_tracker=jnp.where(
            finite, jnp.where(grow, jnp.asarray(self.hysteresis, ht.dtype), ht),
            jnp.maximum(hyst_left, h_zero)))


_register(NoOpLossScale, ())
_register(StaticLossScale, ("loss_scale",))
_register(DynamicLossScale, ("loss_scale", "growth_tracker", "hysteresis_tracker"))


def from_config(config) -> LossScale:
  """The loss scale a `precision.LossScaleConfig` describes."""
  if config.kind == "none":
    return NoOpLossScale()
  if config.kind == "static":
    return StaticLossScale(float(config.initial_scale))
  if config.kind == "dynamic":
    return DynamicLossScale(
        float(config.initial_scale), growth_factor=float(config.growth_factor),
        backoff_factor=float(config.backoff_factor), growth_interval=int(config.growth_interval),
        min_scale=float(config.min_scale), max_scale=float(config.max_scale),
        hysteresis=int(config.hysteresis))
  raise ValueError(f"loss_scale.kind={config.kind!r}; accepted: none, static, dynamic")
