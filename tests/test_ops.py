"""precision.ops: fp32 islands return the input dtype, compute in f32; policy GEMMs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import precision as mp
from precision import ops

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
  half = ops.cross_entropy(logits, labels, where=jnp.arange(5) < 2)
  assert np.isfinite(half)
  with pytest.raises(ValueError, match="integers"):
    ops.cross_entropy(logits, labels.astype(F32))


def test_rotary_keeps_norm_and_dtype():
  x = jax.random.normal(jax.random.key(0), (1, 6, 2, 8), F32).astype(BF16)
  y = ops.rotary_embedding(x, jnp.arange(6))
  assert y.dtype == BF16
  np.testing.assert_allclose(jnp.linalg.norm(y.astype(F32), axis=-1),
                             jnp.linalg.norm(x.astype(F32), axis=-1), rtol=2e-2)
  with pytest.raises(ValueError, match="even"):
    ops.rotary_tables(jnp.arange(3), 5)


def test_policy_gemm_forward_backward_dtypes():
  x = jax.random.normal(jax.random.key(0), (4, 8), F32).astype(BF16)
  w = jax.random.normal(jax.random.key(1), (8, 3), F32)
  y = ops.dot_general(x, w, (((1,), (0,)), ((), ())), BF16)
  assert y.dtype == BF16
  ref = jnp.dot(x.astype(F32), w.astype(BF16).astype(F32)).astype(BF16)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
  report = mp.audit(jax.grad(
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
