"""precision.audit: jaxpr walk through control flow, FLOPs, fp8 GEMMs, check and printing."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import precision as mp

BF16, F32 = jnp.bfloat16, jnp.float32


def test_walks_scan_cond_while_remat_custom_vjp():
  w = jnp.ones((8, 8), BF16)

  def body(c, _):
    y = mp.ops.einsum("ij,jk->ik", c, w)               # custom_vjp GEMM inside scan
    return y, None

  def f(x):
    y, _ = jax.lax.scan(body, x, None, length=3)
    y = jax.lax.cond(True, lambda a: jnp.dot(a, w, preferred_element_type=BF16),
                     lambda a: a, y)
    y = jax.checkpoint(lambda a: mp.ops.dot_general(a, w, (((1,), (0,)), ((), ()))))(y)
    y = jax.lax.while_loop(lambda a: jnp.sum(a.astype(F32)) < 0, lambda a: a * 2, y)
    return jnp.sum(jnp.exp(y.astype(F32)))

  x = jnp.ones((4, 8), BF16)
  r = mp.audit.audit(jax.jit(f), x)
  assert r.num_gemms == 5 and r.has_while
  assert r.flops == 5 * 2 * 4 * 8 * 8
  scan_gemm = [g for g in r.gemms if g.count == 3]
  assert len(scan_gemm) == 1 and scan_gemm[0].flops == 3 * 2 * 4 * 8 * 8
  assert all(g.location for g in r.gemms)
  assert any(g.location.startswith("test_audit.py:") for g in r.gemms)
  assert ("exp", "float32") in {(o.primitive, o.dtype) for o in r.ops}
  assert r.convert_counts()[("bf16", "f32")] >= 2
  # The cond branch's jnp.dot accumulates in bf16: check names it.
  with pytest.raises(ValueError, match="accumulates in bf16"):
    r.check("p=f32,c=bf16")
  grad = mp.audit.audit(
      jax.grad(lambda a: jnp.sum(mp.ops.einsum("ij,jk->ik", a, w).astype(F32))), x)
  assert [g.direction for g in grad.gemms] == ["fwd", "bwd", "bwd"]


def test_reduction_below_f32_and_wrong_operands_are_violations():
  def f(x, w):
    y = mp.ops.einsum("ij,jk->ik", x.astype(F32), w.astype(F32))  # f32 GEMM under bf16 policy
    return jax.lax.reduce(y.astype(BF16), jnp.zeros((), BF16), jax.lax.add, (0, 1))  # bf16 sum
  r = mp.audit.audit(f, jnp.ones((4, 8)), jnp.ones((8, 8)))
  v = r.violations("p=f32,c=bf16,o=f32")
  assert len(v) == 2
  assert any("accumulates in bf16" in s for s in v)
  assert any("operands f32 x f32, expected bf16" in s for s in v)
  with pytest.raises(ValueError) as e:
    r.check("p=f32,c=bf16,o=f32")
  assert e.value.violations == v
  assert len(r.violations("f32")) == 1  # only the bf16 sum


def test_fp8_gemm_reported_as_fp8():
  e4m3 = jnp.float8_e4m3fn

  def f(x, w):
    return jax.lax.dot_general(x.astype(e4m3), w.astype(e4m3), (((1,), (0,)), ((), ())),
                               preferred_element_type=F32)
  r = mp.audit.audit(f, jnp.ones((4, 16)), jnp.ones((16, 8)))
  (g,) = r.gemms
  assert g.is_fp8 and g.lhs_dtype == "float8_e4m3fn" and g.flops == 2 * 4 * 16 * 8
  r.check("p=f32,c=bf16")  # fp8 operands with f32 accumulation are accepted
  assert "fp8" in str(r)


def test_printing_is_one_screen():
  w = jnp.ones((8, 8), BF16)
  f = lambda x: mp.ops.cross_entropy(mp.ops.einsum("ij,jk->ik", x, w), jnp.zeros((4,), jnp.int32))
  r = mp.audit.audit(jax.value_and_grad(f), jnp.ones((4, 8), BF16))
  text = r.precision_map()
  assert len(text.splitlines()) <= 25
  # One row per region: its name, then the dtypes it computes in. The loss's island
  # computes in f32 only (the bf16 logits are upcast before log-softmax).
  rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:]}
  assert rows["cross_entropy"] == ["f32"], text
  assert rows["log_softmax"] == ["f32"], text
  assert "GEMM bwd" in text and "intermediates" in text
  assert "bf16 x bf16 -> f32 -> f32" in r.table()


def test_precision_audit_is_the_package_and_calling_it_is_deprecated():
  # A fresh interpreter: `import precision` alone, no submodule imported by name first.
  code = ("import types, warnings, precision, jax.numpy as jnp\n"
          "assert isinstance(precision.audit, types.ModuleType)\n"
          "assert precision.audit.lower is not None and precision.audit.audit is not None\n"
          "x = jnp.ones((2, 2))\n"
          "with warnings.catch_warnings():\n"
          "  warnings.simplefilter('error')\n"
          "  assert precision.audit.audit(lambda a: a @ a, x).num_gemms == 1\n"
          "with warnings.catch_warnings(record=True) as w:\n"
          "  warnings.simplefilter('always')\n"
          "  assert precision.audit(lambda a: a @ a, x).num_gemms == 1\n"
          "assert [x.category for x in w] == [DeprecationWarning], w\n"
          "assert 'precision.audit.audit(fn, *args)' in str(w[0].message)\n")
  subprocess.run([sys.executable, "-c", code], check=True,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
