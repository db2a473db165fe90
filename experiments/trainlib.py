"""Training a GPT on the embedded corpus under a precision recipe: importable functions.

`train(TrainConfig(...)) -> dict` runs one training run and returns its summary (with
every step's metrics under "history"); `experiments/train.py` is the CLI over it and the
sweep calls it once per recipe and seed. One step is `precision.train_step` (loss scaled
in f32, guard unscales/checks/skips inside the optimizer, exact rounding into the params,
fp8 state rolled back with a skipped step) in one jitted function whose params, model
state and optimizer state are donated.

Reproducibility: everything a step depends on is (params, model_state, opt_state, batch);
the batch is a pure function of the sampler state (seed, step); stochastic rounding draws
from (seed, step, element) inside the optimizer state. So N steps straight and N/2 steps +
checkpoint + restore + N/2 steps give bit-identical states (tests/test_train.py).
"""

from __future__ import annotations

import dataclasses
import errno as errno_lib
import json
import math
import numbers
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import precision as mp
import precision.flax  # noqa: F401  (mp.flax)
import precision.optim  # noqa: F401  (mp.optim)
import precision.fp8  # noqa: F401  (mp.fp8)
from experiments import data as data_lib
from models import gpt as gpt_lib
from precision import checkpoint as ckpt_lib
# Not yet re-exported by precision.optim (its __init__ is outside this change).


