"""Bad and edge inputs at the public entry points, generated from pools of values.

Each case states its expectation: either the call works and its result is checked
against a stated value, or it raises a ValueError/TypeError whose message names the
argument (or field) given the bad value (compared without case: "Override" names
`overrides`). Any other exception from the library fails the
case. Arguments are validated before anything is traced or compiled, so the cases build
their tiny models and states once per module and compile only the few that run a step.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import precision as mp
from precision import checkpoint
from precision import optim
from precision import parallel
from precision import study
from _asserts import bit_identical

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)


class Case(NamedTuple):
  id: str
  call: Callable[[], Any]
  names: str | None                      # the error must contain it; None: must work
  check: Callable[[Any], bool] | None    # for cases that work: the stated expectation
  raises: tuple = (ValueError, TypeError)


CASES: list[Case] = []
_ids = itertools.count()


def bad(what: str, names: str, call: Callable[[], Any], raises=(ValueError, TypeError)):
  CASES.append(Case(f"{next(_ids):03d}-bad-{what}", call, names, None, raises))


def good(what: str, call: Callable[[], Any], check: Callable[[Any], bool]):
  CASES.append(Case(f"{next(_ids):03d}-ok-{what}", call, None, check))


def short(v: Any) -> str:
  # No memory addresses: pytest-xdist workers must collect the same test ids.
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(v)).replace(" ", "")[:24]


class Lazy:
  """Module-wide objects built on first use (a mesh, a compiled step, a saved step)."""

  def __init__(self):
    self._values = {}

  def get(self, name: str, make: Callable[[], Any]) -> Any:
    if name not in self._values:
      self._values[name] = make()
    return self._values[name]


LAZY = Lazy()

# ------------------------------------------------------------------- value pools

NOT_DTYPES = [None, "", "  ", "f33", "float", "int8", "fp8", "p=f32", 3, 1.5, True, [],
              ["f32"], {}, object(), b"f32", np.int32, jnp.int32, "bool", np.bool_]
DTYPES = [("f32", F32), (" f32 ", F32), ("full", F32), ("float32", F32), ("bf16", BF16),
          ("bfloat16", BF16), ("f16", F16), ("half", F16), (np.float32, F32),
          (jnp.bfloat16, BF16), (np.dtype("float16"), F16),
          ("e4m3", np.dtype(jnp.float8_e4m3fn)), ("e5m2", np.dtype(jnp.float8_e5m2))]
BAD_BOOLS = [1, 0, "yes", "True", None, 1.0, [True]]
NOT_INTS = [1.5, 2.0, True, "1", None, [1], np.float32(1)]

# ------------------------------------------------------------------- Policy, get_policy

FIELDS = ("param_dtype", "compute_dtype", "output_dtype")
for i, field in enumerate(FIELDS):
  for v in NOT_DTYPES:
    args = ["f32", "f32", "f32"]
    args[i] = v
    bad(f"Policy-{field}-{short(v)}", field, lambda args=tuple(args): mp.Policy(*args))
  for v in (None, "f33", 3, "int8"):
    bad(f"Policy.with_{field}-{short(v)}", field,
        lambda f=field, v=v: getattr(mp.Policy("f32", "f32", "f32"), f"with_{f}")(v))
for v, want in DTYPES:
  good(f"Policy-{short(v)}", lambda v=v: mp.Policy(v, "f32", v),
       lambda p, want=want: p.param_dtype == want and p.output_dtype == want
       and p.compute_dtype == F32)
for v in NOT_DTYPES:
  bad(f"parse_dtype-{short(v)}", "dtype", lambda v=v: mp.parse_dtype(v))
for v in (None, "f33", object(), [1], "p=f32"):
  bad(f"cast_floating-{short(v)}", "dtype", lambda v=v: mp.cast_floating({"a": X}, v))
for v, want in (("bf16", BF16), (np.float16, F16), ("f32", F32)):
  good(f"cast_floating-{short(v)}",
       lambda v=v: mp.cast_floating({"a": X, "i": np.arange(3), "k": jax.random.key(0)}, v),
       lambda t, want=want: t["a"].dtype == want and t["i"].dtype == np.arange(3).dtype
       and np.array_equal(np.asarray(t["a"], np.float32), X.astype(want).astype(np.float32)))

BAD_POLICY_STRINGS = ["", " ", ",", "p=", "=f32", "p==f32", "p=f32,", "p=f32,,c=bf16",
                      "q=f32", "P=f32", "p=f33", "p=int32", "p=f32,p=bf16",
                      "params=f32,p=bf16", "p=f32;c=bf16", "p:f32", "f32,bf16", "int8",
                      "c=bool", "o=f32=bf16", "p=f32 c=bf16", "compute_float16"]
for s in BAD_POLICY_STRINGS:
  bad(f"get_policy-{short(s)}", "policy", lambda s=s: mp.get_policy(s))
for v in (None, 3, 1.5, ["f32"], {"p": "f32"}, b"f32", np.float32, F32):
  bad(f"get_policy-{short(v)}", "policy", lambda v=v: mp.get_policy(v))
POLICY_STRINGS = [("p=f32,c=bf16,o=f32", "p=f32,c=bf16,o=f32"), ("c=bf16", "p=f32,c=bf16,o=bf16"),
                  ("p=bf16", "p=bf16,c=bf16,o=bf16"), ("bf16", "p=bf16,c=bf16,o=bf16"),
                  (" params = f32 , compute = f16 ", "p=f32,c=f16,o=f16"),
                  ("o=f16", "p=f32,c=f32,o=f16"), ("c=bf16,p=f16", "p=f16,c=bf16,o=bf16"),
                  ("full", "p=f32,c=f32,o=f32"), ("half", "p=f16,c=f16,o=f16"),
                  ("p=f32,c=e4m3,o=f32", "p=f32,c=e4m3,o=f32")]
for s, want in POLICY_STRINGS:
  good(f"get_policy-{short(s)}", lambda s=s: mp.get_policy(s),
       lambda p, want=want: str(p) == want and mp.get_policy(str(p)) == p)

# ------------------------------------------------------------------- recipes

for v in ("nope", "FP32", " fp32", "", None, 3, ["fp32"], {"name": "fp32"}, mp.Policy("f32", "f32", "f32")):
  bad(f"get_recipe-{short(v)}", "recipe", lambda v=v: mp.get_recipe(v))
for name in mp.PRESETS:
  good(f"get_recipe-{name}", lambda name=name: mp.get_recipe(name),
       lambda r, name=name: r is mp.PRESETS[name] and r.name == name)

BAD_RECIPE_FIELDS = {
    "name": ["", " ", None, 3, ["a"]],
    "policy": [None, 3, "p=f33", "int8", "e4m3", "f64", "p=f32,c=f64", {"p": "f32"}, ["f32"]],
    "master_dtype": ["bf16", "f16", "f64", "int8", 3, True, [], "e4m3"],
    "mu_dtype": [None, "f64", "e4m3", 3, True, "x", []],
    "nu_dtype": [None, "f64", "e5m2", 1.0, "int8"],
    "reduce_dtype": [None, "f64", "e4m3", 3, "x"],
    "rounding": ["Nearest", None, 1, "sr", ["nearest"], ""],
    "loss_scale": ["dynamic", 3, None, {"kind": "x"}, {"nope": 1}, {"initial_scale": 0},
                   {"growth_interval": 0.5}],
    "fp8": ["e4m3", 3, True, {"scaling": "x"}, {"margin": -1}, {"nope": 1}],
    "fp32_ops": ["softmax", ["nope"], [1], [""], ["softmax", "softmax"], None, 3],
    "allow_f16_without_loss_scale": BAD_BOOLS[:5],
    "fused": BAD_BOOLS[:5] + [True],  # True: needs stochastic rounding into 16-bit params
}
for field, values in BAD_RECIPE_FIELDS.items():
  for v in values:
    bad(f"Recipe-{field}-{short(v)}", field,
        lambda field=field, v=v: mp.Recipe(**{"name": "r", "policy": "p=bf16,c=bf16,o=f32",
                                             field: v}))
bad("Recipe-f16-unscaled", "loss_scale", lambda: mp.Recipe("r", "p=f32,c=f16,o=f32"))
bad("Recipe-kahan-master", "rounding",
    lambda: mp.Recipe("r", "p=bf16,c=bf16,o=f32", master_dtype="f32", rounding="kahan"))
bad("Recipe-sr-f32", "rounding", lambda: mp.Recipe("r", "f32", rounding="stochastic"))
bad("Recipe.replace-unknown", "nope", lambda: mp.get_recipe("fp32").replace(nope=1))
good("Recipe-policy-object", lambda: mp.Recipe("r", mp.Policy("f32", "bf16", "f32")),
     lambda r: str(r.policy) == "p=f32,c=bf16,o=f32" and r.master_dtype is None)
good("Recipe-dicts", lambda: mp.Recipe("r", "f16", loss_scale={"kind": "dynamic"},
                                       fp8={"scaling": "current"}),
     lambda r: r.loss_scale == mp.LossScaleConfig(kind="dynamic")
     and r.fp8 == mp.Fp8Config(scaling="current"))

BAD_LOSS_SCALE = {
    "kind": ["Dynamic", None, 1, ""],
    "initial_scale": [0, -1.0, float("nan"), float("inf"), 1e39, 1e-46, "1", None, True],
    "growth_factor": [0.5, float("inf"), None, "2"],
    "backoff_factor": [0, 1.5, -0.5, float("nan")],
    "growth_interval": [0, -1, 1.5, 2 ** 31, True, "5"],
    "min_scale": [0, -1, float("inf"), None],
    "max_scale": [0, 1e39, None],
    "hysteresis": [0, 2.0, True, None],
}
for field, values in BAD_LOSS_SCALE.items():
  for v in values:
    bad(f"LossScaleConfig-{field}-{short(v)}", f"loss_scale.{field}",
        lambda field=field, v=v: mp.LossScaleConfig(**{field: v}))
bad("LossScaleConfig-min>max", "min_scale", lambda: mp.LossScaleConfig(min_scale=4.0, max_scale=2.0))
bad("LossScaleConfig-initial<min", "initial_scale",
    lambda: mp.LossScaleConfig(kind="dynamic", initial_scale=1.0, min_scale=2.0))
BAD_FP8 = {
    "forward_format": ["e5m3", "f32", None, 3, "bf16"],
    "backward_format": ["f16", None],
    "scaling": ["x", None, "Delayed"],
    "amax_history_len": [0, 65537, 1.0, True],
    "amax_compute": ["mean", None],
    "margin": [-1, 128, 0.5],
    "power_of_two": [1, "no"],
    "activation_block": [(1,), (0, 128), "1x128", (1.0, 128), None, (1, 2, 3)],
    "weight_block": [(128,), (128, 0), None],
    "keep_high_precision": ["*lm_head*", [1], [""], ["a", "a"], None],
    "keep_first_last": [1, None],
}
for field, values in BAD_FP8.items():
  for v in values:
    bad(f"Fp8Config-{field}-{short(v)}", f"fp8.{field}",
        lambda field=field, v=v: mp.Fp8Config(**{field: v}))
bad("Fp8Config-block-tiles", "weight_block",
    lambda: mp.Fp8Config(scaling="block", activation_block=(1, 64), weight_block=(128, 128)))

# Recipe.from_dict: every field missing, unknown, or given a value of the wrong kind.
BASE = mp.get_recipe("bf16_master").to_dict()
FP8_BASE = mp.get_recipe("fp8_hybrid").to_dict()
for key in BASE:
  if key in ("schema", "fused"):
    continue
  bad(f"from_dict-missing-{key}", key,
      lambda key=key: mp.Recipe.from_dict({k: v for k, v in BASE.items() if k != key}))
FROM_DICT_BAD = {
    "schema": [2, "1", 1.0, True, None],
    "name": [None, 3, ""],
    "policy": [None, 3, ["f32"], "p=f33"],
    "master_dtype": [3, "bf16", ["f32"], "f64"],
    "mu_dtype": [None, 3, "f64"],
    "nu_dtype": [None, ["f32"]],
    "reduce_dtype": [None, 1.5],
    "rounding": [None, 1],
    "loss_scale": [None, "none", [], {}],
    "fp8": ["e4m3", [], {}],
    "fp32_ops": ["softmax", None, [3]],
    "allow_f16_without_loss_scale": [0, None, "false"],
    "fused": [1, "true", None],
}
for key, values in FROM_DICT_BAD.items():
  for v in values:
    bad(f"from_dict-{key}-{short(v)}", key,
        lambda key=key, v=v: mp.Recipe.from_dict({**BASE, key: v}))
bad("from_dict-unknown", "extra_field", lambda: mp.Recipe.from_dict({**BASE, "extra_field": 1}))
bad("from_dict-int-key", "field names", lambda: mp.Recipe.from_dict({**BASE, 3: 1}))
for v in (None, [], "recipe", 3, [("name", "x")]):
  bad(f"from_dict-{short(v)}", "recipe", lambda v=v: mp.Recipe.from_dict(v))
for key in BASE["loss_scale"]:
  bad(f"from_dict-loss_scale-missing-{key}", f"loss_scale.{key}",
      lambda key=key: mp.Recipe.from_dict(
          {**BASE, "loss_scale": {k: v for k, v in BASE["loss_scale"].items() if k != key}}))
  bad(f"from_dict-loss_scale-{key}-str", f"loss_scale.{key}",
      lambda key=key: mp.Recipe.from_dict({**BASE, "loss_scale": {**BASE["loss_scale"],
                                                                   key: "x"}}))
for key in FP8_BASE["fp8"]:
  if key != "keep_first_last":  # optional: dicts written before it existed lack it
    bad(f"from_dict-fp8-missing-{key}", f"fp8.{key}",
        lambda key=key: mp.Recipe.from_dict(
            {**FP8_BASE, "fp8": {k: v for k, v in FP8_BASE["fp8"].items() if k != key}}))
  bad(f"from_dict-fp8-{key}-float", f"fp8.{key}",
      lambda key=key: mp.Recipe.from_dict({**FP8_BASE, "fp8": {**FP8_BASE["fp8"], key: 0.5}}))
for name, r in mp.PRESETS.items():
  good(f"from_dict-json-{name}", lambda r=r: mp.Recipe.from_dict(json.loads(json.dumps(r.to_dict()))),
       lambda got, r=r: got == r and got.to_dict() == r.to_dict())
good("from_dict-no-schema", lambda: mp.Recipe.from_dict({k: v for k, v in BASE.items()
                                                          if k != "schema"}),
     lambda got: got == mp.get_recipe("bf16_master"))
good("from_dict-no-keep_first_last",
     lambda: mp.Recipe.from_dict({**FP8_BASE, "fp8": {k: v for k, v in FP8_BASE["fp8"].items()
                                                      if k != "keep_first_last"}}),
     lambda got: got.fp8.keep_first_last is True and got == mp.get_recipe("fp8_hybrid"))
good("from_dict-fused", lambda: mp.Recipe.from_dict(
    mp.get_recipe("bf16_sr").replace(name="sr_fused", fused=True).to_dict()),
     lambda got: got.fused is True and got.rounding == "stochastic")

# ------------------------------------------------------------------- bind, autocast


def f_mlp(x, w):
  return jnp.tanh(x @ w)


X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
W = np.linspace(-0.5, 0.5, 12, dtype=np.float32).reshape(4, 3)

BAD_POLICY_ARGS = [None, 3, "nope", "p=f33", ["bf16"], {"p": "f32"}, 1.5, b"bf16"]
BAD_OVERRIDES = [(v, "override") for v in ("x", ["a"], {"*": "f33"}, {"*": None}, {3: "f32"},
                                           {"": "f32"}, {"*": "p=f32,c=e4m3,o=f32"})]
BAD_FP32_OPS = [(v, "fp32_ops") for v in ("softmax", ["nope"], [1], [""], ("softmax", 3))]
for v in BAD_POLICY_ARGS:
  bad(f"bind-recipe-{short(v)}", "recipe",
      lambda v=v: mp.bind(v))
  bad(f"autocast-policy-{short(v)}", "policy",
      lambda v=v: mp.autocast(f_mlp, v))
for v, names in BAD_OVERRIDES:
  bad(f"bind-overrides-{short(v)}", names, lambda v=v: mp.bind("bf16_mixed", overrides=v))
  bad(f"autocast-overrides-{short(v)}", names, lambda v=v: mp.autocast(f_mlp, "bf16_mixed", v))
for v, names in BAD_FP32_OPS:
  bad(f"bind-fp32_ops-{short(v)}", names, lambda v=v: mp.bind("bf16_mixed", fp32_ops=v))
  bad(f"autocast-fp32_ops-{short(v)}", names,
      lambda v=v: mp.autocast(f_mlp, "bf16_mixed", fp32_ops=v))
bad("bind-plan-overrides", "overrides",
    lambda: mp.bind(mp.bind("bf16_mixed"), overrides={"*": "f32"}))
for v in BAD_BOOLS[:5]:
  bad(f"autocast-fp8_state-{short(v)}", "fp8_state",
      lambda v=v: mp.autocast(f_mlp, "bf16_mixed", fp8_state=v))
for v in (None, 3, "f_mlp"):
  bad(f"autocast-fn-{short(v)}", "fn", lambda v=v: mp.autocast(v, "bf16_mixed"))
bad("autocast-fp8_state-no-fp8", "fp8_state",
    lambda: mp.autocast(f_mlp, "bf16_mixed", fp8_state=True))
bad("autocast-delayed-no-state", "fp8_state", lambda: mp.autocast(f_mlp, "fp8_hybrid"))
bad("autocast-compute-e4m3", "compute dtype", lambda: mp.autocast(f_mlp, "p=f32,c=e4m3,o=f32"))
for pol in ("f64", "p=f32,c=f64,o=f32", "p=f64,c=f32", "o=f64"):
  bad(f"autocast-x64-off-{pol}", "jax_enable_x64", lambda pol=pol: mp.autocast(f_mlp, pol))
bad("autocast-x64-off-override", "jax_enable_x64",
    lambda: mp.autocast(f_mlp, "bf16_mixed", {"head": "f64"}))
bad("autocast-unmatched-override", "matched no scope",
    lambda: mp.autocast(f_mlp, "bf16_mixed", {"*head*": "f32"})(X, W))


def _reference_bf16(x, w):
  """What p=f32,c=bf16 computes for f_mlp: bf16 operands, f32 accumulation, bf16 GEMM
  result; tanh (a transcendental of the fp32 ops) in f32."""
  y = np.asarray(x).astype(jnp.bfloat16).astype(np.float64) @ np.asarray(w).astype(
      jnp.bfloat16).astype(np.float64)
  y = y.astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
  return np.tanh(y)


for pol, out in (("bf16_mixed", F32), ("p=f32,c=bf16,o=bf16", BF16), ("p=f32,c=bf16,o=f16", F16)):
  good(f"autocast-{pol}", lambda pol=pol: mp.autocast(f_mlp, pol)(X, W),
       lambda y, out=out: y.dtype == out and np.allclose(
           np.asarray(y, np.float32), _reference_bf16(X, W).astype(out).astype(np.float32),
           rtol=2e-7, atol=0))
good("autocast-fp32", lambda: mp.autocast(f_mlp, "fp32")(X, W),
     lambda y: bit_identical(y, jax.jit(f_mlp)(X, W)))

# ------------------------------------------------------------------- apply_recipe / apply_policy


def tiny_model() -> nnx.Module:
  return nnx.Linear(4, 3, rngs=nnx.Rngs(0))


def marked(recipe) -> nnx.Module:
  return mp.flax.apply_recipe(tiny_model(), recipe)


for v in (None, {}, 3, "model", [tiny_model]):
  bad(f"apply_recipe-module-{short(v)}", "nnx.Module",
      lambda v=v: mp.flax.apply_recipe(v, "bf16_mixed"))
  bad(f"apply_policy-module-{short(v)}", "nnx.Module",
      lambda v=v: mp.flax.apply_policy(v, "bf16_mixed"))
for v in BAD_POLICY_ARGS:
  bad(f"apply_recipe-recipe-{short(v)}", "recipe",
      lambda v=v: mp.flax.apply_recipe(tiny_model(), v))
  bad(f"apply_policy-policy-{short(v)}", "policy",
      lambda v=v: mp.flax.apply_policy(tiny_model(), v))
for v, names in BAD_OVERRIDES:
  bad(f"apply_recipe-overrides-{short(v)}", names,
      lambda v=v: mp.flax.apply_recipe(tiny_model(), "bf16_mixed", v))
# A path pattern may name a jax.named_scope of the model's code, known only when it runs:
# one that matches nothing is refused at the first call.
bad("apply_recipe-overrides-nomatch-at-call", "override",
    lambda: mp.flax.apply_recipe(tiny_model(), "bf16_mixed", {"nomatch*": "f32"})(
        jnp.ones((2, 4), jnp.float32)))
for first, second in (("p=bf16,c=bf16,o=f32", "p=f32,c=bf16,o=f32"),
                      ("p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")):
  bad(f"apply_policy-marked-{first}-then-{second}", "already marked",
      lambda first=first, second=second: mp.flax.apply_policy(
          mp.flax.apply_policy(tiny_model(), first), second))
good("apply_policy-same-twice", lambda: mp.flax.apply_policy(
    mp.flax.apply_policy(tiny_model(), "bf16_mixed"), "bf16_mixed"),
     lambda m: m.kernel.get_value().dtype == F32)
good("apply_policy-replace", lambda: mp.flax.apply_policy(
    mp.flax.apply_policy(tiny_model(), "p=f32,c=bf16,o=f32"), "p=bf16,c=bf16,o=f32",
    replace=True), lambda m: m.kernel.get_value().dtype == BF16)
for v in BAD_BOOLS[:5]:
  bad(f"apply_recipe-replace-{short(v)}", "replace",
      lambda v=v: mp.flax.apply_recipe(tiny_model(), "bf16_mixed", replace=v))
bad("apply_policy-fp8-recipe", "apply_recipe",
    lambda: mp.flax.apply_policy(tiny_model(), "fp8_hybrid"))
for first, second in (("pure_bf16", "fp32"), ("fp32", "pure_bf16"), ("bf16_mixed", "f16_mixed"),
                      ("bf16_mixed", mp.bind("bf16_mixed", overrides={"*": "f32"})),
                      ("fp8_hybrid", "bf16_mixed")):
  bad(f"apply_recipe-marked-{first}-then-{short(second)}", "already marked",
      lambda first=first, second=second: mp.flax.apply_recipe(marked(first), second))
bad("apply_recipe-policy-then-recipe", "already marked",
    lambda: mp.flax.apply_recipe(mp.flax.apply_policy(tiny_model(), "p=bf16,c=bf16,o=bf16"),
                                 "bf16_mixed"))
bad("apply_recipe-replace-fp8", "fp8 GEMMs",
    lambda: mp.flax.apply_recipe(marked("fp8_hybrid"), "bf16_mixed", replace=True))


def _twice(recipe):
  m = marked(recipe)
  before = jax.tree.map(lambda x: x, nnx.state(m, nnx.Param))
  return before, mp.flax.apply_recipe(m, recipe)


for name in ("fp32", "bf16_mixed", "pure_bf16", "fp8_hybrid"):
  good(f"apply_recipe-twice-{name}", lambda name=name: _twice(name),
       lambda r, name=name: bit_identical(nnx.state(r[1], nnx.Param), r[0])
       and mp.flax.spec_of(r[1]).recipe == mp.get_recipe(name))


def _replaced():
  m = marked("pure_bf16")
  rounded = np.asarray(m.kernel.get_value()).astype(np.float32)
  return rounded, mp.flax.apply_recipe(m, "fp32", replace=True)


good("apply_recipe-replace", _replaced,
     lambda r: r[1].kernel.get_value().dtype == F32
     and np.array_equal(np.asarray(r[1].kernel.get_value()), r[0])
     and mp.flax.spec_of(r[1]).recipe.name == "fp32")

# ------------------------------------------------------------------- build_optimizer

PARAMS = {"w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
          "b": np.zeros((3,), np.float32)}
for v in (None, 3, "nope", ["fp32"], mp.Policy("f32", "f32", "f32"), {"name": "fp32"}):
  bad(f"build_optimizer-recipe-{short(v)}", "recipe",
      lambda v=v: optim.build_optimizer(v, optax.sgd(0.1)))
for v in (None, "adam", optax.adam, 3, (optax.sgd(0.1),), {"init": None, "update": None}):
  bad(f"build_optimizer-inner-{short(v)}", "inner", lambda v=v: optim.build_optimizer("fp32", v))
bad("build_optimizer-fused-inner", "inner",
    lambda: optim.build_optimizer("bf16_sr", optim.fused_adamw(1e-3)))
BAD_SEEDS = [-1, 1.5, True, False, 2 ** 32, -2 ** 40, "0", None, np.float32(1), [0],
             np.array([1, 2, 3]), np.array(1.0), np.bool_(True)]
for v in BAD_SEEDS:
  if v is not None:  # None is fused_adamw's "build_optimizer's seed"
    bad(f"fused_adamw-seed-{short(v)}", "seed", lambda v=v: optim.fused_adamw(1e-3, seed=v))
for v in (None, "1e-3", True, [1e-3]):
  bad(f"fused_adamw-lr-{short(v)}", "learning_rate", lambda v=v: optim.fused_adamw(v))
for v in (None, "x", [1.0, 2.0], 1.5):
  bad(f"stochastic_round-x-{short(v)}", "x",
      lambda v=v: mp.rounding.stochastic_round(v, "bf16", 0))
for recipe in ("bf16_sr", "bf16_master", "fp32", "f16_mixed"):
  for v in BAD_SEEDS:
    bad(f"build_optimizer-{recipe}-seed-{short(v)}", "seed",
        lambda recipe=recipe, v=v: optim.build_optimizer(recipe, optax.sgd(0.1), seed=v))
for v in (3, "", ["data"], b"data"):
  bad(f"build_optimizer-axis_name-{short(v)}", "axis_name",
      lambda v=v: optim.build_optimizer("bf16_sr", optax.sgd(0.1), axis_name=v))


def _sr_update(seed):
  """One bf16_sr update of bf16 params: the rounded params."""
  tx = optim.build_optimizer("bf16_sr", optax.sgd(0.1), seed=seed)
  p = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), PARAMS)
  g = jax.tree.map(lambda x: jnp.full(x.shape, 1e-3, jnp.bfloat16), PARAMS)

  @jax.jit  # jitted: the rounding's ops one by one take seconds
  def step(p, g):
    updates, _ = tx.update(g, tx.init(p), p)
    return optim.apply_updates(p, updates)

  return step(p, g)


for v in (np.uint32(7), np.int64(7), jnp.asarray(7, jnp.int32)):
  good(f"build_optimizer-seed-{type(v).__name__}", lambda v=v: _sr_update(v),
       lambda got: bit_identical(got, LAZY.get("sr7", lambda: _sr_update(7))))
good("build_optimizer-seed-max", lambda: optim.build_optimizer("bf16_sr", optax.sgd(0.1),
                                                               seed=2 ** 32 - 1),
     lambda tx: isinstance(tx, optax.GradientTransformation))
good("build_optimizer-seed-key", lambda: _sr_update(jax.random.key(3)),
     lambda got: jax.tree.map(lambda x: x.dtype, got) == {"w": BF16, "b": BF16})

# ------------------------------------------------------------------- value_and_grad, train_step


def sq_loss(p, x):
  return jnp.mean(jnp.square(x @ p["w"] + p["b"][None, :]))


OPT = LAZY.get("opt", lambda: optim.build_optimizer("fp32", optax.sgd(0.1)))
XB = np.linspace(-1, 1, 4, dtype=np.float32).reshape(2, 2)
for v in (None, 3, "loss"):
  bad(f"value_and_grad-fn-{short(v)}", "fn", lambda v=v: mp.value_and_grad(v, None))
for v in BAD_BOOLS[:5]:
  bad(f"value_and_grad-has_aux-{short(v)}", "has_aux",
      lambda v=v: mp.value_and_grad(sq_loss, None, has_aux=v))
for what, fn in (("vector", lambda p, x: x @ p["w"]), ("int", lambda p, x: jnp.sum(jnp.ones(3, jnp.int32))),
                 ("python-float", lambda p, x: 1.0), ("none", lambda p, x: None),
                 ("tuple", lambda p, x: (sq_loss(p, x), 1))):
  bad(f"value_and_grad-loss-{what}", "loss",
      lambda fn=fn: mp.value_and_grad(fn, OPT.init(PARAMS))(PARAMS, XB))
for what, fn in (("scalar", sq_loss), ("triple", lambda p, x: (sq_loss(p, x), 1, 2))):
  bad(f"value_and_grad-aux-{what}", "has_aux",
      lambda fn=fn: mp.value_and_grad(fn, OPT.init(PARAMS), has_aux=True)(PARAMS, XB))
good("value_and_grad-fp32", lambda: mp.value_and_grad(sq_loss, OPT.init(PARAMS))(PARAMS, XB),
     lambda r: bit_identical(r, jax.value_and_grad(sq_loss)(PARAMS, XB)))


def sq_model_loss(m, x):
  return jnp.mean(jnp.square(m(x)))


for v in (None, {}, PARAMS, 3):
  bad(f"train_step-model-{short(v)}", "model",
      lambda v=v: mp.train_step(v, OPT, OPT.init(PARAMS), sq_model_loss, X))
for v in (None, optax.sgd, "sgd", 3):
  bad(f"train_step-tx-{short(v)}", "tx",
      lambda v=v: mp.train_step(tiny_model(), v, None, sq_model_loss, X))
for v in (None, {}, "x", (), PARAMS, OPT.init({"w": PARAMS["w"]})[0]):
  bad(f"train_step-opt_state-{short(v)}", "state",
      lambda v=v: mp.train_step(tiny_model(), OPT, v, sq_model_loss, X))
  bad(f"tx.update-state-{short(v)}", "state",
      lambda v=v: OPT.update(jax.tree.map(np.zeros_like, PARAMS), v, PARAMS))
for v in (None, 3, "loss"):
  bad(f"train_step-loss_fn-{short(v)}", "fn",
      lambda v=v: mp.train_step(tiny_model(), OPT, None, v, X))



def _one_step():
  model = tiny_model()
  tx = optim.build_optimizer("fp32", optax.sgd(0.1))
  before = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))
  loss, _ = mp.train_step(model, tx, tx.init(nnx.state(model, nnx.Param)), sq_model_loss, X)
  return before, loss, nnx.state(model, nnx.Param)


def _one_step_reference(before):
  """sgd(0.1) on the plain loss: p - 0.1 * grad, and the loss before the update."""
  f = lambda p: jnp.mean(jnp.square(X @ p["kernel"] + p["bias"][None, :]))
  p = {"kernel": before["kernel"].get_value(), "bias": before["bias"].get_value()}
  loss, g = jax.value_and_grad(f)(p)
  return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


good("train_step-fp32-sgd", _one_step,
     lambda r: (lambda want: bit_identical(r[1], want[0]) and np.allclose(
         r[2]["kernel"].get_value(), want[1]["kernel"], rtol=1e-6, atol=1e-7)
         and np.allclose(r[2]["bias"].get_value(), want[1]["bias"], rtol=1e-6, atol=1e-7))(
             _one_step_reference(r[0])))

# ------------------------------------------------------------------- data_parallel


def mesh():
  return LAZY.get("mesh", lambda: jax.make_mesh((8,), ("data",)))


def dp_loss(p, b):
  return jnp.mean(jnp.square(b["x"] @ p["w"] + p["b"][None, :] - b["y"]))


def dp(**kw):
  kw = {"mesh": mesh(), **kw}
  return parallel.data_parallel(dp_loss, optax.sgd(0.1), kw.pop("mesh"), **kw)


BATCH = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2),
         "y": np.linspace(0, 1, 24, dtype=np.float32).reshape(8, 3)}
for v in (None, 3, "loss"):
  bad(f"data_parallel-loss_fn-{short(v)}", "loss_fn",
      lambda v=v: parallel.data_parallel(v, optax.sgd(0.1), mesh()))
for v in (None, optax.sgd, "sgd", 3):
  bad(f"data_parallel-tx-{short(v)}", "tx",
      lambda v=v: parallel.data_parallel(dp_loss, v, mesh()))
for v in (None, "data", 8, ["data"]):
  bad(f"data_parallel-mesh-{short(v)}", "mesh", lambda v=v: dp(mesh=v))
for v in (True, False, 1.0, 0.0, -1, 4, "1", None, np.float64(2), np.bool_(True)):
  bad(f"data_parallel-zero_stage-{short(v)}", "zero_stage", lambda v=v: dp(zero_stage=v))
for v in BAD_POLICY_ARGS[1:]:  # None: no recipe
  bad(f"data_parallel-recipe-{short(v)}", "recipe", lambda v=v: dp(recipe=v))
bad("data_parallel-overrides-no-recipe", "overrides", lambda: dp(overrides={"*": "f32"}))
for v, names in BAD_OVERRIDES:
  bad(f"data_parallel-overrides-{short(v)}", names,
      lambda v=v: dp(recipe="bf16_mixed", overrides=v))
for v in ("model", 3, None, "", ["data"]):
  bad(f"data_parallel-axis_name-{short(v)}", "axis_name", lambda v=v: dp(axis_name=v))
for recipe in (None, "bf16_sr"):
  for v in (-1, 1.5, True, 2 ** 32, "0", None):
    bad(f"data_parallel-{recipe}-seed-{short(v)}", "seed",
        lambda recipe=recipe, v=v: dp(recipe=recipe, seed=v))
for v in BAD_BOOLS[:5]:
  bad(f"data_parallel-donate-{short(v)}", "donate", lambda v=v: dp(donate=v))
  bad(f"data_parallel-fp8_state-{short(v)}", "fp8_state", lambda v=v: dp(fp8_state=v))
for v in ("Step", "layers", None, 3):
  bad(f"data_parallel-gather-{short(v)}", "gather", lambda v=v: dp(zero_stage=3, gather=v))
bad("data_parallel-gather-layer-stage1", "gather", lambda: dp(zero_stage=1, gather="layer"))
for v in (np.int64(1), 2, 3):
  good(f"data_parallel-zero_stage-{short(v)}", lambda v=v: dp(zero_stage=v),
       lambda d, v=v: d.zero_stage == v)


def dp_state():
  return LAZY.get("dp", lambda: (lambda d: (d, d.init(PARAMS)))(dp(recipe="fp32", donate=False)))


for what, params in (("int", {"w": np.ones((2, 3), np.int32)}), ("bool", {"w": np.ones(3, bool)})):
  bad(f"dp.init-params-{what}", "Parameter leaf", lambda params=params: dp_state()[0].init(params))
for v in (None, {}, {"w": "x"}, {"w": 1}, {"w": [1.0, object()]}):
  bad(f"dp.init-params-{short(v)}", "params", lambda v=v: dp_state()[0].init(v))
bad("dp.init-fp8_state", "fp8_state", lambda: dp_state()[0].init(PARAMS, fp8_state={}))
for v in (None, {}, PARAMS, mp.TrainState(PARAMS, (), {}, None)):
  bad(f"dp.step-state-{short(v)}", "state", lambda v=v: dp_state()[0].step(v, BATCH))
BAD_BATCHES = {
    "zero-rows": {"x": BATCH["x"][:0], "y": BATCH["y"][:0]},
    "zero-rows-one-leaf": {"x": BATCH["x"], "y": BATCH["y"][:0]},
    "sizes-8-16": {"x": BATCH["x"], "y": np.concatenate([BATCH["y"], BATCH["y"]])},
    "sizes-16-8": {"x": np.concatenate([BATCH["x"], BATCH["x"]]), "y": BATCH["y"]},
    "not-divisible": {"x": BATCH["x"][:3], "y": BATCH["y"][:3]},
    "scalar-leaf": {"x": BATCH["x"], "y": np.float32(1)},
    "string-leaf": {"x": BATCH["x"], "y": "labels"},
    "object-leaf": {"x": BATCH["x"], "y": object()},
    "empty": {},
    "none": None,
}
for what, b in BAD_BATCHES.items():
  bad(f"dp.step-batch-{what}", "batch", lambda b=b: dp_state()[0].step(dp_state()[1], b))
  bad(f"dp.compile-batch-{what}", "batch", lambda b=b: dp_state()[0].compile(dp_state()[1], b))


def _dp_loss_reference():
  x, y = BATCH["x"].astype(np.float64), BATCH["y"].astype(np.float64)
  w, b = PARAMS["w"].astype(np.float64), PARAMS["b"].astype(np.float64)
  return float(np.mean(np.square(x @ w + b - y)))


good("dp.step-batch-ok", lambda: dp_state()[0].step(dp_state()[1], BATCH)[1],
     lambda m: m["loss"].dtype == F32 and np.isclose(float(m["loss"]), _dp_loss_reference(),
                                                      rtol=1e-6, atol=0)
     and int(m["skipped_steps"]) == 0)

# ------------------------------------------------------------------- checkpoint


def ck_state():
  def make():
    p = jax.tree.map(jnp.asarray, PARAMS)
    return mp.TrainState(p, OPT.init(p), {}, jnp.zeros((2,), jnp.uint32))
  return LAZY.get("ck_state", make)


FP32 = mp.get_recipe("fp32")


def ck_dir(tmp_path_factory=None) -> str:
  import tempfile  # pylint: disable=g-import-not-at-top
  return LAZY.get("ck_root", lambda: tempfile.mkdtemp(prefix="api_fuzz_"))


_dirs = itertools.count()


def fresh_dir() -> str:
  return os.path.join(ck_dir(), f"run{next(_dirs)}")


def save(**kw):
  kw = {"directory": fresh_dir(), "step": 1, "state": ck_state(), "recipe": FP32, **kw}
  return checkpoint.save(kw.pop("directory"), kw.pop("step"), kw.pop("state"), **kw)


def saved_dir() -> str:
  def make():
    d = fresh_dir()
    checkpoint.save(d, 3, ck_state(), recipe=FP32, model_config={"width": 3}, seed=1,
                    data={"seed": 1, "step": 3})
    return d
  return LAZY.get("saved", make)


def restore(**kw):
  kw = {"directory": saved_dir(), "target": ck_state(), **kw}
  return checkpoint.restore(kw.pop("directory"), kw.pop("target"), **kw)


class Sampler(NamedTuple):
  seed: int
  step: int


BAD_DIRS = ["", None, 3, b"/tmp/x", "a\0b", ["/tmp/x"], 1.5]
for v in BAD_DIRS:
  bad(f"save-directory-{short(v)}", "directory", lambda v=v: save(directory=v))
  bad(f"restore-directory-{short(v)}", "directory", lambda v=v: restore(directory=v))
  bad(f"Checkpointer-directory-{short(v)}", "directory", lambda v=v: checkpoint.Checkpointer(v))
for v in (-1, 1.5, True, "1", None, np.float64(1), [1]):
  bad(f"save-step-{short(v)}", "step", lambda v=v: save(step=v))
  if v is not None:  # None: the newest intact step
    bad(f"restore-step-{short(v)}", "step", lambda v=v: restore(step=v))
bad("restore-step-missing", "step=99", lambda: restore(step=99))
for v in (None, {}, PARAMS, (PARAMS,)):
  bad(f"save-state-{short(v)}", "state", lambda v=v: save(state=v))
  bad(f"restore-target-{short(v)}", "target", lambda v=v: restore(target=v))
for v in (None, "fp33", 3, mp.Policy("f32", "f32", "f32"), FP32.to_dict()):
  bad(f"save-recipe-{short(v)}", "recipe", lambda v=v: save(recipe=v))
for what, leaf in (("str", "x"), ("int", 3), ("float", 1.5), ("object", object())):
  bad(f"save-state-leaf-{what}", "state", lambda leaf=leaf: save(state=ck_state()._replace(
      model_state={"count": leaf})))
  bad(f"restore-target-leaf-{what}", "target", lambda leaf=leaf: restore(
      target=ck_state()._replace(model_state={"count": leaf})))
for v in BAD_DIRS:
  bad(f"import_orbax-path-{short(v)}", "path",
      lambda v=v: checkpoint.import_orbax(v, ck_state(), FP32, optimizer=OPT))
for v in ("fp33", "bf16_mixed", 3, mp.Policy("f32", "f32", "f32")):
  bad(f"restore-recipe-{short(v)}", "recipe", lambda v=v: restore(recipe=v))
for v in ({"a": float("nan")}, {"a": float("inf")}, {"a": object()}, {"a": {1, 2}}, {"a": b"x"},
          {1: 2}, {"a": {2: 3}}, {(1, 2): 3}):
  bad(f"save-model_config-{short(v)}", "model_config", lambda v=v: save(model_config=v))
  bad(f"save-extra-{short(v)}", "extra", lambda v=v: save(extra=v))
bad("restore-model_config-nan", "model_config", lambda: restore(model_config={"a": float("nan")}))
bad("restore-model_config-differs", "width", lambda: restore(model_config={"width": 4}))
for v in (1.5, True, "0", np.float32(1), [0]):
  bad(f"save-seed-{short(v)}", "seed", lambda v=v: save(seed=v))
BAD_DATA = [{"seed": 1.7}, {"seed": 2.0}, {"seed": True}, {"seed": "1"}, {"seed": None},
            {"seed": [1]}, {"seed": np.float64(1)}, {"seed": jnp.ones(2, jnp.int32)},
            {"seed": jnp.asarray(1.0)}, {1: 2}, 5, "seed", [1, 2], [("seed", 1)], 1.5]
for v in BAD_DATA:
  bad(f"save-data-{short(v)}", "data", lambda v=v: save(data=v))
for v in (0, -1, 1.5, True, "3", None):
  bad(f"save-keep-{short(v)}", "keep", lambda v=v: save(keep=v))
  bad(f"Checkpointer-keep-{short(v)}", "keep", lambda v=v: checkpoint.Checkpointer(fresh_dir(), keep=v))
for v in ("short", b"", 3, True, ["k" * 16]):
  bad(f"save-key-{short(v)}", "key", lambda v=v: save(key=v))
  bad(f"restore-key-{short(v)}", "key", lambda v=v: restore(key=v))
for v in (3, "adam"):
  bad(f"restore-optimizer_for-{short(v)}", "optimizer_for", lambda v=v: restore(optimizer_for=v))
for v in ("mesh", 3, jax.devices()):
  bad(f"restore-mesh-{short(v)}", "mesh", lambda v=v: restore(mesh=v))
for v in (1, "yes", None):
  bad(f"restore-allow_unverified-{short(v)}", "allow_unverified",
      lambda v=v: restore(allow_unverified=v))
bad("restore-no-directory", "No complete checkpoint",
    lambda: restore(directory=fresh_dir()), raises=(checkpoint.NoCheckpointError,))


def _round_trip(data):
  d = fresh_dir()
  checkpoint.save(d, 2, ck_state(), recipe=FP32, seed=np.int64(4), data=data,
                  model_config={"width": 3, "names": ["a"]})
  return checkpoint.restore(d, ck_state())


for what, data, want in (
    ("ints", {"seed": 1, "step": 2}, {"seed": 1, "step": 2}),
    ("numpy", {"seed": np.int64(2 ** 40), "step": np.uint8(3)}, {"seed": 2 ** 40, "step": 3}),
    ("jax-scalar", {"seed": jnp.asarray(5, jnp.int32)}, {"seed": 5}),
    ("namedtuple", Sampler(7, 8), {"seed": 7, "step": 8}),
    ("none", None, None)):
  good(f"save-restore-data-{what}", lambda data=data: _round_trip(data),
       lambda r, want=want: r.data == want and r.step == 2 and r.seed == 4
       and r.model_config == {"width": 3, "names": ["a"]}
       and bit_identical(r.state.params, ck_state().params) and r.verified)

# ------------------------------------------------------------------- study

TASK = dict(init=lambda seed: PARAMS, loss=sq_loss, batches=lambda seed: iter(()),
            optimizer=optax.sgd(0.1))
for field, values in {"init": [None, 3], "loss": [None, "x"], "batches": [None, []],
                      "optimizer": [None, optax.sgd, "sgd"], "evaluate": [3, "x"],
                      "eval_batches": [3], "n_eval_batches": [0, 1.5, True, None],
                      "rng_streams": [[1], [""]], "name": ["", None, 3]}.items():
  for v in values:
    bad(f"Task-{field}-{short(v)}", f"Task.{field}",
        lambda field=field, v=v: study.Task(**{**TASK, field: v}))
MAKE_CONFIG = {"recipes": ["fp32", "bf16_mixed"], "seeds": 2, "steps": 10}
for field, values, names in (
    ("recipes", [["nope"], "fp32,nope", [3], [["fp32"]], [None]], "recipe"),
    ("seeds", [1, 0, 2.0, True, "2", None], "seeds"),
    ("steps", [0, 1.5, None], "steps"),
    ("eval_every", [-1, 1.5], "eval_every"),
    ("save_every", [0, "1"], "save_every"),
    ("aa", [1, "yes"], "aa"),
    ("growth_interval", [0, -1, "never", 1.5, True], "growth_interval"),
    ("max_nonfinite", [0, None], "max_nonfinite"),
    ("control", ["nope"], "control"),
    ("overrides", [{3: "f32"}, ["*"]], "overrides")):
  for v in values:
    bad(f"make_config-{field}-{short(v)}", names,
        lambda field=field, v=v: study.make_config(**{**MAKE_CONFIG, field: v}))
good("make_config-ok", lambda: study.make_config("bf16_mixed", 2, 10),
     lambda c: [r.name for r in c.recipes] == ["fp32", "bf16_mixed"] and c.seeds == 2)


# ------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case):
  if case.names is None:
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
      result = case.call()
    assert case.check(result), f"{case.id}: got {result!r}"
    return
  with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
    with pytest.raises(case.raises) as e:
      case.call()
  assert case.names.lower() in str(e.value).lower(), (
      f"{case.id}: the message does not name {case.names!r}: {e.value}")


def test_enough_cases():
  bad_cases = sum(c.names is not None for c in CASES)
  assert len(CASES) >= 500 and bad_cases >= 400, (len(CASES), bad_cases)
  assert len({c.id for c in CASES}) == len(CASES)


def test_a_refused_save_writes_nothing(tmp_path, monkeypatch):
  """Arguments are checked before the directory, the lock or the run record is written."""
  monkeypatch.chdir(tmp_path)
  d = tmp_path / "ckpt"
  refused = [dict(directory=""), dict(data={"seed": 1.7}), dict(data={"seed": True}),
             dict(model_config={1: 2}), dict(extra={"a": float("nan")}), dict(seed=1.5),
             dict(keep=0), dict(key="short"), dict(step=-1), dict(recipe="fp33")]
  for kw in refused:
    with pytest.raises(ValueError):
      save(**{"directory": d, **kw})
  assert os.listdir(tmp_path) == []
