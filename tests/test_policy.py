"""Policy: jmp grammar parity, round trips, casts, errors."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import precision as mp

JMP_DTYPE_NAMES = ["full", "f32", "float32", "bf16", "bfloat16", "f16", "float16", "f64",
                   "float64"]
# Strings jmp accepts in its own tests and README.
JMP_STRINGS = (
    JMP_DTYPE_NAMES
    + [f"c={n}" for n in JMP_DTYPE_NAMES]
    + [f"c={n},o=full" for n in JMP_DTYPE_NAMES]
    + [f"p={a},c={b}" for a in ("f32", "bf16", "f16") for b in ("f32", "bf16", "f16")]
    + ["params=float32,compute=bfloat16,output=float32", "p=f32,c=bf16,o=f32",
       "params=float32,compute=float16,output=float32", "p=f16,c=f16", "c=f16",
       "p=f32,c=f16,o=f32", "params=bfloat16,compute=bfloat16,output=bfloat16"]
)


@pytest.mark.parametrize("text", JMP_STRINGS)
def test_jmp_parity(text):
  ours = mp.get_policy(text)
  theirs = jmp.get_policy(text)
  assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
      np.dtype(theirs.param_dtype), np.dtype(theirs.compute_dtype),
      np.dtype(theirs.output_dtype))


def test_half_is_f16_everywhere():
  # jmp maps "half" to bf16 on TPU; we keep one meaning on every backend.
  assert mp.get_policy("half") == mp.Policy("f16", "f16", "f16")


def test_str_format_and_fp8_names():
  p = mp.get_policy("params=float32,compute=bfloat16")
  assert str(p) == "p=f32,c=bf16,o=bf16"
  q = mp.get_policy("p=bf16,c=e4m3,o=float8_e5m2")
  assert q.compute_dtype == jnp.float8_e4m3fn and q.output_dtype == jnp.float8_e5m2
  assert str(q) == "p=bf16,c=e4m3,o=e5m2"


NAMES = ["f32", "full", "float32", "bf16", "bfloat16", "f16", "float16", "half", "f64",
         "float64", "e4m3", "float8_e4m3fn", "e5m2", "float8_e5m2"]
KEYS = {"param": ["p", "params"], "compute": ["c", "compute"], "output": ["o", "output"]}


@st.composite
def policy_strings(draw):
  fields = draw(st.lists(st.sampled_from(list(KEYS)), unique=True, min_size=0, max_size=3))
  if not fields:
    return draw(st.sampled_from(NAMES)), None
  parts, chosen = [], {}
  for f in fields:
    name = draw(st.sampled_from(NAMES))
    chosen[f] = mp.parse_dtype(name)
    parts.append(f"{draw(st.sampled_from(KEYS[f]))}={name}")
  return ",".join(parts), chosen


@settings(max_examples=300, deadline=None)
@given(policy_strings())
def test_parser_property(case):
  text, chosen = case
  p = mp.get_policy(text)
  if chosen is None:
    assert p.param_dtype == p.compute_dtype == p.output_dtype == mp.parse_dtype(text)
  else:
    param = chosen.get("param", np.dtype(np.float32))
    compute = chosen.get("compute", param)
    output = chosen.get("output", compute)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (param, compute, output)
  assert mp.get_policy(str(p)) == p


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NAMES), st.sampled_from(NAMES), st.sampled_from(NAMES))
def test_str_round_trip(a, b, c):
  p = mp.Policy(a, b, c)
  assert mp.get_policy(str(p)) == p


@pytest.mark.parametrize("bad, token", [
    ("", "Empty"),
    ("   ", "Empty"),
    ("q=f32", "'q'"),
    ("p=f33", "'f33'"),
    ("p=f32,p=bf16", "Duplicated key 'p'"),
    ("params=f32,p=bf16", "Duplicated key 'p'"),
    ("int8", "'int8'"),
    ("p=int32", "'int32'"),
    ("p=f32,,c=bf16", "''"),
    ("p==f32", "'p==f32'"),
])
def test_bad_input_names_token(bad, token):
  with pytest.raises(ValueError, match=token.replace("(", r"\(")) as e:
    mp.get_policy(bad)
  # The message lists what is accepted.
  assert "accepted" in str(e.value) or "expected" in str(e.value) or "Duplicated" in str(e.value)


def test_non_float_dtype_object_rejected():
  with pytest.raises(ValueError, match="int32"):
    mp.Policy(np.int32, "f32", "f32")


def test_casts_touch_floats_only():
  p = mp.get_policy("p=f32,c=bf16,o=f16")
  key = jax.random.key(0)
  tree = {"w": jnp.ones(3, jnp.float32), "i": jnp.arange(3), "b": jnp.array([True]),
          "k": key, "raw": jax.random.PRNGKey(1), "np": np.ones(2, np.float64), "s": "x"}
  out = p.cast_to_compute(tree)
  assert out["w"].dtype == jnp.bfloat16 and out["np"].dtype == jnp.bfloat16
  assert out["i"].dtype == tree["i"].dtype and out["b"].dtype == jnp.bool_
  assert out["k"] is key and out["raw"].dtype == jnp.uint32 and out["s"] == "x"
  assert p.cast_to_output(tree)["w"].dtype == jnp.float16
  assert p.cast_to_param(out)["w"].dtype == jnp.float32


def test_with_replacers():
  p = mp.get_policy("f32").with_compute_dtype("bf16").with_output_dtype(jnp.float32)
  assert str(p) == "p=f32,c=bf16,o=f32"
  assert str(p.with_param_dtype("bf16")) == "p=bf16,c=bf16,o=f32"
  assert hash(p) == hash(mp.get_policy(str(p)))
