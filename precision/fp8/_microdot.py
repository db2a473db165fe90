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
axis do not survive a transposition.
"""

from __future__ import annotations

import dataclasses
import functools
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


@dataclasses.dataclass(frozen=True)
class MicroSpec:
  """How the three operands of one microscaled GEMM are quantised (static, hashable)."""

  scaling: str              # "mxfp8" | "nvfp4"
  forward_format: str       # e4m3 | e5m2 (mxfp8), e2m1 (nvfp4)
  backward_format: str
  block: int
  scale_rounding: str = "up"
  stochastic_gradients: bool = False
  hadamard_wgrad: bool = False
  seed: int = 0

  @classmethod
  def from_config(cls, config) -> MicroSpec:
    return cls(config.scaling, config.forward_format, config.backward_format,
               config.block_size, config.scale_rounding, config.stochastic_gradients,
               config.hadamard_wgrad, config.seed)

  def fake_quantize(self, x: jax.Array, axis: int, fmt: str, stochastic: bool = False,
                    salt: int = 0) -> jax.Array:
    """x quantised in blocks along `axis` and read back in f32."""
    if self.scaling == "mxfp8":
      q, s = ms.mxfp8_quantize(x, fmt, axis=axis, block=self.block,
                               scale_rounding=self.scale_rounding)
      return ms.mxfp8_dequantize(q, s, axis=axis)
    step = None
    if stochastic:
      step = ms.data_digest(x) ^ np.uint32(salt)
    q, sb, ts = ms.nvfp4_quantize(x, axis=axis, block=self.block, stochastic=stochastic,
                                  seed=self.seed, step=step)
    return ms.nvfp4_dequantize(q, sb, ts, axis=axis)

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
  qa = spec.fake_quantize(a, 2, spec.forward_format)
  qb = spec.fake_quantize(b, 1, spec.forward_format)
  return _mm(qa, qb).astype(static.out_dtype)


def _fwd(static: _Static, a, b):
  return micro_bmm(static, a, b), (a, b)


def _bwd(static: _Static, res, g):
  spec = static.spec
  a, b = res
  g = g.astype(_F32)
  sr = spec.stochastic_gradients
  # dgrad: contraction over N.
  gq = spec.fake_quantize(g, 2, spec.backward_format, sr, _DGRAD)
  bq = spec.fake_quantize(b, 2, spec.forward_format)
  da = _mm(gq, jnp.swapaxes(bq, 1, 2))
  # wgrad: contraction over M, optionally after the same random Hadamard transform of
  # both operands along M.
  a32, g32 = a.astype(_F32), g
  if spec.hadamard_wgrad:
    a32 = ms.random_hadamard(a32, 1, spec.seed)
    g32 = ms.random_hadamard(g32, 1, spec.seed)
  aq = spec.fake_quantize(a32, 1, spec.forward_format)
  gq = spec.fake_quantize(g32, 1, spec.backward_format, sr, _WGRAD)
  # Under explicit sharding M (the batch rows) may be sharded: the weight gradient is
  # laid out as the weight is (as precision.fp8._dot does).
  sharded = explicit_spec(a) is not None or explicit_spec(g) is not None
  db = _mm(jnp.swapaxes(aq, 1, 2), gq, (explicit_spec(b) or (None,) * 3) if sharded else None)
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
