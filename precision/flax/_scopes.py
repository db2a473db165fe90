"""NNX module paths as name scopes while autocast traces a call.

NNX pushes no name scope of its own, so an op traced inside `model.blocks[0].mlp` would be
anonymous: neither an override pattern ("blocks/0/*") nor `precision.audit` could place it.
While autocast traces a call that received NNX modules, the `__call__` (and `attend`) of
the module classes in their graphs are intercepted (`precision._intercept`) for this
context only: each call of a module of these graphs opens
`jax.named_scope(<path relative to the calling module>)` around the original; nested calls
give the full path ("blocks/0/mlp/up"). Every class has its own attribute back once the
last trace that needed it ends; calls from other threads, modules of other graphs and
calls outside the trace run as written.

A module that carries an autocast spec of its own (marked by `apply_policy` separately from
the module being traced) contributes its policy for its scope.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
from flax import nnx

from precision import _intercept
from precision import _keypath
from precision import _trace_state

METHODS = ("__call__", "attend")
SPEC_ATTR = "precision_autocast"


def tracked_path(module: Any) -> tuple | None:
  """The graph path of `module` in the trace in progress (None: no module scope of this
  context's trace covers it)."""
  return _trace_state.NNX.get().paths.get(id(module))


def _record(state: _trace_state.NnxScopes, scope: str, module: Any, policy: Any) -> None:
  """`module` (and its policy) at `scope` in every trace of this context in progress."""
  seen = set()
  for module_at, module_policy in state.tables:
    if id(module_at) in seen:
      continue
    seen.add(id(module_at))
    module_at.setdefault(scope, module)
    if policy is not None and scope not in module_policy:
      module_policy[scope] = policy


def _open_scope(module, call, args, kwargs):
  """The interception handler: `call` inside the named scope of `module`'s path."""
  state = _trace_state.NNX.get()
  path = state.paths.get(id(module))
  if path is None or (state.stack and state.stack[-1][0] is module):
    return call(*args, **kwargs)
  parent_path = state.paths.get(id(state.stack[-1][0]), ()) if state.stack else ()
  relative = path[len(parent_path):] if path[:len(parent_path)] == parent_path else path
  name = _keypath.path_str(relative)
  outer = state.stack[-1][1] if state.stack else ""
  scope = "/".join(s for s in (outer, name) if s)
  if scope:
    spec = getattr(module, SPEC_ATTR, None)
    _record(state, scope, module,
            state.policies.get(id(module), None if spec is None else spec.policy))
  with _trace_state.setting(_trace_state.NNX,
                            state._replace(stack=state.stack + ((module, scope),))):
    with jax.named_scope(name) if name else contextlib.nullcontext():
      return call(*args, **kwargs)


@contextlib.contextmanager
def module_scopes(nodes, module_at: dict, module_policy: dict,
                  policies: dict | None = None) -> Iterator[None]:
  """Name scopes for every module call in the graphs of `nodes` while the context lasts.

  `policies` ({id(module): Policy}) gives modules of these graphs the policy their scope
  takes (a marked model's overrides, when the model is called inside another trace).
  Scopes are recorded in `module_at` / `module_policy` and in those of every enclosing
  context of this thread; other threads' traces are unaffected.
  """
  paths: dict[int, tuple] = {}
  classes: dict[type, None] = {}
  for root_index, node in enumerate(nodes):
    for path, obj in nnx.iter_graph(node):
      if isinstance(obj, nnx.Module) and id(obj) not in paths:
        # Several roots: their paths start at each root (the first one's are bare).
        paths[id(obj)] = tuple(path) if len(nodes) == 1 else (root_index, *path)
        classes[type(obj)] = None
  state = _trace_state.NNX.get()
  inner = _trace_state.NnxScopes(
      {**state.paths, **paths}, {**state.policies, **(policies or {})}, state.stack,
      state.tables + ((module_at, module_policy),))
  with _intercept.intercepting(classes, METHODS, _open_scope), \
      _trace_state.setting(_trace_state.NNX, inner):
    yield
