"""Host time of one training step: three ways of jitting `precision.train_step`.

`python -m experiments.bench_host [--quick]` prints, for a GPT of small width with 1, 4
and 16 blocks (each block adds 9 NNX Variables), the time per step of a loop of steps
whose device work is small (width 16, batch 2 x 8 tokens):

  nnx.jit          ``nnx.jit(precision.train_step, static_argnums=(1, 3))`` called with
                   the model: Flax walks the model's object graph on every call
  jit_train_step   ``precision.jit_train_step(model, tx, loss_fn)``: the model split
                   once; each call reads the Variables' arrays and writes the new ones back
  split + jax.jit  the state held as pytrees by hand (params, other state, optimizer
                   state), ``jax.jit`` with donation, the model never touched (what
                   experiments/trainlib.py does)

  program alone    the same program through its compiled executable, its arguments
                   already one flat list of arrays: the step with (almost) no host work

Each figure is the median over interleaved repeats (they take turns, so machine noise
hits them alike) of the mean over `steps` steps of the time from the call to its results
being ready, each step started with the device idle, so host and device work add up
instead of overlapping (on CPU the device work of so small a program is partly run
inside the call anyway). Host time is that figure less the program alone's; the ratios
are of step times. `run(quick)` returns the same figures as a dict. CPU figures unless a
GPU is present; the backend is printed with them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import precision as mp

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from models import gpt as gpt_lib  # noqa: E402

PATTERNS = ("nnx.jit", "jit_train_step", "split + jax.jit")
PROGRAM = "program alone"


def _setup(n_layers: int, recipe: str):
  config = gpt_lib.GPTConfig(seq_len=8, d_model=16, n_layers=n_layers, n_heads=2, d_ff=32)
  model = mp.flax.apply_recipe(gpt_lib.GPT(config, rngs=nnx.Rngs(0)), recipe)
  tx = mp.optim.build_optimizer(recipe, optax.adamw(1e-3))
  # Every leaf in its own buffer: the donated steps may not get one buffer twice.
  opt_state = jax.tree.map(jnp.copy, tx.init(nnx.state(model, nnx.Param)))
  return model, tx, opt_state


def _pure_step(graphdef, tx):
  """precision.train_step over (params, other model state, optimizer state) pytrees."""

  def step(params, rest, opt_state, tokens):
    m = nnx.merge(graphdef, params, rest)
    loss, opt_state = mp.train_step(m, tx, opt_state, gpt_lib.loss_fn, tokens)
    _, params, rest = nnx.split(m, nnx.Param, ...)
    return loss, params, rest, opt_state

  return step


def _steps(n_layers: int, recipe: str, tokens):
  """{pattern: step() -> outputs}: one training step each, each on its own model."""
  steps = {}

  model, tx, opt_state = _setup(n_layers, recipe)
  nnx_step = nnx.jit(mp.train_step, static_argnums=(1, 3))
  box = {"opt": opt_state}

  def run_nnx(model=model, tx=tx, box=box):
    loss, box["opt"] = nnx_step(model, tx, box["opt"], gpt_lib.loss_fn, tokens)
    return loss, box["opt"]

  steps["nnx.jit"] = run_nnx

  model, tx, opt_state = _setup(n_layers, recipe)
  fast = mp.jit_train_step(model, tx, gpt_lib.loss_fn)
  box2 = {"opt": opt_state}

  def run_fast(box=box2):
    loss, box["opt"] = fast(box["opt"], tokens)
    return loss, box["opt"]

  steps["jit_train_step"] = run_fast

  model, tx, opt_state = _setup(n_layers, recipe)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  jitted = jax.jit(_pure_step(graphdef, tx), donate_argnums=(0, 1, 2))
  box3 = {"state": (params, jax.tree.map(jnp.copy, rest), opt_state)}

  def run_split(box=box3):
    loss, *state = jitted(*box["state"], tokens)
    box["state"] = tuple(state)
    return loss, state

  steps["split + jax.jit"] = run_split

  # The same program called with its arguments already one flat list of arrays, through
  # the compiled executable: what a step costs with (almost) no host work around it.
  model, tx, opt_state = _setup(n_layers, recipe)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  leaves, treedef = jax.tree.flatten((params, jax.tree.map(jnp.copy, rest), opt_state))
  pure = _pure_step(graphdef, tx)

  def flat(leaves, tokens):
    loss, *state = pure(*jax.tree.unflatten(treedef, leaves), tokens)
    return loss, jax.tree.leaves(state)

  compiled = jax.jit(flat, donate_argnums=0).lower(leaves, tokens).compile()
  box4 = {"leaves": leaves}

  def run_program(box=box4):
    loss, box["leaves"] = compiled(box["leaves"], tokens)
    return loss, box["leaves"]

  steps[PROGRAM] = run_program
  return steps


def _step_seconds(step, n: int) -> float:
  """Mean over `n` steps of the time from the call to its results being ready, each
  step started with the device idle: host and device work, not overlapped."""
  total = 0.0
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(step())
    total += time.perf_counter() - t0
  return total / n


def run(quick: bool = False) -> dict:
  """{"backend", "recipe", "layers", "variables", "steps", "repeats",
  "seconds": {layers: {pattern or PROGRAM: s per step}},
  "host_seconds": {layers: {pattern: s per step over the program alone}},
  "helper_over_split": {layers: x}, "nnx_over_split": {layers: x}} (step time ratios)."""
  layers = (1, 2) if quick else (1, 4, 16)
  n, repeats = (5, 3) if quick else (20, 9)
  recipe = "bf16_master"
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
  out = {"backend": jax.default_backend(), "recipe": recipe, "layers": list(layers),
         "steps": n, "repeats": repeats, "variables": {}, "seconds": {},
         "host_seconds": {}, "helper_over_split": {}, "nnx_over_split": {}}
  for n_layers in layers:
    steps = _steps(n_layers, recipe, tokens)
    out["variables"][n_layers] = len(jax.tree.leaves(nnx.state(_setup(n_layers, recipe)[0])))
    for step in steps.values():  # compile and warm up
      _step_seconds(step, 2)
    times = {name: [] for name in steps}
    for _ in range(repeats):  # interleaved: machine noise hits them alike
      for name, step in steps.items():
        times[name].append(_step_seconds(step, n))
    secs = {name: statistics.median(ts) for name, ts in times.items()}
    out["seconds"][n_layers] = secs
    out["host_seconds"][n_layers] = {p: secs[p] - secs[PROGRAM] for p in PATTERNS}
    out["helper_over_split"][n_layers] = secs["jit_train_step"] / secs["split + jax.jit"]
    out["nnx_over_split"][n_layers] = secs["nnx.jit"] / secs["split + jax.jit"]
  return out


def main():
  mp.enable_faithful_rounding()  # XLA flags: set here, before the first computation
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="1 and 2 blocks, 3 repeats of 5 steps")
  res = run(quick=ap.parse_args().quick)
  print(f"backend: {res['backend']}; recipe {res['recipe']}; ms per step (call to results "
        f"ready, device idle before), medians of {res['repeats']} interleaved repeats of "
        f"{res['steps']} steps; host: over the program alone")
  cols = PATTERNS + (PROGRAM,)
  print(f"{'blocks':>6s} {'Variables':>9s}" + "".join(f"{p:>16s}" for p in cols)
        + f"{'helper/split':>14s}{'nnx.jit/split':>15s}"
        + "".join(f"{'host ' + p:>21s}" for p in PATTERNS))
  for n in res["layers"]:
    s, h = res["seconds"][n], res["host_seconds"][n]
    print(f"{n:6d} {res['variables'][n]:9d}" + "".join(f"{s[p] * 1e3:16.3f}" for p in cols)
          + f"{res['helper_over_split'][n]:14.2f}{res['nnx_over_split'][n]:15.2f}"
          + "".join(f"{h[p] * 1e3:21.3f}" for p in PATTERNS))

if __name__ == "__main__":
  main()
