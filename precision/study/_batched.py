"""Seed-batched cells: K seeds of one recipe trained by ONE compiled program.

A group is up to K cells of one arm (the same recipe); its program runs the recipe's
seed-explicit step (`Program.core`) over stacked state (params, optimizer state with
its loss scale and counters, the model's other state with fp8 scaling state, the rng
key data), stacked batches (the host stacks each seed's own ``batches(seed)``) and the
seeds (stochastic rounding's). Each seed keeps its own position, skips, divergence and
records: a per-slot `active` mask selects, element by element, the new state of the
seeds that step and the old state of the others (a diverged, failed or finished seed,
one waiting for the group to reach its checkpoint, or a padding slot), so a seed that
stops leaves the others' numbers untouched.

The seed axis is sharded over `devices` local devices (a 1-D mesh "seed", K a multiple
of it, `jax.shard_map`): a device holding one seed runs the one-seed step itself; one
holding several (on a single device: all K) runs them as `SeedBatch.how` says, in a
loop inside the program (`jax.lax.map`, the CPU's default) or vectorised (`jax.vmap`,
an accelerator's).

Every group is padded to exactly K slots (copies of its first seed, never active): a
seed's numbers are then a function of (recipe, seed, K, devices) alone, whichever seeds
share its group, which shard runs it, or how many seeds the study has. They are not, in
general, those of one-seed cells: XLA compiles a vmapped GEMM or reduction with another
loop order (measured in tests/test_study_batched.py on XLA:CPU: params up to 2.4e-7 apart
in f32 and 1.5e-5 with bf16 compute after 6 steps; the gap grows as training is
chaotic), and even the one-seed step, looped or one per device, is compiled inside
another program (bit-equal to one-seed cells on the MLP tasks, not on the Linen CNN).
K, the device count and `how` are therefore part of the study's identity
(`identity_entry`) whenever K > 1.

Cells keep the layout and files of one-seed cells, kept by the same bookkeeping
(`_cells.CellBook`, every file operation under `_faults.library_io`): per-cell
checkpoints, steps.jsonl, telemetry.jsonl, attempts.jsonl, done.json; a killed group
resumes each cell from its own newest checkpoint (cells ahead wait, masked, for the
others), so it ends bit-exactly as an uninterrupted group of the same K and devices.
``step_time_s`` of a batched cell is the batched step's wall time divided by the seeds
it advanced.
"""

from __future__ import annotations

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


HOWS = ("loop", "vmap")


class SeedBatch(NamedTuple):
  """How cells are batched: `k` seeds per program (1: one-seed cells, as without
  batching), the seed axis sharded over `devices` local devices (1: none), and `how`
  seeds sharing a device run: "loop" (`jax.lax.map`: the one-seed step once per seed,
  inside the program) or "vmap" (one vectorised step over them)."""

  k: int
  devices: int = 1
  how: str = "loop"


def default_how(backend: str) -> str:
  """How seeds sharing a device run on `backend`: "loop" on CPU, where a vmapped step was
  measured slower per seed than the one-seed step (experiments/bench_study.py: 0.75x
  and 0.96x on the sweep's plain LM and GPT, the loop 1.19x and 1.23x) because the
  one-seed GEMMs already keep its cores busy; "vmap" on an accelerator, which one seed
  of a small model leaves mostly idle."""
  return "loop" if backend == "cpu" else "vmap"


def default_seed_batch(budget: int, n_devices: int) -> SeedBatch:
  """The library's choice for a new study of `budget` seeds per recipe on `n_devices`
  local devices: on an accelerator one seed per device, K = min(budget, n_devices, 8)
  (every GPU of a node trains a seed of the recipe at once; one device keeps one program
  per cell); on CPU one program per cell. A larger K (seeds vmapped on a device: faster where one
  seed leaves the device idle, measured by experiments/bench_study.py) is asked for
  explicitly, as its numbers differ from one-seed cells' by rounding."""
  if jax.default_backend() == "cpu":
    # CPU (forced host devices included): one program per cell. Batching measured 1.29x
    # on the sweep's grid here (experiments/bench_study.py), its numbers differ from
    # one-seed cells' by rounding, and a CPU "device" shares the same cores.
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
  return SeedBatch(int(value), _devices_for(int(value), n_devices),
                   default_how(jax.default_backend()))


