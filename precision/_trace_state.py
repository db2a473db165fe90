"""What the traces in progress know, as context variables: the library's trace state.

Every piece of state that lives only while a function is traced is here, one
`contextvars.ContextVar` each, so a thread (or a task) sees only its own traces and a
trace that ends restores exactly what the enclosing one had (values are replaced and
reset by token, never mutated in place, except the tables a trace fills for its caller):

- AUTOCAST: the autocasts tracing now, innermost last (precision._autocast).
- NNX: the NNX module paths, per-module policies and calls in progress of the module
  scopes opened for autocast traces (precision.flax._scopes).
- LINEN: the root module name and the modules called (by path) of the Linen trace in
  progress (precision.flax._linen).

The interception of user classes that fills NNX and inspect's scopes is
precision._intercept; its handlers are a context variable there.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, NamedTuple


class NnxScopes(NamedTuple):
  """The module scopes of this context's autocast traces of NNX modules."""
  paths: Mapping[int, tuple] = {}      # id(module) -> graph path
  policies: Mapping[int, Any] = {}     # id(module) -> the Policy its scope takes
  stack: tuple = ()                    # (module, scope) of the calls in progress
  tables: tuple = ()                   # (module_at, module_policy) of each open context


class LinenTrace(NamedTuple):
  """The Linen root call being traced: its class name and {path: module} it called."""
  root_name: str
  module_at: dict


AUTOCAST: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "precision_autocast_traces", default=())
NNX: contextvars.ContextVar[NnxScopes] = contextvars.ContextVar(
    "precision_nnx_scopes", default=NnxScopes())
LINEN: contextvars.ContextVar[LinenTrace | None] = contextvars.ContextVar(
    "precision_linen_trace", default=None)
# precision.fp8's NNX gradient trace (which fp8 layers' state a value_and_grad read).
FP8_GRAD: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "precision_fp8_grad_trace", default=None)
# precision.parallel: the indices of the param leaves a loss_fn gathered (ZeRO-3 by layer).
FSDP_GATHERED: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "precision_fsdp_gathered", default=None)
# precision.optim: whether this thread read the loss scale since the last loss-scaling
# update (its unscaled-gradients warning). A new thread starts with False.
SCALE_READ: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "precision_scale_read", default=False)


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
  """`var` set to `value` while the context lasts, then what it was."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)
