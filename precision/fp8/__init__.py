"""fp8 training: E4M3/E5M2 GEMMs with current, delayed, per-channel and block scaling.

An fp8 `dot_general` with a custom VJP (forward operands in E4M3, the incoming gradient in
E5M2, every GEMM on fp8 operands with f32 accumulation), its scaling recipes, the scaling
state as NNX Variables (`Fp8State`, `Fp8GradState`) or Linen collections, `apply_fp8` to
route a model's Linear/Einsum GEMMs through it (`precision.value_and_grad` carries the
gradient operand's state out of a step, `merge_grad_state` merges it),
`rollback_fp8_state` to undo a step the optimizer guard skipped, `fp8_metrics` and
`sync_fp8_state`. For any JAX function (plain JAX, Linen applied inside a function, other
libraries): `precision.autocast(fn, recipe)` with an fp8
recipe, `init_state` (and `precision.value_and_grad` of the autocast function) for the
scaling state of delayed scaling, `autocast_gemms` for which GEMMs run in fp8.

Examples:
  >>> import jax.numpy as jnp, precision as mp
  >>> from flax import nnx
  >>> recipe = mp.get_recipe("fp8_hybrid")
  >>> mlp = nnx.Sequential(nnx.Linear(8, 16, use_bias=False, rngs=nnx.Rngs(0)),
  ...                     nnx.Linear(16, 8, use_bias=False, rngs=nnx.Rngs(1)))
  >>> _ = mp.fp8.apply_fp8(mlp, recipe.fp8, recipe.policy)
  >>> mlp(jnp.ones((2, 8))).dtype
  dtype(bfloat16)
"""

from precision.fp8._dot import Fp8DotState
from precision.fp8._dot import Fp8Spec
from precision.fp8._dot import fp8_dot_general
from precision.fp8._dot import scaled_matmul
from precision.fp8._linen import GRAD_COLLECTION
from precision.fp8._linen import STATE_COLLECTION
from precision.fp8._linen import LinenFp8DotGeneral
from precision.fp8._metrics import fp8_metrics
from precision.fp8._microscale import expand_tile_scales
from precision.fp8._microscale import hadamard_matrix
from precision.fp8._microscale import mxfp8_dequantize
from precision.fp8._microscale import mxfp8_quantize
from precision.fp8._microscale import nvfp4_dequantize
from precision.fp8._microscale import nvfp4_quantize
from precision.fp8._microscale import nvfp4_quantize_2d
from precision.fp8._microscale import random_hadamard
from precision.fp8._metrics import sync_fp8_state
from precision.fp8._nnx import Fp8DotGeneral
from precision.fp8._nnx import Fp8Einsum
from precision.fp8._nnx import Fp8GradState
from precision.fp8._nnx import Fp8State
from precision.fp8._nnx import apply_fp8
from precision.fp8._nnx import einsum_dimension_numbers
from precision.fp8._nnx import fp8_modules
from precision.fp8._nnx import rollback_fp8_state
from precision.fp8._merge import merge_grad_state
from precision.fp8._scaling import OperandRecipe
from precision.fp8._scaling import OperandState
from precision.fp8._scaling import quantize
from precision.fp8._scaling import scale_from_amax
# `init_state`, `autocast_gemms` and `GemmSite` bind a recipe, so they live above the Plan
# (which sits above this package), in precision/_autocast/_fp8_state.py; precision/__init__.py
# attaches them here.
# Deprecated aliases (merge_grad_state replaces them). The deprecated `value_and_grad` and
# `autocast_value_and_grad` (precision.value_and_grad replaces them) live above this
# package, in precision/_deprecated_grads.py; precision/__init__.py attaches them here.
from precision.fp8._deprecated import merge_fp8_grad_state
from precision.fp8._deprecated import merge_state_grads
from precision.fp8._deprecated import update_fp8_grad_state

__all__ = [
    "Fp8DotGeneral",
    "Fp8DotState",
    "Fp8Einsum",
    "Fp8GradState",
    "Fp8Spec",
    "Fp8State",
    "GRAD_COLLECTION",
    "GemmSite",
    "LinenFp8DotGeneral",
    "OperandRecipe",
    "OperandState",
    "STATE_COLLECTION",
    "apply_fp8",
    "autocast_gemms",
    "autocast_value_and_grad",
    "einsum_dimension_numbers",
    "expand_tile_scales",
    "fp8_dot_general",
    "fp8_metrics",
    "fp8_modules",
    "hadamard_matrix",
    "init_state",
    "merge_fp8_grad_state",
    "merge_grad_state",
    "merge_state_grads",
    "mxfp8_dequantize",
    "mxfp8_quantize",
    "nvfp4_dequantize",
    "nvfp4_quantize",
    "nvfp4_quantize_2d",
    "quantize",
    "random_hadamard",
    "rollback_fp8_state",
    "scale_from_amax",
    "scaled_matmul",
    "sync_fp8_state",
    "update_fp8_grad_state",
    "value_and_grad",
]
