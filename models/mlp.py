"""SwiGLU MLP in Flax NNX (used by the GPT) and its Linen twin.

Both compute ``down(silu(gate(x)) * up(x))`` with three bias-free GEMM layers of the same
names and kernel layouts ([in, out]), so one set of weights gives the same outputs in
either API (`linen_params_from_nnx` moves them across). The GEMMs are plain
`nnx.Linear` / `nn.Dense` layers: the precision policy reaches them from outside
(`precision.flax.apply_policy` for NNX, `precision.flax.linen_policy` for Linen); nothing
in here hard-codes a dtype.

Examples:
  >>> from flax import nnx
  >>> import jax.numpy as jnp
  >>> mlp = MLP(8, 16, rngs=nnx.Rngs(0))
  >>> mlp(jnp.ones((2, 8), jnp.float32)).shape
  (2, 8)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

_DEFAULT_STD = 0.02


class MLP(nnx.Module):
  """SwiGLU feed-forward block: [..., d_model] -> [..., d_model], in the input's dtype.

  Args:
    d_model: width of the input and output.
    d_ff: hidden width of the gated unit.
    init_std: std of the normal init of `gate` and `up`.
    out_init_std: std of the `down` init (GPT-2 scales residual projections by
      1/sqrt(2 * n_layers)); defaults to `init_std`.
  """

  def __init__(self, d_model: int, d_ff: int, *, init_std: float = _DEFAULT_STD,
               out_init_std: float | None = None, rngs: nnx.Rngs):
    init = nnx.initializers.normal(init_std)
    out_init = nnx.initializers.normal(init_std if out_init_std is None else out_init_std)
    self.gate = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, rngs=rngs)
    self.up = nnx.Linear(d_model, d_ff, use_bias=False, kernel_init=init, rngs=rngs)
    self.down = nnx.Linear(d_ff, d_model, use_bias=False, kernel_init=out_init, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class LinenMLP(nn.Module):
  """The Linen twin of `MLP`: same layer names (`gate`, `up`, `down`), same math."""

  d_model: int
  d_ff: int
  init_std: float = _DEFAULT_STD

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    init = nn.initializers.normal(self.init_std)
    gate = nn.Dense(self.d_ff, use_bias=False, kernel_init=init, name="gate")(x)
    up = nn.Dense(self.d_ff, use_bias=False, kernel_init=init, name="up")(x)
    return nn.Dense(self.d_model, use_bias=False, kernel_init=init, name="down")(
        jax.nn.silu(gate) * up)


def linen_params_from_nnx(mlp: MLP) -> dict:
  """The `{"params": ...}` collection that makes `LinenMLP` compute what `mlp` computes."""
  return {"params": {name: {"kernel": jnp.asarray(getattr(mlp, name).kernel[...])}
                     for name in ("gate", "up", "down")}}
