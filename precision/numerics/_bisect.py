"""precision.numerics.bisect: which part of a model made a recipe's run diverge.

From a state saved before the divergence, the next steps are replayed under the recipe
as is (the baseline, which must reproduce the original run bit for bit), under the
recipe's f32 counterpart (the reference) and under the recipe with groups of GEMMs
promoted to f32 by autocast overrides, until a promoted set (one group when one
explains it) whose loss trajectory stays within a tolerance of the reference is found.
A group is one direction of one scope, "scope:fwd" (its forward GEMMs) or "scope:bwd"
(its backward GEMMs): the module paths / name scopes of the GEMMs of the loss
(`inspect`), each split by direction with direction-specific overrides. The culprit's
worst GEMM tensors from that `inspect` run say what went wrong there.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from precision import checkpoint as ckpt_lib
from precision import optim
from precision._policy import Policy, dtype_name
from precision._plan import Plan, as_plan
from precision._recipe import Recipe
from precision.checkpoint import _owner
from precision.numerics import _inspect
from precision.numerics import _report
from precision.numerics._bisect_groups import DIRECTIONS
from precision.numerics._bisect_groups import expand
from precision.numerics._bisect_groups import group
from precision.numerics._bisect_groups import split_group
from precision.numerics._bisect_report import BisectResult
from precision.numerics._bisect_report import Replay

_F32 = np.dtype(np.float32)
TELEMETRY_ROWS = 3   # worst GEMM tensors of the culprit kept in the result


# ------------------------------------------------------------------------------ inputs


def _check_steps(steps: Any) -> int:
  if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
    raise ValueError(f"steps={steps!r}; accepted: an integer >= 1 (steps replayed)")
  return int(steps)


def _check_tolerance(tolerance: Any) -> float:
  if (isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real)
      or not math.isfinite(float(tolerance)) or tolerance < 0):
    raise ValueError(f"tolerance={tolerance!r}; accepted: a finite number >= 0 (the "
                     "largest |loss - f32 reference loss| over the replayed steps)")
  return float(tolerance)


def _check_groups(groups: Any) -> tuple:
  if isinstance(groups, str) or not isinstance(groups, (list, tuple)):
    raise ValueError(f"groups={groups!r}; accepted: a list of scope paths (module paths "
                     "or jax.named_scope names, e.g. ['blocks/0/mlp', 'head']: both "
                     "directions of each), or single directions ('head:bwd', 'l0:fwd')")
  if not groups:
    raise ValueError("groups=() is empty; accepted: at least one scope path, or None to "
                     "take the scopes of the loss's GEMMs")
  for g in groups:
    if not isinstance(g, str) or not split_group(g)[0].strip("/ "):
      raise ValueError(f"groups holds {g!r}; accepted: non-empty scope paths, each "
                       "optionally with ':fwd' or ':bwd'")
  out = expand(groups)
  if len(out) != sum(1 if split_group(g)[1] else 2 for g in groups):
    raise ValueError(f"groups={list(groups)!r} repeats a scope or a direction; accepted: "
                     "distinct groups")
  return out


def f32_counterpart(recipe: Recipe | str | Plan) -> Recipe:
  """`recipe` computing in f32: same param and output dtypes, optimizer, loss scaling
  and fp32 ops, so a state of `recipe` steps under it unchanged."""
  plan = as_plan(recipe)
  p = plan.policy
  if np.dtype(p.compute_dtype) == _F32:
    raise ValueError(f"recipe {plan.name!r} computes in f32 already ({p}); accepted: a "
                     "recipe with a bf16 or f16 compute dtype (nothing to promote)")
  return plan.recipe.replace(name=f"{plan.name}_f32_compute",
                             policy=Policy(p.param_dtype, _F32, p.output_dtype))


def _promoted_policy(policy: Policy) -> str:
  return f"p={dtype_name(policy.param_dtype)},c=f32,o={dtype_name(policy.output_dtype)}"


def literal(scope: str) -> str:
  """A scope as an fnmatch pattern matching exactly itself ('[*]' for a literal '*')."""
  return "".join(f"[{c}]" if c in "*?[]" else c for c in scope)


def overrides_for(promoted: Iterable[str], groups: Sequence[str],
                  recipe: Recipe | str | Plan) -> dict:
  """Autocast overrides promoting exactly the GEMMs of `promoted` (groups "scope:fwd",
  "scope:bwd", or plain scopes: both): each promoted group's scope gets the f32 policy
  for that direction, and a group nested in a promoted one of its direction but not
  promoted itself keeps the recipe's policy there (the deepest matching scope decides,
  per direction). A scope with both directions promoted gets the plain f32 policy."""
  promoted, groups = set(expand(promoted)), expand(groups)
  policy = as_plan(recipe).policy
  up, base = _promoted_policy(policy), str(policy)
  scopes = list(dict.fromkeys(split_group(g)[0] for g in (*groups, *sorted(promoted))))
  out = {}
  for scope in scopes:
    value = {}
    for d in DIRECTIONS:
      if group(scope, d) in promoted:
        value[d] = up
      elif group(scope, d) in groups and any(
          scope.startswith(p + "/") for p, pd in map(split_group, promoted) if pd == d):
        value[d] = base
    if value:
      same = len(value) == 2 and value["fwd"] == value["bwd"]
      out[literal(scope)] = value["fwd"] if same else value
  return out


def _take(batches: Iterable[Any], steps: int) -> list:
  out = []
  for b in batches:
    out.append(b)
    if len(out) == steps:
      return out
  raise ValueError(f"batches yielded {len(out)} batches; accepted: at least steps={steps}")


def restore_checked(directory: str, target: Any, recipe: Recipe, step: int | None,
                    seed: int | None) -> ckpt_lib.Restored:
  """Restores `directory` (step `step`, the newest when None) into `target` after
  checking that it belongs to a run of `recipe` (and `seed` when given): its run record
  and the step's saved recipe; a state of another shape is refused too."""
  ckpt = ckpt_lib.Checkpointer(directory)
  record = ckpt.run_record()
  if record is not None:
    diff = _owner.difference(record, recipe, record.model_config, seed)
    if diff is not None:
      raise ValueError(f"checkpoint={directory!r} is from another run ({record.run_id}): "
                       f"{diff}; accepted: a checkpoint of the run being bisected")
  meta = ckpt.metadata(step)
  saved = Recipe.from_dict(meta["recipe"])
  diff = _owner.recipe_difference(saved, recipe)
  if diff is not None:
    raise ValueError(f"checkpoint={directory!r} step {meta['step']} is from another run: "
                     f"{diff}; accepted: a checkpoint of the run being bisected")
  if seed is not None and meta.get("seed") is not None and int(meta["seed"]) != int(seed):
    raise ValueError(f"checkpoint={directory!r} step {meta['step']} is from another run: "
                     f"seed {meta['seed']}, this one {seed}")
  try:
    return ckpt.restore(target, step=meta["step"])
  except ckpt_lib.CheckpointMismatchError as e:
    raise ValueError(f"checkpoint={directory!r} is from another run (its state does not "
                     f"fit this one): {e}") from None


