"""The GEMMs of a program as lowered for a platform (StableHLO), and a recipe check on them.

`precision.audit` reads the jaxpr, before XLA's platform-specific lowering. This module
reads what a platform is actually handed: ``jax.export.export(jax.jit(fn),
platforms=[platform])`` lowers the whole program for that platform on any machine (a
CPU-only one included), and its StableHLO text names every ``stablehlo.dot_general`` and
``stablehlo.convolution`` with its operand and result element types. Branches that
`jax.lax.platform_dependent` keeps for other platforms (the f32-upcast CPU branch of the
policy GEMMs, the interpret-mode Pallas kernels) are not in a single-platform lowering,
so the dtypes read are those the chosen platform runs.

Examples:
  >>> from precision.audit import lower
  >>> prog = lower(train_step, params, batch, platform="cuda")
  >>> prog.gemm_signatures()        # Counter({('bf16', 'bf16', 'f32'): 45})
  >>> prog.check("bf16_mixed")      # raises PrecisionViolation listing offending GEMMs

Size: the StableHLO reader (dot_general/convolution types, custom calls) and the recipe
check on it share one parser; split, each half would re-derive it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import ml_dtypes
import numpy as np

from precision._policy import dtype_name
from precision._plan import GemmDtypes, Plan, as_plan
from precision._recipe import Recipe
from precision.audit._report import PrecisionViolation

_F32 = np.dtype(np.float32)
# The name JAX gives the forward computation remat re-runs in the backward pass.
_RECOMPUTED = "rematted_computation"

# StableHLO element type -> NumPy dtype.
_ELEMENT_TYPES: dict[str, np.dtype] = {
    "f64": np.dtype(np.float64),
    "f32": _F32,
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f8E4M3FN": np.dtype(ml_dtypes.float8_e4m3fn),
    "f8E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "f8E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "f8E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "f8E4M3B11FNUZ": np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    "f8E8M0FNU": np.dtype(ml_dtypes.float8_e8m0fnu),
    "f4E2M1FN": np.dtype(ml_dtypes.float4_e2m1fn),
    "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32),
    "i16": np.dtype(np.int16),
    "i8": np.dtype(np.int8),
    "ui64": np.dtype(np.uint64),
    "ui32": np.dtype(np.uint32),
    "ui16": np.dtype(np.uint16),
    "ui8": np.dtype(np.uint8),
}

# `tensor<2x15x64xbf16>`: the body, one level of nested <...> allowed (`complex<f32>`, an
# encoding after a comma as in `tensor<?x4xf32, #stablehlo.bounds<...>>`).
_TENSOR = r"tensor<((?:[^<>]|<[^<>]*>)*)>"
_DIMS = re.compile(r"^((?:(?:\d+|\?)x)*)(.+)$")
_GEMM = re.compile(
    r"stablehlo\.(dot_general|convolution)\b.*:\s*\(\s*" + _TENSOR + r"\s*,\s*" + _TENSOR
    + r"\s*\)\s*->\s*" + _TENSOR + r"(?:\s*loc\((.*)\))?\s*$")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s+@([\w$.\-]+)")
_CUSTOM_CALL_GENERIC = re.compile(r'"stablehlo\.custom_call".*call_target_name\s*=\s*"([^"]+)"')
_LOC_ALIAS = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$", re.M)
_NAME_LOC = re.compile(r'^"((?:[^"\\]|\\.)*)"')
_CALLSITE = re.compile(r"^callsite\((#loc\d*|.*?) at ")
_SYMBOL = r'@("(?:[^"\\]|\\.)*"|[\w$.\-]+)'   # @name or @"<lambda>"
_FUNC = re.compile(r"^\s*func\.func\s+(public|private)\s+" + _SYMBOL + r"\(")
# A call of a function of the module (`func.call @f(...)` / `call @f(...)`), not a
# `stablehlo.custom_call @target`.
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call\s+" + _SYMBOL + r"\(")
_TRAILING_LOC = re.compile(r"\bloc\((.*)\)\s*$")
# `jax.nn.scaled_matmul`'s custom call on CUDA: (lhs [B, M, K], rhs [B, N, K], lhs scales
# [B, M, K / block], rhs scales [B, N, K / block]) -> [B, M, N].
BLOCK_SCALED_DOT = "__op$block_scaled_dot"


class LoweredGemm(NamedTuple):
  """One `stablehlo.dot_general` or `stablehlo.convolution` of a lowered program.

  Attributes:
    op: "dot_general" or "convolution".
    lhs_dtype, rhs_dtype: the operands' element types (NumPy dtype names: "bfloat16",
      "float8_e4m3fn", "float32", ...).
    out_dtype: the result's element type: where the platform's GEMM accumulates (the
      f32 of ``preferred_element_type=float32``) or what it rounds to.
    shape: "bf16[2,15,64] x bf16[64,192] -> f32[2,15,192]".
    name: the op's JAX name stack as the lowering records it, e.g.
      "jit(step)/transpose(jvp(lm_head))/dot_general"; "" when the module has no
      locations.
    lhs_scale_dtype, rhs_scale_dtype, block: for a block-scaled GEMM (op
      "block_scaled_dot", the custom call `jax.nn.scaled_matmul` lowers to on CUDA) the
      block scales' element types ("float8_e8m0fnu", "float8_e4m3fn") and the block
      length along the contraction (K over the scales' last dimension); "", "" and 0
      for the other GEMMs.
  """

  op: str
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str
  shape: str
  name: str
  lhs_scale_dtype: str = ""
  rhs_scale_dtype: str = ""
  block: int = 0

  @property
  def direction(self) -> str:
    """"bwd" for a GEMM JAX emitted while transposing (the backward pass: its name stack
    holds "transpose("), else "fwd"; a forward GEMM that remat (`jax.checkpoint`)
    recomputes in the backward pass ("rematted_computation" in its name) is "fwd": it
    computes what the forward GEMM did, on the same operands. Needs the module's
    locations (`jax.export` and `lower` keep them); without a name every GEMM reads as
    "fwd"."""
    if "transpose(" not in self.name or _RECOMPUTED in self.name:
      return "fwd"
    return "bwd"

  @property
  def is_fp8(self) -> bool:
    return self.lhs_dtype.startswith("float8") or self.rhs_dtype.startswith("float8")

  def signature(self) -> tuple[str, str, str]:
    """(lhs, rhs, out) short dtype names, e.g. ("bf16", "bf16", "f32")."""
    return _short(self.lhs_dtype), _short(self.rhs_dtype), _short(self.out_dtype)


def _short(name: str) -> str:
  try:
    return dtype_name(name)
  except (ValueError, KeyError, TypeError):
    return name


def _tensor(spec: str) -> tuple[str, str]:
  """"2x15x64xbf16" -> ("bfloat16", "bf16[2,15,64]"); dynamic dims print as "?"."""
  depth, end = 0, len(spec)
  for i, ch in enumerate(spec):  # the type ends at the first comma outside <...>
    depth += (ch == "<") - (ch == ">")
    if ch == "," and depth == 0:
      end = i
      break
  m = _DIMS.match(spec[:end].strip())
  dims = [d for d in m.group(1).split("x") if d]
  element = m.group(2).strip()
  dt = _ELEMENT_TYPES.get(element)
  name = dt.name if dt is not None else element
  return name, f"{_short(name)}[{','.join(dims)}]"


def _loc_names(text: str) -> dict[str, str]:
  """{"#locN": the innermost op name it stands for} from the module's location aliases."""
  aliases = {k: v.strip() for k, v in _LOC_ALIAS.findall(text)}
  names: dict[str, str] = {}

  def resolve(body: str, depth: int = 0) -> str:
    if depth > 64:
      return ""
    body = body.strip()
    if body.startswith("#loc"):
      ref = body.split()[0].rstrip(")")
      if ref in names:
        return names[ref]
      out = resolve(aliases.get(ref, ""), depth + 1)
      names[ref] = out
      return out
    m = _NAME_LOC.match(body)
    if m:  # NameLoc: "name"(child); a FileLineColLoc "file":l:c is no name
      rest = body[m.end():]
      return m.group(1) if rest.startswith("(") or not rest else ""
    m = _CALLSITE.match(body)
    if m:  # callsite(callee at caller): the callee carries the op's name
      return resolve(m.group(1), depth + 1)
    return ""

  for ref in aliases:
    resolve(ref)
  return names


def stablehlo_text(module: Any) -> str:
  """The StableHLO text of a `jax.export.Exported`, a `jax.stages.Lowered` or a str."""
  if isinstance(module, str):
    return module
  if isinstance(module, jax.export.Exported):
    return module.mlir_module()
  if hasattr(module, "as_text"):  # jax.stages.Lowered
    return module.as_text(debug_info=True)
  raise ValueError(f"Expected StableHLO text, a jax.export.Exported or a jax.stages.Lowered; "
                   f"got {type(module).__name__}")


def _op_name(loc: str | None, names: dict[str, str]) -> str:
  """The JAX name stack an op's trailing `loc(...)` records ("" when none)."""
  if not loc:
    return ""
  loc = loc.strip()
  name = names.get(loc.split()[0], "") if loc.startswith("#loc") else ""
  if not name:
    nm = _NAME_LOC.match(loc)
    name = nm.group(1) if nm else ""
  return name


def _call_contexts(text: str, names: dict[str, str]) -> tuple[list[tuple[str, str]],
                                                               dict[str, list[str]]]:
  """(the module's lines, each with the function it sits in; {function: the name stacks
  of the call sites it is reached through, from the public entry point}).

  JAX outlines jitted sub-functions (a `jax.jit` or `closed_call` inside the traced
  program, the body of a scan under autocast) as private functions; the names of their
  ops are relative to the function, so the name of the call op that reaches them (say
  "jit(step)/transpose(jvp(while))/body/closed_call") is their context: whether they run
  in the forward or the backward pass. A function reached through several call sites
  has one context per call site (the forward and the backward pass may call one cached
  function)."""
  lines, calls = [], collections.defaultdict(list)
  func, public = "", []
  for line in text.splitlines():
    m = _FUNC.match(line)
    if m:
      func = m.group(2)
      if m.group(1) == "public":
        public.append(func)
    lines.append((func, line))
    for callee in _CALL.findall(line):
      loc = _TRAILING_LOC.search(line)
      calls[func].append((callee, _op_name(loc.group(1) if loc else None, names)))
  contexts: dict[str, list[str]] = {f: [""] for f in public}
  todo = list(public)
  while todo:  # JAX's modules have no recursion; the guard bounds a pathological text
    f = todo.pop()
    for callee, name in calls.get(f, ()):
      if callee == f or len(contexts.get(callee, ())) > 4096:
        continue
      contexts.setdefault(callee, []).extend(
          "/".join(p for p in (ctx, name) if p) for ctx in contexts[f])
      todo.append(callee)
  return lines, contexts


def lowered_gemms(module: Any) -> tuple[LoweredGemm, ...]:
  """Every dot_general and convolution of a lowered module, in program order.

  Args:
    module: StableHLO text, a `jax.export.Exported` or a `jax.stages.Lowered`.

  Returns:
    One `LoweredGemm` per op occurrence in the text and call site: an op inside a private
    function (a jitted sub-function JAX outlined) is listed once for each call site that
    reaches it from the entry point, its name prefixed with the call site's name, so that
    its direction is that of the pass calling it (a function called once from a loop body
    is listed once however often the loop runs).

  Raises:
    ValueError: a GEMM line whose types cannot be read (the message quotes it), or a
      `module` of another type.

  Examples:
    >>> exp = jax.export.export(jax.jit(f), platforms=["cuda"])(x, w)
    >>> [g.signature() for g in lowered_gemms(exp)]   # [("bf16", "bf16", "f32")]
  """
  text = stablehlo_text(module)
  names = _loc_names(text)
  lines, contexts = _call_contexts(text, names)
  out = []
  for func, line in lines:
    if BLOCK_SCALED_DOT in line:
      g = _block_scaled_gemm(line, names)
      if g is not None:
        out.extend(g._replace(name="/".join(p for p in (ctx, g.name) if p))
                   for ctx in contexts.get(func, [""]))
        continue
    if "stablehlo.dot_general" not in line and "stablehlo.convolution" not in line:
      continue
    m = _GEMM.search(line)
    if m is None:
      raise ValueError(f"Cannot read the operand/result types of this GEMM: {line.strip()}")
    op, lhs, rhs, res, loc = m.groups()
    (lt, ls), (rt, rs), (ot, os_) = _tensor(lhs), _tensor(rhs), _tensor(res)
    name = _op_name(loc, names)
    for ctx in contexts.get(func, [""]):
      out.append(LoweredGemm(op, lt, rt, ot, f"{ls} x {rs} -> {os_}",
                             "/".join(p for p in (ctx, name) if p)))
  return tuple(out)


def _block_scaled_gemm(line: str, names: dict[str, str]) -> LoweredGemm | None:
  """The block-scaled GEMM of a `__op$block_scaled_dot` custom-call line (None for a line
  that only mentions the name)."""
  m = _CUSTOM_CALL.search(line) or _CUSTOM_CALL_GENERIC.search(line)
  if m is None or m.group(1) != BLOCK_SCALED_DOT:
    return None
  if " : (" not in line:
    raise ValueError(f"Cannot read the operand/result types of this GEMM: {line.strip()}")
  ops, _, res = line.rsplit(" : (", 1)[1].partition(") -> ")
  loc = _TRAILING_LOC.search(res)
  operands = re.findall(_TENSOR, ops)
  results = re.findall(_TENSOR, res.split(" loc(")[0])
  if len(operands) != 4 or len(results) != 1:
    raise ValueError(f"Cannot read the operand/result types of this GEMM: {line.strip()}")
  (lt, ls), (rt, rs), (lst, _), (rst, _) = (_tensor(t) for t in operands)
  ot, os_ = _tensor(results[0])
  k, kb = _dims(operands[0])[-1], _dims(operands[2])[-1]
  block = k // kb if k and kb and k % kb == 0 else 0
  return LoweredGemm("block_scaled_dot", lt, rt, ot, f"{ls} x {rs} -> {os_}",
                     _op_name(loc.group(1) if loc else None, names), lst, rst, block)


def _dims(spec: str) -> list[int]:
  """The static dimensions of a tensor type body ("1x32x64xf32" -> [1, 32, 64]; a
  dynamic one reads as 0)."""
  m = _DIMS.match(spec.split(",")[0].strip())
  return [int(d) if d.isdigit() else 0 for d in m.group(1).split("x") if d]


class LoweredCustomCall(NamedTuple):
  """One `stablehlo.custom_call` of a lowered program (a compiled Pallas kernel is one).

  Attributes:
    target: the call target, e.g. `precision.rounding.TRITON_CUSTOM_CALL`.
    name: the kernel's name where the call carries one (a Pallas kernel's ``name=``, e.g.
      "stochastic_round_bf16"), else "".
    operands, results: "dtype[dims]" strings of the operand and result tensors, e.g.
      ("uint32[4]", "f32[3000]") and ("uint16[3000]",).
  """

  target: str
  name: str
  operands: tuple[str, ...]
  results: tuple[str, ...]


_KERNEL_NAME = re.compile(r'\bname = "([\w.$-]+)"')


def custom_calls(module: Any) -> tuple[LoweredCustomCall, ...]:
  """Every custom call of a lowered module, in program order (a call inside a function
  that is called several times is listed once).

  Args:
    module: StableHLO text, a `jax.export.Exported` or a `jax.stages.Lowered`.
  """
  out = []
  for line in stablehlo_text(module).splitlines():
    m = _CUSTOM_CALL.search(line) or _CUSTOM_CALL_GENERIC.search(line)
    if m is None:
      continue
    name = _KERNEL_NAME.findall(line)
    operands, results = (), ()
    if " : (" in line:
      sig = line.rsplit(" : (", 1)[1]
      ops, _, res = sig.partition(") -> ")
      res = res.split(" loc(")[0]
      operands = tuple(_tensor(t)[1] for t in re.findall(_TENSOR, ops))
      results = tuple(_tensor(t)[1] for t in re.findall(_TENSOR, res))
    out.append(LoweredCustomCall(m.group(1), name[-1] if name else "", operands, results))
  return tuple(out)


def custom_call_targets(module: Any) -> dict[str, int]:
  """{custom-call target: occurrences in the text} of a lowered module, e.g. the
  compiled Pallas kernels (`precision.rounding.TRITON_CUSTOM_CALL` on a GPU)."""
  return dict(collections.Counter(c.target for c in custom_calls(module)))


def gemm_violations(gemms: Sequence[LoweredGemm], recipe: Recipe | str | Plan,
                    platform: str | None = None) -> list[str]:
  """What in `gemms` (from one lowering) contradicts `recipe`; empty when it follows it.

  The rules (the mixed-precision GEMM contract of every preset):
    * every GEMM's result is float32: accumulation in f32 (for an f32 compute dtype,
      f32 x f32 -> f32);
    * a GEMM without fp8 operands takes both operands in the recipe's compute dtype;
    * with ``recipe.fp8``: at least one forward and one backward fp8 GEMM; a forward fp8
      GEMM takes both operands in `fp8.forward_format` (E4M3); a backward one (JAX's
      transpose, see `LoweredGemm.direction`) takes the gradient in
      `fp8.backward_format` (E5M2) and the saved operand in the forward format. GEMMs of
      layers the fp8 config keeps in high precision are ordinary compute-dtype GEMMs.
    * a recipe without fp8 has no fp8 GEMM.
    * microscaled recipes (fp8.scaling mxfp8 / nvfp4): the GEMMs named in the
      microscaled scope ("mxfp8_gemm", "nvfp4_gemm"), at least one forward and one
      backward, are either the emulation on dequantised values (f32 x f32 -> f32) or
      block-scaled GEMMs (`fp8.micro_gemm` "block_scaled": the custom call
      ``__op$block_scaled_dot``) whose elements are in the recipe's formats (forward:
      both in `forward_format`; backward: the gradient in `backward_format`, the saved
      operand in `forward_format`; E2M1 under nvfp4), whose scales are E8M0 (mxfp8) or
      E4M3 (nvfp4) and whose block, read from the scale shapes, is `fp8.block_size`; the
      other GEMMs follow the compute-dtype rule, and no other GEMM has fp8 operands or is
      block-scaled. With ``fp8.micro_gemm="emulated"`` no GEMM is block-scaled; with
      "block_scaled" and `platform` "cuda" no microscaled GEMM is the f32 emulation
      ("auto" takes either: it depends on the machine that traces).

  Args:
    gemms: `lowered_gemms(...)` of a program lowered for one platform.
    recipe: a Recipe, a preset name or a Plan. A lowered program has no module scopes:
      the compute dtypes of a plan's overrides are accepted at any GEMM.
    platform: the platform `gemms` were lowered for (None: not known; the lowering
      choice of `fp8.micro_gemm` is then checked only where it holds on every platform).

  Returns:
    One line per offending GEMM (signature, shape, name) plus a line per missing fp8
    direction.
  """
  want8 = as_plan(recipe).gemms  # the GEMM dtypes bind decided for the recipe
  name, compute, fwd8, bwd8, allowed = (want8.recipe_name, want8.compute, want8.fwd8,
                                        want8.bwd8, want8.allowed)
  found = []
  n_fp8 = collections.Counter()
  micro = want8.micro is not None
  marker = f"{want8.micro}_gemm" if micro else None  # precision.fp8._microdot
  lowering = want8.micro_gemm
  for g in gemms:
    sig = " x ".join(g.signature()[:2]) + " -> " + g.signature()[2]
    where = f"{g.direction} {g.op} {g.shape} [{g.name or '?'}]"
    if g.out_dtype != _F32.name:
      found.append(f"GEMM result {_short(g.out_dtype)} (accumulation below f32 or a result "
                   f"not from an f32 accumulator): {sig}: {where}")
    in_scope = micro and re.search(rf"(^|[/(]){marker}([/)]|$)", g.name)
    if g.op == "block_scaled_dot":
      if in_scope:
        n_fp8[g.direction] += 1
        found.extend(f"{bad}: {where}" for bad in _block_scaled_violations(g, want8))
        if lowering == "emulated":
          found.append(f"block-scaled GEMM {sig} with fp8.micro_gemm='emulated' (recipe "
                       f"{name}): {where}")
      else:
        found.append(f"block-scaled GEMM {sig} outside the microscaled GEMMs of recipe "
                     f"{name}: {where}")
      continue
    if in_scope:
      n_fp8[g.direction] += 1
      if lowering == "block_scaled" and platform == "cuda":
        found.append(f"{want8.micro} GEMM {sig} emulated in f32 with "
                     f"fp8.micro_gemm='block_scaled' on cuda (recipe {name}), "
                     f"expected a block-scaled GEMM: {where}")
      if (g.lhs_dtype, g.rhs_dtype) != (_F32.name, _F32.name):
        found.append(f"{want8.micro} GEMM operands {sig}, expected the dequantised "
                     f"f32 x f32 of the emulation (recipe {name}): {where}")
      continue
    if not g.is_fp8:
      if g.lhs_dtype not in allowed or g.rhs_dtype not in allowed:
        found.append(f"GEMM operands {sig}, expected {_short(compute)} x {_short(compute)} "
                     f"(recipe {name}): {where}")
      continue
    if fwd8 is None:
      found.append(f"fp8 GEMM {sig} in recipe {name}, which has no fp8: {where}")
      continue
    n_fp8[g.direction] += 1
    if g.direction == "fwd":
      want = (fwd8, fwd8)
    else:
      want = tuple(sorted((bwd8, fwd8)))
    got = (g.lhs_dtype, g.rhs_dtype) if g.direction == "fwd" else tuple(
        sorted((g.lhs_dtype, g.rhs_dtype)))
    if got != want:
      found.append(f"fp8 {g.direction} GEMM operands {sig}, expected "
                   f"{' x '.join(_short(w) for w in want)} (recipe {name}): {where}")
  if fwd8 is not None or micro:
    for direction in ("fwd", "bwd"):
      if not n_fp8[direction]:
        found.append(f"recipe {name} has fp8 but the program has no {direction} fp8 "
                     "GEMM")
  return found


def _block_scaled_violations(g: LoweredGemm, want8: GemmDtypes) -> list[str]:
  """What in one block-scaled GEMM of a microscaled recipe's scope contradicts it."""
  fwd, bwd = want8.micro_elements
  scaling, name = want8.micro, want8.recipe_name
  want = (fwd, fwd) if g.direction == "fwd" else tuple(sorted((fwd, bwd)))
  got = (g.lhs_dtype, g.rhs_dtype)
  got = got if g.direction == "fwd" else tuple(sorted(got))
  scale = want8.micro_scale
  found = []
  if got != want:
    found.append(f"{scaling} block-scaled {g.direction} GEMM elements "
                 f"{' x '.join(_short(t) for t in got)}, expected "
                 f"{' x '.join(_short(t) for t in want)} (recipe {name})")
  if (g.lhs_scale_dtype, g.rhs_scale_dtype) != (scale, scale):
    found.append(f"{scaling} block-scaled GEMM scales {_short(g.lhs_scale_dtype)} x "
                 f"{_short(g.rhs_scale_dtype)}, expected {_short(scale)} x {_short(scale)} "
                 f"(recipe {name})")
  if g.block != want8.micro_block:
    found.append(f"{scaling} block-scaled GEMM with blocks of {g.block}, expected "
                 f"{want8.micro_block} (recipe {name}, fp8.block_size)")
  return found


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
  """A program lowered for one platform: its StableHLO, GEMMs and custom calls.

  Attributes:
    platform: "cuda", "rocm", "tpu" or "cpu".
    text: the StableHLO module (with locations).
    gemms: `lowered_gemms(text)`.
    custom_calls: `custom_calls(text)`.
  """

  platform: str
  text: str
  gemms: tuple[LoweredGemm, ...]
  custom_calls: tuple[LoweredCustomCall, ...]

  def custom_call_targets(self) -> dict[str, int]:
    """{target: occurrences}, e.g. {precision.rounding.TRITON_CUSTOM_CALL: 2}."""
    return dict(collections.Counter(c.target for c in self.custom_calls))

  def gemm_signatures(self, direction: str | None = None) -> collections.Counter:
    """Counter of (lhs, rhs, out) short dtype names over GEMMs (optionally "fwd"/"bwd")."""
    return collections.Counter(g.signature() for g in self.gemms
                               if direction in (None, g.direction))

  def violations(self, recipe: Recipe | str | Plan) -> list[str]:
    """`gemm_violations(self.gemms, recipe, self.platform)`."""
    return gemm_violations(self.gemms, recipe, self.platform)

  def check(self, recipe: Recipe | str | Plan) -> "LoweredProgram":
    """Raises PrecisionViolation (a ValueError) listing every GEMM that contradicts
    `recipe` (see `gemm_violations`); returns self."""
    found = self.violations(recipe)
    if found:
      raise PrecisionViolation(found)
    return self


PLATFORMS = ("cuda", "rocm", "tpu", "cpu")


def lower(fn: Callable[..., Any], *args, platform: str = "cuda",
          allow_custom_calls: Sequence[str] = (), **kwargs) -> LoweredProgram:
  """Lowers `fn(*args, **kwargs)` for `platform` on this machine (no device of that kind
  needed; nothing runs) and reads its GEMMs and custom calls.

  Args:
    fn: a function or a `jax.jit` function (donation and static arguments of the latter
      are kept). Arguments may be arrays or `jax.ShapeDtypeStruct`s.
    platform: "cuda" (default), "rocm", "tpu" or "cpu".
    allow_custom_calls: custom-call targets without JAX's serialisation guarantee to
      accept, e.g. ``[precision.rounding.TRITON_CUSTOM_CALL]`` for a program with Pallas
      kernels lowered for a GPU (`jax.export.DisabledSafetyCheck.custom_call`).

  Returns:
    A LoweredProgram.

  Raises:
    ValueError: an unknown platform; `jax.export`'s own error for a custom call not in
      `allow_custom_calls` or a lowering the platform does not support.

  Examples:
    >>> prog = lower(jax.value_and_grad(loss), params, batch, platform="cuda")
    >>> prog.check("bf16_mixed")
  """
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}; accepted: {', '.join(PLATFORMS)}")
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in allow_custom_calls]
  exported = jax.export.export(jitted, platforms=[platform], disabled_checks=checks)(
      *args, **kwargs)
  text = exported.mlir_module()
  return LoweredProgram(platform, text, lowered_gemms(text), custom_calls(text))
