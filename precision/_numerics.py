"""The faithful-rounding switch, and what the running backend actually does.

Two things can make a jitted bf16/f16 result differ from what its dtypes compute:

* Excess precision: XLA may keep bf16/f16 intermediates of a fused computation in f32, so
  the rounding a program asks for between two ops silently disappears.
  ``--xla_allow_excess_precision=false`` makes XLA keep every rounding.
* Contracted multiply-adds: XLA:CPU lets LLVM fuse every ``a * b + c`` into one FMA (its
  compiler sets ``AllowFPOpFusion = Fast`` unconditionally; no XLA option turns it off). On
  a CPU without native half arithmetic that never reaches f16/bf16, whose ops are done in
  f32 and rounded one by one. On an x86 CPU with AVX-512 FP16 (Sapphire Rapids and later)
  f16 is native, and LLVM emits ``vfmadd213ph``: one rounding where the program has two
  (measured here: 27% of the elements of a 512 x 512 f16 ``a * b + c``, inputs uniform in
  [-2, 2), differ from the per-op reference with the excess-precision flag on). The one
  setting that removes the feature from XLA's code generator is its ISA ceiling:
  ``--xla_cpu_max_isa=AVX2`` drops every AVX-512 extension (AVX512 or AVX512_BF16 keep
  avx512fp16), after which f16 ops are done in f32 and rounded one by one again. GEMMs run
  in their libraries either way; elementwise code is vectorised 256 bits wide instead of
  512. Measured here: a small GPT's training step 0 to 4% slower, memory-bound optimizer
  updates alike, stochastic rounding's integer hash up to 1.3x slower
  (`experiments.bench_optim`).

`enable_faithful_rounding()` adds the first flag, and the second on such a CPU (unless
XLA_FLAGS already sets an ISA ceiling: the user's choice is kept). XLA reads its flags
once, when the first backend starts, so the switch must be thrown before any computation
runs; setting XLA_FLAGS afterwards changes nothing.

`faithful_rounding_status()` therefore reads XLA_FLAGS only while no backend has started
(it then says what the backend will start with). Once one has, it asks the backend, once
per process, with two probes per dtype (bf16 and f16) whose results differ when a rounding
is dropped:

* ``y = exp(x)`` for 16 values in [0, 1) and the f32 sum of ``y``, both returned. With
  every rounding kept the sum adds the 16-bit values of ``y`` and is exact in f32 (16
  values with at most 11-bit significands below 3), so it equals the exact sum of the
  returned ``y``; with excess precision XLA feeds the unrounded f32 exponentials to it.
* ``a * b + c`` on 256 random values, against numpy's per-op rounding (the product
  rounded to the dtype, then the sum): an FMA differs in about a quarter of them.

Measured on this project's CPU machines (jax 0.10.2, XLA:CPU; tests/test_numerics.py
measures each case against per-op ml_dtypes rounding in a fresh interpreter and checks
that the status equals the measurement, and runs a CPU without AVX-512 FP16 under the
AVX2 ceiling on a CPU that has it):

* bf16 without the excess-precision flag: the first probe differs (every row), and a
  512 x 512 bf16 softmax changes in about 2% of its elements.
* f16 without that flag keeps every rounding on either kind of CPU: XLA:CPU computes each
  f16 op in f32 and rounds it, and does not fold those roundings away (exp-then-sum and an
  elementwise chain per op). The flag makes no difference to f16; the ISA ceiling does,
  on a CPU with AVX-512 FP16 (the second probe differs there without it, in 27% of the
  elements).
* One rewrite stays that no flag turns off: XLA's algebraic simplifier computes a division
  by a broadcast operand (``x / y[:, None]``, a softmax's division by its row sum) as a
  multiplication by the reciprocal, rounded to the dtype the division is computed in: f16
  itself (26% of f16 quotients differ from the per-op division, and f32's alike), f32 for
  bf16 (whose ops XLA:CPU computes in f32; no bf16 quotient changed in the measurement).
  A division of two full-shape operands is per op. The probes do not count this rewrite:
  it is the program XLA wrote, rounded per op.

On a backend where no flag makes a dtype faithful (a GPU, whose f16/bf16 FMAs XLA also
contracts, or an Arm CPU with native f16), the status names that dtype False and
`faithful_rounding_enabled()` is False.
"""

