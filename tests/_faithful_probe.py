"""Run in a fresh interpreter by tests/test_numerics.py: jitted bf16/f16 chains vs ml_dtypes.

argv[1] == "on" throws the faithful-rounding switch before JAX starts. Prints one JSON line:
the fraction of elements whose bits differ from a strict per-op ml_dtypes reference.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ""
import precision  # noqa: E402

if sys.argv[1] == "on":
  precision.enable_faithful_rounding()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402


def chain(a, b, c):
  return jnp.exp(a * b + c) * a + b


def chain_ref(a, b, c, dt):
  # ml_dtypes rounds every op to dt: the strict meaning of the program above.
  t = (a * b).astype(dt)
  t = (t + c).astype(dt)
  t = np.exp(t.astype(np.float32)).astype(dt)
  t = (t * a).astype(dt)
  return (t + b).astype(dt)


def softmax(a):
  return jax.nn.softmax(a * a, axis=-1)


rng = np.random.default_rng(0)
out = {"faithful": precision.faithful_rounding_enabled()}
for name, dt in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16)):
  a, b, c = (rng.uniform(-2, 2, size=(512, 512)).astype(dt) for _ in range(3))
  got = np.asarray(jax.jit(chain)(a, b, c))
  ref = chain_ref(a, b, c, dt)
  out[f"chain_{name}"] = float(np.mean(got.view(np.uint16) != ref.view(np.uint16)))
  out[f"softmax_{name}"] = np.asarray(jax.jit(softmax)(a)).view(np.uint16).tolist()[:64]
  try:
    precision.enable_faithful_rounding()
    out["late_enable_error"] = None
  except RuntimeError as e:
    out["late_enable_error"] = str(e)
print(json.dumps(out))
