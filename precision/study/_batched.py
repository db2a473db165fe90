"""Seed-batched cells: K seeds of one recipe trained by ONE compiled program.

A group is up to K cells of one arm (the same recipe). Its step is traced and
compiled once for the group, on its first seed (the compiled one-seed step is also the
report's memory column), and run in one of two ways:

* Over stacked state (`_Stacked`; "loop", "vmap", or the seed axis sharded over
  devices): one program runs the seed-explicit step in every slot over stacked state
  (params, optimizer state with its loss scale and counters, the model's other state
  with fp8 scaling state, the rng key data), stacked batches (the host stacks each
  seed's own ``batches(seed)``) and the seeds (stochastic rounding's). A per-slot
  `active` mask selects, element by element, the new state of the seeds that step and
  the old state of the others (a diverged, failed or finished seed, one waiting for
  the group to reach its checkpoint, or a padding slot), so a seed that stops leaves
  the others' numbers untouched. The seed axis is sharded over `devices` local devices
  (a 1-D mesh "seed", K a multiple of it, `jax.shard_map`): a device holding one seed
  runs the one-seed step itself; one holding several (on a single device: all K) runs
  them as `SeedBatch.how` says, in a loop inside the program (`jax.lax.map`, forced CPU
  host devices) or vectorised (`jax.vmap`, an accelerator's default).
* On host threads (`_Threaded`, "threads": a CPU of one device, the default there for
  an explicit K): each seed keeps its own state and is stepped by the group's compiled
  one-seed step itself, several seeds at once on host threads. It is the executable a
  one-seed cell runs, so every seed's numbers are its one-seed cell's bit for bit
  (tests/test_study_batched.py); what the group saves is the per-cell trace, compile
  (or compilation-cache load) and first execution, and several seeds at once keep a
  CPU busier than one seed's small GEMMs do (`threads_for`).

Over stacked state every group is padded to exactly K slots (copies of its first seed,
never active): a seed's numbers are then a function of (recipe, seed, K, devices)
alone, whichever seeds share its group, which shard runs it, or how many seeds the
study has. They are not, in general, those of one-seed cells: XLA compiles a vmapped
GEMM or reduction with another loop order (measured in tests/test_study_batched.py on
XLA:CPU: params up to 2.4e-7 apart in f32 and 1.5e-5 with bf16 compute after 6 steps;
the gap grows as training is chaotic), and even the one-seed step, looped or one per
device, is compiled inside another program (within 1.2e-7 of one-seed cells on the MLP
tasks, not always equal). K, the device count and `how` are therefore part of the
study's identity (`identity_entry`) whenever K > 1 over stacked state; "threads"
changes no number and is not.

Cells keep the layout and files of one-seed cells, kept by the same bookkeeping
(`_cells.CellBook`, every file operation under `_faults.library_io`): per-cell
checkpoints, steps.jsonl, telemetry.jsonl, attempts.jsonl, done.json; a killed group
resumes each cell from its own newest checkpoint (cells ahead wait, masked, for the
others), so it ends bit-exactly as an uninterrupted group of the same K and devices.
``step_time_s`` of a batched cell is the group's step wall time divided by the seeds
it advanced.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from precision.study import _cells
from precision.study import _faults
from precision.study import _models
from precision.study import _signals
from precision.study._cells import Cell, CellSettings
from precision.study._task import Task, batch_stream

MAX_DEFAULT = 8   # the default K (one seed per device) never exceeds this many seeds


HOWS = ("loop", "vmap", "threads")


class SeedBatch(NamedTuple):
  """How cells are batched: `k` seeds per group (1: one-seed cells, as without
  batching), the seed axis sharded over `devices` local devices (1: none), and `how`
  seeds sharing a device run: "loop" (`jax.lax.map`: the one-seed step once per seed,
  inside one program over stacked state), "vmap" (one vectorised step over them), or
  "threads" (one device: the group's one compiled one-seed step run for each seed on
  host threads, so every seed's numbers are its one-seed cell's)."""

  k: int
  devices: int = 1
  how: str = "loop"


def default_how(backend: str, devices: int = 1) -> str:
  """How seeds sharing a device run on `backend` when the seed axis is split over
  `devices`: on an accelerator "vmap" (one seed of a small model leaves it mostly idle);
  on a CPU "threads" on one device and "loop" over forced host devices. On a CPU one
  seed's step already keeps most of the cores busy, so no program over stacked state
  is faster per seed there: a vmapped step was measured slower than the one-seed step
  (0.6x to 0.8x on the sweep's GPT and plain LM), the looped one 0.9x to 1.4x, and
  either costs a second compile per group; "threads" runs the one-seed executable
  itself, compiled once per group, several seeds at a time (`threads_for`;
  experiments/bench_study.py)."""
  if backend != "cpu":
    return "vmap"
  return "threads" if devices == 1 else "loop"


def default_seed_batch(budget: int, n_devices: int) -> SeedBatch:
  """The library's choice for a new study of `budget` seeds per recipe on `n_devices`
  local devices: on an accelerator one seed per device, K = min(budget, n_devices, 8)
  (every GPU of a node trains a seed of the recipe at once; one device keeps one program
  per cell); on CPU one program per cell. A larger K (seeds vmapped on a device: faster where one
  seed leaves the device idle, measured by experiments/bench_study.py) is asked for
  explicitly, as its numbers differ from one-seed cells' by rounding."""
  if jax.default_backend() == "cpu":
    # CPU (forced host devices included): one program per cell, one seed's state in
    # memory at a time. An explicit K on one CPU device runs "threads" (one-seed cells'
    # numbers, faster: experiments/bench_study.py) and holds the group's K states at
    # once, which a model that fits one seed's state need not afford: asked for.
    return SeedBatch(1, 1, "loop")
  k = max(1, min(int(budget), int(n_devices), MAX_DEFAULT))
  return SeedBatch(k, k, default_how(jax.default_backend()))


def _devices_for(k: int, n_devices: int) -> int:
  return max(d for d in range(1, min(k, max(1, n_devices)) + 1) if k % d == 0)


def check_seed_batch(value: Any, budget: int, n_devices: int,
                     budget_name: str = "the seeds per recipe") -> SeedBatch:
  """`value` (an int K, or None for the default) as a SeedBatch; ValueError naming it
  unless 1 <= K <= `budget` (the seeds per recipe, or a sequential study's max_seeds:
  `budget_name` says which). The devices are the most local devices that divide K."""
  if value is None:
    return default_seed_batch(budget, n_devices)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
      1 <= int(value) <= budget):
    raise ValueError(f"seed_batch={value!r}; accepted: an integer from 1 to {budget_name} "
                     f"({budget}), or None for the library's choice")
  devices = _devices_for(int(value), n_devices)
  return SeedBatch(int(value), devices, default_how(jax.default_backend(), devices))