# The fields of a TrainConfig that change what a resumed run computes: a resume compares
# them with the train config saved in the checkpoint.
HYPERPARAMETERS = ("steps", "batch", "seq", "lr", "warmup", "final_lr_ratio",
                   "weight_decay", "b1", "b2", "grad_clip", "corpus_bytes")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run.

  Attributes:
    recipe: preset name of the precision recipe (`precision.get_recipe`).
    model: preset name of the GPT (`models.gpt.CONFIGS`) or a GPTConfig.
    steps: total optimizer steps; the learning-rate schedule spans them.
    batch: sequences per step. seq: tokens per sequence (None: the model's seq_len).
    lr: peak learning rate of AdamW; warmup: linear warmup steps (None: steps // 10,
      at most 100), then cosine decay to lr * final_lr_ratio at `steps`.
    weight_decay: AdamW decoupled weight decay on matrices (not on norm scales).
    b1, b2: AdamW betas. grad_clip: global-norm clip in f32 (None: off).
    seed: model init, data order and stochastic-rounding seed.
    eval_every: validation BPB every this many steps (and at the start and end; 0: only
      at the end). eval_batches: fixed validation batches of size batch x seq.
    ckpt_dir: checkpoint directory (None: no checkpoints); save_every: steps between
      saves (0: only at the end); keep: checkpoints kept. The directory belongs to one
      run (recipe, model config, seed): a fresh run refuses a directory holding
      checkpoints, and a run with another recipe, model or seed refuses one owned by
      another run.
    resume: continue from the newest intact checkpoint in ckpt_dir; with nothing to
      resume the run fails (`NothingToResumeError`) unless `start_if_nothing`.
    start_if_nothing: with `resume`, start fresh when ckpt_dir holds no checkpoint.
    convert: with `resume`, continue a checkpoint of another recipe or seed (the state is
      converted from its f32 master; the directory then belongs to this run). Without
      it, resuming another run's checkpoint fails. It also allows every change of
      hyperparameters (see `allow_change`).
    allow_change: with `resume`, the hyperparameters (names in `HYPERPARAMETERS`) that
      may differ from the ones the checkpoint was trained with. A resume whose steps,
      batch, seq, lr, warmup, schedule, AdamW or clipping settings differ from the saved
      train config, in a field not named here, fails with `ConfigChangedError` listing
      every change (seq and warmup compared as the values they resolve to).
    allow_unverified: with `resume`, a checkpoint step without checksums (written by a
      precision without them, or its integrity.json deleted) may be resumed, with a
      warning; without it such a step is passed over like a damaged one.
    stop_after: stop once this many steps are done (the schedule still spans `steps`),
      as an interrupted run does.
    max_nonfinite_steps: stop with `DivergedError` once this many consecutive steps had
      non-finite gradients (each is skipped, so the run would only mark time).
    out: JSONL file receiving one line per step (None: no file).
    corpus_bytes: cap of the embedded corpus (experiments.data).
    progress: tqdm progress bar on stderr.
  """

  recipe: str = "fp32"
  model: str | gpt_lib.GPTConfig = "small"
  steps: int = 300
  batch: int = 8
  seq: int | None = None
  lr: float = 3e-3
  warmup: int | None = None
  final_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float | None = 1.0
  seed: int = 0
  eval_every: int = 50
  eval_batches: int = 4
  ckpt_dir: str | None = None
  save_every: int = 0
  keep: int = 3
  resume: bool = False
  start_if_nothing: bool = False
  convert: bool = False
  allow_change: tuple[str, ...] = ()
  allow_unverified: bool = False
  stop_after: int | None = None
  max_nonfinite_steps: int = 50
  out: str | None = None
  corpus_bytes: int = data_lib.DEFAULT_MAX_BYTES
  progress: bool = True

  def __post_init__(self):
    def integer(name, lo, hi=None, optional=False):
      v = getattr(self, name)
      if optional and v is None:
        return
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo or (
          hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"TrainConfig.{name}={v!r}; accepted: an integer {rng}")

    def real(name, lo_open, optional=False):
      v = getattr(self, name)
      if optional and v is None:
        return
      if (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
          or not v > lo_open):
        raise ConfigError(f"TrainConfig.{name}={v!r}; accepted: a finite number > {lo_open}")

    for name in ("steps", "batch", "eval_batches", "keep", "max_nonfinite_steps",
                 "corpus_bytes"):
      integer(name, 1)
    for name in ("eval_every", "save_every"):
      integer(name, 0)
    integer("seq", 1, optional=True)
    integer("warmup", 0, self.steps, optional=True)
    integer("stop_after", 1, self.steps, optional=True)
    integer("seed", 0, 2 ** 32 - 1)
    real("lr", 0.0)
    real("grad_clip", 0.0, optional=True)
    wd = self.weight_decay
    if isinstance(wd, bool) or not isinstance(wd, numbers.Real) or not (
        math.isfinite(wd) and wd >= 0):
      raise ConfigError(f"TrainConfig.weight_decay={wd!r}; accepted: a finite number >= 0")
    if not (isinstance(self.final_lr_ratio, numbers.Real) and 0 <= self.final_lr_ratio <= 1):
      raise ConfigError(f"TrainConfig.final_lr_ratio={self.final_lr_ratio!r}; accepted: a "
                        "number in [0, 1]")
    for name in ("b1", "b2"):
      v = getattr(self, name)
      if not (isinstance(v, numbers.Real) and 0 <= v < 1):
        raise ConfigError(f"TrainConfig.{name}={v!r}; accepted: a number in [0, 1)")
    try:
      mp.get_recipe(self.recipe)
      gpt_lib.get_config(self.model)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.resume and not self.ckpt_dir:
      raise ConfigError("TrainConfig.resume=True needs ckpt_dir")
    if (self.start_if_nothing or self.convert) and not self.resume:
      raise ConfigError("TrainConfig.start_if_nothing / convert apply to a resume; set "
                        "resume=True")
    if isinstance(self.allow_change, str) or not all(
        isinstance(f, str) for f in self.allow_change):
      raise ConfigError(f"TrainConfig.allow_change={self.allow_change!r}; accepted: a tuple "
                        f"of field names among {', '.join(HYPERPARAMETERS)}")
    unknown = [f for f in self.allow_change if f not in HYPERPARAMETERS]
    if unknown:
      raise ConfigError(f"TrainConfig.allow_change: {unknown[0]!r} is not a hyperparameter; "
                        f"accepted: {', '.join(HYPERPARAMETERS)}")
    if (self.allow_change or self.allow_unverified) and not self.resume:
      raise ConfigError("TrainConfig.allow_change / allow_unverified apply to a resume; set "
                        "resume=True")

  @property
  def warmup_steps(self) -> int:
    return self.warmup if self.warmup is not None else max(1, min(100, self.steps // 10))


class TrainingError(RuntimeError):
  """A run that cannot start or continue; the message says why and what to do."""


class ConfigError(TrainingError, ValueError):
  """A TrainConfig value out of range (the CLI reports it as a usage error)."""


class NothingToResumeError(TrainingError):
  """resume=True, but the checkpoint directory holds no checkpoint."""


class ConfigChangedError(TrainingError):
  """A resume whose hyperparameters differ from the checkpoint's, not allowed by
  `allow_change` (or `convert`)."""


class LogWriteError(TrainingError):
  """The --out JSONL log could not be written (a full disk, a read-only filesystem, no
  permission): one line with its path and errno (`errno`, `filename`); the checkpoints
  are not touched by it."""

  def __init__(self, message: str, cause: OSError, filename: str):
    super().__init__(message)
    self.errno, self.strerror, self.filename = cause.errno, cause.strerror, filename


def _log_error(path: str, what: str, e: OSError, ckpt) -> LogWriteError:
  code = errno_lib.errorcode.get(e.errno, type(e).__name__) if e.errno else type(e).__name__
  then = (f"the checkpoints in {ckpt.directory} are intact: fix it, then rerun with "
          "--resume-or-start" if ckpt is not None else "fix it, then rerun")
  return LogWriteError(f"--out {path}: {what} failed: {e.strerror or e} ({code}); {then}",
                       e, path)


class TrainWarning(UserWarning):
  """Something about a run a user should know, that stopped nothing (a torn log line)."""


class DivergedError(TrainingError):
  """max_nonfinite_steps consecutive steps had non-finite gradients.

  `summary` is the run's summary up to the stop (status "diverged").
  """

  def __init__(self, message: str, summary: dict[str, Any]):
    super().__init__(message)
    self.summary = summary


def inner_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW with warmup + cosine decay (and f32 global-norm clipping) before the recipe."""
  schedule = inner_schedule(cfg)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  if cfg.grad_clip is None:
    return adamw
  return optax.chain(mp.optim.clip_by_global_norm(cfg.grad_clip), adamw)


@dataclasses.dataclass
class Run:
  """A model, optimizer and jitted step built for one TrainConfig (no state of its own
  beyond the graph: the arrays live in a checkpoint.TrainState)."""

  cfg: TrainConfig
  recipe: mp.Recipe
  model_config: gpt_lib.GPTConfig
  seq: int
  graphdef: Any
  tx: optax.GradientTransformation
  step_fn: Any          # jitted (params, model_state, opt_state, tokens) -> (..., metrics)
  eval_fn: Any          # jitted (params, model_state, tokens) -> f32 mean loss (nats)
  schedule: Any


def optimizer_for(cfg: TrainConfig):
  """recipe -> the recipe's optimizer around this run's inner AdamW (for conversions)."""
  return lambda recipe: mp.optim.build_optimizer(recipe, inner_optimizer(cfg), seed=cfg.seed)


def init_state(cfg: TrainConfig) -> tuple[Run, ckpt_lib.TrainState]:
  """Builds the model under the recipe, the optimizer and the jitted step; fresh state."""
  recipe = mp.get_recipe(cfg.recipe)
  model_config = gpt_lib.get_config(cfg.model)
  seq = cfg.seq or model_config.seq_len
  model = gpt_lib.GPT(model_config, rngs=nnx.Rngs(cfg.seed))
  mp.flax.apply_recipe(model, recipe)
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  tx = optimizer_for(cfg)(recipe)
  # Optimizer inits may share one buffer between leaves (e.g. zero counters); the donated
  # step needs every leaf in its own buffer.
  opt_state = jax.tree.map(jnp.copy, tx.init(params))
  # Likewise fp8 scaling state may start as one shared constant (e.g. unit scales).
  model_state = jax.tree.map(jnp.copy, model_state)

  def loss_of(params, model_state, tokens):
    model = nnx.merge(graphdef, params, model_state)
    loss = gpt_lib.loss_fn(model, tokens)
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  def step(params, model_state, opt_state, tokens):
    # mp.train_step: the loss scaled by the optimizer's loss scale in f32, the fp8
    # gradient-direction (E5M2) scaling state carried out of the backward pass, the
    # update applied with exact rounding, and the fp8 scaling state rolled back with a
    # step the guard skips (params and optimizer state stay as they were).
    model = nnx.merge(graphdef, params, model_state)
    loss, opt_state = mp.train_step(model, tx, opt_state, gpt_lib.loss_fn, tokens)
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    metrics = dict(mp.optim.optimizer_metrics(opt_state))
    metrics["loss"] = loss
    return params, model_state, opt_state, metrics

  step_fn = jax.jit(step, donate_argnums=(0, 1, 2))
  eval_fn = jax.jit(lambda p, s, t: loss_of(p, s, t)[0])
  run = Run(cfg, recipe, model_config, seq, graphdef, tx, step_fn, eval_fn,
            inner_schedule(cfg))
  rng = jax.random.key_data(jax.random.key(cfg.seed))
  return run, ckpt_lib.TrainState(params, opt_state, model_state, rng)


def inner_schedule(cfg: TrainConfig):
  """Learning rate by step: linear warmup from 0, cosine decay to lr * final_lr_ratio."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.final_lr_ratio)


def fingerprint(state: ckpt_lib.TrainState) -> str:
  """SHA-256 over the bytes (with paths and dtypes) of params, optimizer and model state."""
  return mp.study.fingerprint({"params": state.params, "opt_state": state.opt_state,
                               "model_state": state.model_state})


def compile_step(run: Run, state: ckpt_lib.TrainState, tokens: np.ndarray):
  """The step compiled for `state`'s and `tokens`' shapes (AOT; call it like the step)."""
  return run.step_fn.lower(state.params, state.model_state, state.opt_state,
                           jnp.asarray(tokens)).compile()


def step_once(compiled, state: ckpt_lib.TrainState, tokens: np.ndarray
              ) -> tuple[ckpt_lib.TrainState, dict[str, float | int]]:
  """One optimizer step (donates `state`'s arrays); metrics fetched to host."""
  params, model_state, opt_state, metrics = compiled(
      state.params, state.model_state, state.opt_state, jnp.asarray(tokens))
  metrics = {k: _host(v) for k, v in metrics.items()}  # waits for the step
  return state._replace(params=params, opt_state=opt_state, model_state=model_state), metrics


def evaluate(run: Run, state: ckpt_lib.TrainState, val_tokens: np.ndarray) -> float:
  """Validation bits per byte over the fixed batches."""
  losses = [float(run.eval_fn(state.params, state.model_state, jnp.asarray(b)))
            for b in val_tokens]
  return data_lib.bits_per_byte(float(np.mean(losses)))


def _host(x) -> float | int:
  v = np.asarray(jax.device_get(x))
  return int(v) if np.issubdtype(v.dtype, np.integer) else float(v)


def _truncate_log(path: str, last_step: int) -> None:
  """Keeps the JSONL records of steps <= last_step (a resumed run rewrites the rest).

  A line that is no JSON object (the last line cut by a kill while it was written) is
  dropped, with one `TrainWarning` saying how many and where.
  """
  try:
    with open(path) as f:
      lines = [line for line in f if line.strip()]
  except FileNotFoundError:
    return
  kept, torn = [], []
  for i, line in enumerate(lines, 1):
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    except ValueError:
      torn.append(i)
      continue
    if rec.get("step", 0) <= last_step:
      kept.append(line if line.endswith("\n") else line + "\n")
  if torn:
    where = "its last line" if torn == [len(lines)] else f"line(s) {', '.join(map(str, torn))}"
    warnings.warn(f"--out {path}: dropped {len(torn)} unreadable JSONL record(s) at {where} "
                  "(cut by a kill while it was written); the resumed run rewrites the steps "
                  f"after {last_step}", TrainWarning, stacklevel=2)
  with open(path, "w") as f:
    f.writelines(kept)


def _resolved(d: dict, model_seq_len: int) -> dict:
  """The hyperparameters of a train config dict as they resolve (seq and warmup None:
  their defaults), None for a field the dict lacks (a config of an older version)."""
  out = {k: d.get(k) for k in HYPERPARAMETERS}
  if "seq" in d:
    out["seq"] = d["seq"] or model_seq_len
  if "warmup" in d and d["warmup"] is None and isinstance(d.get("steps"), int):
    out["warmup"] = max(1, min(100, d["steps"] // 10))
  return out


def config_changes(saved: dict | None, cfg: TrainConfig, model_seq_len: int) -> list[str]:
  """["lr 0.003 -> 0.001", ...]: the hyperparameters of `cfg` that differ from the saved
  train config (fields the saved config does not record are not compared)."""
  if not isinstance(saved, dict):
    return []
  before = _resolved(saved, model_seq_len)
  after = _resolved(dataclasses.asdict(cfg), model_seq_len)
  # Both left to their defaults: the same model's seq_len; a warmup that follows steps
  # (its change is the change of steps).
  defaulted = {k for k in ("seq", "warmup") if saved.get(k) is None and getattr(cfg, k) is None}
  return [f"{k} {before[k]!r} -> {after[k]!r}" for k in HYPERPARAMETERS
          if k in saved and k not in defaulted and before[k] != after[k]]


def _saved_seed(restored: ckpt_lib.Restored) -> int | None:
  """The seed of a restored step (older steps kept it in the train config only)."""
  if restored.seed is not None:
    return int(restored.seed)
  seed = ((restored.extra or {}).get("train_config") or {}).get("seed")
  return None if seed is None else int(seed)


def _open_checkpoints(cfg: TrainConfig, recipe: mp.Recipe, model_config: dict
                      ) -> ckpt_lib.Checkpointer | None:
  """The run's Checkpointer, its lock taken and its ownership checked: before any work.

  Raises:
    CheckpointLockedError (another process writes the directory), CheckpointOwnershipError
    (it belongs to another run, or a fresh run would overwrite checkpoints),
    NothingToResumeError, OSError (not writable).
  """
  if not cfg.ckpt_dir:
    return None
  ckpt = ckpt_lib.Checkpointer(cfg.ckpt_dir, keep=cfg.keep)
  try:
    ckpt.acquire()
    record = ckpt.run_record()
    steps = ckpt.steps()
    owner = (f"run {record.run_id} (recipe {record.recipe.name}, seed {record.seed})"
             if record else "an earlier run")
    if not cfg.resume:
      if steps:
        raise ckpt_lib.CheckpointOwnershipError(
            f"{ckpt.directory} holds the checkpoints (steps {steps}) of {owner}; a fresh "
            "run would overwrite them. Pass --resume to continue that run, or use another "
            "--ckpt-dir")
      ckpt.claim(recipe=recipe, model_config=model_config, seed=cfg.seed)
      return ckpt
    if not steps and not cfg.start_if_nothing:
      found = ckpt.problems() + [f"'{n}' (an unfinished save, removed)" for n in ckpt.cleaned]
      raise NothingToResumeError(
          f"--resume: nothing to resume in {ckpt.directory}: no complete checkpoint"
          + (f" (found {', '.join(found)})" if found else "")
          + "; pass --resume-or-start to start a fresh run there")
    if record is not None and not cfg.convert:
      diff = record.difference(recipe, model_config, cfg.seed)
      if diff:
        raise ckpt_lib.CheckpointOwnershipError(
            f"{ckpt.directory} belongs to {owner}, not to this run: {diff}. Pass --convert "
            "to continue that run's state under this run's recipe and seed, or use another "
            "--ckpt-dir")
    if not steps:
      ckpt.claim(recipe=recipe, model_config=model_config, seed=cfg.seed)
    return ckpt
  except BaseException:
    ckpt.close()
    raise


def _resume(cfg: TrainConfig, run: Run, ckpt: ckpt_lib.Checkpointer,
            state: ckpt_lib.TrainState) -> tuple[Any, int, tuple[str, ...], Any, tuple]:
  """(state, start step, conversion notes (and allowed hyperparameter changes), sampler,
  skipped damaged steps) of a resume.

  Raises:
    ConfigChangedError when hyperparameters differ from the checkpoint's train config and
    neither `allow_change` nor `convert` allows it.
  """
  model_config = run.model_config.to_dict()
  restored = ckpt.restore(state, recipe=run.recipe, model_config=model_config,
                          optimizer_for=optimizer_for(cfg),
                          allow_unverified=cfg.allow_unverified)
  changes = config_changes((restored.extra or {}).get("train_config"), cfg,
                           run.model_config.seq_len)
  refused = [c for c in changes if c.split(" ", 1)[0] not in cfg.allow_change]
  if refused and not cfg.convert:
    fields = ",".join(c.split(" ", 1)[0] for c in refused)
    raise ConfigChangedError(
        f"--resume: {ckpt.directory} step {restored.step} was trained with other "
        f"hyperparameters: {'; '.join(refused)}. Resume with the saved values, or pass "
        f"--allow-change {fields} to continue with the new ones")
  seed = _saved_seed(restored)
  diffs = [d for d in (
      None if restored.saved_recipe == run.recipe else
      f"recipe {restored.saved_recipe.name} -> {run.recipe.name}",
      None if seed is None or seed == cfg.seed else f"seed {seed} -> {cfg.seed}") if d]
  if diffs and not cfg.convert:
    raise ckpt_lib.CheckpointOwnershipError(
        f"{ckpt.directory} step {restored.step} belongs to another run ({'; '.join(diffs)}). "
        "Pass --convert to continue it under this run's recipe and seed, or use another "
        "--ckpt-dir")
  if diffs:
    ckpt.adopt(recipe=run.recipe, model_config=model_config, seed=cfg.seed,
               reason=f"resumed step {restored.step} with conversion: {'; '.join(diffs)}")
  else:
    ckpt.claim(recipe=run.recipe, model_config=model_config, seed=cfg.seed)
  sampler = data_lib.SamplerState(**restored.data)
  if seed is not None and seed != cfg.seed:
    # The data order follows this run's seed from here on (the position is kept).
    sampler = sampler._replace(seed=cfg.seed)
  notes = restored.converted + tuple(f"hyperparameter changed on resume: {c}" for c in changes)
  return restored.state, restored.step, notes, sampler, restored.skipped


def _finite(x) -> bool:
  return x is not None and math.isfinite(x)


def train(cfg: TrainConfig) -> dict[str, Any]:
  """Trains one run; returns the summary dict (per-step records under "history").

  Summary keys: recipe, model, params, steps, start_step, batch, seq, status ("ok" when
  the final loss and validation BPB are finite, else "diverged"), final_loss,
  final_val_bpb, val_bpb ([[step, bpb], ...]), tokens_per_s (median over timed steps),
  step_time_s, compile_s, memory (compiled step: argument/output/alias/temp bytes and
  argument_plus_temp), skipped_steps, nonfinite_steps, loss_scale, fingerprint,
  converted (notes of a cross-recipe resume, and the hyperparameter changes a resume was
  allowed), skipped_checkpoints (damaged newer steps a
  resume passed over), corpus, history.

  Everything that can refuse the run (the checkpoint directory's lock and owner, nothing
  to resume, the sequence length against the corpus) is checked before the model is
  built.

  Raises:
    DivergedError after `max_nonfinite_steps` consecutive non-finite steps (its `summary`
    holds the run so far); NothingToResumeError; ConfigError; the checkpoint errors of
    `precision.checkpoint` (locked, owned by another run, no intact step).
  """
  recipe = mp.get_recipe(cfg.recipe)
  model_config = gpt_lib.get_config(cfg.model)
  seq = cfg.seq or model_config.seq_len
  corpus = data_lib.load_corpus(cfg.corpus_bytes)
  for split, what in ((corpus.train, "training"), (corpus.validation, "validation")):
    if split.size < seq + 2:
      raise ConfigError(f"seq={seq}: the {what} split has {split.size} bytes; accepted: "
                        f"1 <= seq <= {split.size - 2}")
  ckpt = _open_checkpoints(cfg, recipe, model_config.to_dict())
  try:
    return _train(cfg, corpus, ckpt)
  finally:
    if ckpt is not None:
      ckpt.close()


def _train(cfg: TrainConfig, corpus, ckpt) -> dict[str, Any]:
  run, state = init_state(cfg)
  sampler = data_lib.init_sampler(cfg.seed)
  start, converted, skipped_ckpts = 0, (), ()
  if cfg.resume and ckpt.steps():
    state, start, converted, sampler, skipped_ckpts = _resume(cfg, run, ckpt, state)
  elif ckpt is not None:
    ckpt.claim(recipe=run.recipe, model_config=run.model_config.to_dict(), seed=cfg.seed)
  val_tokens = data_lib.validation_batches(corpus.validation, cfg.eval_batches, cfg.batch,
                                           run.seq)
  tokens0, _ = data_lib.sample_batch(corpus.train, sampler, cfg.batch, run.seq)
  t0 = time.perf_counter()
  compiled = compile_step(run, state, tokens0)
  compile_s = time.perf_counter() - t0
  memory = mp.study.compiled_memory(compiled)
  last = min(cfg.steps, cfg.stop_after) if cfg.stop_after is not None else cfg.steps
  history, val_curve, times = [], [], []
  out = None
  if cfg.out:
    try:
      if start > 0:
        _truncate_log(cfg.out, start)  # drop records of steps after the restored checkpoint
      out = open(cfg.out, "a" if start > 0 else "w")
    except OSError as e:
      raise _log_error(cfg.out, "opening it", e, ckpt) from None
  bar = None
  if cfg.progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=last, initial=start, file=sys.stderr, desc=cfg.recipe, leave=False)

  def emit(rec):
    history.append(rec)
    if out is not None:
      try:
        out.write(json.dumps(rec) + "\n")
        out.flush()
      except OSError as e:
        raise _log_error(cfg.out, f"writing the record of step {rec['step']}", e,
                         ckpt) from None

  metrics = None
  diverged = None
  try:
    if start == 0 and cfg.eval_every:
      val_curve.append([0, evaluate(run, state, val_tokens)])
      emit({"step": 0, "val_bpb": val_curve[-1][1]})
    for step in range(start, last):
      tokens, sampler = data_lib.sample_batch(corpus.train, sampler, cfg.batch, run.seq)
      t = time.perf_counter()
      state, metrics = step_once(compiled, state, tokens)
      dt = time.perf_counter() - t
      times.append(dt)
      done = step + 1
      rec = {"step": done, "lr": float(run.schedule(step)), **metrics,
             "tokens_per_s": cfg.batch * run.seq / dt}
      try:
        # One int32 read of the state the step just returned (already on the host path).
        mp.optim.check_nonfinite_streak(state.opt_state, cfg.max_nonfinite_steps)
      except mp.optim.NonFiniteStreakError as e:
        emit(rec)
        diverged = (f"step {done}: {e}; stopped (max_nonfinite_steps="
                    f"{cfg.max_nonfinite_steps}); no checkpoint written for it")
        break
      if (cfg.eval_every and done % cfg.eval_every == 0) or done == last:
        rec["val_bpb"] = evaluate(run, state, val_tokens)
        val_curve.append([done, rec["val_bpb"]])
      emit(rec)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
      if ckpt is not None and ((cfg.save_every and done % cfg.save_every == 0) or done == last):
        ckpt.save(done, state, recipe=run.recipe, model_config=run.model_config.to_dict(),
                  seed=cfg.seed, data=sampler,
                  extra={"train_config": {k: v for k, v in dataclasses.asdict(cfg).items()
                                          if k != "model"}})
  except BaseException:
    if bar is not None:
      bar.close()
    if out is not None:
      try:
        out.close()
      except OSError:
        pass  # the failure already propagating is the one reported (a full disk fails both)
    raise
  if bar is not None:
    bar.close()
  if out is not None:
    try:
      out.close()
    except OSError as e:
      raise _log_error(cfg.out, "closing it", e, ckpt) from None
  if not val_curve and diverged is None:
    val_curve.append([max(start, last), evaluate(run, state, val_tokens)])
  timed = times[1:] or times
  step_time = float(np.median(timed)) if timed else float("nan")
  final_loss = metrics["loss"] if metrics else None
  final_bpb = val_curve[-1][1] if val_curve else None
  ok = diverged is None and all(_finite(v) for v in (final_loss, final_bpb) if v is not None)
  summary = {
      "recipe": run.recipe.name,
      "model": cfg.model if isinstance(cfg.model, str) else run.model_config.to_dict(),
      "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
      "steps": len(times) + start if diverged else last, "start_step": start,
      "batch": cfg.batch, "seq": run.seq, "status": "ok" if ok else "diverged",
      "final_loss": final_loss,
      "final_val_bpb": final_bpb, "val_bpb": val_curve,
      "tokens_per_s": cfg.batch * run.seq / step_time if timed else None,
      "step_time_s": step_time if timed else None, "compile_s": compile_s, "memory": memory,
      "skipped_steps": metrics["skipped_steps"] if metrics else 0,
      "nonfinite_steps": metrics["nonfinite_steps"] if metrics else 0,
      "loss_scale": metrics["loss_scale"] if metrics else None,
      "fingerprint": fingerprint(state), "converted": list(converted),
      "skipped_checkpoints": list(skipped_ckpts),
      "corpus": corpus.describe(), "history": history,
  }
  if diverged is not None:
    raise DivergedError(diverged, summary)
  return summary
