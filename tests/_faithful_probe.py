"""Run in a fresh interpreter by tests/test_numerics.py: what XLA computes in bf16/f16 with
and without the faithful-rounding switch, and what precision reports.

argv[1]:
  "on"   throws the switch (precision.enable_faithful_rounding()) before JAX starts;
  "off"  leaves it off;
  "excess_only" sets only --xla_allow_excess_precision=false (no ISA ceiling: on a CPU
         with native f16, XLA:CPU then contracts f16 multiply-adds into FMAs);
  "late" starts JAX without it, THEN puts the flag in XLA_FLAGS (too late: XLA read its
         flags at the start) and asks.
argv[2]: a path; the bits of a jitted 512 x 512 bf16 softmax are saved there (.npy).

Prints one JSON line:
  faithful: precision.faithful_rounding_enabled() after JAX computed;
  status: precision.faithful_rounding_status() after JAX computed;
  env_flag: whether XLA_FLAGS holds the flag at that point;
  exp_sum_mismatch: over 256 rows of 16 random bf16 values, the fraction of rows where
    the f32 sum of ``y = exp(x)`` (bf16) differs from the exact sum of the returned y
    (the sum of 16 bf16 values in [e**-2, e**2) is exact in f32, so per-op rounding
    gives 0; excess precision sums the unrounded exponentials);
  chain_bf16, chain_f16: fraction of elements of an elementwise chain whose bits differ
    from a strict per-op ml_dtypes reference;
  ops_bf16, ops_f16: the same for each of +, -, *, / and the multiply-add a * b + c,
    one jitted function each;
  late_enable_error: the message of enable_faithful_rounding() called after JAX ran, or
    None if it returned.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ""
import precision  # noqa: E402

MODE = sys.argv[1]
if MODE == "on":
  precision.enable_faithful_rounding()
elif MODE == "excess_only":
  os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
# Any computation starts the backend with the XLA_FLAGS of this moment.
a = rng.uniform(-2, 2, size=(512, 512)).astype(ml_dtypes.bfloat16)
softmax = np.asarray(jax.jit(lambda a: jax.nn.softmax(a * a, axis=-1))(a))
np.save(sys.argv[2], softmax.view(np.uint16))
if MODE == "late":
  os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=false"


def exp_and_sum(x):
  y = jnp.exp(x)
  return y, jnp.sum(y, axis=-1, dtype=jnp.float32)


x = rng.uniform(-2, 2, size=(256, 16)).astype(ml_dtypes.bfloat16)
y, total = (np.asarray(v) for v in jax.jit(exp_and_sum)(x))
exact = y.astype(np.float64).sum(axis=-1)
out = {
    "faithful": precision.faithful_rounding_enabled(),
    "status": precision.faithful_rounding_status(),
    "env_flag": "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"].split(),
    "exp_sum_mismatch": float(np.mean(total.astype(np.float64) != exact)),
}


def chain(a, b, c):
  return jnp.exp(a * b + c) * a + b


def chain_ref(a, b, c, dt):
  # ml_dtypes rounds every op to dt: the strict meaning of the program above.
  t = (a * b).astype(dt)
  t = (t + c).astype(dt)
  t = np.exp(t.astype(np.float32)).astype(dt)
  t = (t * a).astype(dt)
  return (t + b).astype(dt)


def differ(got, want):
  return float(np.mean(np.asarray(got).view(np.uint16) != want.view(np.uint16)))


OPS = {
    "add": (lambda a, b, c: a + b, lambda a, b, c, f: (f(a) + f(b))),
    "sub": (lambda a, b, c: a - b, lambda a, b, c, f: (f(a) - f(b))),
    "mul": (lambda a, b, c: a * b, lambda a, b, c, f: (f(a) * f(b))),
    "div": (lambda a, b, c: a / b, lambda a, b, c, f: (f(a) / f(b))),
}

for name, dt in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
  a, b, c = (rng.uniform(-2, 2, size=(512, 512)).astype(dt) for _ in range(3))
  out[f"chain_{name}"] = differ(jax.jit(chain)(a, b, c), chain_ref(a, b, c, dt))
  # Each op of two 16-bit values is exact in f32 but for its last rounding (f32 has more
  # than twice their significand bits), so rounding the f32 result is the per-op value.
  f = lambda v: v.astype(np.float32)
  ops = {op: differ(jax.jit(fn)(a, b, c), ref(a, b, c, f).astype(dt))
         for op, (fn, ref) in OPS.items()}
  ops["muladd"] = differ(jax.jit(lambda a, b, c: a * b + c)(a, b, c),
                         (f((f(a) * f(b)).astype(dt)) + f(c)).astype(dt))
  out[f"ops_{name}"] = ops
try:
  precision.enable_faithful_rounding()
  out["late_enable_error"] = None
except RuntimeError as e:
  out["late_enable_error"] = str(e)
print(json.dumps(out))