def identity_entry(sb: SeedBatch) -> dict | None:
  """The study identity's record of the batching: None where the numbers are one-seed
  cells' (K 1, whose identity is what it was before batching existed, and "threads",
  which runs their executable), so such a study continues with any K."""
  if sb.k == 1 or sb.how == "threads":
    return None
  entry = {"k": sb.k, "devices": sb.devices}
  if sb.k > sb.devices:   # seeds share a device: how they run is part of the program
    entry["how"] = sb.how
  return entry


def from_identity(entry: Any) -> SeedBatch:
  """The SeedBatch a stored identity records (one-seed cells when it records none)."""
  if not entry:
    return SeedBatch(1, 1)
  return SeedBatch(int(entry["k"]), int(entry["devices"]), str(entry.get("how", "loop")))


def identity_items(sb: SeedBatch) -> dict:
  """{"seed_batch": entry} for the study's identity, {} for one-seed cells."""
  entry = identity_entry(sb)
  return {} if entry is None else {"seed_batch": entry}


def resolve(value: Any, out: str, budget: int, n_devices: int,
            budget_name: str = "the seeds per recipe") -> SeedBatch:
  """The SeedBatch a run uses: `value` checked (`check_seed_batch`); None: the one the
  identity of the study in `out` records (one program per cell where it records none),
  so a rerun or a grown study continues as it began, and `default_seed_batch` for a
  new study."""
  if value is None:
    try:
      with open(os.path.join(out, "study.json")) as f:
        return from_identity(json.load(f)["identity"].get("seed_batch"))
    except (FileNotFoundError, json.JSONDecodeError, AttributeError, KeyError, TypeError,
            ValueError):
      pass
  return check_seed_batch(value, budget, n_devices, budget_name)


