"""Stopping a study on a signal: a flag the step loop polls, and the record of the stop.

A cluster tells a job it is about to end: Slurm sends the warning signal of
``sbatch --signal=B:USR1@<seconds>`` that many seconds before the time limit, and a
preemption (or ``scancel``) sends SIGTERM, then SIGKILL after the cluster's grace time.
While `handling` is active, SIGTERM and the warning signal (USR1 unless told otherwise) do
nothing but set a flag: no work is done inside the handler, so a signal can never land
in the middle of a save. The cell loop polls `requested()` after each step; when it is
set, the step in flight has finished, the cell saves a checkpoint at that step and raises
`Stopped` (a BaseException, so no cell records it as "failed"); `run` writes the stop
record and passes `Stopped` on; the command line exits with `REQUEUE_EXIT`. Further
signals while that happens are counted and change nothing: the checkpoint's own
guarantees (a half-written step is never restored) cover a SIGKILL at any moment.

The next start of the same command continues every cell bit-exactly from its checkpoint.
Under Slurm the study can requeue its own job first (`requeue_slurm_job`: ``scontrol
requeue`` of this array task, not of the whole array), as submitit does; a cluster whose
slurm.conf lists 75 in ``RequeueExit`` requeues on the exit code alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from typing import NamedTuple

# sysexits.h EX_TEMPFAIL, "temporary failure; the user is invited to retry": the exit
# status of a study stopped by a signal with everything saved.
REQUEUE_EXIT = 75


class StopRequest(NamedTuple):
  """The signals received while `handling` was active: the first one and how many."""

  signum: int
  count: int

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name


class Stopped(BaseException):
  """The study stopped on a signal with every open cell saved; run it again to continue.

  A BaseException like KeyboardInterrupt: code catching Exception (a cell finished as
  "failed") does not swallow it. `cell` and `step`: the cell saved and its step (None when
  the stop came between cells); `record`: the stop record `run` wrote (`stop_file`).
  """

  def __init__(self, request: StopRequest, cell: str | None = None, step: int | None = None,
               record: dict | None = None):
    where = f" in cell {cell} at step {step}" if cell is not None else ""
    super().__init__(f"stopped by {request.name}{where}; everything is saved")
    self.request, self.cell, self.step = request, cell, step
    self.record = record or {}


_lock = threading.Lock()
_depth = 0
_first: int | None = None
_count = 0


def _on_signal(signum, frame):  # pylint: disable=unused-argument
  # Only a flag: the step loop acts on it between steps.
  global _first, _count
  if _first is None:
    _first = signum
  _count += 1


def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
  """"USR1", "SIGUSR1", 10 or signal.SIGUSR1 -> signal.SIGUSR1."""
  if isinstance(name, signal.Signals):
    return name
  if isinstance(name, int) and not isinstance(name, bool):
    try:
      return signal.Signals(name)
    except ValueError:
      pass
  elif isinstance(name, str):
    text = name.strip().upper()
    text = text if text.startswith("SIG") else "SIG" + text
    if text in signal.Signals.__members__ and text not in ("SIGKILL", "SIGSTOP"):
      return signal.Signals[text]
  raise ValueError(f"stop signal {name!r}; accepted: a signal name or number that can be "
                   "caught, e.g. USR1, USR2, SIGTERM, 10")


class handling:  # pylint: disable=invalid-name
  """Context manager: SIGTERM and `warn` (default SIGUSR1) set the stop flag while active.

  Nested uses share one flag (the command line's, from its start, and `run`'s); the flag
  is cleared when the outermost one is entered and when it is left, and each restores the
  handlers it found. Outside the main thread (where Python cannot install handlers) it
  does nothing.
  """

  def __init__(self, warn: str | int | None = "USR1"):
    sigs = [signal.SIGTERM]
    if warn is not None:
      sigs.append(parse_signal(warn))
    self.signals = tuple(dict.fromkeys(sigs))
    self._installed: list[tuple[int, object]] = []

  def __enter__(self) -> "handling":
    global _depth, _first, _count
    if threading.current_thread() is not threading.main_thread():
      return self
    with _lock:
      if _depth == 0:
        _first, _count = None, 0
      _depth += 1
      for s in self.signals:
        self._installed.append((s, signal.signal(s, _on_signal)))
    return self

  def __exit__(self, *exc) -> None:
    global _depth, _first, _count
    if threading.current_thread() is not threading.main_thread():
      return
    with _lock:
      for s, previous in reversed(self._installed):
        signal.signal(s, previous)
      self._installed.clear()
      _depth = max(0, _depth - 1)
      if _depth == 0:
        _first, _count = None, 0  # nothing handles signals now: no request stands


def requested() -> StopRequest | None:
  """The stop request (first signal, count) once a handled signal arrived, else None."""
  first = _first
  return None if first is None else StopRequest(first, _count)


def check() -> None:
  """Raises `Stopped` if a stop was requested."""
  req = requested()
  if req is not None:
    raise Stopped(req)


def slurm_job() -> str | None:
  """This job as scontrol names it: ARRAYJOB_TASK for an array task, else the job id;
  None outside Slurm. (SLURM_JOB_ID alone may be the array's own id, which scontrol
  takes to mean every task of the array.)"""
  array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
  if array and task:
    return f"{array}_{task}"
  return os.environ.get("SLURM_JOB_ID") or None


def requeue_slurm_job(job: str | None = None) -> tuple[bool, str]:
  """``scontrol requeue JOB`` (this job by default): (done, what scontrol said)."""
  job = job or slurm_job()
  if job is None:
    return False, "not under Slurm (no SLURM_JOB_ID)"
  exe = shutil.which("scontrol")
  if exe is None:
    return False, "scontrol not found on PATH"
  try:
    p = subprocess.run([exe, "requeue", job], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired) as e:
    return False, f"scontrol requeue {job}: {type(e).__name__}: {e}"
  said = (p.stdout + p.stderr).strip()
  return p.returncode == 0, f"scontrol requeue {job}: exit {p.returncode}{': ' + said if said else ''}"


def stop_file(out: str, shard: tuple[int, int]) -> str:
  """The stop record of slice K/N: several slices share one study folder."""
  k, n = shard
  return os.path.join(out, "stops", f"slice-{k}-of-{n}.json")


def write_stop_record(out: str, shard: tuple[int, int], request: StopRequest,
                      cell: str | None, step: int | None, requeue: bool) -> dict:
  """Writes (atomically) why slice `shard` stopped and where; requeues it under Slurm
  when `requeue`; returns the record."""
  record = {"reason": "signal", "signal": request.name, "signals_received": request.count,
            "shard": f"{shard[0]}/{shard[1]}", "cell": cell, "saved_at_step": step,
            "pid": os.getpid(), "time": time.time(),
            "slurm_job": slurm_job(), "exit_code": REQUEUE_EXIT,
            "requeued": False, "requeue": None}
  if requeue:
    record["requeued"], record["requeue"] = requeue_slurm_job()
  path = record["file"] = stop_file(out, shard)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # Atomically (a SIGKILL now leaves the previous record or this one, never half), as
  # _cells.write_atomic does; not imported from there: the cells import this module.
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(json.dumps(record, indent=1))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return record


class stopping(handling):  # pylint: disable=invalid-name
  """`handling` for slice `shard` of the study in `out`: when `Stopped` leaves the block,
  the stop record is written (and the Slurm job requeued when `requeue`) while the
  handlers are still in place, then `Stopped` goes on with its `record` set."""

  def __init__(self, out: str, shard: tuple[int, int], warn: str | int | None = "USR1",
               requeue: bool = False):
    if not isinstance(requeue, bool):
      raise ValueError(f"requeue={requeue!r}; accepted: True or False")
    super().__init__(warn)
    self.out, self.shard, self.requeue = out, shard, requeue

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      if isinstance(exc, Stopped):
        req = requested() or exc.request  # count the signals that came while saving
        exc.record = write_stop_record(self.out, self.shard, req, exc.cell, exc.step,
                                       self.requeue)
    finally:
      super().__exit__(exc_type, exc, tb)
