"""Trace-time interception of user classes' methods: the library's one mechanism.

While a trace needs to see the calls of a user's module classes (module paths as name
scopes for the policy's overrides, `numerics.inspect`'s rows, ...), it enters
`intercepting(classes, methods, handle)`. For the duration, the method is replaced on the
class that defines it (`type.__mro__` order: an inherited `__call__` is wrapped once, on
its owner) by a wrapper that calls the `handle`s entered in the *calling* context: a
thread, or a task, without one calls the original straight through. The original is put
back when the last context using it ends, so no class is changed after the traces:
`type(x).__call__` is the user's function again.

The wrappers are installed and removed under one lock and counted across every thread
and every user (the policy's scopes and inspect's share the count), so a trace ending in
one thread never removes a wrapper another still needs, and none is left behind. Which
handlers a call sees is a `contextvars.ContextVar`: each thread reads only its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterable, Iterator, NamedTuple

# handle(instance, call, args, kwargs) -> result; `call(*args, **kwargs)` continues with
# the next handler, then the original method.
Handle = Callable[[Any, Callable, tuple, dict], Any]


class _Handler(NamedTuple):
  keys: frozenset      # (owner class, method name) pairs this handler sees
  classes: tuple       # the classes it was entered for: instances of others pass through
  handle: Handle


@dataclasses.dataclass
class _Slot:
  original: Any        # the owner's own attribute, put back when count reaches 0
  count: int = 0       # intercepting() contexts using it, all threads together


_LOCK = threading.Lock()
_SLOTS: dict[tuple[type, str], _Slot] = {}
_ACTIVE: contextvars.ContextVar[tuple[_Handler, ...]] = contextvars.ContextVar(
    "precision_intercept_handlers", default=())


def owner(cls: type, name: str) -> type | None:
  """The class of `cls.__mro__` whose own `__dict__` defines `name` (None: none does)."""
  return next((c for c in cls.__mro__ if name in c.__dict__), None)


def original(cls: type, name: str) -> Any:
  """`getattr(cls, name)` as the user wrote it, an interception wrapper resolved."""
  attr = getattr(cls, name)
  return getattr(attr, "precision_intercepted", attr)


def _wrapper(key: tuple[type, str], fn: Any):
  @functools.wraps(fn)
  def method(self, *args, **kwargs):
    call = functools.partial(fn, self)
    # The last handler entered is the outermost: it runs first and calls the earlier ones.
    for handler in _ACTIVE.get():
      if key in handler.keys and isinstance(self, handler.classes):
        call = _continue(handler.handle, self, call)
    return call(*args, **kwargs)

  method.precision_intercepted = fn
  return method


def _continue(handle: Handle, instance: Any, call: Callable) -> Callable:
  return lambda *args, **kwargs: handle(instance, call, args, kwargs)


def _keys(classes: Iterable[type], methods: Iterable[str]) -> frozenset:
  keys = set()
  for cls in classes:
    for name in methods:
      home = owner(cls, name)
      if home is not None and callable(home.__dict__[name]):
        keys.add((home, name))
  return frozenset(keys)


@contextlib.contextmanager
def intercepting(classes: Iterable[type], methods: Iterable[str],
                 handle: Handle) -> Iterator[None]:
  """Calls of `methods` on instances of `classes` (and their subclasses) made in this
  context go through `handle(instance, call, args, kwargs)` while the context lasts.

  Calls from other threads, and calls outside the context, run the original method; every
  class gets its own attribute back when the last context that needed it ends.
  """
  classes = tuple(dict.fromkeys(classes))
  keys = _keys(classes, methods)
  with _LOCK:
    for key in keys:
      slot = _SLOTS.get(key)
      if slot is None:
        home, name = key
        slot = _SLOTS[key] = _Slot(home.__dict__[name])
        setattr(home, name, _wrapper(key, slot.original))
      slot.count += 1
  token = _ACTIVE.set(_ACTIVE.get() + (_Handler(keys, classes, handle),))
  try:
    yield
  finally:
    _ACTIVE.reset(token)
    with _LOCK:
      for key in keys:
        slot = _SLOTS[key]
        slot.count -= 1
        if slot.count == 0:
          del _SLOTS[key]
          setattr(key[0], key[1], slot.original)
