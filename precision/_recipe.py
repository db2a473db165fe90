"""Recipe: one frozen value describing a whole training precision recipe.

A Recipe says which dtype each tensor lives in and each op computes in (the module
Policy), how the optimizer keeps its state (master copy, moment dtypes), how updates are
rounded back into the params, how the loss is scaled, in which dtype gradients are reduced
across devices, how fp8 GEMMs are scaled, and which ops stay in f32. It serialises to a
JSON-safe dict stored in every checkpoint. It may also turn on loss-spike skipping
(SpikeGuardConfig).

Every field is validated when a Recipe (or LossScaleConfig / Fp8Config /
SpikeGuardConfig) is built: exact types, ranges, finite numbers, scales that are finite
non-zero f32 values. Each error is a ValueError naming the field's path
(``loss_scale.initial_scale``, ``fp8.weight_block``), the value and what is accepted.
`Recipe.from_dict` is schema-strict on top of that: the dict must have exactly the fields
`to_dict` writes, no more, no fewer.

Size: every field of Recipe, LossScaleConfig, Fp8Config and SpikeGuardConfig with its
validation and JSON round trip; the presets are defined here so they are validated like
user recipes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from precision._fp32_ops import check_names
from precision._policy import Policy, dtype_name, get_policy, parse_dtype

ROUNDINGS = ("nearest", "stochastic", "kahan")
LOSS_SCALE_KINDS = ("none", "static", "dynamic")
FP8_SCALINGS = ("current", "delayed", "per_channel", "block", "mxfp8", "nvfp4")
# Microscaled scalings: one scale per small block along the contraction (precision.fp8's
# mxfp8_quantize / nvfp4_quantize), GEMMs emulated on the dequantised values in f32.
MICRO_SCALINGS = ("mxfp8", "nvfp4")
MICRO_BLOCKS = {"mxfp8": 32, "nvfp4": 16}
AMAX_COMPUTE = ("max", "most_recent")
FP8_FORMATS = ("e4m3", "e5m2", "e2m1")
SCALE_ROUNDINGS = ("up", "floor")
# How a microscaled GEMM is lowered (Fp8Config.micro_gemm).
MICRO_GEMMS = ("auto", "emulated", "block_scaled")
_F32 = np.dtype(np.float32)
_SIXTEEN_BIT = (parse_dtype("bf16"), parse_dtype("f16"))
# The formats a tensor may be stored or reduced in. f64 is not one: with JAX's default
# jax_enable_x64=False it would silently become f32. fp8 formats enter through Fp8Config.
STORAGE_DTYPES = ("f32", "bf16", "f16")
MASTER_DTYPES = ("f32",)

_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = 2 ** 31 - 1
# Version of the dict layout `Recipe.to_dict` writes (its "schema" key). Dicts written
# before the key existed carry exactly the fields of version 1 and read as version 1.
SCHEMA_VERSION = 1

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


# ---------------------------------------------------------------------------------------
# Field checks. Each returns the normalised value or raises ValueError naming `path`.


def _bad(path: str, value: Any, accepted: str) -> ValueError:
  return ValueError(f"{path}={value!r}; accepted: {accepted}")


def _check_choice(path: str, value: Any, accepted: tuple[str, ...]) -> str:
  if not isinstance(value, str) or value not in accepted:
    raise _bad(path, value, ", ".join(accepted))
  return value


def _check_bool(path: str, value: Any) -> bool:
  # numpy bools are bools; ints (0/1) are not: a JSON 0 where true/false belongs is a typo.
  if not isinstance(value, (bool, np.bool_)):
    raise _bad(path, value, "true or false")
  return bool(value)


def _check_int(path: str, value: Any, lo: int, hi: int) -> int:
  # Integers only: 2000.0 or True in an integer field is refused, not truncated.
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise _bad(path, value, f"an integer in [{lo}, {hi}]")
  if not lo <= int(value) <= hi:
    raise _bad(path, value, f"an integer in [{lo}, {hi}]")
  return int(value)


def _check_f32(path: str, value: Any, *, lo: float, hi: float, lo_open: bool = False,
               what: str = "") -> float:
  """A real number that is finite, non-zero-after-rounding and in range as an f32.

  The optimizer holds scales and factors in f32: 1e39 would become inf and 1e-46 zero,
  so the range is checked on the f32 value, and the Python float is kept (to_dict writes
  the number the user gave).
  """
  accepted = what or (f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}] "
                      "(checked as f32)")
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise _bad(path, value, accepted)
  v = float(value)
  with np.errstate(over="ignore", under="ignore"):
    v32 = float(np.float32(v))
  if not (math.isfinite(v) and math.isfinite(v32)):
    raise _bad(path, value, accepted)
  if (v32 <= lo if lo_open else v32 < lo) or v32 > hi or (lo_open and v32 == 0.0):
    raise _bad(path, value, accepted)
  return v


def _check_dtype(path: str, value: Any, accepted: tuple[str, ...]) -> np.dtype:
  """A dtype name (or dtype-like) among `accepted`; None and other types are refused."""
  if value is None or isinstance(value, (bool, numbers.Number, list, tuple, dict)):
    raise _bad(path, value, ", ".join(accepted))
  try:
    dt = parse_dtype(value)
  except (ValueError, TypeError) as e:
    raise _bad(path, value, ", ".join(accepted)) from e
  if dtype_name(dt) not in accepted:
    raise _bad(path, value, ", ".join(accepted))
  return dt


def _check_names(path: str, value: Any, what: str) -> tuple[str, ...]:
  """A list/tuple of distinct non-empty strings (a bare string is refused, not split)."""
  if isinstance(value, str) or not isinstance(value, (list, tuple)):
    raise _bad(path, value, f"a list of {what} (a bare string is not a list: wrap it)")
  seen = set()
  for i, item in enumerate(value):
    if not isinstance(item, str) or not item.strip():
      raise _bad(f"{path}[{i}]", item, f"a non-empty string ({what})")
    if item in seen:
      raise _bad(f"{path}[{i}]", item, f"distinct {what} (this one is repeated)")
    seen.add(item)
  return tuple(value)


def _check_pair(path: str, value: Any, lo: int, hi: int) -> tuple[int, int]:
  if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != 2:
    raise _bad(path, value, f"two integers [rows, cols], each in [{lo}, {hi}]")
  return tuple(_check_int(f"{path}[{i}]", v, lo, hi) for i, v in enumerate(value))


def _check_keys(path: str, d: Any, cls: type, optional: tuple[str, ...] = ()) -> None:
  """`d` is a dict with exactly the fields of dataclass `cls`; `optional` keys (fields or
  not) may be absent."""
  where = path or "recipe"
  if not isinstance(d, dict):
    raise ValueError(f"{where}={d!r}; accepted: a dict with the fields of {cls.__name__}")
  fields = [f.name for f in dataclasses.fields(cls)]
  bad_keys = [k for k in d if not isinstance(k, str)]
  if bad_keys:
    raise ValueError(f"{where}: field names must be strings, got {bad_keys!r}")
  unknown = sorted(set(d) - set(fields) - set(optional))
  missing = [k for k in fields if k not in d and k not in optional]
  prefix = f"{path}." if path else ""
  if unknown:
    raise ValueError(f"{where}: unknown field(s) {', '.join(prefix + k for k in unknown)}; "
                     f"accepted: {', '.join(fields)}")
  if missing:
    raise ValueError(f"{where}: missing field(s) {', '.join(prefix + k for k in missing)}; "
                     f"a {cls.__name__} dict needs every field: {', '.join(fields)}")


def _config_from_dict(cls: type, d: Any, path: str, added: tuple[str, ...] = ()) -> Any:
  """A config dataclass from its dict: exact keys, every field set, then validated.

  `added` names fields added after dicts were first written: a dict without one of them
  (written by an earlier version) reads it as its default; every other field is required.
  """
  if isinstance(d, dict):
    d = {**{f.name: f.default for f in dataclasses.fields(cls) if f.name in added}, **d}
  _check_keys(path, d, cls)
  obj = cls.__new__(cls)
  for f in dataclasses.fields(cls):
    _set(obj, f.name, d[f.name])
  obj._validate(path)  # pylint: disable=protected-access
  return obj


def _set(obj: Any, name: str, value: Any) -> None:
  object.__setattr__(obj, name, value)


# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
  """How the loss is scaled before backward. `kind` none|static|dynamic.

  Dynamic scaling follows PyTorch's GradScaler with Megatron's hysteresis
  (`precision.optim.DynamicLossScale`). Every step with a non-finite gradient is skipped
  and resets the growth count. The scale backs off (times `backoff_factor`, not below
  `min_scale`) on the `hysteresis`-th non-finite step counted since the last growth (or
  since the start), and again on every further non-finite step until the next growth; the
  non-finite steps need not be consecutive, since finite steps in between do not restore
  the count. The scale grows (times `growth_factor`, at most `max_scale`, not at all when
  the grown value would not be a finite f32) after `growth_interval` consecutive finite
  steps, and that growth restores the count to `hysteresis`. With ``hysteresis=1`` this is
  GradScaler: every non-finite step backs off.

  All scales and factors are held in f32, so each must be a finite non-zero f32: e.g.
  ``initial_scale=1e39`` (inf in f32) is refused. Integers (`growth_interval`,
  `hysteresis`) must be integers in [1, 2**31 - 1].

  Examples:
    >>> LossScaleConfig(kind="dynamic", initial_scale=2.0 ** 16, growth_interval=1000)
    >>> LossScaleConfig.from_dict(cfg.to_dict()) == cfg
    True
  """

  kind: str = "none"
  initial_scale: float = 2.0 ** 15
  growth_factor: float = 2.0
  backoff_factor: float = 0.5
  growth_interval: int = 2000
  min_scale: float = 1.0
  max_scale: float = _F32_MAX
  hysteresis: int = 1

  def __post_init__(self):
    self._validate("loss_scale")

  def _validate(self, path: str) -> None:
    _check_choice(f"{path}.kind", self.kind, LOSS_SCALE_KINDS)
    f32 = f"(checked as f32, max {_F32_MAX:.7g})"
    _set(self, "initial_scale", _check_f32(
        f"{path}.initial_scale", self.initial_scale, lo=0.0, hi=_F32_MAX, lo_open=True,
        what=f"a finite number > 0 {f32}"))
    _set(self, "growth_factor", _check_f32(
        f"{path}.growth_factor", self.growth_factor, lo=1.0, hi=_F32_MAX,
        what=f"a finite number >= 1 {f32}"))
    _set(self, "backoff_factor", _check_f32(
        f"{path}.backoff_factor", self.backoff_factor, lo=0.0, hi=1.0, lo_open=True,
        what="a number in (0, 1] (checked as f32)"))
    _set(self, "growth_interval", _check_int(f"{path}.growth_interval", self.growth_interval,
                                             1, _INT32_MAX))
    _set(self, "min_scale", _check_f32(
        f"{path}.min_scale", self.min_scale, lo=0.0, hi=_F32_MAX, lo_open=True,
        what=f"a finite number > 0 {f32}"))
    _set(self, "max_scale", _check_f32(
        f"{path}.max_scale", self.max_scale, lo=0.0, hi=_F32_MAX, lo_open=True,
        what=f"a finite number > 0 {f32}"))
    _set(self, "hysteresis", _check_int(f"{path}.hysteresis", self.hysteresis, 1, _INT32_MAX))
    if not self.min_scale <= self.max_scale:
      raise ValueError(
          f"{path}.min_scale={self.min_scale!r}, {path}.max_scale={self.max_scale!r}; "
          "accepted: 0 < min_scale <= max_scale")
    if self.kind == "dynamic" and not self.min_scale <= self.initial_scale <= self.max_scale:
      raise ValueError(
          f"{path}.initial_scale={self.initial_scale!r} with {path}.min_scale="
          f"{self.min_scale!r}, {path}.max_scale={self.max_scale!r}; accepted: a dynamic "
          "scale starts within [min_scale, max_scale]")

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict of every field."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any], *, path: str = "loss_scale") -> LossScaleConfig:
    """Schema-strict inverse of `to_dict`: exactly its fields, each validated.

    Raises:
      ValueError: naming the field path (e.g. ``loss_scale.hysteresis``), the value and
        what is accepted, for an unknown or missing field or a bad value.
    """
    return _config_from_dict(cls, d, path)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """fp8 GEMM settings: formats per direction and the scaling recipe.

  scaling: "current" (per-tensor amax of this step), "delayed" (amax history, as
  Transformer Engine), "per_channel" (row-wise), "block" (1x128 activation/gradient tiles,
  128x128 weight blocks, as DeepSeek-V3; the contraction tiles must agree:
  ``activation_block[1] == weight_block[0] == weight_block[1]``). `keep_high_precision`
  lists module path patterns (fnmatch) whose GEMMs stay in the compute dtype (lm_head and
  embeddings by default); it is a list of patterns, never a bare string. `margin` in
  [0, 127] (the scale is divided by 2**margin, an f32), `amax_history_len` in [1, 65536].

  `keep_first_last` (default True): under `precision.autocast`, the first and the last
  GEMM of the traced forward function (with a weight operand, outside loop bodies) stay
  in the compute dtype whatever their scope is called (the embedding/stem projection and
  the output head, Transformer Engine's practice), besides the `keep_high_precision`
  scopes. It selects by position in the
  traced program, so it applies where a program is traced (`precision.autocast`);
  `precision.fp8.apply_fp8` on an NNX model selects its layers by path only
  (`keep_high_precision`). Dicts written before this field existed read it as True.

  Microscaled scalings (`precision.fp8.mxfp8_quantize`, `nvfp4_quantize`): every GEMM
  operand is quantised in blocks of `micro_block` contiguous elements along the GEMM's
  contraction (forward and both gradient GEMMs, each along its own contraction), and the
  GEMM runs on the dequantised values in f32 (an emulation whose numbers are the format's).
  "mxfp8": E4M3/E5M2 elements, E8M0 power-of-two scales rounded per `scale_rounding`
  ("up": no element saturates, Mishra et al. 2025; "floor": OCP MX v1.0's rule), block 32
  by default. "nvfp4": E2M1 elements (``forward_format = backward_format = "e2m1"``, the
  only scaling that takes E2M1), E4M3 block scales and an f32 tensor scale, block 16 by
  default; `stochastic_gradients` rounds the incoming gradient stochastically (a fresh
  counter-based stream per gradient tensor, from `seed` and the tensor's bits), and
  `hadamard_wgrad` applies a random 16x16 Hadamard transform (signs from `seed`) to both
  operands of the weight-gradient GEMM along its contraction. These GEMMs keep no scaling
  state (the state passes through unchanged); `margin`, `power_of_two`, the amax history
  and the block tiles do not apply to them. `micro_block` (None: the format's block),
  `scale_rounding`, `stochastic_gradients`, `hadamard_wgrad` and `seed` are written by
  `to_dict` only when they differ from their defaults, and dicts without them read the
  defaults.

  `micro_gemm` (microscaled scalings only; default "auto") chooses how those GEMMs are
  lowered; the quantised elements and scales (scale rounding, stochastic rounding, the
  Hadamard transform) are the same under every choice, only the GEMM differs:
  "emulated": dequantise to f32 and multiply in f32 (dot_general, HIGHEST precision, f32
  accumulation) on every platform. "block_scaled": on a CUDA platform each of the three
  GEMMs is `jax.nn.scaled_matmul` of the quantised elements and block scales (the custom
  call ``__op$block_scaled_dot``, which XLA sends to cuDNN's block-scaled GEMM where cuDNN
  takes it, i.e. compute capability >= 10 with MXFP8 blocks of 32 / NVFP4 blocks of 16,
  and otherwise expands into dequantise + f32 dot); nvfp4's two f32 tensor scales
  multiply its f32 result, which equals the emulation's up to the order and rounding of
  f32 operations; every other platform (the CPU) runs the emulation (a
  `jax.lax.platform_dependent` branch). "auto": "block_scaled" where the default device
  (``jax.devices()[0]``, read when the GEMM is traced) is a CUDA GPU of compute capability
  >= 10 (Blackwell: the cuDNN kernel exists), else "emulated" (a CPU, a Hopper GPU).
  Written by `to_dict` only when not "auto".

  `weight_block_2d` (nvfp4 only; default False): the weight operand (the GEMM's rhs, the
  kernel of nnx.Linear / Einsum and of ``x @ w``, as `precision.fp8.Fp8Spec` takes it) is
  quantised once in `micro_block` x `micro_block` tiles (16 x 16: one E4M3 scale per
  tile), so the forward GEMM and the dgrad GEMM multiply the same weight values, as in
  NVIDIA's NVFP4 training recipe (activations and gradients keep 1 x 16 blocks). False:
  1 x 16 blocks along each GEMM's contraction, quantised again for dgrad. The field's
  default is False so that a recipe dict without it (written before the field existed)
  reads back as the recipe it ran; the `nvfp4` preset sets it (NVIDIA's recipe), so a
  checkpoint of the earlier preset is named another recipe on resume. Written by
  `to_dict` only when True.

  Examples:
    >>> Fp8Config(scaling="current", keep_high_precision=("*lm_head*",))
    >>> Fp8Config(scaling="mxfp8", backward_format="e4m3")
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
  keep_first_last: bool = True
  micro_block: int | None = None
  scale_rounding: str = "up"
  stochastic_gradients: bool = False
  hadamard_wgrad: bool = False
  seed: int = 0
  micro_gemm: str = "auto"
  weight_block_2d: bool = False

  def __post_init__(self):
    self._validate("fp8")

  def _validate(self, path: str) -> None:
    for field in ("forward_format", "backward_format"):
      value = getattr(self, field)
      if isinstance(value, str) and value.strip() == "e2m1" or (
          not isinstance(value, str) and _is_e2m1(value)):
        _set(self, field, "e2m1")  # not a policy dtype: parse_dtype does not know it
      else:
        _set(self, field, dtype_name(_check_dtype(f"{path}.{field}", value, FP8_FORMATS)))
    _check_choice(f"{path}.scaling", self.scaling, FP8_SCALINGS)
    self._validate_micro(path)
    _check_choice(f"{path}.amax_compute", self.amax_compute, AMAX_COMPUTE)
    _set(self, "amax_history_len", _check_int(f"{path}.amax_history_len",
                                              self.amax_history_len, 1, 65536))
    _set(self, "margin", _check_int(f"{path}.margin", self.margin, 0, 127))
    _set(self, "power_of_two", _check_bool(f"{path}.power_of_two", self.power_of_two))
    _set(self, "keep_first_last", _check_bool(f"{path}.keep_first_last",
                                              self.keep_first_last))
    _set(self, "activation_block", _check_pair(f"{path}.activation_block",
                                               self.activation_block, 1, 65536))
    _set(self, "weight_block", _check_pair(f"{path}.weight_block", self.weight_block, 1, 65536))
    _set(self, "keep_high_precision", _check_names(
        f"{path}.keep_high_precision", self.keep_high_precision, "module path patterns"))
    act, wgt = self.activation_block, self.weight_block
    if self.scaling == "block" and not act[1] == wgt[0] == wgt[1]:
      raise ValueError(
          f"{path}.activation_block={list(act)} and {path}.weight_block={list(wgt)} with "
          f"{path}.scaling='block'; accepted: activation_block=[r, k], weight_block=[k, k] "
          "(equal contraction tiles)")

  def _validate_micro(self, path: str) -> None:
    """The microscaled fields, and which formats each scaling takes."""
    micro = self.scaling in MICRO_SCALINGS
    only = lambda what: f"{what} only with {path}.scaling in {', '.join(MICRO_SCALINGS)}"
    if self.micro_block is not None:
      _set(self, "micro_block", _check_int(f"{path}.micro_block", self.micro_block, 1, 65536))
      if not micro:
        raise _bad(f"{path}.micro_block", self.micro_block,
                   f"None with {path}.scaling={self.scaling!r} ({only('a block size')})")
    _check_choice(f"{path}.scale_rounding", self.scale_rounding, SCALE_ROUNDINGS)
    if self.scale_rounding != "up" and self.scaling != "mxfp8":  # E8M0 scales only
      raise _bad(f"{path}.scale_rounding", self.scale_rounding,
                 f"'up' with {path}.scaling={self.scaling!r} (a choice only with "
                 f"{path}.scaling='mxfp8')")
    for field in ("stochastic_gradients", "hadamard_wgrad", "weight_block_2d"):
      _set(self, field, _check_bool(f"{path}.{field}", getattr(self, field)))
      if getattr(self, field) and self.scaling != "nvfp4":
        raise _bad(f"{path}.{field}", True, f"false with {path}.scaling={self.scaling!r} "
                   f"(true only with {path}.scaling='nvfp4')")
    _set(self, "seed", _check_int(f"{path}.seed", self.seed, 0, 2 ** 32 - 1))
    if self.seed and self.scaling != "nvfp4":  # seeds the stochastic rounding / Hadamard
      raise _bad(f"{path}.seed", self.seed, f"0 with {path}.scaling={self.scaling!r} (a "
                 f"seed only with {path}.scaling='nvfp4')")
    _check_choice(f"{path}.micro_gemm", self.micro_gemm, MICRO_GEMMS)
    if self.micro_gemm != "auto" and not micro:
      raise _bad(f"{path}.micro_gemm", self.micro_gemm,
                 f"'auto' with {path}.scaling={self.scaling!r} ({only('a GEMM lowering')})")
    for field in ("forward_format", "backward_format"):
      fmt = getattr(self, field)
      if self.scaling == "nvfp4" and fmt != "e2m1":
        raise _bad(f"{path}.{field}", fmt, f"e2m1 with {path}.scaling='nvfp4'")
      if self.scaling != "nvfp4" and fmt == "e2m1":
        raise _bad(f"{path}.{field}", fmt, f"e4m3 or e5m2 with {path}.scaling="
                   f"{self.scaling!r} (e2m1 only with {path}.scaling='nvfp4': its E4M3 "
                   "block scales and f32 tensor scale)")

  @property
  def block_size(self) -> int | None:
    """The microscaled block length (`micro_block`, or the format's: mxfp8 32, nvfp4 16);
    None for the other scalings."""
    if self.scaling not in MICRO_SCALINGS:
      return None
    return self.micro_block if self.micro_block is not None else MICRO_BLOCKS[self.scaling]

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict of every field (tuples as lists); the microscaled fields only when
    they differ from their defaults (the dict of every other config is unchanged)."""
    defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in _FP8_ADDED}
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()
            if k not in defaults or v != defaults[k]}

  @classmethod
  def from_dict(cls, d: dict[str, Any], *, path: str = "fp8") -> Fp8Config:
    """Schema-strict inverse of `to_dict`: exactly its fields, each validated
    (`keep_first_last` may be absent, in dicts written before it existed: True; the
    microscaled fields may be absent: their defaults).

    Raises:
      ValueError: naming the field path (e.g. ``fp8.keep_high_precision[0]``), the value
        and what is accepted.
    """
    return _config_from_dict(cls, d, path, added=("keep_first_last",) + _FP8_ADDED)


# Fp8Config fields written only when not at their default (see Fp8Config.to_dict).
_FP8_ADDED = ("micro_block", "scale_rounding", "stochastic_gradients", "hadamard_wgrad",
              "seed", "micro_gemm", "weight_block_2d")


def _is_e2m1(value: Any) -> bool:
  try:
    return np.dtype(value) == np.dtype(ml_dtypes.float4_e2m1fn)
  except TypeError:
    return False


@dataclasses.dataclass(frozen=True)
class SpikeGuardConfig:
  """Loss-spike skipping (`precision.optim.spike_guard`): the settings a Recipe turns on.

  A step is skipped when the z-score of its loss or of its global grad norm, against the
  last `window` accepted steps, exceeds `threshold` (one-sided: only increases count);
  no z-score is computed before `min_history` values are in the window (None: the
  smaller of 20 and `window`), and after `max_consecutive` spike skips in a row the next
  step is applied whatever its z-scores and enters the window (0: never skip, only
  measure). `window` in [2, 65536], `threshold` a finite number > 0 (checked as f32),
  `max_consecutive` in [0, 2**31 - 1], `min_history` None or in [2, window].

  Examples:
    >>> SpikeGuardConfig(window=200, threshold=5.0)
    >>> get_recipe("bf16_master").replace(name="bf16_sg", spike_guard=SpikeGuardConfig())
  """

  window: int = 100
  threshold: float = 6.0
  max_consecutive: int = 10
  min_history: int | None = None

  def __post_init__(self):
    self._validate("spike_guard")

  def _validate(self, path: str) -> None:
    _set(self, "window", _check_int(f"{path}.window", self.window, 2, 65536))
    _set(self, "threshold", _check_f32(
        f"{path}.threshold", self.threshold, lo=0.0, hi=_F32_MAX, lo_open=True,
        what="a finite number > 0 (checked as f32), e.g. 6.0"))
    _set(self, "max_consecutive", _check_int(f"{path}.max_consecutive",
                                             self.max_consecutive, 0, _INT32_MAX))
    if self.min_history is not None:
      if isinstance(self.min_history, (bool, np.bool_)) or not isinstance(
          self.min_history, numbers.Integral) or not 2 <= int(self.min_history) <= self.window:
        raise _bad(f"{path}.min_history", self.min_history,
                   f"None (min(20, window)) or an integer in [2, {path}.window={self.window}]")
      _set(self, "min_history", int(self.min_history))

  @property
  def history(self) -> int:
    """The number of window values before the first z-score (`min_history` resolved)."""
    return min(20, self.window) if self.min_history is None else self.min_history

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict of every field (`min_history` null when unset)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any], *, path: str = "spike_guard") -> SpikeGuardConfig:
    """Schema-strict inverse of `to_dict`: exactly its fields, each validated.

    Raises:
      ValueError: naming the field path (e.g. ``spike_guard.window``), the value and what
        is accepted.
    """
    return _config_from_dict(cls, d, path)


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The whole training precision recipe.

  Fields: `name`; `policy` (param/compute/output dtypes, each f32, bf16 or f16);
  `master_dtype` (None or f32, wider than the params); `mu_dtype` / `nu_dtype` (Adam moment
  storage) and `reduce_dtype` (cross-device gradient reduction), each f32, bf16 or f16;
  `rounding` (nearest | stochastic | kahan); `loss_scale`; `fp8` (None or Fp8Config);
  `fp32_ops` (op names kept in f32); `allow_f16_without_loss_scale`; `fused` (the update
  is AdamW + stochastic rounding in one fused pass, `precision.optim.fused_adamw`: only
  with ``rounding="stochastic"``, 16-bit params, f32 moments and no master or an f32 one);
  `spike_guard` (None or SpikeGuardConfig: loss-spike skipping around the optimizer,
  `precision.optim.spike_guard`).

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
  fused: bool = False
  spike_guard: SpikeGuardConfig | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.strip():
      raise _bad("name", self.name, "a non-empty string")
    if not isinstance(self.policy, (str, Policy)):
      raise _bad("policy", self.policy, "a policy string such as 'p=f32,c=bf16,o=f32'")
    # get_policy's ValueError names the policy ("policy='p=f33': ...").
    _set(self, "policy", get_policy(self.policy))
    for part in ("param_dtype", "compute_dtype", "output_dtype"):
      dt = getattr(self.policy, part)
      if dtype_name(dt) not in STORAGE_DTYPES:
        raise ValueError(f"policy={str(self.policy)!r}: its {part} is {dtype_name(dt)}; "
                         f"accepted: {', '.join(STORAGE_DTYPES)} (fp8 GEMMs: set fp8)")
    for field in ("mu_dtype", "nu_dtype", "reduce_dtype"):
      _set(self, field, _check_dtype(field, getattr(self, field), STORAGE_DTYPES))
    if self.master_dtype is not None:
      try:
        _set(self, "master_dtype", _check_dtype("master_dtype", self.master_dtype,
                                                STORAGE_DTYPES))
      except ValueError as e:
        raise _bad("master_dtype", self.master_dtype,
                   "None (no master copy) or " + ", ".join(MASTER_DTYPES)) from e
    if isinstance(self.loss_scale, dict):
      _set(self, "loss_scale", _config_from_kwargs(LossScaleConfig, self.loss_scale,
                                                   "loss_scale"))
    if not isinstance(self.loss_scale, LossScaleConfig):
      raise _bad("loss_scale", self.loss_scale, "a LossScaleConfig or its dict")
    if isinstance(self.fp8, dict):
      _set(self, "fp8", _config_from_kwargs(Fp8Config, self.fp8, "fp8"))
    if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
      raise _bad("fp8", self.fp8, "None, an Fp8Config or its dict")
    if isinstance(self.spike_guard, dict):
      _set(self, "spike_guard", _config_from_kwargs(SpikeGuardConfig, self.spike_guard,
                                                    "spike_guard"))
    if self.spike_guard is not None and not isinstance(self.spike_guard, SpikeGuardConfig):
      raise _bad("spike_guard", self.spike_guard, "None, a SpikeGuardConfig or its dict")
    # The list's shape here (a list of distinct non-empty strings, never a bare string);
    # which names exist, in precision._fp32_ops (each name maps to JAX primitives).
    _set(self, "fp32_ops", check_names(_check_names("fp32_ops", self.fp32_ops, "op names"),
                                       "fp32_ops"))
    _set(self, "allow_f16_without_loss_scale", _check_bool(
        "allow_f16_without_loss_scale", self.allow_f16_without_loss_scale))
    _check_choice("rounding", self.rounding, ROUNDINGS)
    _set(self, "fused", _check_bool("fused", self.fused))
    param = self.policy.param_dtype
    if self.master_dtype is not None:
      if self.master_dtype.itemsize <= param.itemsize:
        raise ValueError(
            f"master_dtype={dtype_name(self.master_dtype)} must be wider than the param "
            f"dtype {dtype_name(param)} of policy={str(self.policy)!r}; use "
            "master_dtype=None to train params directly")
      if dtype_name(self.master_dtype) not in MASTER_DTYPES:
        raise _bad("master_dtype", dtype_name(self.master_dtype),
                   "None (no master copy) or " + ", ".join(MASTER_DTYPES))
      if self.rounding == "kahan":
        raise ValueError(
            "rounding='kahan' compensates bf16 params without a master copy; with "
            f"master_dtype={dtype_name(self.master_dtype)} use 'nearest' or 'stochastic'")
    if self.rounding in ("stochastic", "kahan") and param == _F32 and self.master_dtype is None:
      raise ValueError(
          f"rounding={self.rounding!r} only matters for 16-bit params; this recipe's "
          f"policy={str(self.policy)!r} has {dtype_name(param)} params and master_dtype=None")
    uses_f16 = parse_dtype("f16") in (param, self.policy.compute_dtype)
    if uses_f16 and self.loss_scale.kind == "none" and not self.allow_f16_without_loss_scale:
      raise ValueError(
          f"Recipe {self.name!r} computes in f16 without loss scaling (policy="
          f"{str(self.policy)!r}, loss_scale.kind='none'): small gradients underflow f16 "
          "(smallest subnormal 6e-8). Set loss_scale=LossScaleConfig(kind='dynamic') or "
          "allow_f16_without_loss_scale=True.")
    if self.fused:
      self._check_fused()

  def _check_fused(self) -> None:
    """`fused` computes one update: AdamW with f32 moments, rounded stochastically into
    16-bit params, from the params themselves or an f32 master (`FusedAdamW`)."""
    wrong = []
    if self.rounding != "stochastic":
      wrong.append(f"rounding={self.rounding!r}")
    if self.policy.param_dtype not in _SIXTEEN_BIT:
      wrong.append(f"param dtype {dtype_name(self.policy.param_dtype)}")
    for field in ("mu_dtype", "nu_dtype"):
      if getattr(self, field) != _F32:
        wrong.append(f"{field}={dtype_name(getattr(self, field))}")
    if wrong:
      raise ValueError(
          f"fused=True with {', '.join(wrong)}: the fused AdamW kernel rounds "
          "stochastically into bf16/f16 params and keeps f32 moments; accepted: "
          "fused=True with rounding='stochastic', a bf16 or f16 param dtype, "
          "mu_dtype=nu_dtype=f32 (e.g. get_recipe('bf16_sr').replace(fused=True)), "
          "or fused=False")

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
    if self.fused:
      text = text[:-1] + "; fused AdamW + stochastic rounding kernel."
    if self.spike_guard is not None:
      sg = self.spike_guard
      text = text[:-1] + (f"; loss-spike steps skipped (z > {sg.threshold:g} over the last "
                          f"{sg.window} steps, at most {sg.max_consecutive} in a row).")
    if self.swamping_risk:
      text += (" WARNING: swamping: 16-bit params with nearest rounding and no master copy "
               "lose updates smaller than half an ulp (bf16: 1.0 + 1e-5 == 1.0).")
    return text

  def replace(self, **changes) -> Recipe:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    """JSON-safe dict; ``Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r``.

    "fused" is written only when True and "spike_guard" only when set: the dict of every
    recipe without them is the one written before the fields existed (checkpoints and
    study identities compare these dicts).
    """
    d = {
        "schema": SCHEMA_VERSION,
        "name": self.name,
        "policy": str(self.policy),
        "master_dtype": None if self.master_dtype is None else dtype_name(self.master_dtype),
        "mu_dtype": dtype_name(self.mu_dtype),
        "nu_dtype": dtype_name(self.nu_dtype),
        "rounding": self.rounding,
        "loss_scale": self.loss_scale.to_dict(),
        "reduce_dtype": dtype_name(self.reduce_dtype),
        "fp8": None if self.fp8 is None else self.fp8.to_dict(),
        "fp32_ops": list(self.fp32_ops),
        "allow_f16_without_loss_scale": self.allow_f16_without_loss_scale,
    }
    if self.fused:
      d["fused"] = True
    if self.spike_guard is not None:
      d["spike_guard"] = self.spike_guard.to_dict()
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Recipe:
    """Schema-strict inverse of `to_dict`.

    The dict must hold exactly the fields `to_dict` writes (nested `loss_scale` and `fp8`
    dicts included): a missing field is an error, never a silent default. Types are exact
    (a string where a list belongs, an int where a bool belongs, 2000.0 for an integer and
    None for a dtype are refused), numbers finite and in range, scales finite non-zero f32.
    The "schema" key is the layout version: 1, or absent in dicts written before it
    existed (those hold the same fields). "fused" is optional: absent reads as False;
    so is "spike_guard": absent (or null) reads as None, a dict must hold exactly the
    fields of SpikeGuardConfig.

    Raises:
      ValueError: naming the field path (``fp8.margin``, ``fp32_ops[2]``), the value and
        what is accepted.

    Examples:
      >>> Recipe.from_dict(json.load(open("recipe.json")))
    """
    _check_keys("", d, cls, optional=("schema", "fused", "spike_guard"))
    if "schema" in d and (type(d["schema"]) is not int or d["schema"] != SCHEMA_VERSION):
      raise _bad("schema", d["schema"], f"{SCHEMA_VERSION} (this version's layout), or absent")
    if not isinstance(d["policy"], str):
      raise _bad("policy", d["policy"], "a policy string such as 'p=f32,c=bf16,o=f32'")
    for field in ("mu_dtype", "nu_dtype", "reduce_dtype"):
      if not isinstance(d[field], str):
        raise _bad(field, d[field], ", ".join(STORAGE_DTYPES))
    if d["master_dtype"] is not None and not isinstance(d["master_dtype"], str):
      raise _bad("master_dtype", d["master_dtype"], "null or " + ", ".join(MASTER_DTYPES))
    loss_scale = LossScaleConfig.from_dict(d["loss_scale"])
    fp8 = None if d["fp8"] is None else Fp8Config.from_dict(d["fp8"])
    spike = d.get("spike_guard")
    spike = None if spike is None else SpikeGuardConfig.from_dict(spike)
    kwargs = {k: v for k, v in d.items()
              if k not in ("schema", "loss_scale", "fp8", "spike_guard")}
    return cls(loss_scale=loss_scale, fp8=fp8, spike_guard=spike, **kwargs)


def with_fp8_keeps(recipe: Recipe, patterns: tuple[str, ...]) -> Recipe:
  """`recipe` whose fp8 config also keeps the GEMMs of module path `patterns` (fnmatch) in
  the compute dtype (after its own `keep_high_precision`, repeats dropped); `recipe`
  itself without fp8 or without patterns."""
  if recipe.fp8 is None or not patterns:
    return recipe
  keep = tuple(dict.fromkeys(recipe.fp8.keep_high_precision + tuple(patterns)))
  return recipe.replace(fp8=dataclasses.replace(recipe.fp8, keep_high_precision=keep))


def with_growth_interval(recipe: Recipe, growth: int | None) -> Recipe:
  """`recipe` whose dynamic loss scale grows after `growth` finite steps; `recipe` itself
  when `growth` is None or its loss scale is not dynamic."""
  if growth is None or recipe.loss_scale.kind != "dynamic":
    return recipe
  return recipe.replace(loss_scale=dataclasses.replace(recipe.loss_scale,
                                                       growth_interval=growth))


def _config_from_kwargs(cls: type, d: dict[str, Any], path: str) -> Any:
  """A LossScaleConfig / Fp8Config / SpikeGuardConfig from a partial dict of keyword
  arguments (constructor convenience: missing fields take their defaults; unknown ones
  are an error)."""
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = sorted(str(k) for k in set(d) - set(fields))
  if unknown:
    raise ValueError(f"{path}: unknown field(s) {', '.join(f'{path}.{k}' for k in unknown)}; "
                     f"accepted: {', '.join(fields)}")
  obj = cls.__new__(cls)
  for f in dataclasses.fields(cls):
    _set(obj, f.name, d.get(f.name, f.default))
  obj._validate(path)  # pylint: disable=protected-access
  return obj


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
      # E4M3 for every tensor, gradients included, with round-up E8M0 scales (Mishra et
      # al. 2025, "Recipes for Pre-training LLMs with MXFP8").
      Recipe("mxfp8", "p=f32,c=bf16,o=f32",
             fp8=Fp8Config(scaling="mxfp8", backward_format="e4m3")),
      # NVIDIA's NVFP4 recipe: E2M1 everywhere, stochastic rounding of gradients, a random
      # Hadamard transform on the weight-gradient GEMM, 16x16 weight tiles (the forward
      # and dgrad GEMMs multiply the same quantised weight).
      Recipe("nvfp4", "p=f32,c=bf16,o=f32",
             fp8=Fp8Config(scaling="nvfp4", forward_format="e2m1", backward_format="e2m1",
                           stochastic_gradients=True, hadamard_wgrad=True,
                           weight_block_2d=True)),
  )}


# Read-only: a preset is what every checkpoint, sweep and report means by its name; a
# variant is a new Recipe (`get_recipe("bf16_mixed").replace(name=..., ...)`).
PRESETS: Mapping[str, Recipe] = types.MappingProxyType(_presets())


def get_recipe(name: str | Recipe) -> Recipe:
  """A preset recipe by name (a Recipe passes through).

  Presets: fp32, bf16_mixed, bf16_master, bf16_sr, bf16_kahan, pure_bf16, f16_mixed,
  fp8_hybrid, mxfp8, nvfp4.
  """
  if isinstance(name, Recipe):
    return name
  if not isinstance(name, str) or name not in PRESETS:
    raise ValueError(f"Unknown recipe {name!r}; accepted: a Recipe or a preset name: "
                     f"{', '.join(PRESETS)}")
  return PRESETS[name]