def groups(cells: Sequence[Cell], k: int) -> list[list[Cell]]:
  """The cells of each arm, in grid order, in chunks of at most `k`."""
  by_arm: dict[str, list[Cell]] = {}
  for c in cells:
    by_arm.setdefault(c.arm, []).append(c)
  return [cs[i:i + k] for cs in by_arm.values() for i in range(0, len(cs), k)]


def _shapes(tree: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((np.shape(x), str(np.asarray(x).dtype)) for x in leaves)


def check_stackable(task: Task, seeds: Sequence[int]) -> None:
  """ValueError naming the seeds unless the first batch of every seed has the same
  structure, shapes and dtypes (the host stacks K seeds' batches into one)."""
  ref_seed, ref = None, None
  for s in seeds:
    try:
      b = next(iter(task.batches(s)))
    except StopIteration:
      raise ValueError(f"Task.batches({s}) yielded no batch; accepted: an iterator of at "
                       "least `steps` batches") from None
    sh = _shapes(b)
    if ref is None:
      ref_seed, ref = s, sh
    elif sh != ref:
      raise ValueError(
          f"seed_batch: the batches of seeds {ref_seed} and {s} cannot be stacked (their "
          f"first batches differ: {_describe(ref)} vs {_describe(sh)}); accepted: "
          "batches(seed) of the same structure, shapes and dtypes for every seed, or "
          "seed_batch=1")


def _describe(sh) -> str:
  treedef, leaves = sh
  return "; ".join(f"{dt}{list(shape)}" for shape, dt in leaves) + (
      "" if treedef.num_leaves == len(leaves) else " (another structure)")


def _is_key(x: Any) -> bool:
  return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _stack(trees: Sequence[Any], sharding: Any = None) -> Any:
  """The trees' leaves stacked on a new leading axis, as device arrays (placed by
  `sharding`: the seed axis over a mesh; None: the default device). Stacked on the host
  (one transfer of every leaf, `np.stack`, `device_put`): eager `jnp.stack` on device
  compiled a program per leaf shape, seconds of a group's time on CPU. Typed PRNG keys,
  which have no host form, are stacked on device."""
  host = jax.device_get(list(trees))
  return jax.tree.map(lambda *xs: jax.device_put(jnp.stack(xs) if _is_key(xs[0])
                                                 else np.stack(xs), sharding), *host)


class _HostCopy:
  """The group's stacked state fetched to the host once (at the first `slot` after a
  step) and cut into one seed's state there: a seed's evaluation, checkpoint and summary
  get device arrays of exactly its bits, with no eager device program per leaf (which
  compiled one per leaf shape and slot index)."""

  def __init__(self, state: Any):
    self.state = state
    self._host = None

  def slot(self, i: int) -> Any:
    if self._host is None:
      self._host = jax.device_get(self.state)   # typed keys stay device arrays
    return jax.tree.map(lambda x: x[i] if _is_key(x) else jax.device_put(x[i]), self._host)


def batched_step(core: Callable[..., Any], mesh: Mesh | None = None,
                 how: str = "loop") -> Callable[..., Any]:
  """``step(states, batches, t, seeds, active) -> (states, metrics)`` over the leading
  (seed) axis of every argument but `t`: a slot with ``active`` False keeps its state bit
  for bit (an elementwise select), its metrics are to be ignored.

  On one device (`mesh` None) the K slots are run as `how` says: "loop" (`jax.lax.map`:
  `core` once per slot, in turn) or "vmap" (`core` vectorised over them). With a `mesh`
  (axis "seed") it is a `jax.shard_map` over it, each device running its K / devices
  slots so; a device with exactly one runs `core` itself on that seed (the one-seed
  program, its leading axis squeezed off)."""
  def one(state, batch, seed, active, t):
    new, metrics = core(state, batch, t, seed)
    kept = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state)
    return kept, metrics

  def local(states, batches, t, seeds, active):
    if seeds.shape[0] == 1:
      first = lambda tree: jax.tree.map(lambda x: x[0], tree)
      out = one(first(states), first(batches), seeds[0], active[0], t)
      return jax.tree.map(lambda x: x[None], out)
    if how == "loop":
      return jax.lax.map(lambda slot: one(*slot, t), (states, batches, seeds, active))
    return jax.vmap(one, in_axes=(0, 0, 0, 0, None))(states, batches, seeds, active, t)

  if mesh is None:
    return local
  on_seed = PartitionSpec("seed")
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(on_seed, on_seed, PartitionSpec(), on_seed, on_seed),
                       out_specs=on_seed, check_vma=False)


