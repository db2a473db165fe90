"""The microscaled GEMM (mxfp8 / nvfp4 recipes): block-quantised operands, f32 GEMM.

In the canonical layout of `precision.fp8._dot` (lhs [B, M, K], rhs [B, K, N]):

  forward  out = Q(lhs along K) @ Q(rhs along K)
  dgrad    d_lhs = Q_g(g along N) @ Q(rhs along N)^T
  wgrad    d_rhs = Q(lhs along M)^T @ Q_g(g along M)

Q quantises in blocks along the GEMM's own contraction and dequantises to f32 (the values
of the format, exactly: `precision.fp8._microscale`), and each GEMM multiplies the
dequantised f32 operands with f32 accumulation, so the numbers are those of a
block-scaled tensor-core GEMM up to the order of the f32 sums. Q_g is the gradient's
format (`backward_format`), stochastically rounded under nvfp4 with
`stochastic_gradients`; with `hadamard_wgrad` both wgrad operands are first multiplied by
the same random 16x16 Hadamard transform along M (orthogonal: the product is unchanged in
exact arithmetic, outliers are spread before quantisation). Each operand is quantised
again for each GEMM it enters (from its high-precision value), as block scales along one
axis do not survive a transposition; except, with `weight_block_2d` (nvfp4), the weight
(rhs, the kernel of nnx.Linear / Einsum, as `precision.fp8.Fp8Spec` takes it): quantised
once in 16 x 16 tiles (`precision.fp8._microscale.nvfp4_quantize_2d`), the forward GEMM
and dgrad read the same E2M1 elements, each with the tile scales as block scales along
its own contraction.

Lowering (`MicroSpec.gemm`, from `Fp8Config.micro_gemm`): "emulated" multiplies the
dequantised f32 operands as above on every platform. "block_scaled" hands each of the
three GEMMs, on a CUDA platform, to `jax.nn.scaled_matmul` (the custom call
``__op$block_scaled_dot``: cuDNN's block-scaled GEMM where cuDNN takes it, else XLA's
dequantise + dot) with the SAME quantised elements and block scales, both operands
transposed into its [B, rows, C] x [B, cols, C] layout (C the contraction; the scales
[B, rows, C / block] likewise); `lax.platform_dependent` keeps the emulation as the
branch of every other platform, so the CPU program computes what "emulated" computes.
MXFP8 values are element * 2**s exactly under both, so the results differ only in the
order of the f32 sums (and a backend's flush of subnormal products). NVFP4's f32 tensor
scales ts_a, ts_b are not operands of scaled_matmul: its f32 result (a sum of
q_a sb_a q_b sb_b, each product exact in f32) is multiplied by ts_a, then by ts_b, right
after the GEMM (two products, not one by ts_a * ts_b, which underflows f32 when both
scales are near their 2**-110 floor). The emulation instead rounds each dequantised
operand q * (sb * ts) to f32; the two agree to within a few f32 roundings per term of
the sum. "auto" is resolved when the GEMM is traced (`resolve_gemm`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precision.fp8 import _microscale as ms
from precision.fp8._sharding import explicit_spec

_F32 = jnp.float32
# Salts of the stochastic-rounding streams of the two gradient quantisations.
_DGRAD, _WGRAD = 0x5D6D3A1F, 0x2C1B9E47


GEMMS = ("auto", "emulated", "block_scaled")
# The lowest CUDA compute capability (major) with cuDNN's block-scaled GEMM (Blackwell).
BLOCK_SCALED_MIN_CC = 10


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["elements", "scales", "tensor_scale"], meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class Quantized:
  """One microscaled operand: elements, block scales along `axis` (its shape with `axis`
  of length ``len / block``) and, for nvfp4, the f32 tensor scale (None for mxfp8). A
  pytree whose `axis` is static (it passes through `lax.platform_dependent`)."""

  elements: jax.Array
  scales: jax.Array
  tensor_scale: jax.Array | None
  axis: int


@dataclasses.dataclass(frozen=True)
class MicroSpec:
  """How the three operands of one microscaled GEMM are quantised and multiplied (static,
  hashable)."""

  scaling: str              # "mxfp8" | "nvfp4"
  forward_format: str       # e4m3 | e5m2 (mxfp8), e2m1 (nvfp4)
  backward_format: str
  block: int
  scale_rounding: str = "up"
  stochastic_gradients: bool = False
  hadamard_wgrad: bool = False
  seed: int = 0
  gemm: str = "emulated"    # GEMMS; "auto" is resolved per GEMM when it is traced
  weight_block_2d: bool = False   # nvfp4: rhs (the weight) in block x block tiles

  @classmethod
  def from_config(cls, config) -> MicroSpec:
    return cls(config.scaling, config.forward_format, config.backward_format,
               config.block_size, config.scale_rounding, config.stochastic_gradients,
               config.hadamard_wgrad, config.seed, config.micro_gemm,
               config.weight_block_2d)

  def quantize(self, x: jax.Array, axis: int, fmt: str, stochastic: bool = False,
               salt: int = 0) -> Quantized:
    """x quantised in blocks along `axis` (elements, scales, nvfp4's tensor scale)."""
    if self.scaling == "mxfp8":
      q, s = ms.mxfp8_quantize(x, fmt, axis=axis, block=self.block,
                               scale_rounding=self.scale_rounding)
      return Quantized(q, s, None, axis)
    step = None
    if stochastic:
      step = ms.data_digest(x) ^ np.uint32(salt)
    q, sb, ts = ms.nvfp4_quantize(x, axis=axis, block=self.block, stochastic=stochastic,
                                  seed=self.seed, step=step)
    return Quantized(q, sb, ts, axis)

  def quantize_weight(self, w: jax.Array, axis: int) -> Quantized:
    """The weight [B, K, N] (rhs) quantised for a GEMM contracting `axis` (1: forward,
    2: dgrad). With `weight_block_2d`: block x block tiles over (K, N), the same elements
    for both GEMMs, the tile scales read as block scales along `axis`; else blocks
    along `axis` (`quantize`)."""
    if not self.weight_block_2d:
      return self.quantize(w, axis, self.forward_format)
    q, tiles, ts = ms.nvfp4_quantize_2d(w, axes=(1, 2), tile=self.block)
    return Quantized(q, ms.expand_tile_scales(tiles, (1, 2), axis, self.block), ts, axis)

  def dequantize(self, q: Quantized) -> jax.Array:
    """The f32 values of a quantised operand."""
    if self.scaling == "mxfp8":
      return ms.mxfp8_dequantize(q.elements, q.scales, axis=q.axis)
    return ms.nvfp4_dequantize(q.elements, q.scales, q.tensor_scale, axis=q.axis)

  def fake_quantize(self, x: jax.Array, axis: int, fmt: str, stochastic: bool = False,
                    salt: int = 0) -> jax.Array:
    """x quantised in blocks along `axis` and read back in f32."""
    return self.dequantize(self.quantize(x, axis, fmt, stochastic, salt))

  def check(self, m: int, k: int, n: int, where: str = "fp8") -> None:
    """Every contraction of the three GEMMs (K forward, N dgrad, M wgrad) is a whole
    number of blocks (and of 16 along M for the Hadamard transform)."""
    for what, size in (("K (forward contraction)", k), ("N (dgrad contraction)", n),
                       ("M (wgrad contraction: the rows of lhs)", m)):
      if size % self.block:
        raise ValueError(
            f"{where}.micro_block={self.block} ({self.scaling}) does not divide {what} = "
            f"{size} of a [{m}, {k}] x [{k}, {n}] GEMM; accepted: a micro_block dividing "
            f"M, K and N (or keep this GEMM out of {self.scaling} with "
            f"{where}.keep_high_precision)")
    if self.hadamard_wgrad and m % ms.HADAMARD:
      raise ValueError(
          f"{where}.hadamard_wgrad=True needs the wgrad contraction M = {m} (the rows of "
          f"lhs) to be a multiple of {ms.HADAMARD}; accepted: such an M, or "
          f"hadamard_wgrad=False")


def _mm(a: jax.Array, b: jax.Array, out_spec: tuple | None = None) -> jax.Array:
  """[B, M, K] x [B, K, N] -> [B, M, N], f32 operands, f32 accumulation; `out_spec`: the
  result's PartitionSpec entries under explicit sharding (needed when K is sharded)."""
  return lax.dot_general(
      a, b, (((2,), (1,)), ((0,), (0,))), precision=lax.Precision.HIGHEST,
      preferred_element_type=_F32,
      out_sharding=None if out_spec is None else jax.sharding.PartitionSpec(*out_spec))


def _nt(q: Quantized) -> Quantized:
  """A [B, ., .] operand with its contraction (its quantisation axis) moved last."""
  if q.axis == 2:
    return q
  return Quantized(jnp.swapaxes(q.elements, 1, 2), jnp.swapaxes(q.scales, 1, 2),
                   q.tensor_scale, 2)


def block_scaled_mm(lhs: Quantized, rhs: Quantized, scaled_matmul=None) -> jax.Array:
  """The GEMM of two quantised operands on their elements and block scales: lhs
  [B, rows, C] (quantised along C: axis 2) or [B, C, rows] (axis 1), rhs [B, C, cols]
  (axis 1) or [B, cols, C] (axis 2) -> f32 [B, rows, cols].

  `scaled_matmul` (default `jax.nn.scaled_matmul`, which lowers on CUDA and ROCm only)
  takes ([B, rows, C], [B, cols, C], scales [B, rows, C/block], [B, cols, C/block]);
  NVFP4's tensor scales multiply its f32 result, lhs's first (see the module docstring).
  """
  scaled_matmul = jax.nn.scaled_matmul if scaled_matmul is None else scaled_matmul
  a, b = _nt(lhs), _nt(rhs)
  out = scaled_matmul(a.elements, b.elements, a.scales, b.scales,
                      preferred_element_type=_F32)
  if lhs.tensor_scale is not None:
    out = (out * lhs.tensor_scale.astype(_F32)) * rhs.tensor_scale.astype(_F32)
  return out


def _emulated_mm(spec: MicroSpec, lhs: Quantized, rhs: Quantized,
                 out_spec: tuple | None = None) -> jax.Array:
  """The same GEMM on the dequantised f32 operands (`_mm`)."""
  a, b = spec.dequantize(lhs), spec.dequantize(rhs)
  if lhs.axis == 1:
    a = jnp.swapaxes(a, 1, 2)
  if rhs.axis == 2:
    b = jnp.swapaxes(b, 1, 2)
  return _mm(a, b, out_spec)


def _gemm(spec: MicroSpec, lhs: Quantized, rhs: Quantized,
          out_spec: tuple | None = None) -> jax.Array:
  """One of the three GEMMs, lowered per `spec.gemm` ("emulated" or "block_scaled")."""
  emulated = lambda l, r: _emulated_mm(spec, l, r, out_spec)
  if resolve_gemm(spec.gemm) == "emulated":
    return emulated(lhs, rhs)
  return lax.platform_dependent(lhs, rhs, cuda=block_scaled_mm, default=emulated)


def resolve_gemm(gemm: str) -> str:
  """"auto" -> "block_scaled" where the default device is a CUDA GPU of compute
  capability >= 10 (cuDNN's block-scaled GEMM exists), else "emulated"; the other
  choices pass through."""
  if gemm not in GEMMS:
    raise ValueError(f"fp8.micro_gemm={gemm!r}; accepted: {', '.join(GEMMS)}")
  if gemm != "auto":
    return gemm
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
  m = re.match(r"^\s*(\d+)\.", str(cc)) if cc is not None else None
  if m is not None and int(m.group(1)) >= BLOCK_SCALED_MIN_CC:
    return "block_scaled"
  return "emulated"


@dataclasses.dataclass(frozen=True)
class _Static:
  spec: MicroSpec
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def micro_bmm(static: _Static, a: jax.Array, b: jax.Array) -> jax.Array:
  """The microscaled GEMM [B, M, K] x [B, K, N] -> [B, M, N] in `static.out_dtype`."""
  spec = static.spec
  qa = spec.quantize(a, 2, spec.forward_format)
  qb = spec.quantize_weight(b, 1)
  return _gemm(spec, qa, qb).astype(static.out_dtype)


def _fwd(static: _Static, a, b):
  return micro_bmm(static, a, b), (a, b)


def _bwd(static: _Static, res, g):
  spec = static.spec
  a, b = res
  g = g.astype(_F32)
  sr = spec.stochastic_gradients
  # dgrad: contraction over N.
  gq = spec.quantize(g, 2, spec.backward_format, sr, _DGRAD)
  bq = spec.quantize_weight(b, 2)
  da = _gemm(spec, gq, bq)
  # wgrad: contraction over M, optionally after the same random Hadamard transform of
  # both operands along M.
  a32, g32 = a.astype(_F32), g
  if spec.hadamard_wgrad:
    a32 = ms.random_hadamard(a32, 1, spec.seed)
    g32 = ms.random_hadamard(g32, 1, spec.seed)
  aq = spec.quantize(a32, 1, spec.forward_format)
  gq = spec.quantize(g32, 1, spec.backward_format, sr, _WGRAD)
  # Under explicit sharding M (the batch rows) may be sharded: the weight gradient is
  # laid out as the weight is (as precision.fp8._dot does).
  sharded = explicit_spec(a) is not None or explicit_spec(g) is not None
  db = _gemm(spec, aq, gq, (explicit_spec(b) or (None,) * 3) if sharded else None)
  return da.astype(static.lhs_dtype), db.astype(static.rhs_dtype)


micro_bmm.defvjp(_fwd, _bwd)


def scope_name(scaling: str) -> str:
  """The jax.named_scope around every microscaled GEMM ("mxfp8_gemm", "nvfp4_gemm"): the
  lowering's op names carry it, so the audit tells these f32 GEMMs from others."""
  return f"{scaling}_gemm"


def micro_dot(a: jax.Array, b: jax.Array, spec: MicroSpec, out_dtype: Any) -> jax.Array:
  """The microscaled GEMM of canonical operands (see the module docstring)."""
  spec.check(a.shape[1], a.shape[2], b.shape[2])
  static = _Static(spec, np.dtype(out_dtype), np.dtype(a.dtype), np.dtype(b.dtype))
  with jax.named_scope(scope_name(spec.scaling)):
    return micro_bmm(static, a, b)
