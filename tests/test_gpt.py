"""GPT and MLP models: shapes, presets, causality, layer names, Linen twin."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import gpt as gpt_lib
from models import mlp as mlp_lib


@pytest.fixture(scope="module")
def tiny():
  return gpt_lib.GPT(gpt_lib.CONFIGS["tiny"], rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny_forward(tiny):
  graphdef, state = nnx.split(tiny)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)), state


@pytest.mark.parametrize("name,lo,hi", [("tiny", 80_000, 150_000),
                                        ("small", 500_000, 3_000_000),
                                        ("gpt2_124m", 100_000_000, 130_000_000)])
def test_preset_param_counts(name, lo, hi):
  model = nnx.eval_shape(lambda: gpt_lib.GPT(gpt_lib.CONFIGS[name], rngs=nnx.Rngs(0)))
  assert lo <= gpt_lib.param_count(model) <= hi


def test_logits_shape_dtype_and_initial_loss(tiny, tiny_forward):
  fwd, state = tiny_forward
  tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256, dtype=jnp.int32)
  logits = fwd(state, tokens[:, :-1])
  assert logits.shape == (2, 32, 256) and logits.dtype == jnp.float32
  # Small init: the model starts close to the uniform byte model, ln(256) = 5.545 nats.
  loss = gpt_lib.loss_fn(tiny, tokens)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - np.log(256.0)) < 0.2


def test_causal(tiny_forward):
  fwd, state = tiny_forward
  tokens = jax.random.randint(jax.random.key(2), (1, 32), 0, 256, dtype=jnp.int32)
  changed = tokens.at[0, 20].set((tokens[0, 20] + 1) % 256)
  a, b = np.asarray(fwd(state, tokens)), np.asarray(fwd(state, changed))
  np.testing.assert_array_equal(a[0, :20], b[0, :20])
  assert np.abs(a[0, 20:] - b[0, 20:]).max() > 0


def test_layer_names_and_gemm_layers(tiny):
  paths = {"/".join(map(str, p)) for p, _ in nnx.iter_graph(tiny)}
  assert "embed" in paths and "lm_head" in paths
  linears = [m for _, m in nnx.iter_graph(tiny) if isinstance(m, nnx.Linear)]
  # per block: qkv, out, gate, up, down; plus lm_head
  assert len(linears) == 5 * gpt_lib.CONFIGS["tiny"].n_layers + 1
  assert all(m.bias is None for m in linears)
  norms = [m for _, m in nnx.iter_graph(tiny) if isinstance(m, nnx.RMSNorm)]
  assert len(norms) == 4 * gpt_lib.CONFIGS["tiny"].n_layers + 1  # attn, mlp, q, k; final


def test_without_qk_norm():
  cfg = gpt_lib.CONFIGS["tiny"].replace(qk_norm=False, n_layers=1)
  model = gpt_lib.GPT(cfg, rngs=nnx.Rngs(0))
  assert model.blocks[0].attn.q_norm is None
  assert model(jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 256)


def test_config_round_trip_and_errors():
  cfg = gpt_lib.CONFIGS["small"]
  assert gpt_lib.GPTConfig.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(ValueError, match="n_heads"):
    gpt_lib.GPTConfig(d_model=64, n_heads=5)
  with pytest.raises(ValueError, match="even"):
    gpt_lib.GPTConfig(d_model=12, n_heads=4)
  with pytest.raises(ValueError, match="presets: tiny, small, gpt2_124m"):
    gpt_lib.get_config("huge")
  with pytest.raises(ValueError, match="bogus"):
    gpt_lib.GPTConfig.from_dict({**dataclasses.asdict(cfg), "bogus": 1})
  with pytest.raises(ValueError, match="integers"):
    gpt_lib.GPT(gpt_lib.CONFIGS["tiny"], rngs=nnx.Rngs(0))(jnp.zeros((1, 4), jnp.float32))


def test_linen_twin_matches_nnx_mlp():
  mlp = mlp_lib.MLP(16, 48, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (3, 5, 16), jnp.float32)
  linen = mlp_lib.LinenMLP(d_model=16, d_ff=48)
  fresh = linen.init(jax.random.key(0), x)
  params = mlp_lib.linen_params_from_nnx(mlp)
  assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, params)
  np.testing.assert_array_equal(np.asarray(linen.apply(params, x)), np.asarray(mlp(x)))