class _Slot:
  """One seed of a group while it trains: its cell's bookkeeping (`_cells.CellBook`),
  program, batch stream and position."""

  def __init__(self, book: _cells.CellBook):
    self.book = book
    self.cell = book.cell
    self.prog: _models.Program | None = None
    self.batches = None
    self.batch = None        # the batch of its next step (fetched, not yet trained)
    self.pos = 0             # steps done
    self.finished = False    # done.json written (ok, diverged or failed)
    self.stopped: str | None = None
    self.state0 = None       # the restored (or initial) state, until stacked


def run_group(task: Task, cells: Sequence[Cell], settings: CellSettings, out: str,
              sb: SeedBatch, on_step: Callable[[int], None] | None = None,
              retry_failed: bool = False) -> list[dict]:
  """Runs (or continues) the unfinished cells of `cells` (one arm, at most K) as one
  seed-batched program and writes each one's done.json; returns their records.

  With `retry_failed`, a cell recorded as "failed" runs again from its last checkpoint
  (its record and traceback kept as done.failed.json and error.failed.txt, as
  `_cells.run_cell` does): groups are padded to K, so the seed trains in a group of its
  own exactly as it would have beside the others.

  An error of the whole group (the recipe fails to build or compile) finishes each of
  its unfinished cells as "failed" with that error, as one-seed cells would be; an error
  of one seed (its batch stream ends, its evaluation raises) finishes that cell alone.
  KeyboardInterrupt and SystemExit propagate (every cell resumes next time); so does a
  fault of the environment (`_faults.is_environment`: a full disk, an I/O error, memory
  exhausted; every file operation of a cell runs in its `_cells.CellBook`), as a one-line
  StudyEnvironmentError that leaves the cells unfinished, and a stop request (SIGTERM or
  the warning signal, `_signals`): each open cell saves at its step and `Stopped` is
  raised.
  """
  todo = [c for c in cells if _cells.to_run(out, c, retry_failed)]
  slots: list[_Slot] = []
  try:
    for c in todo:
      book = _cells.CellBook(out, c)
      if _cells.read_done(out, c) is not None:
        book.set_aside_failed()   # a retry (`to_run` chose it)
      book.make_folder()
      slot = _Slot(book)
      slots.append(slot)
      try:
        slot.prog = _models.build(task, c.recipe, c.seed, settings.fp8_keeps,
                                  dict(settings.overrides))
        _open(task, slot, settings)
      except Exception as e:  # pylint: disable=broad-except
        # One seed's error (its init, its batch stream) is its cell's.
        _finish_slot_failed(slot, e)
    live = [s for s in slots if not s.finished]
    if live:
      try:
        _train(live, settings, sb, on_step)
      except Exception as e:  # pylint: disable=broad-except
        # A failing recipe (its build or compile) is a result of the study, not its end.
        for s in live:
          if not s.finished:
            _finish_slot_failed(s, e)
  except BaseException:
    for s in slots:
      s.book.close_after_failure()
    raise
  for s in slots:
    s.book.close()
  return [_cells.read_done(out, c) for c in todo]


def _next_batch(slot: _Slot, step: int):
  try:
    return next(slot.batches)
  except StopIteration:
    raise ValueError(f"Task.batches({slot.cell.seed}) ended after {step} batches; "
                     "accepted: an iterator of at least `steps` batches") from None


