"""Applying a precision Policy to Flax models (NNX in place, Linen as a context).

Public names: apply_policy (NNX), apply_recipe (NNX, Policy then fp8), linen_policy (Linen),
PolicyDotGeneral / PolicyConv (the GEMM callables installed on layers), policy_dot_general,
policy_conv_general_dilated, policy_einsum (the functional GEMMs), PolicyEinsum and
PolicyEmbed (the NNX layer classes Einsum and Embed are switched to), GEMM_LAYERS,
NORM_LAYERS.
"""

from precision.flax._gemm import PolicyConv
from precision.flax._gemm import PolicyDotGeneral
from precision.flax._gemm import policy_conv_general_dilated
from precision.flax._gemm import policy_dot_general
from precision.flax._gemm import policy_einsum
from precision.flax._linen import linen_policy
from precision.flax._nnx import GEMM_LAYERS
from precision.flax._nnx import NORM_LAYERS
from precision.flax._nnx import PolicyEinsum
from precision.flax._nnx import PolicyEmbed
from precision.flax._nnx import apply_policy
from precision.flax._recipe import apply_recipe

__all__ = [
    "GEMM_LAYERS",
    "NORM_LAYERS",
    "PolicyConv",
    "PolicyDotGeneral",
    "PolicyEinsum",
    "PolicyEmbed",
    "apply_policy",
    "apply_recipe",
    "linen_policy",
    "policy_conv_general_dilated",
    "policy_dot_general",
    "policy_einsum",
]