# ----------------------------------------------------------------------------- replays


def _copy(state: Any) -> Any:
  # A fresh buffer per leaf: the step may donate its state, and every replay starts from
  # the same restored one.
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, state)


def _gaps(losses: np.ndarray, ref: np.ndarray) -> np.ndarray:
  with np.errstate(invalid="ignore", over="ignore"):
    gap = np.abs(losses - ref)
  return np.where(np.isfinite(losses) & np.isfinite(ref), gap, np.inf)


class _Replayer:
  """Runs the replays and keeps them, each against the reference once that exists."""

  def __init__(self, make_step, recipe, plan, state, batches, groups, tolerance):
    self.make_step, self.recipe, self.plan, self.state = make_step, recipe, plan, state
    self.batches, self.groups, self.tolerance = batches, groups, tolerance
    self.ref: np.ndarray | None = None
    self.done: list[Replay] = []

  def losses(self, recipe: Recipe, overrides: Mapping[str, str] | None) -> np.ndarray:
    step = self.make_step(recipe, overrides)
    state, out = _copy(self.state), []
    for batch in self.batches:
      state, loss = step(state, batch)
      out.append(np.asarray(jax.device_get(loss), np.float32).reshape(()))
    return np.stack(out)

  def run(self, kind: str, promoted: tuple = (), recipe: Recipe | None = None) -> Replay:
    overrides = overrides_for(promoted, self.groups, self.plan) if promoted else None
    raw = self.losses(recipe or self.recipe, overrides)
    if self.ref is None:
      self.ref = raw
    gap = _gaps(raw.astype(np.float64), self.ref.astype(np.float64))
    r = Replay(kind, tuple(promoted), tuple(float(x) for x in raw), float(gap[-1]),
               float(gap.max()), bool(gap.max() <= self.tolerance))
    self.done.append(r)
    return r


