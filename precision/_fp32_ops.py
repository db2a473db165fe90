"""The ops a recipe keeps in f32, and the JAX primitives each one is made of.

`Recipe.fp32_ops` names ops ("softmax", "rms_norm", ...); `precision.autocast` sees a traced
program, where a softmax is `reduce_max`, `sub`, `exp`, `reduce_sum` and `div`. This table
maps every name to its primitives: wherever one of them meets an operand below f32, autocast
upcasts the operand and the primitive computes (and returns) f32. The f32 result then
stays f32 through the elementwise ops that follow (mixed operands promote to the wider
dtype) until a GEMM rounds it to the compute dtype: a softmax's max, exp, sum and division
all run in f32, as do a norm's mean of squares, rsqrt and scale.

The lists follow PyTorch autocast's "runs in float32" list (exp, log, pow, softmax,
log_softmax, norms, sums, losses) and the precision map of mixed-precision LLM training
(norm statistics, softmax, RoPE tables, cross entropy, logit soft-caps in f32). A
primitive name ("tanh", "erf", ...) is accepted as an op name of its own.
"""

from __future__ import annotations

from typing import Iterable

# The pseudo-primitive of the "router" op: the router GEMM (no JAX primitive has the name).
ROUTER_GEMM = "router_gemm"

# Statistics of a norm: squares, their (mean) sum, the division by the count, rsqrt/sqrt.
_NORM = ("integer_pow", "square", "reduce_sum", "div", "rsqrt", "sqrt", "reduce_window_sum")
# Softmax-like reductions: max for stability, exp, the normaliser, log of it.
_SOFTMAX = ("reduce_max", "exp", "reduce_sum", "div", "log")

FP32_OP_PRIMITIVES: dict[str, tuple[str, ...]] = {
    "softmax": _SOFTMAX,
    "attention_probs": _SOFTMAX,
    "log_softmax": _SOFTMAX,
    "logsumexp": _SOFTMAX,
    "cross_entropy": _SOFTMAX,
    "rms_norm": _NORM,
    "layer_norm": _NORM,
    "group_norm": _NORM,
    "batch_norm": _NORM,
    "rotary_embedding": ("sin", "cos"),
    "grad_norm": ("integer_pow", "square", "reduce_sum", "sqrt"),
    # The optimizer keeps its update in f32 itself (precision.optim); no model primitive.
    "optimizer_update": (),
    # Transcendentals of activations and logit soft-caps (silu's logistic, gelu's tanh or
    # erf, tanh soft-capping): bf16 tanh(x) near its saturation loses the small slope.
    "transcendentals": ("exp", "exp2", "log", "log1p", "expm1", "logistic", "tanh", "erf",
                        "erfc", "pow", "sin", "cos", "tan"),
    # Accumulating scans.
    "cumsum": ("cumsum", "cumprod", "cumlogsumexp"),
    # An MoE router: the GEMM whose result reaches a top_k / argmax that dispatches tokens
    # (precision._autocast._router finds it) computed f32 x f32 -> f32, so the top-k, the
    # softmax and the gating weights after it run on f32 logits: bf16 logits tie where
    # f32's differ and route tokens differently. Its gradient GEMMs run f32 too, also in a
    # function that takes its own gradient (autocast(jax.grad(f))). ROUTER_GEMM is no JAX
    # primitive; the interpreter reads it as the request.
    "router": (ROUTER_GEMM, "top_k", "argmax", "argmin"),
}

# Primitive names accepted as op names of their own.
PRIMITIVE_NAMES: frozenset[str] = frozenset(
    p for prims in FP32_OP_PRIMITIVES.values() for p in prims) | frozenset(
        ("reduce_prod", "reduce_min", "atan2", "sinh", "cosh", "erf_inv", "lgamma",
         "digamma", "cbrt")) - {ROUTER_GEMM}


def accepted_names() -> list[str]:
  return sorted(FP32_OP_PRIMITIVES) + sorted(PRIMITIVE_NAMES - set(FP32_OP_PRIMITIVES))


def check_names(names: Iterable[str], what: str = "fp32_ops") -> tuple[str, ...]:
  """`names` as a tuple; ValueError naming any unknown entry and listing the accepted ones."""
  if isinstance(names, str):
    raise ValueError(f"{what}={names!r}: expected a list of op names, not one string; "
                     f"accepted names: {', '.join(accepted_names())}")
  names = tuple(names)
  unknown = [n for n in names if not isinstance(n, str) or (
      n not in FP32_OP_PRIMITIVES and n not in PRIMITIVE_NAMES)]
  if unknown:
    raise ValueError(f"{what}: unknown op name(s) {unknown!r}; accepted: "
                     f"{', '.join(accepted_names())}")
  return names


def primitives_of(names: Iterable[str]) -> frozenset[str]:
  """The JAX primitive names that make up the ops `names`."""
  out: set[str] = set()
  for name in check_names(names):
    out.update(FP32_OP_PRIMITIVES.get(name, (name,)))
  return frozenset(out)
