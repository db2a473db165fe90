"""One training step for every recipe: `value_and_grad` and `train_step`.

The recipe optimizer (`precision.optim.build_optimizer`) expects the gradients of the
loss MULTIPLIED BY its current loss scale: its guard divides them by the scale (in f32),
checks they are finite, skips the step if not and adjusts the scale. `value_and_grad`
does the multiplication (a no-op scale of 1 for recipes without loss scaling) and, for
an NNX model, carries the fp8 gradient-operand scaling state out of the backward pass
(precision._grad); `train_step` adds the update, writes the params back
and rolls the fp8 scaling state back when the guard skipped the step. So the loop is the
same for fp32, bf16, f16 with loss scaling and fp8:

  >>> tx = mp.optim.build_optimizer(recipe, optax.adamw(1e-3))
  >>> opt_state = tx.init(nnx.state(model, nnx.Param))
  >>> step = mp.jit_train_step(model, tx, loss_fn)    # train_step, jitted for this model
  >>> loss, opt_state = step(opt_state, x, y)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import optax
from flax import nnx

from precision import _grad
from precision import _step_core
from precision import fp8
from precision.flax import _nnx
from precision.numerics import _telemetry


def _telemetry_spec(fn, model_or_params):
  """(the spec the call runs under, the function to trace under it) for telemetry."""
  if isinstance(model_or_params, nnx.Module):
    spec = _nnx.spec_of(model_or_params)
    if spec is None:
      raise ValueError("value_and_grad(telemetry=True): the model is not marked; accepted: "
                       "a model prepared by precision.flax.apply_recipe / apply_policy")
    inner = fn
  else:
    spec = getattr(fn, "autocast_spec", None)
    inner = getattr(fn, "__wrapped__", None)
    if spec is None or inner is None:
      raise ValueError("value_and_grad(telemetry=True) on a params pytree: fn is not an "
                       "autocast'ed function; accepted: fn = precision.autocast(loss, recipe)")
  if spec.fp8_state:
    raise ValueError("value_and_grad(telemetry=True): fn carries its fp8 scaling state as "
                     "an argument (autocast(..., fp8_state=True)), which value_and_grad "
                     "does not thread; accepted: an NNX model under an fp8 recipe (its "
                     "layers hold the state), or a stateless fp8 scaling ('current', "
                     "'per_channel', 'block', mxfp8, nvfp4)")
  return spec, inner


def value_and_grad(fn: Callable[..., Any], opt_state: Any = None, *, has_aux: bool = False,
                   argnums: int | Sequence[int] = 0,
                   telemetry: bool = False) -> Callable[..., Any]:
  """The loss and the gradients a recipe optimizer's ``tx.update`` expects.

  The one value_and_grad of the package (loss scaling, fp8 scaling state, telemetry).
  With `opt_state`, differentiates ``fn(model_or_params, *args, **kwargs) *
  loss_scale_of(opt_state)``: the loss is cast to f32 and multiplied by the optimizer's
  current loss scale (1 for recipes without loss scaling) before differentiating, so the
  gradients come out SCALED, in the units the optimizer's loss-scaling guard divides back
  out; the loss returned is unscaled. Without `opt_state` (None), `fn` is differentiated
  as written (no scaling, no f32 cast: the loss is returned as `fn` returns it), with the
  same handling of fp8 state.

  * An `nnx.Module` first argument is differentiated with respect to its `nnx.Param`
    (grads: an `nnx.State` matching ``nnx.state(model, nnx.Param)``), and the fp8
    gradient-operand scaling state of its fp8 GEMMs is written into the model; other
    model state (fp8 forward state, BatchNorm statistics) updates as in a plain call.
  * `fn` an autocast function with explicit fp8 scaling state (``fn =
    precision.autocast(loss, recipe, fp8_state=True)``, called ``fn(state, *args)``):
    the returned function takes the state first and also returns the new state (forward
    operands and gradient operand, `precision.fp8.merge_grad_state`); `argnums` count
    the arguments after the state.
  * Any other first argument is a pytree of params: ``jax.value_and_grad`` w.r.t. it
    (w.r.t. the arguments `argnums` names).

  Build it inside the step, from the `opt_state` that step's ``tx.update`` receives: the
  scale is read when the returned function is called, from that state, and a state
  captured outside a jitted step would freeze the scale into the compiled step.

  Args:
    fn: ``fn(model_or_params, *args, **kwargs) -> loss`` (``(loss, aux)`` with
      `has_aux`), the loss a floating scalar: the mean over the batch.
    opt_state: the optimizer state (any optax state; its loss scale is found inside), or
      None: no loss scaling.
    has_aux: `fn` returns ``(loss, aux)``.
    argnums: which positional arguments to differentiate (an int or a tuple of them;
      grads then a tuple); 0 for an NNX model.
    telemetry: also return a `precision.numerics.TelemetryRecord` of this call: every GEMM
      operand, cotangent and result of the forward and backward pass with its statistics,
      and the logit monitors (`precision.numerics.gemm_telemetry`), computed by the same
      compiled program as a second evaluation of the loss and gradient under the spec the
      call runs under: an NNX model's mark (`apply_recipe`), or, for a params pytree,
      `fn`'s own (`fn = precision.autocast(loss, recipe)`). fp8 GEMMs are measured on
      their scaled operands (the values the cast to E4M3/E5M2 rounds). Jit
      the step twice, with and without, and call the telemetry one every N steps: the
      step without it is the program it always was.

  Returns:
    ``g(model_or_params, *args, **kwargs) -> (loss, grads)``, or ``((loss, aux), grads)``
    with `has_aux`; `loss` f32 and unscaled (with `opt_state`), `grads` in the params'
    dtypes, scaled; ``g(state, *args, **kwargs) -> (loss, grads, new_state)`` for an
    autocast function with explicit fp8 state; with `telemetry`, ``(loss, grads,
    record)``.

  Examples:
    >>> loss, grads = precision.value_and_grad(loss_fn, opt_state)(model, x, y)
    >>> params = nnx.state(model, nnx.Param)
    >>> params, opt_state = precision.optim.update_and_apply(tx, grads, opt_state, params)
    >>> nnx.update(model, params)
    >>> g = precision.autocast(loss, "fp8_hybrid", fp8_state=True)
    >>> state = g.init_state(params, x)
    >>> loss, grads, state = precision.value_and_grad(g, opt_state)(state, params, x)
  """
  if not isinstance(telemetry, bool):
    raise ValueError(f"value_and_grad: telemetry={telemetry!r}; accepted: True or False")
  plain = _grad.value_and_grad(fn, opt_state, has_aux=has_aux, argnums=argnums)
  if not telemetry:
    return plain
  if argnums != 0:
    raise ValueError(f"value_and_grad(telemetry=True): argnums={argnums!r}; accepted: 0 "
                     "(the model or params are the first argument)")

  def with_telemetry(model_or_params, *args, **kwargs):
    spec, inner = _telemetry_spec(fn, model_or_params)
    traced = _grad.value_and_grad(inner, opt_state, has_aux=has_aux)
    # The model passed is flattened and rebuilt inside the telemetry trace: its state
    # (RNG counters, statistics) is the same for the real call below.
    record = _telemetry.gemm_telemetry(
        lambda m, *a: traced(m, *a, **kwargs), spec, model_or_params, *args)
    value, grads = plain(model_or_params, *args, **kwargs)
    return value, grads, record

  return with_telemetry


def train_step(model: nnx.Module, tx: optax.GradientTransformation, opt_state: Any,
               loss_fn: Callable[..., Any], *args: Any, telemetry: bool = False,
               **kwargs: Any) -> tuple[Any, ...]:
  """One optimizer step of an NNX model under any recipe; updates `model` in place.

  `value_and_grad` (loss scaled by the optimizer's loss scale, fp8 gradient state
  carried), `precision.optim.update_and_apply` (``tx.update``, `apply_updates`: exact
  rounding into 16-bit params, and the state's writes ordered so a jitted step updates
  its donated buffers in place), the new params written into `model`; when the
  optimizer's guard skipped the step (non-finite grads), the fp8 scaling state is rolled
  back with it (`precision.fp8.rollback_fp8_state`), so a skipped step leaves params,
  optimizer state and fp8 state bit-identical. A `tx` that is an optax
  GradientTransformationExtraArgs (a ``Recipe.spike_guard`` optimizer) gets the unscaled
  loss as ``value=``. Other model state (e.g. BatchNorm statistics) keeps
  the step's update. Works eagerly and under any jit: `precision.jit_train_step(model,
  tx, loss_fn)` compiles it once for a model and costs the host what plain `jax.jit`
  does per call; ``nnx.jit(precision.train_step, static_argnums=(1, 3))`` computes the
  same bit for bit but walks the model's object graph on every call.

  Args:
    model: the NNX model, e.g. after `precision.flax.apply_recipe(model, recipe)`.
    tx: the optimizer, e.g. `precision.optim.build_optimizer(recipe, optax.adamw(...))`,
      initialised on ``nnx.state(model, nnx.Param)``.
    opt_state: its state.
    loss_fn: ``loss_fn(model, *args, **kwargs) -> scalar loss`` (floating; the mean over
      the batch). For an auxiliary output use `value_and_grad` with `has_aux`.
    *args, **kwargs: passed to `loss_fn` (the batch).
    telemetry: also return the step's `precision.numerics.TelemetryRecord`: every GEMM
      tensor of its forward and backward pass (see `value_and_grad`) plus the parameter
      monitors of its update (`precision.numerics.param_monitors`, measured on the master
      copy when the recipe keeps one). A keyword of train_step, not passed to `loss_fn`.

  Returns:
    ``(loss, opt_state)``: the f32 unscaled loss of this step (before the update) and the
    new optimizer state; ``(loss, opt_state, record)`` with `telemetry`.

  Examples:
    >>> model = precision.flax.apply_recipe(MLP(rngs=nnx.Rngs(0)), "f16_mixed")
    >>> tx = precision.optim.build_optimizer("f16_mixed", optax.sgd(0.1))
    >>> opt_state = tx.init(nnx.state(model, nnx.Param))
    >>> step = precision.jit_train_step(model, tx, loss_fn)   # updates `model` in place
    >>> for x, y in batches:
    ...   loss, opt_state = step(opt_state, x, y)
    >>> probe = precision.jit_train_step(model, tx, loss_fn, telemetry=True)
    >>> loss, opt_state, record = probe(opt_state, x, y)  # every 100 steps, instead of `step`
    >>> record.report().first_anomaly(), record.monitors()
    >>> # The same step without the helper (Flax walks the model on every call):
    >>> step = nnx.jit(precision.train_step, static_argnums=(1, 3))
    >>> loss, opt_state = step(model, tx, opt_state, loss_fn, x, y)
  """
  if not isinstance(telemetry, bool):
    raise ValueError(f"train_step: telemetry={telemetry!r}; accepted: True or False")
  if not isinstance(model, nnx.Module):
    raise ValueError(
        f"train_step: model is a {type(model).__name__}; accepted: an nnx.Module (for a "
        "pytree of params use precision.value_and_grad, tx.update and "
        "precision.optim.apply_updates)")
  if not isinstance(tx, optax.GradientTransformation):
    raise ValueError(f"train_step: tx={tx!r}; accepted: an optax.GradientTransformation "
                     "(precision.optim.build_optimizer's)")
  has_fp8 = bool(fp8.fp8_modules(model))
  # The fp8 state before the step, for a rollback: a tree map makes new Variables holding
  # the same (immutable) arrays, which the step's in-place updates of the model leave be.
  before = jax.tree.map(lambda x: x, nnx.state(model, fp8.Fp8State)) if has_fp8 else None
  params = nnx.state(model, nnx.Param)
  if telemetry:
    loss, grads, record = value_and_grad(loss_fn, opt_state, telemetry=True)(
        model, *args, **kwargs)
    # Copied now: `params` holds the model's Variables, which the update below rewrites.
    params_before = jax.tree.map(lambda x: x, params)
  else:
    loss, grads = value_and_grad(loss_fn, opt_state)(model, *args, **kwargs)
  # The step core: the unscaled loss as a spike guard's `value`, update, apply_updates,
  # in-place ordering, and the fp8 state of a skipped step rolled back.
  result = _step_core.apply_gradients(
      tx, grads, opt_state, params, loss=loss, fp8_before=before,
      fp8_after=nnx.state(model, fp8.Fp8State) if has_fp8 else None)
  new_opt_state = result.opt_state
  nnx.update(model, result.params)
  if has_fp8:
    nnx.update(model, result.fp8_state)
  if telemetry:
    monitors = _telemetry.update_monitors(params_before, nnx.state(model, nnx.Param), grads,
                                          opt_state, new_opt_state)
    return loss, new_opt_state, record.with_monitors(monitors)
  return loss, new_opt_state


__all__ = ["train_step", "value_and_grad"]
