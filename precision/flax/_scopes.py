"""NNX module paths as name scopes while autocast traces a call.

NNX pushes no name scope of its own, so an op traced inside `model.blocks[0].mlp` would be
anonymous: neither an override pattern ("blocks/0/*") nor `precision.audit` could place it.
While autocast traces a call that received NNX modules, the `__call__` (and `attend`) of
every module class in their graphs is wrapped, for that trace only, by a function that
opens `jax.named_scope(<path relative to the calling module>)` around the original; nested
calls give the full path ("blocks/0/mlp/up"). The classes are restored when the trace ends;
modules of other graphs and calls outside the trace are untouched.

A module that carries an autocast spec of its own (marked by `apply_policy` separately from
the module being traced) contributes its policy for its scope.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import jax
from flax import nnx

METHODS = ("__call__", "attend")
SPEC_ATTR = "precision_autocast"


class _Tracker(threading.local):
  def __init__(self):
    self.paths: dict[int, tuple] = {}     # id(module) -> graph path
    self.policies: dict[int, Any] = {}    # id(module) -> Policy its scope takes
    self.stack: list[tuple[Any, str]] = []  # (module, scope) of the calls in progress


_TRACKER = _Tracker()


def tracked_path(module: Any) -> tuple | None:
  """The graph path of `module` in the trace in progress (None: no module scope of this
  thread's trace covers it)."""
  return _TRACKER.paths.get(id(module))


def _wrap(original, module_at: dict, module_policy: dict):
  @functools.wraps(original)
  def method(self, *args, **kwargs):
    path = _TRACKER.paths.get(id(self))
    if path is None or (_TRACKER.stack and _TRACKER.stack[-1][0] is self):
      return original(self, *args, **kwargs)
    parent_path = _TRACKER.paths.get(id(_TRACKER.stack[-1][0]), ()) if _TRACKER.stack else ()
    relative = path[len(parent_path):] if path[:len(parent_path)] == parent_path else path
    name = "/".join(str(p) for p in relative)
    outer = _TRACKER.stack[-1][1] if _TRACKER.stack else ""
    scope = "/".join(s for s in (outer, name) if s)
    if scope:
      module_at.setdefault(scope, self)
      spec = getattr(self, SPEC_ATTR, None)
      policy = _TRACKER.policies.get(id(self), None if spec is None else spec.policy)
      if policy is not None and scope not in module_policy:
        module_policy[scope] = policy
    _TRACKER.stack.append((self, scope))
    try:
      with jax.named_scope(name) if name else contextlib.nullcontext():
        return original(self, *args, **kwargs)
    finally:
      _TRACKER.stack.pop()

  return method


@contextlib.contextmanager
def module_scopes(nodes, module_at: dict, module_policy: dict,
                  policies: dict | None = None) -> Iterator[None]:
  """Name scopes for every module call in the graphs of `nodes` while the context lasts.

  `policies` ({id(module): Policy}) gives modules of these graphs the policy their scope
  takes (a marked model's overrides, when the model is called inside another trace).
  """
  paths: dict[int, tuple] = {}
  classes: set[type] = set()
  for root_index, node in enumerate(nodes):
    for path, obj in nnx.iter_graph(node):
      if isinstance(obj, nnx.Module) and id(obj) not in paths:
        # Several roots: their paths start at each root (the first one's are bare).
        paths[id(obj)] = tuple(path) if len(nodes) == 1 else (root_index, *path)
        classes.add(type(obj))
  originals = {(cls, m): getattr(cls, m) for cls in classes for m in METHODS
               if callable(getattr(cls, m, None))}
  owned = {(cls, m): m in cls.__dict__ for cls, m in originals}
  saved_paths, saved_policies = _TRACKER.paths, _TRACKER.policies
  _TRACKER.paths = {**saved_paths, **paths}
  _TRACKER.policies = {**saved_policies, **(policies or {})}
  try:
    for (cls, m), original in originals.items():
      setattr(cls, m, _wrap(original, module_at, module_policy))
    yield
  finally:
    for (cls, m), original in originals.items():
      if owned[(cls, m)]:
        setattr(cls, m, original)
      else:
        delattr(cls, m)
    _TRACKER.paths, _TRACKER.policies = saved_paths, saved_policies
