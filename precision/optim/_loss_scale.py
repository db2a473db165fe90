"""Loss scales as pytrees: NoOpLossScale, StaticLossScale, DynamicLossScale.

Each is a frozen dataclass registered with `jax.tree_util.register_dataclass`: the state
(scale, counters) are leaves and the settings (factors, interval, floor, ceiling,
hysteresis) are static metadata in the treedef. The generated flatten/unflatten lists
every field, so none can be forgotten (jmp's hand-written `tree_flatten` drops
`min_loss_scale`, which then silently resets after any jit or tree_map).

All state is f32/int32 so it never drifts dtype across jitted steps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)


class _Unset:
  """Default of the counter fields: filled in by __post_init__ on user construction.

  A sentinel rather than None, so that unflattening with any leaves (tracers, None from a
  `tree.map`, Orbax abstract stand-ins) passes them through untouched.
  """

  def __repr__(self):
    return "<unset>"


_UNSET = _Unset()


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32)


def _unscale_leaf(g: jax.Array, scale: jax.Array) -> jax.Array:
  # Unscale in f32 whatever the grad dtype: an f16 grad divided in f16 could overflow or
  # lose bits; f32 holds every f16/bf16 value exactly and the result feeds the f32 update.
  return g.astype(jnp.float32) / scale if jnp.issubdtype(g.dtype, jnp.floating) else g


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """No loss scaling: `scale` and `unscale` return the tree unchanged (dtypes kept)."""

  @property
  def loss_scale(self) -> jax.Array:
    return _f32(1.0)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale(self, tree: Any) -> Any:
    return tree

  def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
    del grads_finite
    return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=["loss_scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale (f32). `unscale` returns f32 grads."""

  loss_scale: jax.Array

  def __post_init__(self):
    if isinstance(self.loss_scale, (int, float)):
      if not (np.isfinite(self.loss_scale) and self.loss_scale > 0):
        raise ValueError(f"StaticLossScale({self.loss_scale!r}); the scale must be finite and > 0")
      object.__setattr__(self, "loss_scale", _f32(self.loss_scale))

  def scale(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32) * self.loss_scale, tree)

  def unscale(self, tree: Any) -> Any:
    return jax.tree.map(lambda g: _unscale_leaf(g, self.loss_scale), tree)

  def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
    del grads_finite
    return self


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["loss_scale", "growth_tracker", "hysteresis_tracker"],
    meta_fields=["growth_factor", "backoff_factor", "growth_interval", "min_scale",
                 "max_scale", "hysteresis"])
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scale (PyTorch GradScaler's rule, with Megatron's hysteresis and floor).

  After each step, given whether all grads were finite:
    * non-finite: ``growth_tracker = 0``; ``hysteresis_tracker -= 1``; when it reaches 0 the
      scale backs off: ``scale = max(scale * backoff_factor, min_scale)``.
    * finite: ``growth_tracker += 1``; when it reaches `growth_interval` it resets to 0,
      ``hysteresis_tracker = hysteresis`` and the scale grows by `growth_factor`, unless the
      grown scale would not be a finite f32 (then it stays, as GradScaler), and at most
      `max_scale`.
  With ``hysteresis=1`` and a `min_scale` that is never reached this is exactly GradScaler.

  Args (settings are static pytree metadata, state fields are f32/int32 leaves):
    initial_scale: starting scale (f32), e.g. 2**15.
    growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis:
      as above.

  Examples:
    >>> ls = DynamicLossScale(2.0 ** 15, growth_interval=2000)
    >>> ls = ls.adjust(jnp.asarray(False))      # overflow: scale halves
    >>> float(ls.loss_scale)
    16384.0
  """

  loss_scale: jax.Array
  growth_tracker: jax.Array = _UNSET  # int32 consecutive finite
  hysteresis_tracker: jax.Array = _UNSET  # int32 overflows left
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = 1.0
  max_scale: float = _F32_MAX
  hysteresis: int = 1

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    # Only validate and fill defaults on user construction; unflatten passes leaves that may
    # be tracers or abstract stand-in objects, which must go through untouched.
    if isinstance(self.loss_scale, (int, float)):
      if not (np.isfinite(self.loss_scale) and self.loss_scale > 0):
        raise ValueError(
            f"DynamicLossScale(initial_scale={self.loss_scale!r}); must be finite and > 0")
      set_("loss_scale", _f32(self.loss_scale))
    if self.growth_tracker is _UNSET:
      set_("growth_tracker", _i32(0))
    if self.hysteresis_tracker is _UNSET:
      set_("hysteresis_tracker", _i32(self.hysteresis))
    if not float(self.growth_factor) >= 1.0:
      raise ValueError(f"growth_factor={self.growth_factor!r}; must be >= 1")
    if not 0.0 < float(self.backoff_factor) <= 1.0:
      raise ValueError(f"backoff_factor={self.backoff_factor!r}; must be in (0, 1]")
    if int(self.growth_interval) < 1 or int(self.hysteresis) < 1:
      raise ValueError(f"growth_interval={self.growth_interval!r} and hysteresis="
                       f"{self.hysteresis!r}; both must be >= 1")
    if not 0.0 < float(self.min_scale) <= float(self.max_scale) <= _F32_MAX:
      raise ValueError(f"min_scale={self.min_scale!r}, max_scale={self.max_scale!r}; need "
                       f"0 < min_scale <= max_scale <= f32 max ({_F32_MAX:g})")

  def scale(self, tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32) * self.loss_scale, tree)

  def unscale(self, tree: Any) -> Any:
    return jax.tree.map(lambda g: _unscale_leaf(g, self.loss_scale), tree)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """The next scale and counters; `grads_finite` is a bool scalar (traced is fine)."""
    finite = jnp.asarray(grads_finite, jnp.bool_)
    s = self.loss_scale
    # Overflow branch (Megatron): the scale backs off once `hysteresis` overflows are spent.
    hyst_left = self.hysteresis_tracker - 1
    backed = jnp.maximum(s * _f32(self.backoff_factor), _f32(self.min_scale))
    s_bad = jnp.where(hyst_left <= 0, backed, s)
    # Finite branch (GradScaler): grow after `growth_interval` finite steps, only if finite.
    grown_count = self.growth_tracker + 1
    grow = grown_count >= self.growth_interval
    g = s * _f32(self.growth_factor)
    g = jnp.where(jnp.isfinite(g), jnp.minimum(g, _f32(self.max_scale)), s)
    s_good = jnp.where(grow, g, s)
    return dataclasses.replace(
        self,
        loss_scale=jnp.where(finite, s_good, s_bad),
        growth_tracker=jnp.where(finite, jnp.where(grow, _i32(0), grown_count), _i32(0)),
        hysteresis_tracker=jnp.where(
            finite, jnp.where(grow, _i32(self.hysteresis), self.hysteresis_tracker),
            jnp.maximum(hyst_left, _i32(0))))


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


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
