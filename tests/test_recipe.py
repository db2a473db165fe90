"""Recipe: presets, JSON round trip, validation."""

import json

import numpy as np
import pytest

import precision as mp

PRESET_NAMES = ["fp32", "bf16_mixed", "bf16_master", "bf16_sr", "bf16_kahan", "pure_bf16",
                "f16_mixed", "fp8_hybrid", "mxfp8", "nvfp4"]


def test_presets_exist():
  assert list(mp.PRESETS) == PRESET_NAMES


def test_presets_are_read_only():
  with pytest.raises(TypeError):
    mp.PRESETS["bf16_mixed"] = mp.get_recipe("fp32")
  with pytest.raises(TypeError):
    del mp.PRESETS["fp32"]
  with pytest.raises(AttributeError):
    mp.PRESETS.clear()
  assert mp.get_recipe("bf16_mixed").name == "bf16_mixed"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_json_round_trip(name):
  r = mp.get_recipe(name)
  d = json.loads(json.dumps(r.to_dict()))
  assert mp.Recipe.from_dict(d) == r
  assert json.dumps(mp.Recipe.from_dict(d).to_dict(), sort_keys=True) == json.dumps(
      r.to_dict(), sort_keys=True)


def test_preset_contents():
  r = mp.get_recipe("bf16_master")
  assert str(r.policy) == "p=bf16,c=bf16,o=f32" and r.master_dtype == np.float32
  assert mp.get_recipe("bf16_sr").rounding == "stochastic"
  assert mp.get_recipe("bf16_kahan").rounding == "kahan"
  assert mp.get_recipe("f16_mixed").loss_scale.kind == "dynamic"
  assert mp.get_recipe("fp8_hybrid").fp8.scaling == "delayed"
  assert mp.get_recipe("fp8_hybrid").fp8.amax_history_len == 1024
  assert mp.get_recipe("fp32").policy.is_full_precision


def test_swamping_warning_only_where_due():
  for name in PRESET_NAMES:
    r = mp.get_recipe(name)
    assert ("swamping" in r.description) == (name == "pure_bf16"), name


def test_unknown_preset_lists_presets():
  with pytest.raises(ValueError, match="Unknown recipe 'bf17'.*fp32.*fp8_hybrid"):
    mp.get_recipe("bf17")


def test_f16_without_loss_scale_is_an_error():
  with pytest.raises(ValueError, match="f16 without loss scaling"):
    mp.Recipe("x", "p=f32,c=f16")
  r = mp.Recipe("x", "p=f32,c=f16", allow_f16_without_loss_scale=True)
  assert r.loss_scale.kind == "none"


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="p=f32,c=bf16", rounding="round"), "rounding='round'"),
    (dict(policy="p=bf16", master_dtype="bf16"), "must be wider"),
    (dict(policy="p=bf16", master_dtype="f32", rounding="kahan"), "kahan"),
    (dict(policy="p=f32", rounding="stochastic"), "only matters for 16-bit"),
    (dict(policy="p=f32", mu_dtype="int8"), "'int8'"),
    (dict(policy="p=f32", loss_scale=dict(kind="dyn")), "kind=.dyn."),
    (dict(policy="p=f32", fp8=dict(scaling="tensor")), "scaling='tensor'"),
    (dict(policy="p=f32", fp8=dict(forward_format="bf16")), "forward_format"),
])
def test_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    mp.Recipe("bad", **kwargs)


def test_from_dict_rejects_unknown_fields():
  d = mp.get_recipe("fp32").to_dict()
  d["mystery"] = 1
  with pytest.raises(ValueError, match="mystery"):
    mp.Recipe.from_dict(d)


# ---------------------------------------------------------------------------------------
# Schema-strict from_dict: the cases of the bug report, then a fuzz over mutated presets.


def _preset_dict(name):
  return json.loads(json.dumps(mp.get_recipe(name).to_dict()))


