"""Recipe: one frozen value describing a whole training precision recipe.

A Recipe says which dtype each tensor lives in and each op computes in (the module
Policy), how the optimizer keeps its state (master copy, moment dtypes), how updates are
rounded back into the params, how the loss is scaled, in which dtype gradients are reduced
across devices, how fp8 GEMMs are scaled, and which ops stay in f32. It serialises to a
JSON-safe dict stored in every checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from precision._policy import Policy, dtype_name, get_policy, parse_dtype

ROUNDINGS = ("nearest", "stochastic", "kahan")
LOSS_SCALE_KINDS = ("none", "static", "dynamic")
FP8_SCALINGS = ("current", "delayed", "per_channel", "block")
AMAX_COMPUTE = ("max", "most_recent")
_F32 = np.dtype(np.float32)
_SIXTEEN_BIT = (parse_dtype("bf16"), parse_dtype("f16"))

# Ops kept in f32 whatever the compute dtype: PyTorch autocast's fp32 list (softmax,
# log_softmax, norms, losses, exp/log/pow, sums) and the precision map of mixed-precision
# LLM training (RMSNorm and QK-norm statistics, softmax, RoPE tables, cross entropy,
# exp/log/tanh/logistic of activations and soft-caps, grad norm and the optimizer update).
# precision._fp32_ops maps each name to the JAX primitives precision.autocast keeps in f32.
DEFAULT_FP32_OPS = (
    "softmax", "attention_probs", "log_softmax", "logsumexp", "cross_entropy", "rms_norm",
    "layer_norm", "group_norm", "batch_norm", "rotary_embedding", "transcendentals",
    "grad_norm", "optimizer_update",
)


def _check_choice(what: str, value: Any, accepted: tuple[str, ...]) -> None:
  if value not in accepted:
    raise ValueError(f"{what}={value!r}; accepted: {', '.join(accepted)}")


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """How the loss is scaled before backward. `kind` none|static|dynamic.

  Dynamic scaling follows PyTorch's GradScaler and Megatron: the scale backs off by
  `backoff_factor` after `hysteresis` consecutive non-finite steps (which are skipped), and
  grows by `growth_factor` after `growth_interval` consecutive finite steps, within
  [min_scale, max_scale].
  """

  kind: str = "none"
  initial_scale: float = 2.0 ** 15
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = 1.0
  max_scale: float = float(np.finfo(np.float32).max)
  hysteresis: int = 1

  def __post_init__(self):
    _check_choice("loss_scale.kind", self.kind, LOSS_SCALE_KINDS)
    if not (self.initial_scale > 0 and np.isfinite(self.initial_scale)):
      raise ValueError(f"loss_scale.initial_scale={self.initial_scale!r}; must be finite and > 0")
    if self.growth_factor < 1.0:
      raise ValueError(f"loss_scale.growth_factor={self.growth_factor!r}; must be >= 1")
    if not 0.0 < self.backoff_factor <= 1.0:
      raise ValueError(f"loss_scale.backoff_factor={self.backoff_factor!r}; must be in (0, 1]")
    if self.growth_interval < 1 or self.hysteresis < 1:
      raise ValueError(
          f"loss_scale.growth_interval={self.growth_interval!r} and hysteresis="
          f"{self.hysteresis!r} must be >= 1")
    if not 0 < self.min_scale <= self.max_scale:
      raise ValueError(
          f"loss_scale.min_scale={self.min_scale!r}, max_scale={self.max_scale!r}; need "
          "0 < min_scale <= max_scale")


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """fp8 GEMM settings: formats per direction and the scaling recipe.

  scaling: "current" (per-tensor amax of this step), "delayed" (amax history, as
  Transformer Engine), "per_channel" (row-wise), "block" (1x128 activation/gradient tiles,
  128x128 weight blocks, as DeepSeek-V3). `keep_high_precision` lists module path patterns
  whose GEMMs stay in the compute dtype (lm_head and embeddings by default).
  """

  forward_format: str = "e4m3"
  backward_format: str = "e5m2"
  scaling: str = "delayed"
  amax_history_len: int = 1024
  amax_compute: str = "max"
  margin: int = 0
  power_of_two: bool = False
  activation_block: tuple[int, int] = (1, 128)
  weight_block: tuple[int, int] = (128, 128)
  keep_high_precision: tuple[str, ...] = ("*lm_head*", "*embed*")

  def __post_init__(self):
    for field in ("forward_format", "backward_format"):
      name = dtype_name(getattr(self, field))
      if name not in ("e4m3", "e5m2"):
        raise ValueError(f"fp8.{field}={getattr(self, field)!r}; accepted: e4m3, e5m2")
      object.__setattr__(self, field, name)
    _check_choice("fp8.scaling", self.scaling, FP8_SCALINGS)
    _check_choice("fp8.amax_compute", self.amax_compute, AMAX_COMPUTE)
    if self.amax_history_len < 1:
      raise ValueError(f"fp8.amax_history_len={self.amax_history_len!r}; must be >= 1")
    object.__setattr__(self, "activation_block", tuple(int(v) for v in self.activation_block))
    object.__setattr__(self, "weight_block", tuple(int(v) for v in self.weight_block))
    object.__setattr__(self, "keep_high_precision", tuple(self.keep_high_precision))


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The whole training precision recipe.

  Examples:
    >>> r = get_recipe("bf16_master")
    >>> str(r.policy), dtype_name(r.master_dtype)
    ('p=bf16,c=bf16,o=f32', 'f32')
    >>> Recipe.from_dict(r.to_dict()) == r
    True
  """

  name: str
  policy: Policy
  master_dtype: np.dtype | None = None
  mu_dtype: np.dtype = _F32
  nu_dtype: np.dtype = _F32
  rounding: str = "nearest"
  loss_scale: LossScaleConfig = LossScaleConfig()
  reduce_dtype: np.dtype = _F32
  fp8: Fp8Config | None = None
  fp32_ops: tuple[str, ...] = DEFAULT_FP32_OPS
  allow_f16_without_loss_scale: bool = False

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("policy", get_policy(self.policy))
    for field in ("mu_dtype", "nu_dtype", "reduce_dtype"):
      set_(field, parse_dtype(getattr(self, field)))
    if self.master_dtype is not None:
      set_("master_dtype", parse_dtype(self.master_dtype))
    if isinstance(self.loss_scale, dict):
      set_("loss_scale", LossScaleConfig(**self.loss_scale))
    if isinstance(self.fp8, dict):
      set_("fp8", Fp8Config(**self.fp8))
    from precision._fp32_ops import check_names  # pylint: disable=g-import-not-at-top
    set_("fp32_ops", check_names(self.fp32_ops, "fp32_ops"))
    _check_choice("rounding", self.rounding, ROUNDINGS)
    param = self.policy.param_dtype
    if self.master_dtype is not None:
      if self.master_dtype.itemsize <= param.itemsize:
        raise ValueError(
            f"master_dtype={dtype_name(self.master_dtype)} must be wider than the param "
            f"dtype {dtype_name(param)}; use master_dtype=None to train params directly")
      if self.rounding == "kahan":
        raise ValueError(
            "rounding='kahan' compensates bf16 params without a master copy; with "
            f"master_dtype={dtype_name(self.master_dtype)} use 'nearest' or 'stochastic'")
    if self.rounding in ("stochastic", "kahan") and param == _F32 and self.master_dtype is None:
      raise ValueError(
          f"rounding={self.rounding!r} only matters for 16-bit params; this recipe's "
          f"params are {dtype_name(param)}")
    uses_f16 = parse_dtype("f16") in (param, self.policy.compute_dtype)
    if uses_f16 and self.loss_scale.kind == "none" and not self.allow_f16_without_loss_scale:
      raise ValueError(
          f"Recipe {self.name!r} computes in f16 without loss scaling: small gradients "
          "underflow f16 (smallest subnormal 6e-8). Set loss_scale=LossScaleConfig("
          "kind='dynamic') or allow_f16_without_loss_scale=True.")

  @property
  def swamping_risk(self) -> bool:
    """16-bit params updated with nearest rounding and no master: small updates vanish."""
    return (self.policy.param_dtype in _SIXTEEN_BIT and self.master_dtype is None
            and self.rounding == "nearest")

  @property
  def description(self) -> str:
    p = self.policy
    parts = [f"{self.name}: params {dtype_name(p.param_dtype)}, compute "
             f"{dtype_name(p.compute_dtype)}, output {dtype_name(p.output_dtype)}"]
    parts.append(f"master {dtype_name(self.master_dtype)}" if self.master_dtype is not None
                 else "no master copy")
    parts.append(f"moments mu {dtype_name(self.mu_dtype)} / nu {dtype_name(self.nu_dtype)}")
    parts.append(f"{self.rounding} rounding of updates")
    if self.loss_scale.kind != "none":
      parts.append(f"{self.loss_scale.kind} loss scale (initial {self.loss_scale.initial_scale:g})")
    parts.append(f"gradients reduced in {dtype_name(self.reduce_dtype)}")
    if self.fp8 is not None:
      parts.append(f"fp8 GEMMs {self.fp8.forward_format}/{self.fp8.backward_format}, "
                   f"{self.fp8.scaling} scaling")
    text = "; ".join(parts) + "."
    if self.swamping_risk:
      text += (" WARNING: swamping: 16-bit params with nearest rounding and no master copy "
               "lose updates smaller than half an ulp (bf16: 1.0 + 1e-5 == 1.0).")
    return text

  def replace(self, **changes) -> Recipe:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict; ``Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r``."""
    return {
        "name": self.name,
        "policy": str(self.policy),
        "master_dtype": None if self.master_dtype is None else dtype_name(self.master_dtype),
        "mu_dtype": dtype_name(self.mu_dtype),
        "nu_dtype": dtype_name(self.nu_dtype),
        "rounding": self.rounding,
        "loss_scale": dataclasses.asdict(self.loss_scale),
        "reduce_dtype": dtype_name(self.reduce_dtype),
        "fp8": None if self.fp8 is None else {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self.fp8).items()},
        "fp32_ops": list(self.fp32_ops),
        "allow_f16_without_loss_scale": self.allow_f16_without_loss_scale,
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Recipe:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
      raise ValueError(f"Unknown recipe fields {sorted(unknown)}; accepted: {sorted(known)}")
    return cls(**d)


def _presets() -> dict[str, Recipe]:
  dynamic = LossScaleConfig(kind="dynamic")
  return {r.name: r for r in (
      Recipe("fp32", "p=f32,c=f32,o=f32"),
      Recipe("bf16_mixed", "p=f32,c=bf16,o=f32"),
      Recipe("bf16_master", "p=bf16,c=bf16,o=f32", master_dtype="f32"),
      Recipe("bf16_sr", "p=bf16,c=bf16,o=f32", rounding="stochastic"),
      Recipe("bf16_kahan", "p=bf16,c=bf16,o=f32", rounding="kahan"),
      Recipe("pure_bf16", "p=bf16,c=bf16,o=f32", mu_dtype="bf16", nu_dtype="bf16",
             reduce_dtype="bf16"),
      Recipe("f16_mixed", "p=f32,c=f16,o=f32", loss_scale=dynamic),
      Recipe("fp8_hybrid", "p=f32,c=bf16,o=f32", fp8=Fp8Config()),
  )}


PRESETS: dict[str, Recipe] = _presets()


def get_recipe(name: str | Recipe) -> Recipe:
  """A preset recipe by name (a Recipe passes through).

  Presets: fp32, bf16_mixed, bf16_master, bf16_sr, bf16_kahan, pure_bf16, f16_mixed,
  fp8_hybrid.
  """
  if isinstance(name, Recipe):
    return name
  if name not in PRESETS:
    raise ValueError(f"Unknown recipe {name!r}; presets: {', '.join(PRESETS)}")
  return PRESETS[name]
