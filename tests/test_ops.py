"""precision.ops: fp32 islands return the input dtype, compute in f32; policy GEMMs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision import ops
from precision.audit import lower

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp", "rms_norm",
                                  "layer_norm"])
def test_islands_match_f32_reference_and_keep_dtype(name):
  x = jax.random.normal(jax.random.key(0), (4, 16), F32).astype(BF16)
  out = getattr(ops, name)(x)
  assert out.dtype == BF16
  xf = x.astype(F32)
  ref = {"softmax": jax.nn.softmax(xf), "log_softmax": jax.nn.log_softmax(xf),
         "logsumexp": jax.nn.logsumexp(xf, axis=-1),
         "rms_norm": xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6),
         "layer_norm": (xf - xf.mean(-1, keepdims=True)) * jax.lax.rsqrt(
             xf.var(-1, keepdims=True) + 1e-6)}[name]
  # Computing in f32 then rounding once: equal to the f32 reference rounded to bf16.
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.astype(BF16)))


def test_cross_entropy_f32_and_mask():
  logits = jax.random.normal(jax.random.key(0), (2, 5, 7), F32).astype(BF16)
  labels = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) % 7
  loss = ops.cross_entropy(logits, labels)
  assert loss.dtype == F32
  ref = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits.astype(F32)),
                                      labels[..., None], -1))
  np.testing.assert_allclose(loss, ref, rtol=1e-6)
  # Masked: the mean over the counted tokens only (first 2 of 5 positions in each row),
  # against an f64 reference of the same f32 logits.
  mask = np.arange(5) < 2
  lf = np.asarray(logits.astype(F32), np.float64)
  logp = lf - np.log(np.sum(np.exp(lf - lf.max(-1, keepdims=True)), -1, keepdims=True)) \
      - lf.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, np.asarray(labels)[..., None], -1)[..., 0]
  half = ops.cross_entropy(logits, labels, where=jnp.asarray(mask))
  assert half.dtype == F32
  np.testing.assert_allclose(float(half), nll[:, mask].mean(), rtol=1e-6)
  assert abs(float(half) - nll.mean()) > 1e-3  # the mask matters for these logits
  per_row = jnp.asarray([[True] * 5, [False] * 5])  # a [2, 5] mask: row 0 only
  np.testing.assert_allclose(float(ops.cross_entropy(logits, labels, where=per_row)),
                             nll[0].mean(), rtol=1e-6)
  assert float(ops.cross_entropy(logits, labels, where=jnp.zeros((2, 5), bool))) == 0.0
  with pytest.raises(ValueError, match="integers"):
    ops.cross_entropy(logits, labels.astype(F32))


def _rotary_reference(x, positions, base=10000.0):
  """Half-split rotary embedding in f64: pair (i, i + D/2) rotated by the angle
  position * base**(-2i/D), i < D/2 (Su et al., RoFormer; GPT-NeoX / Llama layout)."""
  x = np.asarray(x, np.float64)
  d = x.shape[-1]
  inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
  ang = np.asarray(positions, np.float64)[:, None] * inv_freq  # [T, D/2]
  sin, cos = np.sin(ang)[:, None, :], np.cos(ang)[:, None, :]  # over heads
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_rotary_matches_reference_values_and_keeps_dtype():
  positions = jnp.asarray([0, 1, 2, 7, 100, 4095])
  x32 = jax.random.normal(jax.random.key(0), (1, 6, 2, 8), F32)
  ref = _rotary_reference(np.asarray(x32), np.asarray(positions))
  y32 = ops.rotary_embedding(x32, positions)
  assert y32.dtype == F32
  # f32 tables and rotation: a few f32 ulps of the vector's scale (angles up to 4095).
  np.testing.assert_allclose(np.asarray(y32), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
  np.testing.assert_array_equal(np.asarray(y32[:, 0]), np.asarray(x32[:, 0]))  # position 0
  x = x32.astype(BF16)
  y = ops.rotary_embedding(x, positions)
  assert y.dtype == BF16
  # Computed in f32, rounded once to bf16: within one bf16 ulp of the exact value.
  ref16 = _rotary_reference(np.asarray(x.astype(F32)), np.asarray(positions))
  ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref16), 2.0 ** -126))) - 7)
  assert np.all(np.abs(np.asarray(y.astype(F32), np.float64) - ref16) <= ulp)
  # A known value: head_dim 2 rotates (1, 0) by the position itself (frequency 1).
  unit = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]]], F32)[None]  # [1, T=2, H=1, D=2]
  np.testing.assert_allclose(np.asarray(ops.rotary_embedding(unit, jnp.asarray([0, 3])))[0, :, 0],
                             [[1.0, 0.0], [np.cos(3.0), np.sin(3.0)]], rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match="even"):
    ops.rotary_tables(jnp.arange(3), 5)


def test_policy_gemm_forward_backward_dtypes():
  x = jax.random.normal(jax.random.key(0), (4, 8), F32).astype(BF16)
  w = jax.random.normal(jax.random.key(1), (8, 3), F32)
  y = ops.dot_general(x, w, (((1,), (0,)), ((), ())), BF16)
  assert y.dtype == BF16
  ref = jnp.dot(x.astype(F32), w.astype(BF16).astype(F32)).astype(BF16)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  report = mp.audit.audit(jax.grad(
      lambda x, w: jnp.sum(ops.dot_general(x, w, (((1,), (0,)), ((), ())), BF16).astype(F32)),
      argnums=(0, 1)), x, w)
  assert report.gemm_signatures() == {("bf16", "bf16", "f32", "f32"): 3}
  assert [g.direction for g in report.gemms] == ["fwd", "bwd", "bwd"]
  gx, gw = jax.grad(lambda x, w: jnp.sum(ops.dot_general(
      x, w, (((1,), (0,)), ((), ())), BF16).astype(F32)), argnums=(0, 1))(x, w)
  assert gx.dtype == BF16 and gw.dtype == F32
  with pytest.raises(ValueError, match="compute_dtype"):
    ops.einsum("ij,jk->ik", x, w)
  assert ops.einsum("ij,jk->ik", x, w, compute_dtype=BF16).dtype == BF16


def test_cpu_runs_row_major_bf16_gemms_natively_and_upcasts_the_others():
  """XLA:CPU: a policy GEMM in row-major form (x @ w, the forward of Flax's layers) runs
  bf16 x bf16 -> f32, as hand-written Flax does; one contracted over the lhs's leading dim
  (a weight gradient's form, for which XLA:CPU has no bf16 kernel) is upcast to f32. Both
  execute, and both equal the f64 product of the bf16-rounded operands to f32 accuracy."""
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(k[0], (64, 48), F32)
  b = jax.random.normal(k[1], (48, 32), F32)
  row_major = mp.autocast(lambda x, w: x @ w, "p=f32,c=bf16,o=f32")
  leading = mp.autocast(lambda xt, w: jnp.einsum("kn,km->nm", xt, w), "p=f32,c=bf16,o=f32")
  sig = lambda f, *args: [g.signature() for g in lower(f, *args, platform="cpu").gemms]
  assert sig(row_major, a, b) == [("bf16", "bf16", "f32")]
  assert sig(leading, a.T, b) == [("f32", "f32", "f32")]
  ref = (np.asarray(a.astype(BF16), np.float64) @ np.asarray(b.astype(BF16), np.float64))
  for f, args in ((row_major, (a, b)), (leading, (a.T, b))):
    got = np.asarray(jax.jit(f)(*args), np.float64)  # the result is rounded to bf16 once
    np.testing.assert_allclose(got, ref.astype(BF16).astype(np.float64), rtol=8e-3)
  # The rule itself: batch dims leading, lhs contracted over its trailing dims.
  native = mp._gemm._cpu_runs_natively
  x4 = jnp.zeros((2, 3, 4, 5), BF16)
  assert native(x4, x4, (((3,), (3,)), ((0, 1), (0, 1))))      # q @ k^T per head
  assert native(x4, jnp.zeros((2, 3, 5, 4), BF16), (((3,), (2,)), ((0, 1), (0, 1))))
  assert not native(x4, x4, (((2,), (2,)), ((0, 1), (0, 1))))  # contracted over the rows
  assert not native(x4, x4, (((3,), (3,)), ((0, 2), (0, 2))))  # batch dims not leading
  assert not native(x4.astype(jnp.float16), x4.astype(jnp.float16),
                    (((3,), (3,)), ((0, 1), (0, 1))))           # f16: always upcast