@pytest.mark.parametrize("preset, path, value, match", [
    ("f16_mixed", "loss_scale.initial_scale", 1e39, r"loss_scale\.initial_scale=1e\+39"),
    ("f16_mixed", "loss_scale.initial_scale", 1e-46, r"loss_scale\.initial_scale=1e-46"),
    ("f16_mixed", "loss_scale.growth_factor", float("inf"), r"loss_scale\.growth_factor=inf"),
    ("f16_mixed", "loss_scale.backoff_factor", float("nan"), r"loss_scale\.backoff_factor=nan"),
    ("fp8_hybrid", "fp8.keep_high_precision", "*lm_head*",
     r"fp8\.keep_high_precision='\*lm_head\*'.*bare string"),
    ("fp32", "mu_dtype", None, r"mu_dtype=None; accepted: f32, bf16, f16"),
    ("fp32", "nu_dtype", None, r"nu_dtype=None"),
    ("fp32", "reduce_dtype", None, r"reduce_dtype=None"),
    ("fp32", "mu_dtype", "f64", r"mu_dtype='f64'"),
    ("f16_mixed", "loss_scale.growth_interval", 2.5, r"loss_scale\.growth_interval=2\.5"),
    ("f16_mixed", "loss_scale.growth_interval", 2000.0, r"loss_scale\.growth_interval=2000\.0"),
    ("f16_mixed", "loss_scale.hysteresis", True, r"loss_scale\.hysteresis=True"),
    ("fp32", "loss_scale", "dynamic", r"loss_scale='dynamic'"),
    ("fp32", "fp8", "e4m3", r"fp8='e4m3'"),
    ("fp32", "policy", 3, r"policy=3"),
    ("fp32", "policy", "p=f64", r"policy="),
    ("fp32", "fp32_ops", "softmax", r"fp32_ops='softmax'"),
    ("fp32", "fp32_ops", ["softmax", "softmax"], r"fp32_ops\[1\]='softmax'.*repeated"),
    ("fp32", "allow_f16_without_loss_scale", 1, r"allow_f16_without_loss_scale=1"),
    ("fp8_hybrid", "fp8.activation_block", [1, 128, 3], r"fp8\.activation_block"),
    ("fp8_hybrid", "fp8.margin", -1, r"fp8\.margin=-1"),
    ("fp8_hybrid", "fp8.amax_history_len", 0, r"fp8\.amax_history_len=0"),
    ("bf16_master", "master_dtype", "f16", r"master_dtype=f16 must be wider"),
    ("fp32", "schema", 2, r"schema=2"),
    ("fp32", "name", "", r"name=''"),
])
def test_from_dict_refuses_bad_values_naming_the_field(preset, path, value, match):
  d = _preset_dict(preset)
  parent, leaf = _get_parent(d, path)
  parent[leaf] = value
  with pytest.raises(ValueError, match=match):
    mp.Recipe.from_dict(d)


@pytest.mark.parametrize("preset, path", [
    ("bf16_master", "master_dtype"), ("fp32", "name"), ("f16_mixed", "loss_scale.kind"),
    ("fp8_hybrid", "fp8.scaling"), ("fp32", "loss_scale"), ("fp32", "fp8")])
def test_from_dict_refuses_missing_fields(preset, path):
  d = _preset_dict(preset)
  parent, leaf = _get_parent(d, path)
  del parent[leaf]
  with pytest.raises(ValueError, match=rf"missing field\(s\) {path}\b"):
    mp.Recipe.from_dict(d)


def test_dicts_written_before_the_schema_key_still_load():
  """A checkpoint's recipe dict from before the "schema" key: the same fields, version 1."""
  for name in PRESET_NAMES:
    d = _preset_dict(name)
    assert d.pop("schema") == 1
    assert mp.Recipe.from_dict(d) == mp.get_recipe(name)


def test_constructor_refuses_a_bare_string_list():
  with pytest.raises(ValueError, match="fp8.keep_high_precision"):
    mp.Fp8Config(keep_high_precision="*lm_head*")
  with pytest.raises(ValueError, match="fp32_ops"):
    mp.Recipe("x", "p=f32", fp32_ops="softmax")
  with pytest.raises(ValueError, match=r"fp8\.activation_block=\[1, 64\].*fp8\.weight_block"):
    mp.Fp8Config(scaling="block", activation_block=(1, 64))


