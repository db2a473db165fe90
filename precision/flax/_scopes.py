"""NNX module paths as name scopes while autocast traces a call.

NNX pushes no name scope of its own, so an op traced inside `model.blocks[0].mlp` would be
anonymous: neither an override pattern ("blocks/0/*") nor `precision.audit` could place it.
While autocast traces a call that received NNX modules, the `__call__` (and `attend`) of
every module class in their graphs is wrapped, for that trace only, by a function that
opens `jax.named_scope(<path relative to the calling module>)` around the original; nested
calls give the full path ("blocks/0/mlp/up"). The classes are restored when the last trace
that needs them ends (wrappers are installed under a lock and counted across threads; each
call reads its own thread's trace); modules of other graphs and calls outside the trace are
untouched.

A module that carries an autocast spec of its own (marked by `apply_policy` separately from
the module being traced) contributes its policy for its scope.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    self.tables: list[tuple[dict, dict]] = []  # (module_at, module_policy), per context


_TRACKER = _Tracker()


@dataclasses.dataclass
class _Installed:
  """A scope wrapper installed on a class attribute, shared by every thread's traces."""
  original: Any     # the attribute the wrapper calls (and restores)
  owned: bool       # the class defined it (restored on removal) or inherited it (deleted)
  count: int = 0    # module_scopes contexts using it, in all threads together


# Wrappers are installed and removed under LOCK, counted across threads: a class stays
# wrapped while any thread's trace needs it, and gets its own attribute back after the
# last. (Installing per context without a count let two threads tracing at once record
# each other's scopes and leave a wrapper installed.) Each call reads its thread's state.
LOCK = threading.RLock()
_INSTALLED: dict[tuple[type, str], _Installed] = {}


def tracked_path(module: Any) -> tuple | None:
  """The graph path of `module` in the trace in progress (None: no module scope of this
  thread's trace covers it)."""
  return _TRACKER.paths.get(id(module))


def unwrapped(cls: type, name: str) -> Any:
  """`getattr(cls, name)` with any scope wrapper (its own or a parent's) resolved; call
  under LOCK when the result is kept."""
  attr = getattr(cls, name)
  while getattr(attr, "precision_scope_key", None) is not None:
    entry = _INSTALLED.get(attr.precision_scope_key)
    attr = attr.precision_scope_fallback if entry is None else entry.original
  return attr


def replace_original(cls: type, name: str, value: Any) -> bool:
  """Under LOCK: when `cls.name` is wrapped now, make `value` what the wrapper calls and
  restores (True); else change nothing (False)."""
  entry = _INSTALLED.get((cls, name))
  if entry is None:
    return False
  entry.original, entry.owned = value, True
  return True


def _record(scope: str, module: Any, policy: Any) -> None:
  """`module` (and its policy) at `scope` in every trace of this thread in progress."""
  seen = set()
  for module_at, module_policy in _TRACKER.tables:
    if id(module_at) in seen:
      continue
    seen.add(id(module_at))
    module_at.setdefault(scope, module)
    if policy is not None and scope not in module_policy:
      module_policy[scope] = policy


def _wrap(key: tuple[type, str], fallback):
  @functools.wraps(fallback)
  def method(self, *args, **kwargs):
    entry = _INSTALLED.get(key)
    original = fallback if entry is None else entry.original
    path = _TRACKER.paths.get(id(self))
    if path is None or (_TRACKER.stack and _TRACKER.stack[-1][0] is self):
      return original(self, *args, **kwargs)
    parent_path = _TRACKER.paths.get(id(_TRACKER.stack[-1][0]), ()) if _TRACKER.stack else ()
    relative = path[len(parent_path):] if path[:len(parent_path)] == parent_path else path
    name = "/".join(str(p) for p in relative)
    outer = _TRACKER.stack[-1][1] if _TRACKER.stack else ""
    scope = "/".join(s for s in (outer, name) if s)
    if scope:
      spec = getattr(self, SPEC_ATTR, None)
      _record(scope, self,
              _TRACKER.policies.get(id(self), None if spec is None else spec.policy))
    _TRACKER.stack.append((self, scope))
    try:
      with jax.named_scope(name) if name else contextlib.nullcontext():
        return original(self, *args, **kwargs)
    finally:
      _TRACKER.stack.pop()

  method.precision_scope_key = key
  method.precision_scope_fallback = fallback
  return method


def _install(keys) -> None:
  with LOCK:
    for key in keys:
      entry = _INSTALLED.get(key)
      if entry is None:
        cls, name = key
        entry = _INSTALLED[key] = _Installed(getattr(cls, name), name in cls.__dict__)
        setattr(cls, name, _wrap(key, entry.original))
      entry.count += 1


def _uninstall(keys) -> None:
  with LOCK:
    for key in keys:
      entry = _INSTALLED[key]
      entry.count -= 1
      if entry.count == 0:
        del _INSTALLED[key]
        cls, name = key
        if entry.owned:
          setattr(cls, name, entry.original)
        else:
          delattr(cls, name)


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
  classes: set[type] = set()
  for root_index, node in enumerate(nodes):
    for path, obj in nnx.iter_graph(node):
      if isinstance(obj, nnx.Module) and id(obj) not in paths:
        # Several roots: their paths start at each root (the first one's are bare).
        paths[id(obj)] = tuple(path) if len(nodes) == 1 else (root_index, *path)
        classes.add(type(obj))
  keys = [(cls, m) for cls in classes for m in METHODS if callable(getattr(cls, m, None))]
  saved_paths, saved_policies = _TRACKER.paths, _TRACKER.policies
  _install(keys)
  _TRACKER.paths = {**saved_paths, **paths}
  _TRACKER.policies = {**saved_policies, **(policies or {})}
  _TRACKER.tables.append((module_at, module_policy))
  try:
    yield
  finally:
    _TRACKER.tables.pop()
    _TRACKER.paths, _TRACKER.policies = saved_paths, saved_policies
    _uninstall(keys)
