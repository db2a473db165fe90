"""Grouped GEMMs (mixture-of-experts layers) under autocast.

An MoE layer written with `lax.ragged_dot` (MaxText's sorted dispatch: tokens sorted by
expert, one weight per expert group) has nearly all of its FLOPs in grouped GEMMs. Checked
here, on a router `x @ r`, two expert ragged_dots and a gelu:
  * the program lowered for CUDA (`jax.export`, nothing runs) under bf16_mixed / f16_mixed:
    every GEMM of the forward and of the backward (the ragged dlhs and the per-group drhs
    that JAX's transpose of ragged_dot_general lowers to) takes compute-dtype operands and
    accumulates in f32, and `precision.audit.lower(...).check` passes - while the plain
    function under the same check fails (the check catches escaped experts);
  * the values against NumPy: the forward per group of the rounded operands, the two
    gradients per group from the rounded cotangent, f32 accumulation;
  * fp32 is bit-identical to the plain function.
"""

import collections

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import precision as mp
from precision.audit import lower
from _asserts import assert_bit_identical

T, D, H, E = 16, 8, 16, 4
GROUPS = (5, 3, 0, 8)          # an empty expert included; sums to T
BF16 = np.dtype(jnp.bfloat16)


def _moe(params, x, group_sizes):
  """A sorted-dispatch MoE layer as users write it (tokens already sorted by expert)."""
  r, w1, w2 = params["router"], params["w1"], params["w2"]
  gate = jax.nn.softmax(x @ r, axis=-1).max(axis=-1, keepdims=True)
  h = jax.nn.gelu(lax.ragged_dot(x, w1, group_sizes))
  y = lax.ragged_dot(h, w2, group_sizes)
  return jnp.mean((y * gate) ** 2)


def _args():
  k = jax.random.split(jax.random.key(0), 4)
  params = {"router": jax.random.normal(k[0], (D, E)),
            "w1": jax.random.normal(k[1], (E, D, H)) / np.sqrt(D),
            "w2": jax.random.normal(k[2], (E, H, D)) / np.sqrt(H)}
  return params, jax.random.normal(k[3], (T, D)), jnp.asarray(GROUPS, jnp.int32)


@pytest.mark.parametrize("recipe,compute", [("bf16_mixed", "bf16"), ("f16_mixed", "f16")])
def test_every_gemm_of_the_moe_step_is_compute_dtype_in_the_cuda_lowering(recipe, compute):
  params, x, gs = _args()
  prog = lower(jax.grad(mp.autocast(_moe, recipe)), params, x, gs, platform="cuda")
  by_direction = collections.Counter(g.direction for g in prog.gemms)
  # router forward + 2 expert GEMMs forward; backward: router dlhs/drhs and the experts'
  # ragged dlhs and per-group drhs (XLA's expansion of a grouped GEMM: dense GEMMs).
  assert by_direction["fwd"] >= 3 and by_direction["bwd"] >= 5, by_direction
  assert set(prog.gemm_signatures()) == {(compute, compute, "f32")}, prog.gemm_signatures()
  prog.check(recipe)
  # The check catches experts that escape the recipe: the plain step is f32 x f32.
  plain = lower(jax.grad(_moe), params, x, gs, platform="cuda")
  with pytest.raises(mp.audit.PrecisionViolation, match="ragged_dot_general"):
    plain.check(recipe)


def test_the_jaxpr_audit_sees_the_grouped_gemms_in_the_compute_dtype():
  params, x, gs = _args()
  report = mp.audit.audit(jax.grad(mp.autocast(_moe, "bf16_mixed")), params, x, gs)
  ragged = [g for g in report.gemms if g.primitive == "ragged_dot_general"]
  # 2 forward; 4 backward: each expert GEMM's ragged dlhs and per-group drhs (the policy
  # GEMM's backward computes both; x's, not needed by jax.grad, is dead code to XLA)
  assert collections.Counter(g.direction for g in ragged) == {"fwd": 2, "bwd": 4}
  assert {(g.lhs_dtype, g.rhs_dtype, g.acc_dtype) for g in ragged} == {
      ("bfloat16", "bfloat16", "float32")}
  report.check("bf16_mixed")
  with pytest.raises(mp.audit.PrecisionViolation, match="ragged_dot_general"):
    mp.audit.audit(jax.grad(_moe), params, x, gs).check("bf16_mixed")


def test_fp32_is_bit_identical_to_the_plain_moe():
  params, x, gs = _args()
  want = jax.jit(jax.value_and_grad(_moe))(params, x, gs)
  got = jax.jit(jax.value_and_grad(mp.autocast(_moe, "fp32")))(params, x, gs)
  assert_bit_identical(got, want, "fp32 MoE step")


def _round(a, dtype):
  return np.asarray(np.asarray(a, np.float32).astype(dtype), np.float64)


def _per_group(fn, group_sizes):
  """[fn(g, rows of group g)] over the groups."""
  starts = np.concatenate([[0], np.cumsum(group_sizes)[:-1]])
  return [fn(g, slice(s, s + n)) for g, (s, n) in enumerate(zip(starts, group_sizes))]


@pytest.mark.parametrize("recipe,dtype", [("bf16_mixed", ml_dtypes.bfloat16),
                                          ("f16_mixed", np.float16)])
def test_grouped_gemm_values_match_numpy_per_group(recipe, dtype):
  """Forward: each group's rows of the rounded lhs times that group's rounded weight, f32
  accumulation, rounded once to the compute dtype. Backward (cotangent rounded once):
  dx per group g_c @ w_c[g]^T, dw[g] = x_c[rows]^T @ g_c[rows] (zero for the empty
  group), both straight from the accumulator in f32 (f32 operands: f32 gradients)."""
  _, x, gs = _args()
  w = jax.random.normal(jax.random.key(5), (E, D, H)) / np.sqrt(D)
  ct = jax.random.normal(jax.random.key(6), (T, H))
  f = mp.autocast(lambda x, w, gs: lax.ragged_dot(x, w, gs), recipe)
  y, vjp = jax.vjp(lambda x, w: f(x, w, gs), x, w)
  dx, dw = vjp(ct)
  assert (y.dtype, dx.dtype, dw.dtype) == (np.float32,) * 3
  xc, wc, gc = _round(x, dtype), _round(w, dtype), _round(ct, dtype)
  y_ref = np.concatenate(_per_group(lambda g, rows: xc[rows] @ wc[g], GROUPS))
  dx_ref = np.concatenate(_per_group(lambda g, rows: gc[rows] @ wc[g].T, GROUPS))
  dw_ref = np.stack(_per_group(lambda g, rows: xc[rows].T @ gc[rows], GROUPS))
  # The forward result is rounded to the compute dtype once from the f32 accumulator:
  # within half a unit of the compute dtype (plus the f32 summation's few ulps).
  eps = float(ml_dtypes.finfo(dtype).eps)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=eps / 2 + 1e-6, atol=1e-6)
  assert np.array_equal(_round(y, dtype), np.asarray(y, np.float64)), "not rounded"
  # Gradients: f32 accumulation of compute-dtype products (exact in f32); an f32-operand
  # GEMM (the escaped expert) would differ by ~eps.
  np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(dw)[GROUPS.index(0)])