_POOL = [None, True, False, 0, 1, -1, 2, 7, 2000, 2 ** 31, 2 ** 63, 0.0, -0.0, 0.5, 1.0, 2.5,
         -3.0, 1e-46, 1e-30, 65504.0, 3e38, 1e39, float("inf"), float("-inf"), float("nan"),
         "", " ", "abc", "f32", "bf16", "f16", "f64", "float32", "int8", "e4m3", "e5m2",
         "none", "static", "dynamic", "nearest", "stochastic", "kahan", "current", "delayed",
         "block", "per_channel", "max", "most_recent", "p=bf16,c=bf16,o=f32", "p=f32,c=f16",
         "p=f32,c=bf16,o=f32", "*lm_head*", [], ["x"], ["a", "a"], [1, 2], [1, 128],
         [128, 128], [0, 1], ["softmax", 3], {}, {"kind": "dynamic"}]


def _paths(d, prefix=""):
  for k, v in d.items():
    path = f"{prefix}{k}"
    yield path
    if isinstance(v, dict):
      yield from _paths(v, path + ".")


def _get_parent(d, path):
  *parents, leaf = path.split(".")
  for p in parents:
    d = d[p]
  return d, leaf


def _mutations(rng, n):
  """(description, path named by any error, mutated dict), n of them, from every preset."""
  other_nested = {
      "loss_scale": [_preset_dict(p)["loss_scale"] for p in ("fp32", "f16_mixed")],
      "fp8": [_preset_dict("fp8_hybrid")["fp8"], None]}
  for i in range(n):
    d = _preset_dict(PRESET_NAMES[i % len(PRESET_NAMES)])
    paths = list(_paths(d))
    path = paths[rng.integers(len(paths))]
    parent, leaf = _get_parent(d, path)
    kind = ["delete", "add", "value", "value", "value", "element", "nested"][rng.integers(7)]
    if kind == "delete":
      del parent[leaf]
    elif kind == "add":
      if isinstance(parent[leaf], dict) and rng.integers(2):
        parent[leaf]["zz_unknown"] = 1
        path = f"{path}.zz_unknown"
      else:
        parent["zz_unknown"] = _POOL[rng.integers(len(_POOL))]
        path = path.rsplit(".", 1)[0] + ".zz_unknown" if "." in path else "zz_unknown"
    elif kind == "element" and isinstance(parent[leaf], list) and parent[leaf]:
      j = int(rng.integers(len(parent[leaf])))
      parent[leaf][j] = _POOL[rng.integers(len(_POOL))]
    elif kind == "nested" and leaf in other_nested:
      choices = other_nested[leaf]
      parent[leaf] = json.loads(json.dumps(choices[rng.integers(len(choices))]))
    else:
      parent[leaf] = json.loads(json.dumps(_POOL[rng.integers(len(_POOL))]))
    yield f"{kind} {path}", path, d


def _assert_sane(r):
  """What an accepted recipe must hold: the types and ranges its consumers rely on."""
  f32 = lambda x: np.isfinite(np.float32(x)) and np.float32(x) > 0
  ls = r.loss_scale
  assert all(f32(getattr(ls, k)) and type(getattr(ls, k)) is float
             for k in ("initial_scale", "growth_factor", "backoff_factor", "min_scale",
                       "max_scale"))
  assert type(ls.growth_interval) is int and type(ls.hysteresis) is int
  assert all(isinstance(x, str) and x for x in r.fp32_ops)
  for dt in (r.mu_dtype, r.nu_dtype, r.reduce_dtype, r.policy.param_dtype):
    assert mp.dtype_name(dt) in ("f32", "bf16", "f16")
  if r.fp8 is not None:
    assert all(isinstance(x, str) and x for x in r.fp8.keep_high_precision)
    assert all(type(v) is int and v >= 1 for v in r.fp8.activation_block + r.fp8.weight_block)