from __future__ import annotations

import os
import re

import numpy as np

from precision import _compat

_FLAG = "--xla_allow_excess_precision=false"
_ISA_FLAG = "--xla_cpu_max_isa=AVX2"
_ENV = "XLA_FLAGS"
DTYPES = ("bfloat16", "float16")
# The probes' answers for this process (None until they ran after a backend started):
# {dtype: {"excess": ..., "muladd": ...}} (`_probe_checks`).
_PROBED: dict[str, dict[str, bool]] | None = None


def _backends_started() -> bool:
  return _compat.backends_are_initialized()


def _env_flags() -> list[str]:
  return os.environ.get(_ENV, "").split()


def native_f16_cpu(cpuinfo: str | None = None) -> bool:
  """Whether this machine's x86 CPU does f16 arithmetic natively (AVX-512 FP16), from
  /proc/cpuinfo (`cpuinfo`: its text, for tests). False where it cannot be read."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        cpuinfo = f.read()
    except OSError:
      return False
  return any("avx512_fp16" in line.split(":", 1)[-1].split()
             for line in cpuinfo.splitlines() if line.startswith("flags"))


def flags_needed(cpuinfo: str | None = None, flags: list[str] | None = None) -> list[str]:
  """The XLA flags `enable_faithful_rounding` adds to `flags` (XLA_FLAGS' words): the
  excess-precision flag, and on a CPU with native f16 the ISA ceiling, unless `flags`
  already sets one."""
  flags = _env_flags() if flags is None else flags
  needed = [] if _FLAG in flags else [_FLAG]
  if native_f16_cpu(cpuinfo) and _ceiling(flags) is None:
    needed.append(_ISA_FLAG)
  return needed


def _ceiling(flags: list[str]) -> str | None:
  """The ISA ceiling XLA_FLAGS' words set (the last one wins, as in XLA), or None."""
  found = [m.group(1).upper() for f in flags
           if (m := re.fullmatch(r"--xla_cpu_max_isa=(\S+)", f))]
  return found[-1] if found else None


def _f16_native_in_codegen(flags: list[str]) -> bool:
  """Whether XLA:CPU started with `flags` emits native f16 arithmetic on this CPU (an ISA
  ceiling above AVX2 keeps AVX-512 FP16: XLA filters it only with the AVX-512 family)."""
  return native_f16_cpu() and _ceiling(flags) not in ("SSE4_2", "AVX", "AVX2")


def _probe_inputs(dtype) -> tuple[np.ndarray, ...]:
  """x: 16 values in [0, 1) (exp of each is in [1, e), not a 16-bit value in general);
  a, b, c: 256 random values each, for the multiply-add."""
  x = np.arange(16, dtype=np.float32) / np.float32(16) + np.float32(1 / 48)
  rng = np.random.default_rng(0)
  a, b, c = (rng.uniform(-2, 2, 256).astype(np.float32).astype(dtype) for _ in range(3))
  return x.astype(dtype), a, b, c


def probe_faithful_rounding() -> dict[str, bool]:
  """Runs the probes on the default backend: {"bfloat16": ok, "float16": ok}, ok when
  the dtype's ops round as stated (see the module docstring).

  Compiles and runs one tiny jitted function per dtype (about 0.1 s each); starts the
  backend if none has started. `faithful_rounding_status()` calls it once per process.
  """
  return {name: all(checks.values()) for name, checks in _probe_checks().items()}


def _probe_checks() -> dict[str, dict[str, bool]]:
  """{dtype: {"excess": the exp-sum probe kept every rounding, "muladd": the multiply-add
  rounded twice}} on the default backend."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  def probe(x, a, b, c):
    y = jnp.exp(x)
    return y, jnp.sum(y, dtype=jnp.float32), a * b + c

  out = {}
  for name in DTYPES:
    dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.float16
    x, a, b, c = _probe_inputs(dtype)
    # Evaluated now even when called while a function is being traced.
    with jax.ensure_compile_time_eval():
      y, total, fused = (np.asarray(v) for v in jax.jit(probe)(x, a, b, c))
    # Exact: 16 values in [1, e) with at most 11-bit significands are multiples of
    # 2**-10 below 44; float64 adds them without error, as f32 does given the rounded y.
    exact = y.astype(np.float64).sum()
    per_op = ((a.astype(np.float32) * b.astype(np.float32)).astype(dtype).astype(np.float32)
              + c.astype(np.float32)).astype(dtype)
    out[name] = {"excess": float(total) == float(exact),
                 "muladd": bool(np.all(fused.view(np.uint16) == per_op.view(np.uint16)))}
  return out


def faithful_rounding_status() -> dict[str, bool]:
  """For bf16 and f16: whether every jitted op of that dtype rounds as the dtype says.

  Before any JAX backend has started: whether XLA_FLAGS holds what
  `enable_faithful_rounding` puts there (what the backend will start with). After: the
  answer of the running backend, from probes run once per process (see the module
  docstring), so setting XLA_FLAGS after the start does not change it.

  Returns:
    ``{"bfloat16": bool, "float16": bool}``.

  Examples:
    >>> precision.faithful_rounding_status()
    {'bfloat16': True, 'float16': True}
  """
  if not _backends_started() and _PROBED is None:
    flags = _env_flags()
    excess = _FLAG in flags
    return {"bfloat16": excess, "float16": excess and not _f16_native_in_codegen(flags)}
  return {name: all(checks.values()) for name, checks in _checks().items()}


def _checks() -> dict[str, dict[str, bool]]:
  """The running backend's probe answers, probed once per process."""
  global _PROBED
  if _PROBED is None:
    _PROBED = _probe_checks()
  return _PROBED


def faithful_rounding_enabled() -> bool:
  """Whether every jitted bf16 and f16 op rounds as its dtype says (no excess precision,
  no contracted multiply-add): both entries of `faithful_rounding_status()`.

  Returns:
    bool.

  Examples:
    >>> import precision
    >>> precision.enable_faithful_rounding()   # first thing in a script
    >>> precision.faithful_rounding_enabled()  # later, in a report: the mode in force
    True
  """
  return all(faithful_rounding_status().values())


def enable_faithful_rounding() -> None:
  """Makes every jitted bf16/f16 op round as its dtype says. Call before JAX computes anything.

  Before any backend has started it adds the flags to XLA_FLAGS (idempotent):
  ``--xla_allow_excess_precision=false``, and on an x86 CPU with AVX-512 FP16 also
  ``--xla_cpu_max_isa=AVX2`` (see the module docstring; an ISA ceiling already in
  XLA_FLAGS is kept). After a backend has started, it returns quietly if the running
  backend already rounds faithfully (it was started with the flags), and raises
  RuntimeError otherwise: XLA would ignore the flags, and the message says how to do it
  right.

  Raises:
    RuntimeError: a backend has started without faithful rounding.

  Examples:
    >>> import precision
    >>> precision.enable_faithful_rounding()   # first thing in a script, before any jnp op
  """
  if not _backends_started():
    needed = flags_needed()
    if needed:
      os.environ[_ENV] = " ".join(_env_flags() + needed)
    return
  # What the flags would have fixed: excess precision anywhere, and contracted f16
  # multiply-adds on an x86 CPU with native f16 (the ISA ceiling). A backend that
  # contracts multiply-adds whatever its flags (a GPU, an Arm CPU with native f16) is
  # what it is: faithful_rounding_status() says so, and this returns.
  import jax  # pylint: disable=g-import-not-at-top
  fixable = {name: checks["excess"] and (checks["muladd"] or name != "float16"
                                         or jax.default_backend() != "cpu"
                                         or not native_f16_cpu())
             for name, checks in _checks().items()}
  if all(fixable.values()):
    return
  wrong = ", ".join(name for name, ok in fixable.items() if not ok)
  flags = " ".join([_FLAG] + ([_ISA_FLAG] if native_f16_cpu() else []))
  raise RuntimeError(
      "precision.enable_faithful_rounding() was called after a JAX backend started "
      f"without it, so XLA would ignore it (setting XLA_FLAGS now changes nothing): the "
      f"running backend does not round {wrong} as stated. Call it before the first JAX "
      "computation (first lines of the script), or start Python with "
      f"{_ENV}='{flags}' in the environment.")
