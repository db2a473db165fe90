"""fp8 scaling recipes: how a tensor is mapped into an fp8 format's range.

A GEMM operand `x` is stored in fp8 as ``q = fp8(clip(x / s, -max, max))`` and read back as
``q * s``; `s` (f32, the "scale", Flax's and Transformer Engine's `scale_inv` convention: the
divisor) is chosen so that the largest magnitude in the tensor (or tile) lands at the
format's max. Recipes differ in *which* amax and *over what* region:

  current      per-tensor amax of this step;
  delayed      per-tensor, amax taken from a history of past steps (Transformer Engine);
               the current amax is pushed after the scale is chosen (no data dependency
               between the quantization and its own statistics, one reduction per step);
  per_channel  one scale per row of the operand along the contraction dimension;
  block        one scale per tile: 1x128 for activations and gradients, 128x128 for
               weights (DeepSeek-V3), contraction-dimension tiles of equal length so the
               partial products of one tile can be scaled and summed in f32.

Every array here is f32 except the quantized values. Operands are handled in the canonical
layout of ``_dot``: a "left" operand is [B, R, C] with the contraction over C, a "right"
operand is [B, R, C] with the contraction over R.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from precision import formats
from precision._recipe import FP8_SCALINGS

_F32 = jnp.float32
PER_TENSOR = ("current", "delayed")
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class OperandRecipe:
  """How one GEMM operand (lhs, rhs or the incoming gradient) is scaled.

  Attributes:
    fmt: "e4m3" or "e5m2".
    scaling: one of current | delayed | per_channel | block.
    block: (free, contraction) tile lengths used when scaling == "block".
    history_len: amax history length (delayed); other recipes record the last amax only.
    amax_compute: "max" over the history or its "most_recent" entry (delayed).
    margin: the scale is multiplied by 2**margin (headroom for growth between steps).
    power_of_two: round every scale up to a power of two (exact scaling, no mantissa error
      from the scale itself).
  """

  fmt: str
  scaling: str
  block: tuple[int, int] = (1, 128)
  history_len: int = 1
  amax_compute: str = "max"
  margin: int = 0
  power_of_two: bool = False

  def __post_init__(self):
    if self.fmt not in FP8_DTYPES and not (self.fmt == "e2m1" and self.scaling == "nvfp4"):
      raise ValueError(f"fp8 format {self.fmt!r}; accepted: {', '.join(FP8_DTYPES)} (e2m1 "
                       "with nvfp4 scaling)")
    if self.scaling not in FP8_SCALINGS:
      raise ValueError(f"fp8 scaling {self.scaling!r}; accepted: {', '.join(FP8_SCALINGS)}")
    if min(self.block) < 1:
      raise ValueError(f"fp8 block {self.block!r}; both tile lengths must be >= 1")

  @property
  def dtype(self):
    return FP8_DTYPES[self.fmt]

  @property
  def fmax(self) -> float:
    return formats.info(self.fmt).max

  @property
  def overflow(self) -> tuple[float, bool]:
    """(boundary, inclusive): |x / s| beyond it would round past the format's max in an
    unbounded format; below it the clip changes nothing. The boundary is max + ulp/2; a
    tie there rounds up (counts as saturated) when max has an odd significand (E5M2:
    57344 = 7 * 8192), down otherwise (E4M3: 448 = 14 * 32)."""
    ulp = float(formats.ulp(self.fmax, self.fmt))
    return self.fmax + ulp / 2, int(self.fmax / ulp) % 2 == 1

  @property
  def per_tensor(self) -> bool:
    return self.scaling in PER_TENSOR

  @property
  def state_len(self) -> int:
    return self.history_len if self.scaling == "delayed" else 1


class OperandState(NamedTuple):
  """Scaling state of one operand of one GEMM (all f32, so it can ride a cotangent).

  amax_history: [L] per-tensor amaxes, index 0 the most recent (L = 1 unless delayed).
  scale: [] the per-tensor scale used at the last step; for per_channel/block the largest
    scale of any row/tile (the one holding the tensor's amax).
  saturated: [] elements of the last step with |x / s| beyond the fp8 max (clipped, incl.
    inf), see `OperandRecipe.overflow`.
  underflowed: [] nonzero elements of the last step that quantized to zero.
  Counts are exact up to 2**24 elements per tensor (f32).
  """

  amax_history: jax.Array
  scale: jax.Array
  saturated: jax.Array
  underflowed: jax.Array


def init_operand_state(recipe: OperandRecipe) -> OperandState:
  """Zero history, unit scale (as Flax fp8_ops and Transformer Engine), zero counters."""
  zero = jnp.zeros((), _F32)
  return OperandState(jnp.zeros((recipe.state_len,), _F32), jnp.ones((), _F32), zero, zero)


def _pow2_ceil(s: jax.Array) -> jax.Array:
  """Smallest power of two >= s (s > 0), exactly: frexp gives s = m * 2**e, m in [0.5, 1)."""
  m, e = jnp.frexp(s)
  e = jnp.where(m == 0.5, e - 1, e)
  return jnp.ldexp(jnp.ones_like(s), e)


def scale_from_amax(amax: jax.Array, recipe: OperandRecipe, fallback: jax.Array) -> jax.Array:
  """Scale (divisor) mapping `amax` to the format's max, elementwise, f32.

  Written as Transformer Engine's `scale_inv` and Flax's `compute_scale`:
  ``1 / ((fmax / amax) / 2**margin)``, so delayed scaling is bit-identical to both. A zero or
  non-finite amax (or one so small that the scale would underflow f32) keeps `fallback`.
  """
  amax = amax.astype(_F32)
  sf = (jnp.asarray(recipe.fmax, _F32) / amax) / jnp.asarray(2.0 ** recipe.margin, _F32)
  ok = (amax > 0) & jnp.isfinite(amax) & jnp.isfinite(sf) & (sf > 0)
  # The select sits between the two divisions, as in Flax: without it XLA's algebraic
  # simplifier rewrites 1 / (fmax / amax) into amax / fmax, which can differ in the last
  # bit. (Both are fine scales; this keeps delayed scaling bit-identical to Flax and TE.)
  s = 1.0 / jnp.where(ok, sf, 1.0)
  if recipe.power_of_two:
    s = _pow2_ceil(s)
  return jnp.where(ok, s, fallback.astype(_F32))


def history_amax(history: jax.Array, recipe: OperandRecipe) -> jax.Array:
  """The amax a delayed recipe scales with: max of the history or its newest entry.

  Non-finite entries (a step whose tensor held inf or NaN) are recorded in the history but
  never scale: "max" takes the largest finite entry, "most_recent" a non-finite newest
  entry, which `scale_from_amax` answers by keeping the previous scale.

  Reference, Transformer Engine's delayed scaling (`delayed_scaling.cu`): a non-finite or
  zero amax keeps the previous scale for that step, and its history max uses `fmaxf`,
  which skips NaN but not inf, so one inf amax keeps the scale frozen until it leaves the
  history (`amax_history_len` steps, 1024 by default). Here inf is skipped like NaN: an
  overflow says nothing about the range of the finite values the scale is for, and the
  loss-scale guard (or the fp8 rollback) usually discards that step anyway. So a
  non-finite amax costs at most the one step whose own scale it would have set.
  """
  if recipe.amax_compute == "most_recent":
    return history[0]
  return jnp.max(jnp.where(jnp.isfinite(history), history, jnp.zeros_like(history)))


def push_history(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Newest amax at index 0, oldest dropped: Flax's and TE's roll(-1) then set [0]."""
  return jnp.roll(history, -1, axis=0).at[0].set(amax.astype(_F32))


def tensor_amax(x: jax.Array) -> jax.Array:
  """max |x| over the whole tensor, f32 (exact: |x| and max round nothing)."""
  return jnp.max(jnp.abs(x.astype(_F32)))


def operand_tile(recipe: OperandRecipe, shape: tuple[int, int, int], side: str) -> tuple[int, int]:
  """(rows, cols) tile of a [B, R, C] operand sharing one scale (per-tensor: whole matrix).

  side "left": contraction over C; "right": contraction over R. `block` is given as
  (free, contraction) and oriented here.
  """
  _, r, c = shape
  if recipe.per_tensor:
    return (r, c)
  if recipe.scaling == "per_channel":
    return (1, c) if side == "left" else (r, 1)
  free, contr = recipe.block
  return (min(free, r), min(contr, c)) if side == "left" else (min(contr, r), min(free, c))


def _blocks(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
  """[B, R, C] zero-padded to whole tiles -> [B, R/tr, tr, C/tc, tc]."""
  b, r, c = x.shape
  tr, tc = tile
  rb, cb = -(-r // tr), -(-c // tc)
  x = jnp.pad(x, ((0, 0), (0, rb * tr - r), (0, cb * tc - c)))
  return x.reshape(b, rb, tr, cb, tc)


def block_amax(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
  """max |x| per tile: [B, R, C] -> [B, ceil(R/tr), ceil(C/tc)] f32 (padding is zero)."""
  return jnp.max(jnp.abs(_blocks(x.astype(_F32), tile)), axis=(2, 4))


def expand_scale(scale: jax.Array, tile: tuple[int, int], shape: tuple[int, int, int]) -> jax.Array:
  """Tile grid [B', Rb, Cb] -> per element [B', R|1, C|1], broadcastable against `shape`."""
  _, r, c = shape
  tr, tc = tile
  if scale.shape[1] > 1:
    scale = jnp.repeat(scale, tr, axis=1)[:, :r]
  if scale.shape[2] > 1:
    scale = jnp.repeat(scale, tc, axis=2)[:, :, :c]
  return scale


class Quantized(NamedTuple):
  """An fp8 operand: values [B, R, C] in fp8, scale grid [B'|1, Rb, Cb] f32, its tile."""

  q: jax.Array
  scale: jax.Array
  tile: tuple[int, int]


def current_scales(x: jax.Array, recipe: OperandRecipe, side: str) -> tuple[jax.Array, tuple[int, int]]:
  """Scale grid and tile of this step's data (current/per_channel/block; per-tensor [1,1,1])."""
  tile = operand_tile(recipe, x.shape, side)
  if recipe.per_tensor:
    amax = tensor_amax(x).reshape(1, 1, 1)
  else:
    amax = block_amax(x, tile)
  return scale_from_amax(amax, recipe, jnp.ones((), _F32)), tile


def quantize(x: jax.Array, scale: jax.Array, tile: tuple[int, int],
             recipe: OperandRecipe) -> tuple[Quantized, jax.Array, jax.Array]:
  """x [B, R, C] (any float dtype) -> (Quantized, saturated count, underflowed count).

  The division runs in f32 (exact upcast of bf16/f16/f32 inputs), so the only rounding is
  the one to fp8, round-to-nearest-even. Finite values beyond the format's max are clipped
  to it (saturation: a too-small scale must not turn data into inf). Non-finite inputs stay
  non-finite (inf -> E5M2 inf, or NaN in E4M3, which has no inf; NaN -> NaN), as in a
  bf16 GEMM: an overflowed, loss-scaled gradient then reaches the optimizer as inf/NaN and
  its step is skipped, instead of passing as a finite gradient at the fp8 max.
  `saturated` counts the finite elements the clip actually changes (beyond max + ulp/2, so
  the tensor's own amax landing a rounding error above max is not counted). Counts are f32
  scalars.
  """
  y = x.astype(_F32) / expand_scale(scale, tile, x.shape)
  fmax = jnp.asarray(recipe.fmax, _F32)
  finite = jnp.isfinite(x)
  q = jnp.where(finite, jnp.clip(y, -fmax, fmax), y).astype(recipe.dtype)
  boundary, inclusive = recipe.overflow
  over = jnp.abs(y) >= boundary if inclusive else jnp.abs(y) > boundary
  saturated = jnp.sum(over & finite, dtype=jnp.int32).astype(_F32)
  underflowed = jnp.sum((x != 0) & (q.astype(_F32) == 0), dtype=jnp.int32).astype(_F32)
  return Quantized(q, scale, tile), saturated, underflowed


def record_scale(scale: jax.Array) -> jax.Array:
  """The per-tensor scale stored in state: the largest of a grid (the tensor amax's)."""
  return jnp.max(scale).astype(_F32)



def combine_grad_states(own: OperandState, later: OperandState) -> OperandState:
  """The gradient-operand state of one GEMM used several times in a differentiated step.

  `own` is this use's new state; `later` the combined state of the uses after it in the
  forward pass (the cotangent of the state token this use passed on; zeros when there is
  none). The result is the state one use of the concatenated gradient operand would give:
  every use pushed its amax on the same history, so the elementwise max of the histories
  is that history with the max amax pushed (NaN propagates: a non-finite use makes the
  combined amax non-finite, as in the concatenated tensor); the scales are the same
  (delayed) or grow with the amax (current, per-channel, block), so their max is the
  concatenated operand's; saturation and underflow counts add up. Zeros (no later use)
  leave `own` unchanged: amaxes are >= 0 and scales > 0.
  """
  return OperandState(jnp.maximum(own.amax_history, later.amax_history),
                      jnp.maximum(own.scale, later.scale),
                      own.saturated + later.saturated,
                      own.underflowed + later.underflowed)


def keep_unused_grad_state(old: Mapping[str, jax.Array], new: Mapping[str, jax.Array],
                           scale_key: str) -> dict[str, jax.Array]:
  """One GEMM's gradient-operand state after a differentiation that carried it out as the
  cotangent `new` (same keys as `old`; `scale_key` names the scale among them).

  A GEMM that took no part in the differentiated computation gets zero cotangents, scale 0
  (never a real scale): its `old` state is kept rather than zeroed. State with leading
  layer axes (a stack of layers) is decided layer by layer.
  """
  used = new[scale_key] > 0   # per GEMM; [L] for layers stacked by nnx.vmap
  return {k: jnp.where(jnp.reshape(used, used.shape + (1,) * (jnp.ndim(v) - used.ndim)),
                       new[k], v) for k, v in old.items()}
