"""One cell of a study: a (recipe, seed) training run that survives being killed.

A cell lives in its own folder of the study's output:

  cells/<arm>__s<seed>/ckpt/          precision.checkpoint steps (every `save_every` steps)
  cells/<arm>__s<seed>/steps.jsonl    one record per step (and the evaluations)
  cells/<arm>__s<seed>/telemetry.jsonl numerics telemetry every `telemetry_every` steps
                                      (when on): every GEMM tensor's statistics and the
                                      monitors, measured on the state before that step
  cells/<arm>__s<seed>/attempts.jsonl one line per start or resume of the cell
  cells/<arm>__s<seed>/done.json      the cell's outcome, written last and atomically
  cells/<arm>__s<seed>/error.txt      the traceback of a failed cell

A cell with done.json is finished and never run again (a failed one only with
`retry_failed`). Otherwise a run continues from the
newest intact checkpoint: the state is restored bit-exactly, steps.jsonl is cut back to the
checkpoint's step (a torn last line from a kill is dropped), and the task's batch stream is
replayed to that position, so the cell ends exactly as an uninterrupted one would.
A cell whose own code raises (the task's init, loss, batches or evaluate) is finished as
"failed" with the error; one whose gradients stay non-finite for `max_nonfinite`
consecutive steps, or whose final evaluation is not finite, as "diverged". Neither stops
the study. A fault of the environment (a full disk, an I/O or permission error of the
study's own files, memory exhausted) is no result: it stops the study with one
`StudyEnvironmentError` and leaves the cell unfinished (see `_faults`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from precision import checkpoint as ckpt_lib
from precision._recipe import Recipe
from precision.study import _faults
from precision.study import _models
from precision.study import _signals
from precision.study._faults import library_io
from precision.study._task import Task, batch_stream
from precision.numerics import _telemetry

STATUSES = ("ok", "diverged", "failed")
STEP_FIELDS = ("loss", "grad_norm", "loss_scale", "skipped_steps", "nonfinite_steps",
                "fp8_saturated")


class Cell(NamedTuple):
  """One (arm, seed) of the grid: `arm` names the row of the report, `recipe` is what
  it trains, `index` pairs it with the control's cell of the same index, `seed` is what
  the task receives (index + the arm's seed offset: A/A arms use other seeds)."""

  arm: str
  recipe: Recipe
  index: int
  seed: int

  @property
  def name(self) -> str:
    return f"{self.arm}__s{self.index}"


class CellSettings(NamedTuple):
  """What every cell of a study shares."""

  steps: int
  eval_every: int
  save_every: int
  max_nonfinite: int
  fp8_keeps: tuple[str, ...]
  overrides: tuple[tuple[str, str], ...] = ()
  telemetry_every: int = 0      # 0: off (the trajectory is the same either way)
  telemetry_whatif: bool = True


def safe_name(name: str) -> str:
  """A recipe name as a folder name: letters, digits, '.', '_' and '-' kept."""
  return re.sub(r"[^A-Za-z0-9_.-]", "-", name)


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` so that a reader (or a kill) never sees half a file.

  A write that fails (a full disk) removes its temporary file and raises the OSError
  with `path` as its filename; `path` keeps its previous content.
  """
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise OSError(e.errno, e.strerror, path) from e


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file; a torn (unparsable) line, as a kill leaves, is dropped."""
  out = []
  try:
    with open(path) as f:
      for line in f:
        line = line.strip()
        if not line:
          continue
        try:
          out.append(json.loads(line))
        except json.JSONDecodeError:
          continue
  except FileNotFoundError:
    pass
  return out


def cell_dir(out: str, cell: Cell) -> str:
  return os.path.join(out, "cells", cell.name)


def read_done(out: str, cell: Cell) -> dict | None:
  """The finished cell's record, or None while it is not finished.

  Raises:
    StudyEnvironmentError when the cell's folder or its done.json cannot be read (a
    permission, an I/O error): not knowing whether a cell is finished stops the study.
  """
  path = os.path.join(cell_dir(out, cell), "done.json")
  try:
    with open(path) as f:
      return json.load(f)
  except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
    return None
  except Exception as e:  # pylint: disable=broad-except  (PermissionError, EIO, ...)
    raise _faults.fault(cell.name, "reading done.json", path, e) from e


def to_run(out: str, cell: Cell, retry_failed: bool = False) -> bool:
  """Whether a run trains `cell`: it is not finished, or (with `retry_failed`) it was
  finished as "failed" (by an earlier version, a fault of the environment counted so)."""
  done = read_done(out, cell)
  return done is None or (retry_failed and done.get("status") == "failed")


def read_steps(out: str, cell: Cell) -> list[dict]:
  return read_jsonl(os.path.join(cell_dir(out, cell), "steps.jsonl"))


def update_digest(h, tree: Any) -> None:
  """Feeds every array of `tree` (its path, dtype, shape and bytes; typed PRNG keys as
  their key data) into the hash `h`."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jnp.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    arr = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}:{arr.dtype}:{arr.shape}".encode())
    h.update(arr.tobytes())


def fingerprint(state: Any) -> str:
  """SHA-256 over every array of the state (with its path, dtype and shape)."""
  h = hashlib.sha256()
  update_digest(h, state)
  return h.hexdigest()


def _host(x) -> float | int:
  v = np.asarray(jax.device_get(x))
  return int(v) if np.issubdtype(v.dtype, np.integer) else float(v)


def _finite(x) -> bool:
  return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _truncate(path: str, last_step: int) -> None:
  kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
  write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class CellBook:
  """The bookkeeping of one cell while it trains, shared by one-seed cells (`run_cell`)
  and seed-batched groups (`precision.study._batched`): its folder, checkpoint,
  records (steps.jsonl), attempts, telemetry lines and outcome (done.json, error.txt).

  Every file operation runs under `library_io`, one operation per call: its failure is
  the environment's (a `StudyEnvironmentError` naming the cell, what it was doing and
  the path), never the model's result. The training itself (the task's and the recipe's
  code) is the caller's.
  """

  def __init__(self, out: str, cell: Cell):
    self.cell = cell
    self.folder = cell_dir(out, cell)
    self.steps_path = os.path.join(self.folder, "steps.jsonl")
    self.tele_path = os.path.join(self.folder, "telemetry.jsonl")
    self.ckpt_dir = os.path.join(self.folder, "ckpt")
    self.records: list[dict] = []
    self.ckpt: ckpt_lib.Checkpointer | None = None
    self._log = None

  def io(self, what: str, path: str | None):
    return library_io(self.cell.name, what, path)

  def set_aside_failed(self) -> None:
    """Before a retry of a "failed" cell: done.json and error.txt kept as
    done.failed.json and error.failed.txt."""
    path = os.path.join(self.folder, "done.json")
    with self.io("setting done.json aside to retry the cell", path):
      error = os.path.join(self.folder, "error.txt")
      if os.path.exists(error):
        os.replace(error, os.path.join(self.folder, "error.failed.txt"))
      os.replace(path, os.path.join(self.folder, "done.failed.json"))

  def make_folder(self) -> None:
    with self.io("creating the cell's folder", self.folder):
      os.makedirs(self.folder, exist_ok=True)

  def restore(self, prog: _models.Program) -> tuple[Any, int]:
    """(state, step) of the cell's newest intact checkpoint, (prog.state, 0) without one."""
    with self.io("restoring its checkpoint", self.ckpt_dir):
      self.ckpt = ckpt_lib.Checkpointer(self.ckpt_dir, keep=2)
      if self.ckpt.steps():
        restored = self.ckpt.restore(prog.state, recipe=prog.recipe)
        return restored.state, restored.step
    return prog.state, 0

  def open_logs(self, start: int, telemetry_every: int) -> None:
    """Cuts the logs back to step `start` (the records after it are redone; a fresh
    start redoes them all), records the attempt, and opens steps.jsonl for appending."""
    with self.io("cutting its logs back to the checkpoint", self.folder):
      _truncate(self.steps_path, start if start else -1)
      if telemetry_every:
        # A record of step s is taken before step s + 1 runs: from `start` on, redone.
        _truncate(self.tele_path, start - 1)
      _attempt(self.folder, "resume" if start else "start", start)
    with self.io("opening steps.jsonl", self.steps_path):
      self.records = read_jsonl(self.steps_path)
      self._log = open(self.steps_path, "a")

  def record(self, rec: dict) -> None:
    """Appends one step's (or evaluation's) record to steps.jsonl."""
    self.records.append(rec)
    with self.io("writing steps.jsonl", self.steps_path):
      self._log.write(json.dumps(rec) + "\n")
      self._log.flush()

  def telemetry(self, line: str) -> None:
    with self.io("writing telemetry.jsonl", self.tele_path), open(self.tele_path, "a") as f:
      f.write(line)

  def save(self, step: int, state: Any, prog: _models.Program) -> None:
    with self.io(f"saving its checkpoint of step {step}", self.ckpt_dir):
      self.ckpt.save(step, state, recipe=prog.recipe, seed=self.cell.seed,
                     extra={"arm": self.cell.arm, "index": self.cell.index})

  def close(self) -> None:
    """Closes steps.jsonl and releases the checkpoint (after the cell's last step)."""
    if self._log is not None:
      with self.io("closing steps.jsonl", self.steps_path):
        self._log.close()
      self._log = None
    if self.ckpt is not None:
      with self.io("releasing its checkpoint lock", self.ckpt_dir):
        self.ckpt.close()
      self.ckpt = None

  def close_after_failure(self) -> None:
    """Closes while an exception propagates: that first failure is the one reported."""
    for close in ((self._log.close if self._log is not None else None),
                  (self.ckpt.close if self.ckpt is not None else None)):
      if close is not None:
        _close_after_failure(close)
    self._log = self.ckpt = None

  def summary(self, prog: _models.Program, state: Any, memory: dict,
              stopped: str | None) -> dict:
    """The finished cell's record (done.json's content) from its records and state."""
    return _summary(self.cell, prog, self.records, state, memory, stopped)

  def failed(self, e: BaseException, tb: str | None = None) -> dict:
    """Writes error.txt (`tb`, else `e`'s traceback); returns the "failed" record."""
    path = os.path.join(self.folder, "error.txt")
    if tb is None:
      tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    with self.io("writing error.txt", path):
      write_atomic(path, tb)
    msg = f"{type(e).__name__}: {e}".splitlines()[0][:400]
    return {"arm": self.cell.arm, "recipe": self.cell.recipe.name, "index": self.cell.index,
            "seed": self.cell.seed, "status": "failed", "error": msg}

  def done(self, record: dict) -> None:
    """Writes done.json (atomically, last): the cell is finished."""
    path = os.path.join(self.folder, "done.json")
    with self.io("writing done.json", path):
      write_atomic(path, json.dumps(record, indent=1))


def step_record(step: int, metrics: dict, step_time_s: float) -> dict:
  """A step's steps.jsonl record from its host metrics (STEP_FIELDS)."""
  return {"step": step, **{k: metrics[k] for k in STEP_FIELDS}, "step_time_s": step_time_s}


def stop_reason(metrics: dict, step: int, max_nonfinite: int) -> str | None:
  """Why a cell stops as diverged after `step` (None: it goes on)."""
  if metrics["consecutive_nonfinite"] >= max_nonfinite:
    return (f"{metrics['consecutive_nonfinite']} consecutive steps with non-finite "
            f"gradients at step {step} (max_nonfinite={max_nonfinite})")
  return None


def run_cell(task: Task, cell: Cell, settings: CellSettings, out: str,
             on_step: Callable[[int], None] | None = None,
             retry_failed: bool = False) -> dict:
  """Runs (or continues) one cell to its end and writes its done.json; returns it.

  A finished cell is returned as recorded, without running (with `retry_failed`, one
  recorded as "failed" runs again from its last checkpoint; its old record and traceback
  are kept as done.failed.json and error.failed.txt). Exceptions of the task or the recipe finish the cell as "failed".
  KeyboardInterrupt, SystemExit and a fault of the environment (`StudyEnvironmentError`:
  the study's own file I/O failing, memory exhausted) propagate: the cell stays
  unfinished and resumes next time.
  """
  book = CellBook(out, cell)
  done = read_done(out, cell)
  if done is not None:
    if not (retry_failed and done.get("status") == "failed"):
      return done
    book.set_aside_failed()
  book.make_folder()
  try:
    record = _train(task, book, settings, on_step)
  except _faults.StudyEnvironmentError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if _faults.is_environment(e):
      raise _faults.fault(cell.name, "training", None, e) from e
    # A failing recipe is a result of the study, not its end.
    record = book.failed(e, traceback.format_exc())
  book.done(record)
  return record


def _attempt(folder: str, event: str, step: int) -> None:
  with open(os.path.join(folder, "attempts.jsonl"), "a") as f:
    f.write(json.dumps({"event": event, "step": step, "pid": os.getpid(),
                        "time": time.time()}) + "\n")


def _train(task: Task, book: CellBook, settings: CellSettings,
           on_step: Callable[[int], None] | None) -> dict:
  # The study's own file operations run in `book` (their failure stops the study, see
  # `_faults`); everything else here is the task's code and the recipe's.
  cell = book.cell
  prog = _models.build(task, cell.recipe, cell.seed, settings.fp8_keeps,
                       dict(settings.overrides))
  try:
    state, start = book.restore(prog)
    book.open_logs(start, settings.telemetry_every)
    batches = batch_stream(task, cell.seed, skip=start)
    first = _next_batch(batches, task, cell, start)
    compiled = prog.step.lower(state, first, jnp.int32(start)).compile()
    memory = compiled_memory(compiled)
    if start == 0 and settings.eval_every:
      book.record({"step": 0, "eval": prog.evaluate(state)})
    batch, stopped = first, None
    for step in range(start, settings.steps):
      if batch is None:
        batch = _next_batch(batches, task, cell, step)
      if settings.telemetry_every and step % settings.telemetry_every == 0:
        book.telemetry(telemetry_line(prog, state, batch, step, settings.telemetry_whatif))
      t0 = time.perf_counter()
      state, metrics = compiled(state, batch, jnp.int32(step))
      metrics = {k: _host(metrics[k]) for k in STEP_FIELDS + ("consecutive_nonfinite",)}
      dt = time.perf_counter() - t0
      batch = None
      done = step + 1
      rec = step_record(done, metrics, dt)
      stopped = stop_reason(metrics, done, settings.max_nonfinite)
      if stopped or done == settings.steps or (
          settings.eval_every and done % settings.eval_every == 0):
        rec["eval"] = prog.evaluate(state)
      book.record(rec)
      if on_step is not None:
        on_step(1)
      if stopped:
        break
      stop = _signals.requested() if done < settings.steps else None  # SIGTERM/USR1
      if done < settings.steps and (done % settings.save_every == 0 or stop):
        book.save(done, state, prog)
      if stop:
        raise _signals.Stopped(stop, cell=cell.name, step=done)
  except BaseException:
    book.close_after_failure()
    raise
  book.close()
  return book.summary(prog, state, memory, stopped)


def _close_after_failure(close: Callable[[], None]) -> None:
  """Closes a file or checkpointer while an exception propagates: that first failure is
  the one reported, not a second one of the close (a full disk fails both)."""
  try:
    close()
  except Exception:  # pylint: disable=broad-except
    pass


def read_telemetry(out: str, cell: Cell) -> list[dict]:
  return read_jsonl(os.path.join(cell_dir(out, cell), "telemetry.jsonl"))


def telemetry_line(prog: _models.Program, state, batch, step: int, whatif: bool) -> str:
  """One telemetry.jsonl line: the numerics of the step taken from `state` (which the
  telemetry program does not change: the trajectory is the step's alone)."""
  record = prog.telemetry(state, batch, jnp.int32(step), whatif)
  rows = _telemetry.record_rows(record, step)
  for r in rows:
    for k in ("index", "primitive", "location", "recomputed", "size", "step", "operand"):
      r.pop(k, None)
  return json.dumps({"step": step, "policy": record.policy, "rows": rows,
                     "monitors": record.monitors(),
                     "unvisited": list(record.unvisited)}) + "\n"


def _next_batch(batches, task: Task, cell: Cell, step: int):
  try:
    return next(batches)
  except StopIteration:
    raise ValueError(f"Task.batches({cell.seed}) ended after {step} batches; accepted: "
                     "an iterator of at least `steps` batches") from None


def compiled_memory(compiled) -> dict[str, int]:
  """Argument, output, alias and temporary bytes of a compiled step (XLA's memory
  analysis; {} where the backend gives none), and argument_plus_temp."""
  ma = compiled.memory_analysis()
  if ma is None:
    return {}
  out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias",
                                                              "temp")}
  out["argument_plus_temp"] = out["argument"] + out["temp"]
  return out


def _summary(cell: Cell, prog: _models.Program, records: list[dict], state: Any,
             memory: dict, stopped: str | None) -> dict:
  steps = [r for r in records if "loss" in r]
  evals = [[r["step"], r["eval"]] for r in records if "eval" in r]
  last = steps[-1] if steps else {}
  final = evals[-1][1] if evals else None
  status = "ok"
  if stopped is not None or not _finite(final) or not _finite(last.get("loss")):
    status = "diverged"
  times = [r["step_time_s"] for r in steps[1:]] or [r["step_time_s"] for r in steps]
  return {
      "arm": cell.arm, "recipe": cell.recipe.name, "index": cell.index, "seed": cell.seed,
      "status": status, "error": stopped, "kind": prog.kind, "n_params": prog.n_params,
      "steps_done": last.get("step", 0), "final_metric": final,
      "final_loss": last.get("loss"), "eval_curve": evals,
      "skipped_steps": last.get("skipped_steps", 0),
      "nonfinite_steps": last.get("nonfinite_steps", 0),
      "final_loss_scale": last.get("loss_scale"),
      "max_fp8_saturated": max((r.get("fp8_saturated", 0.0) for r in steps), default=0.0),
      "step_memory_bytes": memory.get("argument_plus_temp"),
      "fingerprint": fingerprint(state),
      "timing": {"median_step_s": float(np.median(times)) if times else None},
  }