def _open(task: Task, slot: _Slot, settings: CellSettings) -> None:
  """Restores the slot's cell from its newest checkpoint (or starts it), cuts its
  records back to that step and replays its batch stream there, as `_cells` does."""
  state, start = slot.book.restore(slot.prog)
  slot.book.open_logs(start, settings.telemetry_every)
  slot.batches = batch_stream(task, slot.cell.seed, skip=start)
  slot.batch = _next_batch(slot, start)
  slot.pos = start
  slot.state0 = state


def _trace_one(prog: _models.Program, state, batch, t: int):
  """`prog.step` traced on one seed's (state, batch, t) and compiled: (the traced step,
  the compiled one-seed step)."""
  traced = prog.step.trace(state, batch, jnp.int32(t))
  return traced, traced.lower().compile()


def _core_of(prog: _models.Program, traced) -> Callable[..., Any]:
  """The seed-explicit core a stacked program runs in each slot. For a recipe whose
  optimizer does not read the seed (all but stochastic rounding's) it is the traced
  one-seed step's own jaxpr, evaluated per slot: the step is traced once for the memory
  program and the batched one (tracing an autocast step costs about as much as
  compiling it on CPU). Stochastic rounding hashes the seed into its updates, so its
  core (`Program.core`) is traced again, the seed an argument of the program."""
  if _models.seeds_rounding(prog.recipe):
    return prog.core
  closed, in_tree, out_tree = traced.jaxpr, traced.in_tree, traced.out_tree

  def core(state, batch, t, seed):
    del seed  # the optimizer does not read it
    flat, tree = jax.tree.flatten(((state, batch, t), {}))
    if tree != in_tree:
      raise ValueError(f"seed_batch: a slot's (state, batch) has another structure than "
                       f"the seed the step was traced on: {tree} vs {in_tree}")
    out = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
    return jax.tree.unflatten(out_tree, out)
  return core


def one_seed_step(prog: _models.Program, state, batch,
                  t: int = 0) -> tuple[dict, Callable[..., Any]]:
  """A group's one-seed step (`prog.step`) traced and compiled once on one seed's state,
  batch and step `t`: (its compiled memory, the core a stacked program runs in each
  slot, `_core_of`). The memory is the report's cost column: one seed's step, compiled,
  not run (the study's compilation cache keeps it for the next group)."""
  traced, compiled = _trace_one(prog, state, batch, t)
  return _cells.compiled_memory(compiled), _core_of(prog, traced)


_FIELDS = _cells.STEP_FIELDS + ("consecutive_nonfinite",)


class _Stacked:
  """K slots in one program over stacked state: "loop" / "vmap" on one device, or the
  seed axis sharded over `sb.devices` (`batched_step`). Slots that do not step this
  time (waiting, finished, padding) are masked: their state is kept bit for bit."""

  def __init__(self, first: _Slot, states: list, seeds: np.ndarray, sb: SeedBatch):
    self.memory, core = one_seed_step(first.prog, states[0], first.batch, first.pos)
    mesh, self.sharding = None, None
    if sb.devices > 1:
      mesh = Mesh(np.asarray(jax.local_devices()[:sb.devices]), ("seed",))
      self.sharding = NamedSharding(mesh, PartitionSpec("seed"))
    self._fn = jax.jit(batched_step(core, mesh, sb.how), donate_argnums=(0,))
    self._compiled = None
    self.width = sb.k
    # Every leaf in a buffer of its own (the padding slots share the first seed's
    # arrays), stacked on the host: no device program runs outside the step.
    self.state = _stack(states, self.sharding)
    self.seeds = jax.device_put(seeds, self.sharding)
    self._view = _HostCopy(self.state)

  def slot(self, i: int) -> Any:
    return self._view.slot(i)

  def step(self, live: list[int], batches: list, t: int) -> dict:
    """One step of the `live` slots on `batches` (one per slot, K of them; the others'
    are fillers of the same shapes); the metrics, indexed by slot."""
    active = np.zeros((self.width,), bool)
    active[live] = True
    args = (_stack(batches, self.sharding), jnp.int32(t), self.seeds,
            jax.device_put(active, self.sharding))
    if self._compiled is None:
      # Compiled ahead, as one-seed cells are: step times are the steps' alone.
      self._compiled = self._fn.lower(self.state, *args).compile()
    self.state, metrics = self._compiled(self.state, *args)
    self._view = _HostCopy(self.state)
    return jax.device_get({f: metrics[f] for f in _FIELDS})

  def close(self) -> None:
    pass