def _normalised(d):
  """The dict as to_dict writes it back: canonical dtype and policy names, float fields as
  floats. Anything else from_dict changed (a string split into characters, None read as
  a dtype, 2.5 truncated to 2) shows as a difference."""
  d = json.loads(json.dumps(d))
  d.setdefault("schema", 1)
  d["policy"] = str(mp.get_policy(d["policy"]))
  for k in ("master_dtype", "mu_dtype", "nu_dtype", "reduce_dtype"):
    d[k] = None if d[k] is None else mp.dtype_name(d[k])
  for k in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
    d["loss_scale"][k] = float(d["loss_scale"][k])
  if d["fp8"] is not None:
    for k in ("forward_format", "backward_format"):
      if d["fp8"][k] != "e2m1":  # E2M1 (nvfp4) is no policy dtype: kept as written
        d["fp8"][k] = mp.dtype_name(d["fp8"][k])
    d["fp8"].setdefault("keep_first_last", True)  # a field added later: absent reads True
    # The microscaled fields are written only when not at their defaults.
    for k, default in (("micro_block", None), ("scale_rounding", "up"),
                       ("stochastic_gradients", False), ("hadamard_wgrad", False),
                       ("seed", 0)):
      if k in d["fp8"] and d["fp8"][k] == default and type(d["fp8"][k]) is type(default):
        del d["fp8"][k]
  return d


def test_fp8_dict_written_before_keep_first_last_reads_its_default():
  d = _preset_dict("fp8_hybrid")
  del d["fp8"]["keep_first_last"]
  r = mp.Recipe.from_dict(d)
  assert r == mp.get_recipe("fp8_hybrid") and r.fp8.keep_first_last is True
  d["fp8"]["keep_first_last"] = 0
  with pytest.raises(ValueError, match=r"fp8\.keep_first_last=0; accepted: true or false"):
    mp.Recipe.from_dict(d)
  d["fp8"]["keep_first_last"] = False
  assert mp.Recipe.from_dict(d).to_dict()["fp8"]["keep_first_last"] is False


def test_from_dict_fuzz_over_mutated_presets():
  """>= 2,000 mutated preset dicts: each one either loads to a valid recipe that
  round-trips through JSON to an equal recipe, or raises ValueError naming the field."""
  rng = np.random.default_rng(20240518)
  outcomes = {"accepted": 0, "refused": 0}
  for desc, path, d in _mutations(rng, 2400):
    try:
      r = mp.Recipe.from_dict(d)
    except ValueError as e:
      assert path in str(e), f"{desc}: {d!r} -> {e}"
      outcomes["refused"] += 1
      continue
    except Exception as e:  # pylint: disable=broad-except
      pytest.fail(f"{desc}: {d!r} raised {type(e).__name__}: {e}")
    _assert_sane(r)
    assert r.to_dict() == _normalised(d), desc
    again = mp.Recipe.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r and again.to_dict() == r.to_dict(), desc
    outcomes["accepted"] += 1
  assert outcomes["accepted"] + outcomes["refused"] == 2400
  assert outcomes["accepted"] >= 100 and outcomes["refused"] >= 1500, outcomes


def test_fused_field_round_trip_and_validation():
  """`fused` is written only when True (every other recipe's dict is unchanged), read as
  False when absent, and only accepted where the fused AdamW kernel computes the update."""
  fused = mp.get_recipe("bf16_sr").replace(name="bf16_sr_fused", fused=True)
  d = json.loads(json.dumps(fused.to_dict()))
  assert d["fused"] is True and mp.Recipe.from_dict(d) == fused
  assert "fused" not in mp.get_recipe("bf16_sr").to_dict()
  del d["fused"]
  assert mp.Recipe.from_dict(d).fused is False
  d["fused"] = 1
  with pytest.raises(ValueError, match=r"fused=1; accepted: true or false"):
    mp.Recipe.from_dict(d)
  master = mp.Recipe("m", "p=bf16,c=bf16,o=f32", master_dtype="f32", rounding="stochastic",
                     fused=True)
  assert master.fused and "fused AdamW" in master.description
  for name, match in [("bf16_master", "rounding='nearest'"), ("fp32", "rounding='nearest'"),
                      ("pure_bf16", "mu_dtype=bf16, nu_dtype=bf16")]:
    with pytest.raises(ValueError, match=rf"fused=True with .*{match}.*accepted: fused=True"):
      mp.get_recipe(name).replace(fused=True)