def _search(rp: _Replayer, groups: tuple) -> tuple:
  """The promoted set found (() when none): see `bisect` for the algorithm."""
  cand, verified = list(groups), False
  while len(cand) > 1:
    half = cand[:(len(cand) + 1) // 2]
    if rp.run("halve", tuple(half)).within:
      cand, verified = half, True
    else:
      cand, verified = cand[len(half):], False
  if verified or rp.run("verify", tuple(cand)).within:
    return tuple(cand)
  if len(groups) == 1 or not rp.run("all", groups).within:
    return ()
  kept = list(groups)
  for g in groups:
    trial = [k for k in kept if k != g]
    if trial and rp.run("shrink", tuple(trial)).within:
      kept = trial
  return tuple(kept)


def _compare(base: Replay, original: Sequence[float] | None, steps: int):
  if original is None:
    return None, None
  orig = np.asarray([float(x) for x in original][:steps], np.float32)
  if orig.size < steps:
    raise ValueError(f"original_losses holds {orig.size} losses; accepted: at least "
                     f"steps={steps}")
  mine = np.asarray(base.losses, np.float32)
  # Bit for bit, except that two non-finite losses at the same step are the same fault:
  # a NaN's sign and payload depend on the op that made it (x86 makes -NaN from inf - inf)
  # and are lost where losses are logged (JSON writes every NaN as NaN).
  differ = np.flatnonzero((mine.view(np.uint32) != orig.view(np.uint32))
                          & ~(~np.isfinite(mine) & ~np.isfinite(orig)))
  if differ.size == 0:
    return True, None
  i = int(differ[0])
  return False, (f"replayed step {i + 1}: loss {mine[i]!r}, original {orig[i]!r}")


def _telemetry(report, culprits: tuple) -> tuple:
  """The worst GEMM tensors of the culprits' scopes (nested ones included), each of the
  culprit's direction."""
  wanted = [split_group(c) for c in culprits]
  rows = tuple(r for r in report.rows
               if any((r.scope == s or r.scope.startswith(s + "/")) and r.direction == d
                      for s, d in wanted))
  sub = _report.NumericsReport(report.name, report.policy, rows, report.unvisited)
  return sub.worst(TELEMETRY_ROWS)


def bisect(make_step: Any, recipe: Any, state: Any = None,
           batches: Iterable[Any] | None = None, *, steps: int, tolerance: float,
           loss: Callable[[Any, Any], Any] | None = None, checkpoint: str | None = None,
           step: int | None = None, seed: int | None = None,
           original_losses: Sequence[float] | None = None,
           groups: Sequence[str] | None = None) -> BisectResult:
  """Finds the smallest group of GEMMs whose promotion to f32 undoes a divergence.

  Replays `steps` steps from `state` (or the checkpoint restored into it):
    1. the baseline: `recipe` as is; compared bit for bit with `original_losses` (the
       run's losses of those steps) when given, two non-finite losses of one step
       counting as equal (a NaN's sign and payload are not kept by a JSON log);
    2. the reference: the recipe's f32 counterpart (compute dtype f32; params, output,
       optimizer and loss scaling unchanged, so the state steps under it as is);
    3. the recipe with groups promoted to f32 by autocast overrides, searched as below.
  A replay is within tolerance when max over steps |loss - reference loss| <= tolerance
  (a non-finite loss is an infinite gap).

  Groups are (scope, direction) pairs written "scope:fwd" and "scope:bwd": the module
  paths / jax.named_scope names of the GEMMs of `jax.grad(loss)` as `inspect` sees them
  on the restored state and the first batch, in program order, each scope's forward
  group followed by its backward one (2 groups per scope: halving narrows to a scope,
  then to a direction). Promoting "l0:bwd" gives l0's backward GEMMs (the gradient GEMMs
  of its GEMMs) f32 operands, cotangent and accumulation by a direction-specific
  override ({"l0": {"bwd": f32 policy}}); its forward GEMMs and every other op keep the
  recipe's policy. "l0:fwd" promotes its forward GEMMs and the scope's other ops (f32
  ops, elementwise), whose backward follows their forward. The culprit's telemetry rows
  are its scope's GEMM tensors of its direction. GEMMs outside any scope cannot be
  promoted (`BisectResult.unscoped` counts their tensors). The telemetry is read at the
  first replayed step where the baseline leaves tolerance (its state replayed again up to
  there): a fault that appears only at a later step (an overflow the first batch does not
  reach) is seen where it happens; rows rank overflow and non-finite values above SQNR.

  Algorithm, n groups (twice the scopes searched):
    * the baseline is within tolerance: stop (2 replays).
    * single culprit: halve the candidates (first half promoted: within -> keep it,
      else the second half), ceil(log2 n) replays; the last candidate is replayed alone
      unless the last halving step already promoted it alone and passed: at most
      ceil(log2 n) + 1 replays, ceil(log2 n) + 3 with the baseline and reference
      (ceil(log2 n) + 2 when the last halving step passes). The extra replay is what
      makes the culprit a tested fact: without it a divergence that needs two groups
      would name a false culprit (any search ending in a passing single group needs
      ceil(log2 n) + 1 replays in the worst case).
    * no single group passes: every group promoted (1 replay; fails -> no culprit: the
      cause lies outside the groups), then each group is dropped in turn while the rest
      still passes (n replays): a set none of whose members can be dropped.
  Worst case: ceil(log2 n) + n + 4 replays.

  Args:
    make_step: ``make_step(recipe, overrides) -> step``, ``step(state, batch) -> (state,
      loss)``: the run's training step built under `recipe` (a Recipe: the run's, or its
      f32 counterpart) with `overrides` ({scope pattern: policy string, or
      {"fwd": .., "bwd": ..} of policy strings for one direction} for
      precision.autocast / precision.bind, or None). It may jit and donate its state.
      Or a precision.study.Task: the cell of `recipe` whose `checkpoint` is given
      (<study out>/cells/<cell>/ckpt) is replayed with the study's own step; state,
      batches (the task's stream at the checkpoint's step), loss and the original
      losses (the cell's steps.jsonl) come from the cell; a checkpoint of another task
      (the study's task digest), recipe or seed is refused.
    recipe: the run's Recipe, preset name or Plan without overrides (not fp8: its GEMMs
      are chosen by Fp8Config, not overrides).
    state: the state to replay from; with `checkpoint`, the target it is restored into
      (a TrainState of the run's structure, e.g. its initial state).
    batches: the batches of the steps after the state (at least `steps`).
    steps: steps replayed (>= 1). tolerance: loss units (>= 0).
    loss: ``loss(params, batch) -> scalar`` (state.params) for the groups and the
      telemetry (run under `recipe` by `inspect`, times the state's loss scale); None:
      `groups` must be given and there is no telemetry.
    checkpoint, step: a precision.checkpoint directory and step (newest when None). A
      checkpoint of another run (run record, saved recipe, seed or state shape differ)
      is refused.
    seed: the run's seed, checked against the checkpoint's when given.
    original_losses: the original run's losses of the replayed steps.
    groups: groups to search instead of the loss's: scope paths (each matched
      literally; a plain scope is both its groups, "scope:fwd" then "scope:bwd") or
      single directions ("head:bwd").
  Returns:
    A BisectResult; ``str(result)`` is the verdict.
  Raises:
    ValueError: steps < 1, a negative or non-finite tolerance, empty groups (given, or
      no GEMM of the loss in a scope), a checkpoint from another run, too few batches
      or original losses, an fp8 recipe or one computing in f32.

  Examples:
    >>> def make_step(recipe, overrides):
    ...   plan = mp.bind(recipe, overrides=overrides)
    ...   tx = mp.optim.build_optimizer(plan, optax.adam(1e-3))
    ...   fn = mp.autocast(loss, plan)
    ...   def step(state, batch):   # the loss times the loss scale, differentiated
    ...     value, grads = mp.value_and_grad(fn, state.opt_state)(state.params, batch)
    ...     updates, opt = tx.update(grads, state.opt_state, state.params)
    ...     return state._replace(params=mp.optim.apply_updates(state.params, updates),
    ...                           opt_state=opt), value
    ...   return jax.jit(step)
    >>> result = mp.numerics.bisect(make_step, recipe, initial_state, batches[100:],
    ...                             checkpoint="run/ckpt", step=100, steps=8,
    ...                             tolerance=1e-3, loss=loss, original_losses=losses[100:])
    >>> print(result)   # ... layer 'l0' backward GEMMs: ...; its worst GEMM tensor: l0,
    ...                 # backward GEMM cotangent, float16: 100% underflow.
    >>> result.culprits, result.baseline_bit_identical, result.n_replays
    (('l0:bwd',), True, 6)

    A cell of a precision.study run, from its checkpoint of step 100:

    >>> mp.numerics.bisect(task, "f16_mixed", checkpoint="study_out/cells/"
    ...                    "f16_mixed__s0/ckpt", step=100, steps=20, tolerance=0.05)
  """
  # A precision.study.Task brings its own replay (Task.bisect_replay): numerics sits
  # below the study and knows it only by that method.
  is_task = callable(getattr(type(make_step), "bisect_replay", None))
  if not callable(make_step) and not is_task:
    raise ValueError(f"make_step={make_step!r}; accepted: make_step(recipe, overrides) "
                     "-> step(state, batch) -> (state, loss), or a precision.study.Task")
  plan = as_plan(recipe)  # a Recipe, a preset name or a Plan, bound once
  if plan.bound_dict() != as_plan(plan.recipe).bound_dict():
    raise ValueError(f"recipe={plan}: bisect sets the overrides itself (groups promoted to "
                     "f32) and make_step takes the recipe alone; accepted: a Recipe, a "
                     "preset name or a Plan without overrides or fp32_ops of its own")
  recipe = plan.recipe  # what make_step(recipe, overrides) and the checkpoint take
  steps, tolerance = _check_steps(steps), _check_tolerance(tolerance)
  if plan.fp8 is not None:
    raise ValueError(f"recipe {plan.name!r} has fp8 GEMMs, which Fp8Config chooses "
                     "(keep_high_precision), not overrides; accepted: a recipe without fp8")
  reference = f32_counterpart(plan)
  if groups is not None:
    groups = _check_groups(groups)
  start = None
  if is_task:
    if state is not None or batches is not None or loss is not None:
      raise ValueError("a Task brings its own state (from `checkpoint`), batches and "
                       "loss; accepted: state=None, batches=None, loss=None with a Task")
    prep = make_step.bisect_replay(recipe, checkpoint, step, seed, steps,
                                   restore_checked)
    make_step, state, batches, loss, start = prep[:5]
    if original_losses is None:
      original_losses = prep.original_losses
  else:
    if loss is None and groups is None:
      raise ValueError("loss=None and groups=None; accepted: loss(params, batch) (the "
                       "groups are its GEMMs' scopes) or an explicit list of groups")
    if state is None or batches is None:
      raise ValueError("state and batches are needed with make_step (state: the state "
                       "to replay from, or the target a checkpoint is restored into)")
    if checkpoint is not None:
      restored = restore_checked(checkpoint, state, recipe, step, seed)
      state, start = restored.state, restored.step
  batches = _take(batches, steps)
  report = _inspect_at(loss, plan, state, batches[0]) if loss is not None else None
  found = expand(dict.fromkeys(r.scope for r in report.rows if r.scope)) if report else ()
  if groups is None:
    if not found:
      raise ValueError("groups: the loss has no GEMM inside a module path or "
                       "jax.named_scope, so no override can promote part of it (empty "
                       "groups); accepted: a loss whose layers run in scopes, or groups=")
    groups = found
  unscoped = sum(1 for r in report.rows if not r.scope) if report else 0
  rp = _Replayer(make_step, recipe, plan, state, batches, groups, tolerance)
  # The reference runs first so that every replay, the baseline included, has its gaps;
  # the baseline is listed first.
  rp.run("reference", recipe=reference)
  base = rp.run("baseline")
  rp.done.reverse()
  ident, mismatch = _compare(base, original_losses, steps)
  culprits = ()
  ref_ok = all(math.isfinite(x) for x in rp.done[1].losses)
  if ref_ok and not base.within:
    culprits = _search(rp, groups)
  telemetry, at = (), None
  if culprits and report is not None:
    at = _first_divergence(base, rp.ref, tolerance)
    if at:   # the culprit's tensors where the baseline leaves tolerance, not before
      report = _inspect_at(loss, plan, _replayed_state(rp, at), batches[at])
    telemetry = _telemetry(report, culprits)
  return BisectResult(plan.name, reference.name, start, steps, tolerance, groups,
                      culprits, len(culprits) == 1, not base.within, bool(culprits),
                      ident, mismatch, tuple(rp.done), telemetry, unscoped,
                      None if at is None else at + 1)


def _inspect_at(loss, plan: Plan, state, batch):
  """`inspect` of the scaled loss's gradient (as the step differentiates it) at `state`
  and `batch`."""
  scale = optim.loss_scale_of(state.opt_state)
  grad = jax.grad(lambda p, b: jnp.asarray(loss(p, b)).astype(jnp.float32) * scale)
  return _inspect.inspect(grad, plan, state.params, batch)


def _first_divergence(base: Replay, ref: np.ndarray, tolerance: float) -> int:
  """The index of the first replayed step whose baseline loss leaves `tolerance` of the
  reference's (a non-finite loss always does)."""
  gap = _gaps(np.asarray(base.losses, np.float64), ref.astype(np.float64))
  return int(np.flatnonzero(gap > tolerance)[0])


def _replayed_state(rp: _Replayer, n: int):
  """The state after the baseline's first `n` replayed steps (the baseline run again:
  every step is deterministic, so it is the state the baseline replay had there)."""
  step = rp.make_step(rp.recipe, None)
  state = _copy(rp.state)
  for batch in rp.batches[:n]:
    state, _ = step(state, batch)
  return state
