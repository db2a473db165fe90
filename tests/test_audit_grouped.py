"""precision.audit on grouped GEMMs (`lax.ragged_dot`: an MoE layer's experts).

Each ragged_dot of a step is one audit row, forward and backward: the forward GEMM, the
ragged dlhs (the tokens' gradient: groups split its rows) and the per-group drhs (the
experts' weight gradients: groups split its contraction), each with its dtypes, its
group count and its FLOPs (one dense GEMM over all rows: the static bound).
`check(recipe)` names the grouped GEMM, its groups and its role when its dtypes are not
the recipe's: a hand-written bf16 MoE whose second expert GEMM was left f32 is flagged
there and only there; the autocast MoE passes.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import precision as mp

T, D, H, E = 16, 8, 16, 4
GROUPS = (5, 3, 0, 8)          # an empty expert included; sums to T
BF16 = jnp.bfloat16


def _moe(params, x, group_sizes):
  """A sorted-dispatch MoE layer (tokens already sorted by expert)."""
  with jax.named_scope("up"):
    h = jax.nn.gelu(lax.ragged_dot(x, params["w1"], group_sizes))
  with jax.named_scope("down"):
    y = lax.ragged_dot(h, params["w2"], group_sizes)
  return jnp.mean(y ** 2)


def _hand_bf16(params, x, group_sizes, down_dtype=BF16):
  """The layer in hand-written mixed precision: bf16 operands, f32 accumulation; the
  down GEMM's operands in `down_dtype` (f32: the GEMM the author forgot)."""
  with jax.named_scope("up"):
    h = jax.nn.gelu(lax.ragged_dot(x.astype(BF16), params["w1"].astype(BF16), group_sizes,
                                   preferred_element_type=jnp.float32))
  with jax.named_scope("down"):
    y = lax.ragged_dot(h.astype(down_dtype), params["w2"].astype(down_dtype), group_sizes,
                       preferred_element_type=jnp.float32)
  return jnp.mean(y ** 2)


def _args():
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k[0], (E, D, H)), "w2": jax.random.normal(k[1], (E, H, D))}
  return params, jax.random.normal(k[2], (T, D)), jnp.asarray(GROUPS, jnp.int32)


def test_every_expert_gemm_of_the_step_is_a_row_with_dtypes_groups_and_role():
  params, x, gs = _args()
  step = jax.grad(mp.autocast(_moe, "bf16_mixed"), argnums=(0, 1))
  report = mp.audit.audit(step, params, x, gs)
  rows = report.grouped_gemms()
  assert len(rows) == len(report.gemms) == 6  # no GEMM of the step is anything else
  got = collections.Counter((g.scope, g.role) for g in rows)
  assert got == {(s, r): 1 for s in ("up", "down") for r in ("fwd", "dlhs", "drhs")}, got
  for g in rows:
    assert (g.lhs_dtype, g.rhs_dtype, g.acc_dtype) == ("bfloat16", "bfloat16", "float32"), g
    assert g.groups == E and g.count == 1, g
    # Every row of the ragged dimension meets one expert's weight: T*D*H multiply-adds.
    assert g.flops == 2 * T * D * H, g
    assert g.ragged == ("contraction" if g.role == "drhs" else "rows"), g
  # The drhs gives one weight gradient per expert; the dlhs one row per token.
  assert {g.shape.split(" -> ")[1] for g in report.grouped_gemms("drhs")} == {
      f"f32[{E},{D},{H}]", f"f32[{E},{H},{D}]"}
  assert {g.shape.split(" -> ")[1] for g in report.grouped_gemms("dlhs")} == {
      f"f32[{T},{D}]", f"f32[{T},{H}]"}
  text = str(report)
  for role in ("fwd", "dlhs", "drhs"):
    assert f"({E} groups, {role})" in report.table()
    assert f"{role} bf16 x bf16 -> f32 ({E} groups) x2" in text, text
  report.check("bf16_mixed")


def test_dense_gemms_are_no_grouped_rows():
  w, x = jnp.ones((D, H)), jnp.ones((T, D))
  report = mp.audit.audit(jax.grad(lambda w: jnp.sum(x @ w)), w)
  assert report.gemms and not report.grouped_gemms()
  assert {(g.groups, g.ragged, g.role) for g in report.gemms} == {(0, "", "")}


def test_check_flags_the_expert_gemm_left_f32_and_passes_the_rest():
  params, x, gs = _args()
  mp.audit.audit(_hand_bf16, params, x, gs).check("bf16_mixed")
  report = mp.audit.audit(lambda p, x, g: _hand_bf16(p, x, g, jnp.float32), params, x, gs)
  with pytest.raises(mp.audit.PrecisionViolation) as e:
    report.check("bf16_mixed")
  (line,) = e.value.violations
  assert line.startswith("GEMM operands f32 x f32, expected bf16: fwd ragged_dot_general "
                         f"({E} groups, fwd) f32[{T},{H}] x f32[{E},{H},{D}]"), line
  assert line.endswith("[down]"), line


def test_check_flags_forward_dlhs_and_drhs_of_an_expert_left_f32_in_the_step():
  """The step's expert `down` left f32 by an override: `check` against the recipe alone
  names its three GEMMs (forward, dlhs, drhs) and no other; against the recipe with that
  override, and for the autocast step without it, it passes."""
  params, x, gs = _args()
  grad = lambda **kw: jax.grad(mp.autocast(_moe, "bf16_mixed", **kw), argnums=(0, 1))
  mp.audit.audit(grad(), params, x, gs).check("bf16_mixed")
  overrides = {"down": "full"}
  report = mp.audit.audit(grad(overrides=overrides), params, x, gs)
  report.check("bf16_mixed", overrides)
  with pytest.raises(mp.audit.PrecisionViolation) as e:
    report.check("bf16_mixed")
  found = e.value.violations
  assert len(found) == 3, found
  assert all(v.startswith("GEMM operands f32 x f32, expected bf16: ") and v.endswith("[down]")
             for v in found), found
  assert sorted(v.split("(")[1].split(")")[0] for v in found) == [
      f"{E} groups, {r}" for r in ("dlhs", "drhs", "fwd")], found


def test_a_scan_over_moe_layers_counts_each_grouped_gemm_per_layer():
  params, x, gs = _args()
  stacked = jax.tree.map(lambda a: jnp.stack([a, a, a]), params)

  def layers(stacked, x, gs):
    def body(h, p):
      return h + _moe(p, h, gs), None
    return jnp.sum(lax.scan(body, x, stacked)[0])

  report = mp.audit.audit(jax.grad(mp.autocast(layers, "bf16_mixed")), stacked, x, gs)
  rows = report.grouped_gemms()
  assert {g.count for g in rows} == {3}
  assert sum(g.flops for g in report.grouped_gemms("fwd")) == 3 * 2 * (2 * T * D * H)
  assert len(report.grouped_gemms("drhs")) == 2