def identity_entry(sb: SeedBatch) -> dict | None:
  """The study identity's record of the batching (None for one-seed cells: their
  identity is what it was before batching existed)."""
  if sb.k == 1:
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


def _stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _slot(tree: Any, i: int) -> Any:
  return jax.tree.map(lambda x: x[i], tree)


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


def _single_memory(slot: _Slot, state, batch) -> dict:
  """The one-seed step's compiled memory: the report's cost column is one seed's step
  (compiled, not run; the study's compilation cache keeps it for the next group)."""
  compiled = slot.prog.step.lower(state, batch, jnp.int32(slot.pos)).compile()
  return _cells.compiled_memory(compiled)


def _train(slots: list[_Slot], settings: CellSettings, sb: SeedBatch,
           on_step: Callable[[int], None] | None) -> None:
  k = sb.k
  n = len(slots)
  # Padding slots: copies of the first seed, never active, so the program has K slots
  # whatever the group's size (a seed's numbers depend on K, not on its neighbours).
  states = [s.state0 for s in slots] + [slots[0].state0] * (k - n)
  for s in slots:
    s.state0 = None
  memory = _single_memory(slots[0], states[0], slots[0].batch)
  seeds = np.asarray([s.cell.seed for s in slots] + [slots[0].cell.seed] * (k - n),
                     np.uint32)
  if sb.devices > 1:
    mesh = Mesh(np.asarray(jax.local_devices()[:sb.devices]), ("seed",))
    on_seed = NamedSharding(mesh, PartitionSpec("seed"))
    compiled_fn = jax.jit(batched_step(slots[0].prog.core, mesh, sb.how),
                          donate_argnums=(0,))
    put = lambda tree: jax.device_put(tree, on_seed)
  else:
    compiled_fn = jax.jit(batched_step(slots[0].prog.core, None, sb.how),
                          donate_argnums=(0,))
    put = lambda tree: tree
  # Every leaf in a buffer of its own: the padding slots share the first seed's arrays.
  state = put(_stack(states))
  del states
  seeds = put(jnp.asarray(seeds))
  evaluate = slots[0].prog.evaluate   # one function of the state for every seed
  start = min(s.pos for s in slots)
  compiled = None
  for i, s in enumerate(slots):
    if s.pos == 0 and settings.eval_every:
      try:
        rec = {"step": 0, "eval": evaluate(_slot(state, i))}
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
            slots[i].prog, _slot(state, i), slots[i].batch, t, settings.telemetry_whatif))
    filler = slots[live[0]].batch
    stacked = _stack([slots[i].batch if i in live else (
        slots[i].batch if i < n and slots[i].batch is not None
        and _shapes(slots[i].batch) == ref else filler) for i in range(k)])
    active = np.zeros((k,), bool)
    active[live] = True
    args = (put(stacked), jnp.int32(t), seeds, put(jnp.asarray(active)))
    if compiled is None:
      # Compiled ahead, as one-seed cells are: step times are the steps' alone.
      compiled = compiled_fn.lower(state, *args).compile()
    t0 = time.perf_counter()
    state, metrics = compiled(state, *args)
    metrics = {f: np.asarray(jax.device_get(metrics[f]))
               for f in _cells.STEP_FIELDS + ("consecutive_nonfinite",)}
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
          rec["eval"] = evaluate(_slot(state, i))
      except Exception as e:  # pylint: disable=broad-except
        _finish_slot_failed(s, e)
        continue
      s.book.record(rec)
      if on_step is not None:
        on_step(1)
      if s.stopped or done == settings.steps:
        _finish_slot(s, _slot(state, i), memory)
      elif done % settings.save_every == 0:
        s.book.save(done, _slot(state, i), s.prog)
    stop = _signals.requested()  # SIGTERM / the warning signal: save every open cell
    if stop is not None:
      open_slots = [(i, s) for i, s in enumerate(slots) if not s.finished]
      for i, s in open_slots:
        if s.pos > 0 and s.pos % settings.save_every != 0:
          s.book.save(s.pos, _slot(state, i), s.prog)
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