class _Threaded:
  """Each seed's own state stepped by the group's one compiled one-seed step, on up to
  `threads` host threads at once ("threads", a CPU's: the executable that one-seed cells
  run, so every seed's numbers are bit for bit its one-seed cell's). The step is traced
  and compiled once for the group (its memory the report's column), and several seeds'
  steps at once (`threads_for`) keep a CPU busier than one seed's small GEMMs do
  (experiments/bench_study.py). Stochastic rounding's step reads its seed, so its seeds
  share one program compiled with the seed an argument (`Program.core`)."""

  def __init__(self, first: _Slot, states: list, seeds: np.ndarray, threads: int):
    _, compiled = _trace_one(first.prog, states[0], first.batch, first.pos)
    self.memory = _cells.compiled_memory(compiled)
    self._seeded = _models.seeds_rounding(first.prog.recipe)
    if self._seeded:
      core = jax.jit(first.prog.core, donate_argnums=(0,))
      compiled = core.lower(states[0], first.batch, jnp.int32(first.pos),
                            jnp.uint32(seeds[0])).compile()
    self._compiled = compiled
    self._seeds = [jnp.uint32(s) for s in seeds]
    self.states = list(states)   # each seed's own buffers, donated to its step
    self.width = len(self.states)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads))

  def slot(self, i: int) -> Any:
    return self.states[i]

  def _one(self, i: int, batch, t: int):
    args = (self.states[i], batch, jnp.int32(t)) + ((self._seeds[i],) if self._seeded
                                                      else ())
    new, metrics = self._compiled(*args)
    return new, jax.device_get({f: metrics[f] for f in _FIELDS})

  def step(self, live: list[int], batches: list, t: int) -> dict:
    futures = {i: self._pool.submit(self._one, i, batches[i], t) for i in live}
    out = {f: [0] * self.width for f in _FIELDS}
    for i, fut in futures.items():
      self.states[i], m = fut.result()
      for f in _FIELDS:
        out[f][i] = m[f]
    return out

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def threads_for(n: int) -> int:
  """Host threads stepping a "threads" group of `n` seeds: two per core, at most 8.
  Measured on the sweep's plain LM on this project's 2-core machines, ms per seed-step
  with 1, 2, 3 and 4 threads: fp32 14.6, 11.7, 11.2, 10.8; bf16_master 19.2, 15.6,
  13.9, 13.2 (the executions overlap where one seed's small GEMMs and host dispatch
  leave a core idle)."""
  return max(1, min(n, 2 * (os.cpu_count() or 1), 8))


def _train(slots: list[_Slot], settings: CellSettings, sb: SeedBatch,
           on_step: Callable[[int], None] | None) -> None:
  k = sb.k
  n = len(slots)
  # Padding slots (stacked programs): copies of the first seed, never active, so the
  # program has K slots whatever the group's size (a seed's numbers depend on K, not on
  # its neighbours). Threads run no padding: each seed is its one-seed cell.
  pad = 0 if sb.how == "threads" else k - n
  states = [s.state0 for s in slots] + [slots[0].state0] * pad
  for s in slots:
    s.state0 = None
  seeds = np.asarray([s.cell.seed for s in slots] + [slots[0].cell.seed] * pad, np.uint32)
  if sb.how == "threads":
    group = _Threaded(slots[0], states, seeds, threads_for(n))
  else:
    group = _Stacked(slots[0], states, seeds, sb)
  del states
  try:
    _steps(slots, group, settings, on_step)
  finally:
    group.close()


