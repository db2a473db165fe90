"""A task's model trained under one recipe: the `Program` of a (recipe, seed) cell.

Three kinds of model, one training step for all of them:

* ``nnx``: an `nnx.Module`. The recipe is applied with `precision.flax.apply_recipe`
  (its calls run under autocast; fp8 recipes get fp8 layers with their scaling state),
  then the model is split into params and the rest (BatchNorm statistics, RNG counters,
  fp8 state), and each step is `precision.train_step` on the merged model.
* ``linen``: a ``(module, variables)`` pair. The loss runs under `precision.autocast`,
  the user's loss receives a `LinenModel` that applies the module with the current
  params and collections (mutable collections carried out, rng streams keyed by seed and
  step).
* ``params``: a pytree of param arrays; the loss ``loss(params, batch)`` runs under
  `precision.autocast`.

For the linen and params kinds one step is `precision.value_and_grad` (the loss scaled by
the optimizer's loss scale) and `precision.optim.update_and_apply` (``tx.update``,
`apply_updates`, in-place order), exactly as `precision.train_step` does for NNX. Params
start as the task's f32 weights cast to the recipe's param dtype (round to nearest), so
every recipe of a seed starts from the same weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import unfreeze

from precision import _autocast
from precision._autocast import _fp8_state
from precision import _step_core
from precision import flax as mp_flax
from precision import fp8 as mp_fp8
from precision import optim
from precision import _recipe
from precision._plan import Plan, as_plan, bind
from precision._recipe import Recipe
from precision._state import TrainState
from precision._train import train_step
from precision._train import value_and_grad as mp_value_and_grad
from precision.numerics import _inspect
from precision.numerics import _telemetry
from precision.audit import audit
from precision.flax import _nnx as mp_nnx
from precision.study._task import Task

KINDS = ("nnx", "linen", "params")
_F32 = jnp.float32


def model_kind(model: Any) -> str:
  """"nnx", "linen" or "params" for what ``Task.init`` returned; ValueError otherwise."""
  if isinstance(model, nnx.Module):
    return "nnx"
  if (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module)):
    variables = model[1]
    if not (isinstance(variables, Mapping) and "params" in variables):
      raise ValueError(
          f"Task.init returned ({type(model[0]).__name__}, {type(variables).__name__}); "
          "accepted for Linen: (module, variables) with variables['params'] (what "
          "module.init returns)")
    return "linen"
  leaves = jax.tree.leaves(model)
  if leaves and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
    floating = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)]
    if floating:
      return "params"
  raise ValueError(
      f"Task.init returned a {type(model).__name__}; accepted: an nnx.Module, a Linen "
      "(module, variables) pair, or a pytree of arrays with floating params")


def _check_f32(kind: str, params: Any) -> None:
  bad = sorted({str(x.dtype) for x in jax.tree.leaves(params)
                if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != _F32})
  if bad:
    raise ValueError(f"Task.init returned {kind} params in {', '.join(bad)}; accepted: "
                     "float32 params (the study casts them to each recipe's param dtype, "
                     "so every recipe starts from the same weights)")


class LinenModel:
  """A Linen module bound to the study's current variables: call it like ``apply``.

  ``model(*args, **kwargs)`` is ``module.apply(variables, *args, **kwargs)`` with the
  current params and collections; while training (`training` True) every non-param
  collection is mutable and its update is kept (BatchNorm statistics), and each rng
  stream of the task gets ``fold_in(step_key, call_index)``. ``method=`` picks another
  method of the module, as in ``apply``.

  Attributes:
    module: the Linen module. params: its params (the recipe's param dtype).
    state: the other collections ({} if none). training: True in a training step, False
      in evaluation (write ``model(x, train=model.training)``).
  """

  def __init__(self, module: nn.Module, params: Any, state: Mapping[str, Any],
               rng: jax.Array | None, training: bool, streams: tuple[str, ...] = ("dropout",),
               recipe: Recipe | Plan | None = None):
    self.module, self.params, self.state = module, params, dict(state)
    self.training = training
    self._rng, self._streams, self._calls, self._recipe = rng, streams, 0, recipe

  def __call__(self, *args, method=None, **kwargs):
    rngs = None
    if self._rng is not None and self._streams:
      key = jax.random.fold_in(self._rng, self._calls)
      rngs = {s: jax.random.fold_in(key, i) for i, s in enumerate(self._streams)}
    self._calls += 1
    # No collections: mutable=False (flax returns (out, {}) for an empty list).
    mutable = list(self.state) if self.training and self.state else False
    module = self.module

    def apply(params, state):
      return module.apply({"params": params, **state}, *args, rngs=rngs, mutable=mutable,
                          method=method, **kwargs)

    if self._recipe is not None:
      # Evaluation of a user's `evaluate`: the apply runs under the recipe as training did.
      apply = _autocast.autocast(apply, self._recipe)
    out = apply(self.params, self.state)
    if mutable:
      out, updated = out
      self.state = {**self.state, **unfreeze(updated)}
    return out


@dataclasses.dataclass
class Program:
  """One (recipe, seed) cell's model, initial state and jitted step.

  Attributes:
    kind: "nnx", "linen" or "params".
    recipe: the recipe trained (fp8 first/last GEMMs already added to its kept list).
    state: the initial TrainState (params in the param dtype, optimizer state, the
      model's other state, rng: uint32 key data of ``key(seed)``).
    step: ``step(state, batch, t) -> (state, metrics)``, jitted, donating `state`;
      metrics: device scalars loss, grad_norm, loss_scale, skipped_steps,
      nonfinite_steps, consecutive_nonfinite, fp8_saturated.
    evaluate: ``evaluate(state) -> float``.
    n_params: trainable parameter count.
    graphdef: the NNX model's graph (marked with the plan): ``nnx.merge(graphdef,
      state.params, state.model_state)`` is the model as trained; None for other kinds.
    telemetry: ``telemetry(state, batch, t, whatif) -> TelemetryRecord`` (jitted,
      `whatif` static): the numerics of the step `step` would take from `state` on
      `batch` (every GEMM tensor of its forward and backward pass, the logit monitors,
      and the parameter monitors of its update), computed without changing `state`.
      fp8 GEMMs are measured on their scaled operands (the values the cast to E4M3 /
      E5M2 rounds), inside fp8 layers or with the explicit scaling state alike.
    core: ``core(state, batch, t, seed) -> (state, metrics)``, not jitted: the step as a
      pure function of its arguments, `seed` (a uint32 scalar, traced or not) seeding
      the optimizer's stochastic rounding. Every seed of a recipe shares it (the model's
      structure, the plan, the loss), so `jax.vmap` of it over stacked states, batches
      and seeds trains many seeds in one program (`precision.study._batched`).
  """

  kind: str
  recipe: Recipe
  state: TrainState
  step: Callable[..., Any]
  evaluate: Callable[[TrainState], float]
  n_params: int
  graphdef: Any = None
  telemetry: Callable[..., Any] | None = None
  core: Callable[..., Any] | None = None


def _fnmatch_literal(path: str) -> str:
  # Module paths are matched with fnmatch; a literal path must not act as a pattern.
  return "".join(f"[{c}]" if c in "*?[]" else c for c in path)


def fp8_role_keeps(task: Task, model: nnx.Module, batch: Any) -> tuple[str, ...]:
  """Module paths of the first and last forward GEMM of an NNX model's loss.

  Transformer Engine's practice, stated as a rule of the study: under an fp8 recipe the
  first GEMM (the stem or first projection) and the last (the head) stay in the compute
  dtype whatever the layers are called. Found by tracing the loss of the model under the
  fp32 recipe (nothing runs) and reading the module scope of each forward GEMM.

  Returns:
    The distinct paths (1 or 2), or () when the model has no GEMM in a module scope.
  """
  mp_flax.apply_recipe(model, "fp32")
  gemms = [g for g in audit(task.loss, model, batch).gemms if g.direction == "fwd"]
  scopes = [g.scope for g in gemms if g.scope]
  if not scopes:
    return ()
  return tuple(dict.fromkeys((scopes[0], scopes[-1])))


def with_fp8_keeps(recipe: Recipe, paths: tuple[str, ...]) -> Recipe:
  """`recipe` whose fp8 config also keeps the GEMMs of `paths` in the compute dtype."""
  return _recipe.with_fp8_keeps(recipe, tuple(_fnmatch_literal(p) for p in paths))


def _copy_leaves(tree: Any) -> Any:
  # Optimizer inits may share one buffer between leaves (zero counters); a donated step
  # needs every leaf in a buffer of its own.
  return jax.tree.map(jnp.copy, tree)


def _rng_data(seed: int) -> jax.Array:
  return jax.random.key_data(jax.random.key(seed))


def _metrics(opt_state: Any, loss: jax.Array, fp8_saturated: jax.Array | None) -> dict:
  m = dict(optim.optimizer_metrics(opt_state))
  m["loss"] = loss
  m["fp8_saturated"] = (jnp.zeros((), _F32) if fp8_saturated is None
                        else jnp.asarray(fp8_saturated, _F32))
  return m


def _telemetry_record(vg, spec, args, grads_of, params, opt_state, tx, whatif,
                      grads_in=None):
  """The TelemetryRecord of one step: GEMM rows of `vg(*args)` under `spec` (a Plan, a
  model's mark, or `_inspect.AsWritten` for a `vg` that runs its recipe itself) and the
  parameter monitors of the update the step would make. `grads_in(outputs)`: the step's
  gradients from the outputs of the evaluation measured (default: autocast's
  ``(value, grads)`` with grads widened to f32, narrowed back to the params' dtypes);
  `grads_of()` computes them anew where the outputs do not give them."""
  rec, outputs = _telemetry.telemetry_and_outputs(vg, spec, *args, whatif=whatif)
  if grads_in is not None:
    grads = grads_in(outputs)
  elif np.dtype(spec.policy.output_dtype) == np.dtype(np.float32):
    # The gradients of the evaluation measured, widened to f32 by autocast's output
    # cast (exact): narrowed back to the params' dtypes they are the step's own.
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), outputs[1], params)
  else:
    grads = grads_of()
  updates, new_opt_state = tx.update(grads, opt_state, params)
  after = optim.apply_updates(params, updates)
  return rec.with_monitors(_telemetry.update_monitors(params, after, grads, opt_state,
                                                      new_opt_state))


def _mean(values: list[float]) -> float:
  return float(np.mean(np.asarray(values, np.float64)))


def build(task: Task, recipe: Recipe, seed: int, fp8_keeps: tuple[str, ...] = (),
          overrides: Mapping[str, str] | None = None) -> Program:
  """The Program of `task` under `recipe` for `seed` (calls ``task.init(seed)``).

  The recipe is bound once (`precision.bind`, with the study's `overrides`): the model's
  marking or autocast, the optimizer and the ledger all come from that one Plan.
  """
  model = task.init(seed)
  kind = model_kind(model)
  if kind == "nnx":
    recipe = with_fp8_keeps(recipe, fp8_keeps)
  plan = bind(recipe, overrides=dict(overrides) if overrides else None)
  tx = plan.optimizer(task.optimizer, seed=seed)
  held_out = None if task.evaluate is not None else task.held_out()
  prog = (_build_nnx(task, plan, seed, model, tx, held_out) if kind == "nnx"
          else _build_functional(task, plan, seed, kind, model, tx, held_out))
  # The builders leave their `make_step(tx)` in `core`; the seed-explicit step takes it.
  return dataclasses.replace(prog, core=_core(prog.core, plan, task.optimizer, tx))


def seeds_rounding(recipe: Recipe | Plan) -> bool:
  """Whether `recipe`'s optimizer reads the seed (stochastic rounding, fused or not)."""
  return as_plan(recipe).optimizer_decisions.seeds_rounding


def _core(make_step, plan: Plan, inner, tx):
  """The seed-explicit step of a Program from its `make_step(tx)`: a recipe whose updates
  round stochastically gets the optimizer built for the given seed (a traced uint32
  seed hashes as the int does); any other recipe never reads the seed, and keeps the one
  optimizer built for the cell."""
  def core(state, batch, t, seed):
    tx_seed = plan.optimizer(inner, seed=seed) if seeds_rounding(plan) else tx
    return make_step(tx_seed)(state, batch, t)
  return core


def _build_nnx(task, plan: Plan, seed, model, tx, held_out) -> Program:
  _check_f32("NNX", nnx.state(model, nnx.Param))
  recipe = plan.recipe
  mp_flax.apply_recipe(model, plan)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  has_fp8 = bool(mp_fp8.fp8_modules(model))
  state = TrainState(params, _copy_leaves(tx.init(params)), _copy_leaves(rest),
                     _rng_data(seed))

  def make_step(tx):
    def step(state: TrainState, batch: Any, t: jax.Array):
      del t  # NNX models draw their randomness from their own Rngs (in model_state)
      m = nnx.merge(graphdef, state.params, state.model_state)
      loss, opt_state = train_step(m, tx, state.opt_state, task.loss, batch)
      _, params, rest = nnx.split(m, nnx.Param, ...)
      sat = mp_fp8.fp8_metrics(m)["fp8/saturated"] if has_fp8 else None
      return (state._replace(params=params, opt_state=opt_state, model_state=rest),
              _metrics(opt_state, loss, sat))
    return step

  step = make_step(tx)

  if held_out is not None:
    def eval_loss(params, rest, batch):
      m = nnx.merge(graphdef, params, rest)
      m.eval()  # deterministic dropout, running statistics
      return jnp.asarray(task.loss(m, batch), _F32)

    eval_jit = jax.jit(eval_loss)
    evaluate = lambda s: _mean([float(eval_jit(s.params, s.model_state, b))
                                for b in held_out])
  else:
    evaluate = lambda s: float(task.evaluate(nnx.merge(graphdef, s.params, s.model_state)))
  def telemetry(state: TrainState, batch: Any, t: jax.Array, whatif: bool):
    del t
    def vg(model, batch):
      return mp_value_and_grad(task.loss, state.opt_state)(model, batch)

    def grads_of():
      return vg(nnx.merge(graphdef, state.params, state.model_state), batch)[1]

    m = nnx.merge(graphdef, state.params, state.model_state)
    # The model's mark (the plan's spec; fp8 layers hold their own scaling state).
    return _telemetry_record(vg, mp_nnx.spec_of(m), (m, batch), grads_of, state.params,
                             state.opt_state, tx, whatif)

  n = int(sum(x.size for x in jax.tree.leaves(params)))
  return Program("nnx", recipe, state, jax.jit(step, donate_argnums=(0,)), evaluate, n,
                 graphdef, jax.jit(telemetry, static_argnums=(3,)), make_step)


def _build_functional(task, plan: Plan, seed, kind, model, tx, held_out) -> Program:
  recipe = plan.recipe
  if kind == "linen":
    module, variables = model
    variables = unfreeze(variables)
    f32_params = variables["params"]
    collections = {k: v for k, v in variables.items() if k != "params"}
  else:
    module, f32_params, collections = None, model, {}
  _check_f32(kind, f32_params)
  params = plan.policy.cast_to_param(f32_params)
  streams = task.rng_streams
  has_fp8 = plan.fp8 is not None

  def loss_of(params, collections, batch, rng, scale):
    # The loss in f32 times the optimizer's loss scale (1 without loss scaling), so the
    # gradients arrive in the units the recipe's guard divides back out.
    if module is None:
      loss, new = task.loss(params, batch), collections
    else:
      m = LinenModel(module, params, collections, rng, training=True, streams=streams)
      loss = task.loss(m, batch)
      new = m.state
    loss = jnp.asarray(loss).astype(_F32)
    # A non-finite loss makes the gradients NaN: the guard skips the step (as train_step).
    return optim.nonfinite_loss_guard(loss) * scale, (loss, new)

  def eval_loss(params, collections, batch):
    if module is None:
      return jnp.asarray(task.loss(params, batch), _F32)
    m = LinenModel(module, params, collections, None, training=False, streams=streams)
    return jnp.asarray(task.loss(m, batch), _F32)

  # fp8 recipes run their GEMMs through autocast with the scaling state explicit (delayed
  # scaling keeps amax histories): model_state is then {"collections", "fp8"}.
  if has_fp8:
    # The fp8 entry points take the cell's plan itself (the same GEMM choice, bound once).
    vg = mp_value_and_grad(_autocast.autocast(loss_of, plan, fp8_state=True), has_aux=True)
    example = next(iter(task.batches(seed)))
    fp8_state0 = _fp8_state.init_state(loss_of, plan, params, collections, example,
                                       jax.random.key(0), jnp.ones((), _F32))
    model_state = {"collections": collections, "fp8": fp8_state0}
  else:
    vg = jax.value_and_grad(_autocast.autocast(loss_of, plan), has_aux=True)
    model_state = collections

  def make_step(tx):
    def step(state: TrainState, batch: Any, t: jax.Array):
      # Common random numbers: the key of step t depends on the seed and t only.
      rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), t)
      scale = optim.loss_scale_of(state.opt_state)
      if has_fp8:
        fp8_old = state.model_state["fp8"]
        (_, (loss, new_coll)), grads, fp8_new = vg(
            fp8_old, state.params, state.model_state["collections"], batch, rng, scale)
      else:
        (_, (loss, new_coll)), grads = vg(state.params, state.model_state, batch, rng, scale)
      # The step core (precision._step_core, as train_step's and the data-parallel
      # step's): the unscaled loss as a spike guard's value, update, apply, in-place
      # order, and the fp8 state of a skipped step rolled back with params and moments.
      result = _step_core.apply_gradients(
          tx, grads, state.opt_state, state.params, loss=loss,
          fp8_before=fp8_old if has_fp8 else None, fp8_after=fp8_new if has_fp8 else None)
      params, opt_state = result.params, result.opt_state
      sat = None
      if has_fp8:
        fp8_new = result.fp8_state
        new_model_state = {"collections": new_coll, "fp8": fp8_new}
        sat = mp_fp8.fp8_metrics(fp8_new)["fp8/saturated"]
      else:
        new_model_state = new_coll
      return (state._replace(params=params, opt_state=opt_state, model_state=new_model_state),
              _metrics(opt_state, loss, sat))
    return step

  step = make_step(tx)

  def collections_of(s):
    return s.model_state["collections"] if has_fp8 else s.model_state

  if held_out is not None:
    if has_fp8:
      eval_fp8 = jax.jit(_autocast.autocast(eval_loss, plan, fp8_state=True))
      eval_jit = lambda s, b: eval_fp8(s.model_state["fp8"], s.params, collections_of(s),
                                       b)[0]
    else:
      eval_plain = jax.jit(_autocast.autocast(eval_loss, plan))
      eval_jit = lambda s, b: eval_plain(s.params, s.model_state, b)
    evaluate = lambda s: _mean([float(eval_jit(s, b)) for b in held_out])
  elif module is None:
    evaluate = lambda s: float(task.evaluate(s.params))
  else:
    evaluate = lambda s: float(task.evaluate(LinenModel(
        module, s.params, collections_of(s), None, training=False, streams=streams,
        recipe=None if has_fp8 else plan)))
  def telemetry(state: TrainState, batch: Any, t: jax.Array, whatif: bool):
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), t)
    scale = optim.loss_scale_of(state.opt_state)
    args = (state.params, collections_of(state), batch, rng, scale)
    plain_vg = jax.value_and_grad(loss_of, has_aux=True)

    if has_fp8:
      # The step's own gradient function, measured as written: it runs the fp8 GEMMs
      # with the explicit scaling state, whose new value the record discards.
      return _telemetry_record(vg, _inspect.AsWritten(str(plan.policy)),
                               (state.model_state["fp8"], *args), None, state.params,
                               state.opt_state, tx, whatif, grads_in=lambda out: out[1])
    return _telemetry_record(plain_vg, plan, args, lambda: vg(*args)[1], state.params,
                             state.opt_state, tx, whatif)

  state = TrainState(params, _copy_leaves(tx.init(params)), _copy_leaves(model_state),
                     _rng_data(seed))
  n = int(sum(x.size for x in jax.tree.leaves(params)))
  return Program(kind, recipe, state, jax.jit(step, donate_argnums=(0,)), evaluate, n,
                 None, jax.jit(telemetry, static_argnums=(3,)), make_step)


def check_loss(task: Task, model: Any, batch: Any) -> None:
  """Raises ValueError unless ``task.loss(model, batch)`` is a floating scalar (traced
  abstractly under fp32: nothing runs)."""
  kind = model_kind(model)
  if kind == "nnx":
    graphdef, state = nnx.split(model)
    fn = lambda s, b: task.loss(nnx.merge(graphdef, s), b)
    args = (state, batch)
  elif kind == "linen":
    module, variables = model
    variables = unfreeze(variables)
    rest = {k: v for k, v in variables.items() if k != "params"}
    fn = lambda p, b: task.loss(LinenModel(module, p, rest, jax.random.key(0), True,
                                           task.rng_streams), b)
    args = (variables["params"], batch)
  else:
    fn, args = task.loss, (model, batch)
  try:
    out = jax.eval_shape(fn, *args)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f"Task.loss(model, batch) failed on the first batch of seed 0: "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                     ) from e
  shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
  if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    what = f"{dtype}{list(shape)}" if shape is not None else type(out).__name__
    raise ValueError(f"Task.loss returned {what}; accepted: a floating scalar (the mean "
                     "over the batch)")
