"""Recipe: presets, JSON round trip, validation."""

import json

import numpy as np
import pytest

import precision as mp

PRESET_NAMES = ["fp32", "bf16_mixed", "bf16_master", "bf16_sr", "bf16_kahan", "pure_bf16",
                "f16_mixed", "fp8_hybrid"]


def test_presets_exist():
  assert list(mp.PRESETS) == PRESET_NAMES


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