def _steps(slots: list[_Slot], group, settings: CellSettings,
           on_step: Callable[[int], None] | None) -> None:
  """Trains the group's slots in lockstep to `settings.steps` with each cell's records,
  evaluations, checkpoints and outcome, as one-seed cells keep them."""
  n = len(slots)
  evaluate = slots[0].prog.evaluate   # one function of the state for every seed
  start = min(s.pos for s in slots)
  for i, s in enumerate(slots):
    if s.pos == 0 and settings.eval_every:
      try:
        rec = {"step": 0, "eval": evaluate(group.slot(i))}
      except Exception as e:  # pylint: disable=broad-except
        _finish_slot_failed(s, e)
        continue
      s.book.record(rec)
  for t in range(start, settings.steps):
    live = [i for i, s in enumerate(slots) if not s.finished and s.pos == t]
    if not any(not s.finished for s in slots):
      break
    for i in live:
      s = slots[i]
      if s.batch is None:
        try:
          s.batch = _next_batch(s, t)
        except Exception as e:  # pylint: disable=broad-except
          _finish_slot_failed(s, e)
    live = [i for i in live if not slots[i].finished]
    if not live:
      continue
    ref = _shapes(slots[live[0]].batch)
    for i in live[1:]:
      if _shapes(slots[i].batch) != ref:
        _finish_slot_failed(slots[i], ValueError(
            f"seed_batch: Task.batches({slots[i].cell.seed}) yielded at step {t} a batch "
            f"({_describe(_shapes(slots[i].batch))}) that cannot be stacked with seed "
            f"{slots[live[0]].cell.seed}'s ({_describe(ref)}); accepted: batches of the "
            "same shapes for every seed, or seed_batch=1"))
    live = [i for i in live if not slots[i].finished]
    if settings.telemetry_every and t % settings.telemetry_every == 0:
      for i in live:
        slots[i].book.telemetry(_cells.telemetry_line(
            slots[i].prog, group.slot(i), slots[i].batch, t, settings.telemetry_whatif))
    filler = slots[live[0]].batch
    batches = [slots[i].batch if i in live else (
        slots[i].batch if i < n and slots[i].batch is not None
        and _shapes(slots[i].batch) == ref else filler)
        for i in range(group.width)]
    t0 = time.perf_counter()
    metrics = group.step(live, batches, t)
    dt = (time.perf_counter() - t0) / len(live)
    done = t + 1
    for i in live:
      s = slots[i]
      s.batch, s.pos = None, done
      m = {f: _host(v[i]) for f, v in metrics.items()}
      rec = _cells.step_record(done, m, dt)
      s.stopped = _cells.stop_reason(m, done, settings.max_nonfinite)
      try:
        if s.stopped or done == settings.steps or (
            settings.eval_every and done % settings.eval_every == 0):
          rec["eval"] = evaluate(group.slot(i))
      except Exception as e:  # pylint: disable=broad-except
        _finish_slot_failed(s, e)
        continue
      s.book.record(rec)
      if on_step is not None:
        on_step(1)
      if s.stopped or done == settings.steps:
        _finish_slot(s, group.slot(i), group.memory)
      elif done % settings.save_every == 0:
        s.book.save(done, group.slot(i), s.prog)
    stop = _signals.requested()  # SIGTERM / the warning signal: save every open cell
    if stop is not None:
      open_slots = [(i, s) for i, s in enumerate(slots) if not s.finished]
      for i, s in open_slots:
        if s.pos > 0 and s.pos % settings.save_every != 0:
          s.book.save(s.pos, group.slot(i), s.prog)
      if open_slots:
        raise _signals.Stopped(stop, cell=",".join(s.cell.name for _, s in open_slots),
                               step=min(s.pos for _, s in open_slots))


def _host(v) -> float | int:
  v = np.asarray(v)
  return int(v) if np.issubdtype(v.dtype, np.integer) else float(v)


def _finish_slot(s: _Slot, state, memory: dict) -> None:
  s.book.done(s.book.summary(s.prog, state, memory, s.stopped))
  s.finished = True


def _finish_slot_failed(s: _Slot, e: BaseException) -> None:
  # A fault of the environment is not the model's result: the run stops, the cell stays
  # unfinished and continues from its checkpoint next time (as one-seed cells).
  if _faults.is_environment(e):
    if isinstance(e, _faults.StudyEnvironmentError):
      raise e
    raise _faults.fault(s.cell.name, "training its seed-batched group", s.book.folder,
                        e) from e
  s.book.done(s.book.failed(e))
  s.finished = True
