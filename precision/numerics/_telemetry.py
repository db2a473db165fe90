"""Numerics telemetry inside a compiled training step: every GEMM tensor's statistics and
the instability monitors, computed on the device and returned as one pytree.

`gemm_telemetry(fn, recipe, *args)` is `inspect` made traceable: the same jaxpr (fn under
precision.autocast) is evaluated equation by equation by the same recording evaluator,
but under the caller's trace (jax.jit, nnx.jit), so every operand, cotangent and result
is measured by jnp reductions (precision.numerics._device_stats) inside the compiled
program instead of by numpy on the host. What stays on the host is static: which
tensor each row is (TensorInfo), carried as the pytree's auxiliary data, so a jitted
function can return a TelemetryRecord and `record.report()` names every row.

Differences from `inspect`, all forced by tracing: a `cond` whose predicate is traced
and a `while` loop run whole (their GEMMs are listed in `unvisited`); a `scan` is
unrolled (its body's GEMMs get one row per iteration) up to MAX_UNROLL iterations, and
runs whole beyond that. A grouped GEMM (lax.ragged_dot) gets one row per expert group
and operand as inspect does, its E groups static and their sizes runtime values: each
group's part is the tensor's static shape with the group's rows dynamically sliced to
the front and the rest zeroed (no element of it: it counts in no statistic), an empty
group's rows included with size 0; the record then has a "rows" column (the runtime
rows of each part, for its shape). That costs E measurements of each grouped tensor
(E times its size in f32 while they run); a record without grouped GEMMs is unchanged.
Under jit XLA fuses the statistics with the step; with
`precision.enable_faithful_rounding()` every value is the one its dtype computes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from precision import _compat
from precision import _deprecation
from precision import _dtypes
from precision import _keypath
from precision.audit import _walk
from precision.numerics import _device_stats
from precision.numerics import _interpret
from precision.numerics import _report
from precision import optim
from precision.numerics import _inspect

MAX_UNROLL = 64
# Functions whose reduce_max is the max logit of a softmax over its last axis (attention
# probabilities: Wortsman et al. 2023's attention logit growth) or of an output
# log-partition (log_softmax / logsumexp of the logits: log Z drift).
_SOFTMAX_FNS = ("softmax", "_softmax", "_softmax_deprecated")
_LOGZ_FNS = ("log_softmax", "_log_softmax", "logsumexp")
MONITOR_KINDS = ("logit_max", "log_z_mean", "log_z_absmax")


def _fn_kind(frames) -> str:
  """"softmax" / "logz" for an equation inside one of those functions, else ""."""
  for f in frames:
    if f.function_name in _LOGZ_FNS:
      return "logz"
    if f.function_name in _SOFTMAX_FNS:
      return "softmax"
  return ""


def _traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


class _TracingRecorder(_interpret.Recorder):
  """The recording evaluator, runnable under a trace; also records the logit monitors."""

  def __init__(self, on_tensor):
    super().__init__(on_tensor)
    self.monitors: list[tuple[tuple, Any]] = []   # ((kind, scope, fn_kind), value)
    self._last_max: dict = {}

  def _whole(self, eqn, invals, bwd):
    if any(sub is not None and _walk.walk(sub).gemms for sub, _ in _walk._subjaxprs(eqn)):
      if eqn.primitive.name not in self.unvisited:
        self.unvisited.append(eqn.primitive.name)
    outs = _compat.bind_eqn(eqn, invals)
    outs = outs if eqn.primitive.multiple_results else [outs]
    return outs, [_interpret._Meta(bwd=bwd)] * len(outs)

  def _cond(self, eqn, invals, inmetas, inner, iteration):
    if not eqn.params.get("branches_platforms") and _traced(invals[0]):
      return self._whole(eqn, invals, any(m.bwd for m in inmetas))
    return super()._cond(eqn, invals, inmetas, inner, iteration)

  def _while(self, eqn, invals, inmetas, inner, iteration, bwd):
    if any(_traced(x) for x in invals):
      return self._whole(eqn, invals, bwd)
    return super()._while(eqn, invals, inmetas, inner, iteration, bwd)

  def _scan(self, eqn, invals, inmetas, inner, iteration, bwd):
    if int(eqn.params["length"]) > MAX_UNROLL:
      return self._whole(eqn, invals, bwd)
    return super()._scan(eqn, invals, inmetas, inner, iteration, bwd)

  def _eqn(self, eqn, invals, inmetas, inner, iteration, scope, bwd, recomputed):
    outs, metas = super()._eqn(eqn, invals, inmetas, inner, iteration, scope, bwd,
                               recomputed)
    name = eqn.primitive.name
    if bwd or recomputed or name not in ("reduce_max", "log"):
      return outs, metas
    kind = _fn_kind(_walk._frames(eqn))
    if not kind:
      return outs, metas
    where = _interpret._clean_scope(scope)
    out = outs[0]
    if name == "reduce_max" and jnp.issubdtype(out.dtype, jnp.floating):
      self._last_max[(where, kind)] = out
      self.monitors.append((("logit_max", where, kind),
                            jnp.max(out.astype(jnp.float32), initial=-jnp.inf)))
    elif name == "log" and kind == "logz" and (where, kind) in self._last_max:
      m = self._last_max.pop((where, kind))
      if m.size == out.size:
        # log Z = max + log(sum(exp(x - max))): jax.nn.log_softmax and logsumexp both
        # compute it in this form; the max they subtract is finite (logsumexp replaces a
        # non-finite max by 0, which only changes Z for rows that are all -inf or inf).
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        logz = out.astype(jnp.float32) + jnp.reshape(m, out.shape).astype(jnp.float32)
        self.monitors.append((("log_z_mean", where, kind), jnp.mean(logz)))
        self.monitors.append((("log_z_absmax", where, kind),
                              jnp.max(jnp.abs(logz), initial=0.0)))
    return outs, metas


@jax.tree_util.register_pytree_node_class
class TelemetryRecord:
  """The telemetry of one step: device arrays (children) and what they are (static).

  A pytree, so a jitted step can return it. Children: `stats` (f32 [rows, fields]: the
  statistics of each GEMM tensor, fields in the order of `fields`) and `values` (one f32
  scalar per monitor). Static: `infos` (the TensorInfo of each row), `fields`,
  `monitor_keys` ((kind, scope, name) per value: the logit monitors, and the parameter
  monitors of `param_monitors` with scope = the parameter's path), `policy`, `unvisited`.
  """

  def __init__(self, stats, values, infos, fields, monitor_keys, policy="", unvisited=()):
    self.stats, self.values = stats, values
    self.infos, self.fields = tuple(infos), tuple(fields)
    self.monitor_keys, self.policy = tuple(monitor_keys), policy
    self.unvisited = tuple(unvisited)

  def tree_flatten(self):
    return (self.stats, self.values), (self.infos, self.fields, self.monitor_keys,
                                       self.policy, self.unvisited)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  def with_monitors(self, monitors: Mapping[tuple, Any]) -> TelemetryRecord:
    """This record with more monitors ({(kind, scope, name): f32 scalar})."""
    keys = self.monitor_keys + tuple(monitors)
    new = [jnp.asarray(v, jnp.float32) for v in monitors.values()]
    values = jnp.concatenate([jnp.reshape(self.values, (-1,)),
                              jnp.stack(new) if new else jnp.zeros((0,), jnp.float32)])
    return TelemetryRecord(self.stats, values, self.infos, self.fields, keys, self.policy,
                           self.unvisited)

  def report(self, name: str = "step") -> _report.NumericsReport:
    """The rows as a NumericsReport (copies the statistics to the host)."""
    stats = np.asarray(jax.device_get(self.stats), np.float64)
    rows = []
    for info, vec in zip(self.infos, stats):
      d = dict(zip(self.fields, (float(v) for v in vec)))
      d["nonzero"] = int(d["nonzero"])
      for f in _device_stats.WHATIF_FIELDS:
        d.setdefault(f, math.nan)
      n_rows = d.pop("rows", None)
      if -1 in info.shape:   # an expert group's part: its rows known at runtime
        info = dataclasses.replace(
            info, shape=tuple(int(n_rows) if s == -1 else s for s in info.shape))
      rows.append(_report.TensorStats(**vars(info), size=int(np.prod(info.shape)), **d))
    return _report.NumericsReport(name, self.policy, tuple(rows), self.unvisited)

  def monitors(self) -> dict[str, float]:
    """{"kind/scope/name": value} on the host (scope "" for the whole model)."""
    values = np.asarray(jax.device_get(self.values), np.float64).reshape(-1)
    return {"/".join(p for p in key if p): float(v)
            for key, v in zip(self.monitor_keys, values)}

  def __repr__(self) -> str:
    return (f"TelemetryRecord({len(self.infos)} tensors, {len(self.monitor_keys)} monitors, "
            f"policy={self.policy!r})")


@_deprecation.renamed_keyword("recipe_or_policy", "recipe", "precision.numerics.gemm_telemetry")
def gemm_telemetry(fn: Callable, recipe: Any, *args, whatif: bool = True,
                   **kwargs) -> TelemetryRecord:
  """The statistics of every GEMM operand, cotangent and result of `fn(*args, **kwargs)`
  under precision.autocast, and the logit monitors, as a TelemetryRecord of device arrays.

  Traceable: call it inside jax.jit / nnx.jit (the statistics are then computed by the
  compiled program) or eagerly. Rows are those of precision.numerics.inspect (same
  TensorInfo, same statistics, defined in TensorStats), with the differences stated in
  this module's docstring.

  Monitors (monitor_keys (kind, scope, fn), one f32 value each), for every softmax,
  log_softmax and logsumexp in the forward pass:
    logit_max: the largest logit (the max the function subtracts): attention logit
      growth for an attention softmax.
    log_z_mean, log_z_absmax: the mean and max |.| of the log-partition log sum exp(x)
      over the reduced axis (log_softmax, logsumexp: the output log Z, whose drift is the
      instability z-loss targets).

  Args:
    fn, recipe, *args, **kwargs: as precision.numerics.inspect.
    whatif: compute the what-if columns (bf16, f16, E4M3, E5M2, MXFP8); False leaves them
      NaN in `report()` and costs about half of the statistics' work.
  Returns:
    A TelemetryRecord.
  """
  return telemetry_and_outputs(fn, recipe, *args, whatif=whatif, **kwargs)[0]


@_deprecation.renamed_keyword("recipe_or_policy", "recipe",
                              "precision.numerics.telemetry_and_outputs")
def telemetry_and_outputs(fn: Callable, recipe: Any, *args, whatif: bool = True,
                          **kwargs) -> tuple[TelemetryRecord, Any]:
  """gemm_telemetry and the outputs of the evaluation it measured: fn's results as
  autocast returns them (floating results in the policy's output dtype)."""
  if not isinstance(whatif, bool):
    raise ValueError(f"whatif={whatif!r}; accepted: True or False")
  infos: list = []
  tensors: list = []
  grouped: list = []

  def on_tensor(info, value, dtype):
    infos.append(info)
    tensors.append((value, dtype))
    if isinstance(value, _interpret.GroupPart):   # an expert group's runtime rows
      grouped.append(len(tensors) - 1)

  recorder_box: list = []

  def make(on):
    rec = _TracingRecorder(on)
    recorder_box.append(rec)
    return rec

  policy, unvisited, outputs = _inspect._run(fn, recipe, args, kwargs, on_tensor,
                                             recorder=make)
  rec = recorder_box[0]
  order = {"lhs": 0, "rhs": 1, "out": 2}
  # inspect's order: by GEMM, then expert group (grouped GEMMs), then operand.
  perm = sorted(range(len(infos)), key=lambda i: (
      infos[i].index, -1 if infos[i].group is None else infos[i].group,
      order[infos[i].operand]))
  fields = _device_stats.FIELDS if whatif else _device_stats.BASE_FIELDS
  values = [tensors[i][0] for i in perm]
  counts = None
  if grouped:
    # Expert groups of a grouped GEMM with runtime sizes: each part has the tensor's
    # static shape, its group's rows first (precision.numerics._interpret.take); its
    # element count and its rows (a "rows" column: the report's shape) are runtime.
    counts = [None] * len(values)
    rows = jnp.zeros((len(values),), jnp.float32)
    for k, v in enumerate(values):
      if isinstance(v, _interpret.GroupPart):
        per_row = int(np.prod(v.value.shape)) // max(int(v.value.shape[v.axis]), 1)
        counts[k] = jnp.asarray(v.rows, jnp.int32) * np.int32(per_row)
        rows = rows.at[k].set(jnp.asarray(v.rows, jnp.float32))
        values[k] = v.value
  stats = _device_stats.batch_stats(values, [tensors[i][1] for i in perm], whatif,
                                    [infos[i].block_axes for i in perm], counts)
  if grouped:
    fields = fields + ("rows",)
    stats = jnp.concatenate([stats, rows[:, None]], axis=1)
  keys = tuple(k for k, _ in rec.monitors)
  values = (jnp.stack([jnp.asarray(v, jnp.float32) for _, v in rec.monitors]) if keys
            else jnp.zeros((0,), jnp.float32))
  return TelemetryRecord(stats, values, [infos[i] for i in perm], fields, keys, policy,
                         unvisited), outputs


# --------------------------------------------------------------------------- parameters

PARAM_MONITORS = ("update_rms", "param_rms", "update_to_param", "update_lost",
                  "adam_rms_g2_over_v")


def _rms(x):
  x = jnp.asarray(x, jnp.float32)
  return jnp.sqrt(jnp.mean(x * x)) if x.size else jnp.float32(0.0)


def _leaves(tree) -> list:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    if isinstance(leaf, nnx.Variable):
      leaf = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
    if _dtypes.is_float(leaf):
      out.append((_keypath.path_str(path), leaf))
  return out


def _find_nu(opt_state, n_params: int):
  """Adam's (second moment, count) from an optax state: the first node with a `nu` field
  holding as many leaves as the params (optax.scale_by_adam's ScaleByAdamState)."""
  found = []

  def visit(node):
    if found:
      return
    if hasattr(node, "_fields") and "nu" in node._fields:
      nu = [x for _, x in _leaves(node.nu)]
      if len(nu) == n_params:
        found.append((nu, getattr(node, "count", None)))
        return
    children = (node if isinstance(node, (tuple, list)) else
                node.values() if isinstance(node, dict) else ())
    for c in children:
      visit(c)

  visit(opt_state)
  return found[0] if found else (None, None)


def param_monitors(params_before: Any, params_after: Any, grads: Any = None,
                   opt_state_before: Any = None, *, b2: float = 0.999) -> dict:
  """Per-parameter monitors of one optimizer step, as {(kind, path, ""): f32 scalar}.

  For each floating parameter p (path = its pytree path, e.g. "blocks/0/qkv/kernel"),
  with u = p_after - p_before computed in f32 (the change the stored value actually made):
    update_rms: RMS(u).
    param_rms: RMS(p_before).
    update_to_param: RMS(u) / RMS(p_before) (0 when p_before is all zeros).
    update_lost: the fraction of the elements with a nonzero gradient whose stored
      value did not move (u == 0): updates swamped by rounding into p's dtype (an
      update below half an ulp of p), or skipped. Needs `grads`.
    adam_rms_g2_over_v: sqrt(mean(g^2 / v_hat)) over elements with v > 0, g the
      gradient of this step (unscaled: pass the grads the optimizer divides by its loss
      scale already divided, or a recipe without loss scaling) and v_hat the bias-corrected
      second moment BEFORE this step's update (Adam's nu / (1 - b2^count)): about 1 while
      v tracks g^2, large when a gradient outgrows the second moment (the underestimate
      that precedes loss spikes). Needs `grads` and an optax Adam state in
      `opt_state_before`.
  Args:
    params_before, params_after: the params before and after the step (same structure).
    grads: the step's gradients (unscaled), or None.
    opt_state_before: the optimizer state the step started from, or None.
    b2: Adam's second-moment decay (for the bias correction).
  """
  before, after = _leaves(params_before), _leaves(params_after)
  if [p for p, _ in before] != [p for p, _ in after]:
    raise ValueError("param_monitors: params_before and params_after have different "
                     "structures; accepted: the params of one model before and after a step")
  g = _leaves(grads) if grads is not None else None
  if g is not None and len(g) != len(before):
    raise ValueError(f"param_monitors: grads has {len(g)} floating leaves, the params "
                     f"{len(before)}; accepted: the gradients of these params")
  nu, count = _find_nu(opt_state_before, len(before)) if opt_state_before is not None \
      else (None, None)
  out: dict = {}
  for i, ((path, p0), (_, p1)) in enumerate(zip(before, after)):
    p0f, p1f = jnp.asarray(p0, jnp.float32), jnp.asarray(p1, jnp.float32)
    u = p1f - p0f
    urms, prms = _rms(u), _rms(p0f)
    out[("update_rms", path, "")] = urms
    out[("param_rms", path, "")] = prms
    out[("update_to_param", path, "")] = jnp.where(prms > 0, urms / jnp.where(
        prms > 0, prms, 1.0), 0.0)
    if g is not None:
      gi = jnp.asarray(g[i][1], jnp.float32)
      moving = gi != 0
      n = jnp.sum(moving, dtype=jnp.int32)
      stuck = jnp.sum(moving & (u == 0), dtype=jnp.int32)
      out[("update_lost", path, "")] = jnp.where(
          n > 0, stuck.astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32), 0.0)
      if nu is not None:
        v = jnp.asarray(nu[i], jnp.float32)
        c = jnp.asarray(0 if count is None else count, jnp.float32)
        corr = jnp.where(c > 0, 1.0 - jnp.float32(b2) ** c, 1.0)
        vhat = v / corr
        ok = vhat > 0
        ratio = jnp.where(ok, gi * gi / jnp.where(ok, vhat, 1.0), 0.0)
        k = jnp.sum(ok, dtype=jnp.int32)
        out[("adam_rms_g2_over_v", path, "")] = jnp.where(
            k > 0, jnp.sqrt(jnp.sum(ratio) / jnp.maximum(k, 1).astype(jnp.float32)), 0.0)
  return out


def update_monitors(params_before: Any, params_after: Any, grads: Any,
                    opt_state_before: Any, opt_state_after: Any) -> dict:
  """`param_monitors` of one recipe-optimizer step: `grads` as ``tx.update`` received them
  (scaled by the loss scale of `opt_state_before`, divided back out here), the params
  measured where the update accumulates (the master copy when the recipe keeps one: an
  update lost in the 16-bit copy but kept by the master is not lost)."""
  scale = optim.loss_scale_of(opt_state_before)
  unscaled = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / scale, grads)
  return param_monitors(optim.master_params(opt_state_before, params_before),
                        optim.master_params(opt_state_after, params_after), unscaled,
                        opt_state_before)


def record_rows(record: TelemetryRecord, step: int) -> list[dict]:
  """One JSON-safe dict per GEMM tensor (the report's records plus `step`)."""
  out = []
  for d in record.report().to_records():
    d = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
    d["step"] = int(step)
    out.append(d)
  return out


__all__ = ["MONITOR_KINDS", "PARAM_MONITORS", "TelemetryRecord",
           "gemm_telemetry", "param_monitors", "record_rows", "update_monitors"]
