"""Run in a fresh interpreter by tests/test_numerics.py: what XLA computes in bf16/f16 with
and without the faithful-rounding switch, measured against the per-op ml_dtypes rounding,
and what precision reports.

argv[1], the mode:
  "on"   throws the switch (precision.enable_faithful_rounding()) before JAX starts;
  "off"  leaves it off;
  "excess_only" sets only --xla_allow_excess_precision=false (no ISA ceiling: on a CPU
         with native f16, XLA:CPU then contracts f16 multiply-adds into FMAs);
  "late" starts JAX without it, THEN puts the flag in XLA_FLAGS (too late: XLA read its
         flags at the start) and asks;
  "off_avx2", "excess_only_avx2": "off" and "excess_only" under --xla_cpu_max_isa=AVX2,
         which takes AVX-512 FP16 away from XLA's code generator: on a CPU that has it,
         this is what a CPU without it computes (on one without it, the same as the
         modes without the suffix).
argv[2]: a path; the bits of a jitted 512 x 512 bf16 softmax are saved there (.npy).

Prints one JSON line:
  faithful: precision.faithful_rounding_enabled() after JAX computed;
  status: precision.faithful_rounding_status() after JAX computed;
  measured: per dtype, whether every measurement below is 0 (softmax and the division by
    a broadcast against either division reference, see below): the direct answer the
    status must equal;
  env_flag: whether XLA_FLAGS holds the flag at that point;
  per dtype name (bf16, f16), the fraction of elements (rows for exp_sum) whose bits differ
  from the per-op reference:
    exp_sum_<d>: over 256 rows of 16 values, the f32 sum of ``y = exp(x)`` against the
      exact sum of the returned y (16 such values in [e**-2, e**2) sum exactly in f32, so
      per-op rounding gives 0; excess precision sums the unrounded exponentials);
    softmax_<d>: jax.nn.softmax over rows of 512 values in [0, 2.5), against the per-op
      reference (x - max, exp, the f32 sum - exact here, every exponential being a
      multiple of 2**-14 or 2**-11 at least 2**-4 - rounded to the dtype, the division);
      softmax_recip_<d>: the same with the division written as XLA's simplifier writes a
      division by a broadcast operand, a * (1 / b) with 1 / b rounded to the dtype;
    div_bcast_<d>, div_bcast_recip_<d>: a / b for b broadcast along rows, against the
      per-op division and against that reciprocal form;
    chain_<d>: an elementwise chain exp(a * b + c) * a + b;
    ops_<d>: each of +, -, *, / and the multiply-add a * b + c, one jitted function each;
  late_enable_error: the message of enable_faithful_rounding() called after JAX ran, or
    None if it returned.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
MODE = sys.argv[1]
os.environ["XLA_FLAGS"] = "--xla_cpu_max_isa=AVX2" if MODE.endswith("_avx2") else ""
BASE = MODE.removesuffix("_avx2")
import precision  # noqa: E402

if BASE == "on":
  precision.enable_faithful_rounding()
elif BASE == "excess_only":
  os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
# Any computation starts the backend with the XLA_FLAGS of this moment.
a = rng.uniform(-2, 2, size=(512, 512)).astype(ml_dtypes.bfloat16)
softmax = np.asarray(jax.jit(lambda a: jax.nn.softmax(a * a, axis=-1))(a))
np.save(sys.argv[2], softmax.view(np.uint16))
if BASE == "late":
  os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=false"

out = {"status": precision.faithful_rounding_status(),
       "faithful": precision.faithful_rounding_enabled(),
       "env_flag": "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"].split()}


def f(v):
  return v.astype(np.float32)


def differ(got, want):
  return float(np.mean(np.asarray(got).view(np.uint16) != want.view(np.uint16)))


def exp_and_sum(x):
  y = jnp.exp(x)
  return y, jnp.sum(y, axis=-1, dtype=jnp.float32)


def chain(a, b, c):
  return jnp.exp(a * b + c) * a + b


def chain_ref(a, b, c, dt):
  # ml_dtypes rounds every op to dt: the strict meaning of the program above.
  t = (a * b).astype(dt)
  t = (t + c).astype(dt)
  t = np.exp(t.astype(np.float32)).astype(dt)
  t = (t * a).astype(dt)
  return (t + b).astype(dt)


def divisions(num, den, dt):
  """The two readings of num / den: the per-op division, and num * (1 / den) with the
  reciprocal rounded to dt. Each op of two 16-bit values is exact in f32 but for its last
  rounding (f32 has more than twice their significand bits), so rounding the f32 result
  is the per-op value."""
  return ((f(num) / f(den)).astype(dt),
          (f(num) * f((np.float32(1) / f(den)).astype(dt))).astype(dt))


OPS = {
    "add": (lambda a, b, c: a + b, lambda a, b, c: (f(a) + f(b))),
    "sub": (lambda a, b, c: a - b, lambda a, b, c: (f(a) - f(b))),
    "mul": (lambda a, b, c: a * b, lambda a, b, c: (f(a) * f(b))),
    "div": (lambda a, b, c: a / b, lambda a, b, c: (f(a) / f(b))),
}

measured = {}
for name, dt in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
  x = rng.uniform(-2, 2, size=(256, 16)).astype(dt)
  y, total = (np.asarray(v) for v in jax.jit(exp_and_sum)(x))
  out[f"exp_sum_{name}"] = float(np.mean(total.astype(np.float64)
                                         != y.astype(np.float64).sum(axis=-1)))
  s = rng.uniform(0, 2.5, size=(256, 512)).astype(dt)
  e = np.exp(f((f(s) - f(s.max(axis=-1, keepdims=True))).astype(dt))).astype(dt)
  # Exact in f32: 512 multiples of 2**-14 below 512 need 23 significand bits.
  tot = f(e).astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32).astype(dt)
  got = jax.jit(jax.nn.softmax)(s)
  true_div, recip_div = divisions(e, tot, dt)
  out[f"softmax_{name}"] = differ(got, true_div)
  out[f"softmax_recip_{name}"] = differ(got, recip_div)
  num = rng.uniform(0.1, 1, size=(256, 512)).astype(dt)
  den = rng.uniform(100, 300, size=(256, 1)).astype(dt)
  got = jax.jit(lambda n, d: n / d)(num, den)
  true_div, recip_div = divisions(num, den, dt)
  out[f"div_bcast_{name}"] = differ(got, true_div)
  out[f"div_bcast_recip_{name}"] = differ(got, recip_div)
  a, b, c = (rng.uniform(-2, 2, size=(512, 512)).astype(dt) for _ in range(3))
  out[f"chain_{name}"] = differ(jax.jit(chain)(a, b, c), chain_ref(a, b, c, dt))
  ops = {op: differ(jax.jit(fn)(a, b, c), ref(a, b, c).astype(dt))
         for op, (fn, ref) in OPS.items()}
  ops["muladd"] = differ(jax.jit(lambda a, b, c: a * b + c)(a, b, c),
                         (f((f(a) * f(b)).astype(dt)) + f(c)).astype(dt))
  out[f"ops_{name}"] = ops
  measured["bfloat16" if name == "bf16" else "float16"] = (
      out[f"exp_sum_{name}"] == 0.0 and out[f"chain_{name}"] == 0.0
      and not any(ops.values())
      and min(out[f"softmax_{name}"], out[f"softmax_recip_{name}"]) == 0.0
      and min(out[f"div_bcast_{name}"], out[f"div_bcast_recip_{name}"]) == 0.0)
out["measured"] = measured
try:
  precision.enable_faithful_rounding()
  out["late_enable_error"] = None
except RuntimeError as e:
  out["late_enable_error"] = str(e)
print(json.dumps(out))
