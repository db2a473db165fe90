"""Autocast and JAX's tracing cache: what `jax_explain_cache_misses` reports on a retrace.

A retrace (the user's jitted step called at new input shapes) is one real cache miss of
the user's function. Autocast re-evaluates the traced program and hands JAX functions of
its own per layer (f32 glue regions under jax.checkpoint, the policy GEMMs' platform
branches); they are library code, so JAX explains none of their misses and the user sees
about what the hand-written model gives. Counted here: the explanations JAX logs (or warns)
while a jitted value-and-grad step is traced at a second shape, for an 8-layer model
written by hand in bf16, the same model under autocast (a params function) and an NNX
transformer stack under precision.flax.apply_recipe.

`pytest -s tests/test_autocast_cache.py` prints the counts.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import types
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

import precision as mp
import precision.flax as pf
import _models

L, D = 8, 8   # layers, width: tiny, the count does not depend on the width
BF16, F32 = jnp.bfloat16, jnp.float32


class _Explanations(logging.Handler):
  """Collects the cache-miss explanations JAX logs (jax._src.* loggers)."""

  def __init__(self):
    super().__init__(level=logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record):
    text = record.getMessage()
    if "CACHE MISS" in text:
      self.messages.append(text)


@contextlib.contextmanager
def explained_misses():
  """Within: `jax_explain_cache_misses` on; yields the list of explanations JAX gives
  (logged by its tracing cache, or warned, depending on the JAX version)."""
  handler = _Explanations()
  logger = logging.getLogger("jax")
  level, propagate = logger.level, logger.propagate
  logger.addHandler(handler)
  logger.setLevel(logging.WARNING)
  logger.propagate = False   # counted, not printed
  try:
    with jax.explain_cache_misses(True), warnings.catch_warnings(record=True) as warned:
      warnings.simplefilter("always")
      yield handler.messages
      handler.messages.extend(str(w.message) for w in warned if "CACHE MISS" in str(w.message))
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate


def retrace_misses(step, first_args, second_args) -> list[str]:
  """The explanations given while `jax.jit(step)` is traced at `second_args` after a
  trace at `first_args` (other shapes): the misses of one retrace."""
  jitted = jax.jit(step)
  with explained_misses() as first:
    jitted.trace(*first_args)
  assert first, "the first trace of a new function is a miss: nothing was counted"
  with explained_misses() as second:
    jitted.trace(*second_args)
  return list(second)


# ----------------------------------------------------------------------------- models


def _params():
  keys = jax.random.split(jax.random.key(0), L)
  return [{"w": jax.random.normal(k, (D, D), F32) * 0.3, "b": jnp.zeros((D,), F32)}
          for k in keys]


def _norm(x):
  x = x - jnp.mean(x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def mlp_loss(params, x):
  """An 8-layer MLP written with no dtype in mind (Linear, gelu, a norm per layer)."""
  for p in params:
    x = _norm(jax.nn.gelu(x @ p["w"] + p["b"]))
  return jnp.mean(jnp.square(x))


def handwritten_mlp_loss(params, x):
  """The same MLP in bf16 by hand: bf16 GEMM operands, f32 accumulation and glue."""
  for p in params:
    y = jnp.dot(x.astype(BF16), p["w"].astype(BF16), preferred_element_type=F32) + p["b"]
    x = _norm(jax.nn.gelu(y)).astype(BF16)
  return jnp.mean(jnp.square(x.astype(F32)))


def _xs():
  return jnp.ones((2, D), F32), jnp.ones((3, D), F32)


def _grad_step(loss):
  def step(params, x):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
      return jax.value_and_grad(loss)(params, x)
  return step


def _lm(handwritten=None, recipe=None):
  """The transformer stack, abstract (nnx.eval_shape: tracing needs shapes only)."""
  def build():
    with jax.numpy_dtype_promotion("standard"):
      model = _models.AttentionLM(vocab=16, d=8, heads=2, n_layers=L, rngs=nnx.Rngs(0),
                                  handwritten=handwritten)
      return model if recipe is None else pf.apply_recipe(model, recipe)
  return nnx.eval_shape(build)


def _lm_misses(model) -> list[str]:
  graph, state = nnx.split(model)

  def step(state, tokens):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
      return nnx.value_and_grad(_models.lm_loss)(nnx.merge(graph, state), tokens)

  short, long = jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 7), jnp.int32)
  return retrace_misses(step, (state, short), (state, long))


# ----------------------------------------------------------------------------- tests


def test_autocast_retrace_misses_as_few_as_handwritten():
  params = _params()
  (x1, x2) = _xs()
  hand = retrace_misses(_grad_step(handwritten_mlp_loss), (params, x1), (params, x2))
  auto = retrace_misses(_grad_step(mp.autocast(mlp_loss, "bf16_mixed")), (params, x1),
                        (params, x2))
  print(f"\n8-layer MLP retrace: hand-written bf16 {len(hand)} explained misses, "
        f"autocast bf16_mixed {len(auto)}")
  assert 1 <= len(hand) and len(auto) <= 2 * len(hand), "\n\n".join(auto)
  # The real miss is still explained: the user's function, and why (the new shape).
  assert any("for step" in m and "f32[3,8]" in m for m in auto), "\n\n".join(auto)


def test_static_argument_retrace_misses_as_few_as_handwritten():
  """A retrace at the same shapes (a new static argument): the one miss of the step."""
  params, (x, _) = _params(), _xs()

  def misses(loss):
    def step(params, x, scale):
      with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return jax.value_and_grad(loss)(params, x * scale)
    jitted = jax.jit(step, static_argnums=2)
    jitted.trace(params, x, 1.0)
    with explained_misses() as second:
      jitted.trace(params, x, 2.0)
    return list(second)

  hand, auto = misses(handwritten_mlp_loss), misses(mp.autocast(mlp_loss, "bf16_mixed"))
  print(f"\n8-layer MLP retrace for a new static argument: hand-written bf16 {len(hand)} "
        f"explained misses, autocast bf16_mixed {len(auto)}")
  assert 1 <= len(hand) and len(auto) <= 2 * len(hand), "\n\n".join(auto)
  assert any("for step" in m and "Static(val=2.0)" in m for m in auto), "\n\n".join(auto)


def test_apply_recipe_retrace_misses_as_few_as_handwritten():
  hand = _lm_misses(_lm(handwritten=BF16))
  recipe = _lm_misses(_lm(recipe="bf16_mixed"))
  print(f"\n8-block NNX transformer retrace: hand-written bf16 {len(hand)} explained "
        f"misses, apply_recipe bf16_mixed {len(recipe)}")
  assert 1 <= len(hand) and len(recipe) <= 2 * len(hand), "\n\n".join(recipe)
  assert any("for step" in m and "i32[2,7]" in m for m in recipe), "\n\n".join(recipe)


def test_misses_of_user_functions_inside_autocast_still_explained():
  """Only the library's own functions are skipped: a function of the user's that JAX
  traces again while autocast runs (a lax.scan body, traced at each new shape) is still
  explained, under autocast as without it."""

  def body(c, _):
    return jnp.tanh(c @ jnp.ones((D, D), F32)), None

  def loss(x):
    return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])

  x1, x2 = _xs()
  plain = retrace_misses(loss, (x1,), (x2,))
  auto = retrace_misses(mp.autocast(loss, "bf16_mixed"), (x1,), (x2,))
  for misses in (plain, auto):
    assert any("for loss" in m for m in misses), "\n\n".join(misses)
    assert any("for body" in m for m in misses), "\n\n".join(misses)
  assert len(auto) == len(plain), "\n\n".join(auto)


def _library_functions() -> int:
  """Live Python functions defined in autocast's interpreter or the policy GEMMs."""
  roots = (os.path.dirname(mp._autocast._api.__file__) + os.sep,  # pylint: disable=protected-access
           mp._gemm.__file__)  # pylint: disable=protected-access
  gc.collect()
  return sum(1 for f in gc.get_objects() if isinstance(f, types.FunctionType)
             and f.__code__.co_filename.startswith(roots))


def test_retraces_leave_no_function_behind():
  """The functions autocast hands JAX per trace are not kept (JAX's tracing caches hold
  them weakly): retracing at ever new shapes does not accumulate them."""
  g = jax.value_and_grad(mp.autocast(mlp_loss, "bf16_mixed"))
  params = _params()

  def trace(n):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
      jax.make_jaxpr(g)(params, jnp.ones((n, D), F32))

  trace(2)
  before = _library_functions()
  for n in range(3, 6):
    trace(n)
  assert _library_functions() <= before


def test_mark_library_code_tolerates_a_missing_private_name(monkeypatch):
  """A JAX without register_exclusion: marking is skipped (no MissingPrivateName at
  import), only the explanations come back."""
  from precision import _compat  # pylint: disable=g-import-not-at-top

  def missing(module, attribute):
    raise _compat.MissingPrivateName(f"{module}.{attribute}")

  monkeypatch.setattr(_compat, "resolve", missing)
  _compat.mark_library_code(os.path.dirname(_compat.__file__) + os.sep)

