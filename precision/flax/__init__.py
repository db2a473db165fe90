"""Applying a precision Policy or Recipe to Flax models (NNX in place, Linen as a context).

Both run the model's calls under `precision.autocast`, which governs every GEMM and every
f32 op of the model's code, Flax layers or not; nothing in the model is replaced.

Public names: apply_policy (NNX), apply_recipe (NNX: policy, then fp8 layers), policy_of
(the Policy a model was marked with), spec_of (its whole autocast spec), linen_policy
(Linen; a policy, a recipe or a Plan), PolicyDotGeneral / PolicyConv (policy GEMM callables
for a layer's `dot_general` / `conv_general_dilated` attribute, for code that wants one
layer by hand), policy_dot_general, policy_conv_general_dilated, policy_einsum (the
functional GEMMs), UnmatchedOverrideWarning (an override pattern that matches no module
path of the model marked). Every entry point takes a Plan (`precision.bind`) or what it binds.
"""

from precision._overrides import UnmatchedOverrideWarning
from precision._gemm import PolicyConv
from precision._gemm import PolicyDotGeneral
from precision._gemm import policy_conv_general_dilated
from precision._gemm import policy_dot_general
from precision._gemm import policy_einsum
from precision.flax._linen import linen_policy
from precision.flax._nnx import apply_policy
from precision.flax._nnx import policy_of
from precision.flax._nnx import spec_of
from precision.flax._recipe import apply_recipe

__all__ = [
    "PolicyConv",
    "PolicyDotGeneral",
    "UnmatchedOverrideWarning",
    "apply_policy",
    "apply_recipe",
    "linen_policy",
    "policy_conv_general_dilated",
    "policy_dot_general",
    "policy_einsum",
    "policy_of",
    "spec_of",
]
