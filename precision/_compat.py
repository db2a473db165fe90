"""Every private JAX / Flax / Orbax name the library uses, in one place.

The library's dependencies are version ranges (pyproject.toml), so a private name may move
in a release inside the range. Each one is imported here and nowhere else;
tests/test_compat.py imports every entry of `PRIVATE_NAMES` and fails naming any that
disappeared. All are checked by that test against the versions CI installs (jax 0.10.2,
flax 0.12.8, orbax-checkpoint 0.12.8, constraints.txt); the transpose rules and xla_bridge
were also found unchanged in the jax 0.11.2 / 0.12.0.1 wheels. The others
(source_info_util, the Orbax helper) have been seen in 0.10.2 only: on a newer JAX, run
tests/test_compat.py first.

| name                                              | used for                                   |
|---------------------------------------------------|--------------------------------------------|
| jax._src.lax.lax._dot_general_transpose_lhs/rhs   | backward GEMMs of the policy dot_general   |
| jax._src.lax.convolution._conv_general_dilated_transpose_lhs/rhs | backward convolutions       |
| jax._src.lax.lax._ragged_dot_general_transpose_rule | backward grouped GEMMs (ragged_dot)      |
| jax._src.interpreters.ad.UndefinedPrimal          | the operand that rule differentiates for   |
| jax._src.source_info_util.user_context / current_name_stack | autocast keeps each op's source  |
|                                                   | line and name stack (the audit reads them)  |
| jax._src.xla_bridge.backends_are_initialized      | the faithful-rounding switch refuses late   |
|                                                   | enabling                                    |
| jax._src.source_info_util.register_exclusion      | the interpreter's and the policy GEMMs' own |
|                                                   | functions are library code, not user code   |
|                                                   | (`mark_library_code`)                       |
| orbax.checkpoint._src.asyncio_utils._run_sync_via_new_loop | a failed checkpoint read drains |
|                                                   | its TensorStore reads before the loop closes |
|                                                   | (orbax-checkpoint 0.12.8, the newest in range) |

Jaxpr equations are public types (jax.extend.core), but three of their protocols changed
across releases and are bridged here: how an equation is bound again (`bind_eqn`), its
context manager (`eqn_context`) and a custom_jvp call's rule (`custom_jvp_rule`).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

# (module, attribute) pairs; `resolve` imports them lazily and names the missing one.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("jax._src.lax.lax", "_dot_general_transpose_lhs"),
    ("jax._src.lax.lax", "_dot_general_transpose_rhs"),
    ("jax._src.lax.convolution", "_conv_general_dilated_transpose_lhs"),
    ("jax._src.lax.convolution", "_conv_general_dilated_transpose_rhs"),
    ("jax._src.lax.lax", "_ragged_dot_general_transpose_rule"),
    ("jax._src.interpreters.ad", "UndefinedPrimal"),
    ("jax._src.source_info_util", "user_context"),
    ("jax._src.source_info_util", "current_name_stack"),
    ("jax._src.xla_bridge", "backends_are_initialized"),
    ("jax._src.source_info_util", "register_exclusion"),
)


class MissingPrivateName(ImportError):
  """A private JAX/Flax name the library relies on is gone from the installed version."""


def resolve(module: str, attribute: str) -> Any:
  """`module.attribute`, or MissingPrivateName naming both and the installed versions."""
  try:
    return getattr(importlib.import_module(module), attribute)
  except (ImportError, AttributeError) as e:
    import jax  # pylint: disable=g-import-not-at-top
    import flax  # pylint: disable=g-import-not-at-top
    raise MissingPrivateName(
        f"precision needs the private name {module}.{attribute}, which this installation "
        f"lacks (jax {jax.__version__}, flax {flax.__version__}); precision is tested with "
        "jax>=0.10.2,<0.13 and flax>=0.12.8,<0.13") from e


def dot_general_transpose_lhs(*args, **kwargs):
  return resolve("jax._src.lax.lax", "_dot_general_transpose_lhs")(*args, **kwargs)


def dot_general_transpose_rhs(*args, **kwargs):
  return resolve("jax._src.lax.lax", "_dot_general_transpose_rhs")(*args, **kwargs)


def conv_transpose_lhs(*args, **kwargs):
  return resolve("jax._src.lax.convolution", "_conv_general_dilated_transpose_lhs")(
      *args, **kwargs)


def conv_transpose_rhs(*args, **kwargs):
  return resolve("jax._src.lax.convolution", "_conv_general_dilated_transpose_rhs")(
      *args, **kwargs)


def ragged_dot_general_transpose(ct, lhs, rhs, group_sizes, **params):
  """JAX's transpose of ragged_dot_general; `lhs`/`rhs`: an `undefined(aval)` for the
  operand whose cotangent is wanted, the value for the other. Returns (lhs_bar, rhs_bar,
  None), None for the defined operand."""
  return resolve("jax._src.lax.lax", "_ragged_dot_general_transpose_rule")(
      ct, lhs, rhs, group_sizes, **params)


def undefined(aval):
  """The linear (undefined) operand of a JAX transpose rule that checks for one."""
  return resolve("jax._src.interpreters.ad", "UndefinedPrimal")(aval)


def user_context(traceback, name_stack):
  """Context in which newly bound primitives carry `traceback` and `name_stack`."""
  return resolve("jax._src.source_info_util", "user_context")(traceback,
                                                              name_stack=name_stack)


def current_name_stack():
  return resolve("jax._src.source_info_util", "current_name_stack")()


def backends_are_initialized() -> bool:
  return bool(resolve("jax._src.xla_bridge", "backends_are_initialized")())


def mark_library_code(path: str) -> None:
  """Tells JAX that the functions defined under `path` (a module file, or a package
  directory ending in os.sep) are library code, as JAX's and Flax's own modules are.

  Autocast re-evaluates a traced program and, per layer, hands JAX functions of its own
  to trace: the jax.checkpoint'ed f32 glue regions, the branches of the policy GEMMs'
  `lax.platform_dependent`, rebuilt scan/cond/while bodies and custom_jvp calls. They are
  traced at each call's shapes, so on a retrace at new shapes every one of them misses
  JAX's tracing cache however stable the function object is: under
  `jax_explain_cache_misses`, some 40 explanations per layer besides the one for the
  user's own function. JAX explains misses only of functions defined in user code (its
  own internal jits and lambdas are skipped the same way), so once marked, autocast's are
  skipped and the user's remain. The mark also makes JAX skip these files when it looks
  for the user's frame of an op (the source location in lowered HLO metadata, some error
  messages); Python tracebacks are not filtered.

  With a JAX that lacks the private name nothing is marked and everything works; only
  the explanations come back.
  """
  try:
    register = resolve("jax._src.source_info_util", "register_exclusion")
  except MissingPrivateName:
    return
  register(path)


# --- Orbax ------------------------------------------------------------------------------
# orbax.checkpoint._src.asyncio_utils._run_sync_via_new_loop runs each synchronous Orbax
# call on a fresh event loop and closes it as soon as the call returns or raises. When one
# TensorStore read of a damaged checkpoint fails, the others are still in flight; they
# finish after the loop closed and each prints "RuntimeError: Event loop is closed" (and
# "Exception ignored in <coroutine ...>") long after the error was raised. Within
# `orbax_drained_event_loops()` a failed call first lets its pending operations finish.
PRIVATE_NAMES += (("orbax.checkpoint._src.asyncio_utils", "_run_sync_via_new_loop"),)


def _drained_run(coro):
  """`_run_sync_via_new_loop` that finishes every pending task before closing the loop."""
  import asyncio  # pylint: disable=g-import-not-at-top

  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    try:
      pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
      if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=300))
        for t in pending:
          if t.done() and not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" at exit
    finally:
      asyncio.set_event_loop(None)
      loop.close()


@contextlib.contextmanager
def orbax_drained_event_loops():
  """Within this context a failing synchronous Orbax call returns only once all of its
  TensorStore operations have finished, so none reports into a closed event loop."""
  try:
    original = resolve("orbax.checkpoint._src.asyncio_utils", "_run_sync_via_new_loop")
  except MissingPrivateName:
    yield  # another Orbax version: checkpoints work the same, only the noise may return
    return
  module = importlib.import_module("orbax.checkpoint._src.asyncio_utils")
  module._run_sync_via_new_loop = _drained_run  # pylint: disable=protected-access
  try:
    yield
  finally:
    module._run_sync_via_new_loop = original  # pylint: disable=protected-access
def bind_eqn(eqn, invals):
  """Binds a jaxpr equation's primitive again on `invals` with its own params (as
  `jax.core.eval_jaxpr` does; higher-order primitives get their sub-functions back)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(params, tuple):  # older JAX: (subfuns, params)
    subfuns, params = params
    return eqn.primitive.bind(*subfuns, *invals, **params)
  return eqn.primitive.bind(*invals, **params)


def eqn_context(eqn):
  """The context (compute type, xla metadata, ...) the equation was traced under."""
  ctx = getattr(eqn, "ctx", None)
  manager = getattr(ctx, "manager", None)
  return manager if manager is not None else contextlib.nullcontext()


def custom_jvp_rule(params: dict, symbolic_zeros: list[bool]):
  """(jaxpr, consts, ...) of a custom_jvp_call equation's JVP rule for the given tangent
  zero pattern; the jaxpr takes (primals..., nonzero tangents...)."""
  fun = params.get("jvp_jaxpr_fun", params.get("jvp_jaxpr_thunk"))
  if fun is None:
    raise MissingPrivateName("custom_jvp_call has neither jvp_jaxpr_fun nor jvp_jaxpr_thunk")
  call = getattr(fun, "call_wrapped", fun)
  return call(*symbolic_zeros)


def without_leading_scope(name_stack, name: str):
  """`name_stack` without its first entry when that entry is the scope `name` (a Linen
  root module seen twice: once by the enclosing call, once by the traced re-entry)."""
  stack = getattr(name_stack, "stack", ())
  if stack and getattr(stack[0], "name", None) == name:
    return type(name_stack)(tuple(stack[1:]))
  return name_stack
