"""The chaos floor (precision.study._floor) and seeds="auto" end to end on a task file
written outside the package (tests/study_tasks/params_mlp.py: a param pytree, no Flax):
the one-ulp nudge of NNX modules, Linen pairs and param pytrees, the seeds a margin
needs against the floor, a sequential study's summary (seeds_used, decided, the top-level
floor), a killed-and-rerun sequential study ending with the same summary, and bad input
(one line, ValueError / exit 2, nothing written)."""

import contextlib
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from precision import study
from precision.study import _floor
from precision.study import _report
from precision.study import _stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(ROOT, "tests", "study_tasks")
SMALL = dict(steps=8, eval_every=4, save_every=4, timing_rounds=0, progress=False)


@contextlib.contextmanager
def user_code():
  with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
    yield


def task():
  return study.load_task(os.path.join(TASKS, "params_mlp.py:task"))


def _ulps(a, b):
  a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
  return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


# --------------------------------------------------------------------------- the nudge


def _largest_grad(grads, values):
  """(leaf path, flat index) of the largest |gradient| at a nonzero value, computed
  directly (the rule `_floor` states)."""
  best = None
  for (path, g), v in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                          jax.tree.leaves(values)):
    score = np.where(np.asarray(v).reshape(-1) != 0, np.abs(np.asarray(g).reshape(-1)), -1)
    j = int(np.argmax(score))
    if best is None or score[j] > best[2]:
      best = (jax.tree_util.keystr(path), j, score[j])
  return best[:2]


def test_nudge_changes_one_ulp_of_the_element_of_largest_gradient():
  tree = {"bias": jnp.zeros((64,), jnp.float32), "w": jnp.array([[0.0, -2.0], [1.0, 3.0]]),
          "v": jnp.array([0.5, 0.25], jnp.float32), "steps": jnp.array([3], jnp.int32)}
  x = jnp.array([[1.0, 4.0]], jnp.float32)

  def loss(p, batch):
    c = jnp.array([[0.5, 0.25]], jnp.float32)
    return jnp.sum(batch @ p["w"] * c) + 0.1 * jnp.sum(p["v"]) + jnp.sum(p["bias"] ** 2) \
        + 100.0 * jnp.sum(p["bias"])

  new, where = _floor.nudge(tree, loss, x)
  # d/dw[i, j] = x[i] c[j]: w[1, 0] (4 x 0.5 = 2) is largest; w[1, 1] (1) next. The zero
  # bias has the largest gradient (100) but is never nudged: its next value is a
  # subnormal, which XLA:CPU flushes. The int leaf is left alone.
  assert np.all(new["bias"] == 0) and np.all(new["v"] == tree["v"])
  assert np.array_equal(new["steps"], tree["steps"])
  assert _ulps(new["w"], tree["w"]).tolist() == [0, 0, 1, 0]
  assert float(new["w"][1, 0]) > 1.0 and new["w"].dtype == jnp.float32
  assert where.startswith("['w'][1, 0]: 1.0 -> ") and "one float32 ulp" in where
  again, where2 = _floor.nudge(tree, loss, x)
  assert where2 == where and np.array_equal(np.asarray(again["w"]), np.asarray(new["w"]))


def test_nudge_nnx_in_place_and_linen_pair():
  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(3, 8, rngs=rngs)
      self.b = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      return self.b(jnp.tanh(self.a(x)))

  x = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]], jnp.float32)
  loss = lambda m, b: jnp.mean(m(b) ** 2)
  model = Mlp(nnx.Rngs(0))
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  g = nnx.grad(loss)(model, x)
  path, j = _largest_grad(g, before)
  _, where = _floor.nudge(model, loss, x)
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  diffs = jax.tree.map(lambda x, y: int(_ulps(x, y).sum()), before, after)
  assert sum(jax.tree.leaves(diffs)) == 1
  leaf = dict((jax.tree_util.keystr(p), v)
              for p, v in jax.tree_util.tree_flatten_with_path(after)[0])[path]
  shape = leaf.shape
  want = f"{path.removesuffix('.value')}[{', '.join(map(str, np.unravel_index(j, shape)))}]"
  assert where.startswith(want + ": "), (where, want)

  module = nn.Dense(4)
  variables = module.init(jax.random.key(0), jnp.ones((1, 5)))
  xs = jnp.arange(10, dtype=jnp.float32).reshape(2, 5) / 10.0
  lin_loss = lambda m, b: jnp.mean(m(b) ** 2)
  g = jax.grad(lambda p: jnp.mean(module.apply({"params": p}, xs) ** 2))(variables["params"])
  path, j = _largest_grad(g, variables["params"])
  (m2, v2), where = _floor.nudge((module, variables), lin_loss, xs)
  assert m2 is module and path == "['kernel']"
  assert where.startswith(f"['kernel'][{', '.join(map(str, np.unravel_index(j, (5, 4))))}]")
  assert int(_ulps(v2["params"]["kernel"], variables["params"]["kernel"]).sum()) == 1
  assert np.array_equal(v2["params"]["bias"], variables["params"]["bias"])


def test_nudge_without_a_gradient_is_refused():
  x = jnp.ones((2,), jnp.float32)
  with pytest.raises(ValueError, match="gradient on seed 0's first batch is nonzero"):
    _floor.nudge({"w": jnp.zeros((2,), jnp.float32)}, lambda p, b: jnp.sum(p["w"] * b), x)
  # Nonzero weights that the loss does not read: no element takes part in training.
  with pytest.raises(ValueError, match="every such gradient of the model's loss is zero"):
    _floor.nudge({"w": jnp.ones((2,), jnp.float32), "u": jnp.zeros((2,), jnp.float32)},
                 lambda p, b: jnp.sum(p["u"] * b), x)


# An embedding task whose largest parameter has a row no batch uses (token 0, like byte 0
# of a text corpus): the floor's element must be one that training reads.
VOCAB, DIM = 32, 16


def _embed_task():
  target = np.random.default_rng(3).standard_normal((VOCAB,)).astype(np.float32)

  def init(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"emb": jax.random.normal(k1, (VOCAB, DIM)),  # 512 elements: the largest
            "w": jax.random.normal(k2, (DIM,)) / np.sqrt(DIM)}

  def batches(seed):
    rng = np.random.default_rng(seed)
    while True:
      tok = rng.integers(1, VOCAB, (8,)).astype(np.int32)  # never token 0
      yield {"tok": tok, "y": target[tok]}

  def loss(p, b):
    return jnp.mean((p["emb"][b["tok"]] @ p["w"] - b["y"]) ** 2)

  every = np.arange(1, VOCAB)

  def evaluate(p):
    # In float64 on the host over every token the data uses, so that a difference of
    # one ulp in a used weight shows; it reads only those rows, as any metric of the
    # model does.
    emb, w = np.asarray(p["emb"], np.float64), np.asarray(p["w"], np.float64)
    return float(np.mean((emb[every] @ w - target[every]) ** 2))

  # A small lr: the nudged element's one-ulp lead is not lost to an update's rounding.
  return study.Task(init=init, loss=loss, batches=batches, optimizer=optax.adam(1e-3),
                    evaluate=evaluate, name="embed")


def test_floor_moves_on_a_task_whose_largest_parameter_has_an_unused_row(tmp_path):
  """The old rule nudged emb[0, 0] (the first nonzero element of the largest parameter):
  no batch reads row 0, so no gradient reaches it and the floor was the control bit for
  bit (every per-seed difference exactly 0). The element of the largest gradient on the
  first batch is one the loss reads: every seed's floor moves."""
  with user_code():
    r = study.run(_embed_task(), ["fp32"], seeds=2, out=str(tmp_path / "s"), floor=True,
                  **SMALL)
  floor = r.summary["floor"]
  assert len(floor["deltas"]) == 2 and all(d != 0 for d in floor["deltas"]), floor["deltas"]
  # Seed 0's element (here in w, whose gradient sums over the batch) is not row 0's.
  assert not floor["nudge"].startswith("['emb'][0, ")


def test_seeds_for_margin_reach_the_power_they_promise():
  rng = np.random.default_rng(0)
  for margin, spread, m in ((0.01, 0.01, 1), (0.01, 0.02, 3), (0.05, 0.02, 2)):
    n = _floor.seeds_for_margin(margin, spread, m)
    d = spread * rng.standard_normal((4000, n))
    power = np.mean([_stats.tost_p_value(row, margin) <= 0.05 / m for row in d])
    assert power >= 0.78, (margin, spread, m, n, power)
    d = spread * rng.standard_normal((4000, n - 1))
    fewer = np.mean([_stats.tost_p_value(row, margin) <= 0.05 / m for row in d])
    assert fewer < 0.85, (n, fewer)  # not grossly more than needed
  assert _floor.seeds_for_margin(0.01, 0.0) is None
  assert _floor.seeds_for_margin(1e-6, 1.0, max_seeds=50) is None


def test_floor_summary_flags_a_margin_below_it():
  s = _floor.summarize([0.02, -0.03, 0.01], [0, 1, 2], 2.0, 0.01, "w[0]", m=2)
  assert s["rms"] == pytest.approx(math.sqrt((0.02**2 + 0.03**2 + 0.01**2) / 3))
  assert s["margin_below_floor"] is True and s["seeds_for_margin"] > 10
  assert s["relative"] == pytest.approx(s["rms"] / 2.0)
  assert _floor.summarize([0.001, -0.001], [0, 1], 2.0, 0.05, None)["margin_below_floor"] \
      is False


# --------------------------------------------------------------------------- the words


def test_a_tiny_win_reads_as_practically_equivalent():
  row = {"mean_delta": -0.000137, "relative_delta": -0.00006, "equivalence_bound": 0.0004}
  words = _report._verdict_words(row, "better", "fp32", None, 0.002, None, "Holm p = 0.035")
  assert words.startswith("practically equivalent: better than fp32 by -0.000137 (-0.006%")
  assert "smaller than the chaos floor 0.002" in words and "within ±0.0004 at 95%" in words
  words = _report._verdict_words(row, "better", "fp32", 0.01, None, True, "Holm p = 0.035")
  assert "smaller than the margin ±0.01" in words and words.endswith("holds up within ±0.01")
  big = {**row, "mean_delta": 0.02, "relative_delta": 0.01}
  words = _report._verdict_words(big, "worse", "fp32", 0.01, 0.002, False, "Holm p = 0.01")
  assert words.startswith("worse than fp32 by +0.02 (+1%; Holm p = 0.01)")
  # Without a margin or a floor the magnitude is still stated.
  words = _report._verdict_words(row, "better", "fp32", None, None, None, "Holm p = 0.035")
  assert words.startswith("better than fp32 by -0.000137 (-0.006%; Holm p = 0.035)")


# --------------------------------------------------------------------------- seeds="auto"


def test_sequential_study_summary(tmp_path):
  """bf16_mixed holds up at the first look (3 seeds); the A/A arm (the control on other
  seeds: seed-to-seed spread ~0.1 here) cannot within 0.05 and takes the second round,
  so the control and the floor run 6 seeds and the recipe stays at 3."""
  out = str(tmp_path / "auto")
  with user_code():
    r = study.run(task(), ["fp32", "bf16_mixed"], seeds="auto", max_seeds=6, margin=0.05,
                  out=out, aa=True, **SMALL)
  rows = r.summary["recipes"]
  bf = rows["bf16_mixed"]
  assert bf["seeds_used"] == len(bf["deltas"]) == 3 and bf["decided"] is True
  assert bf["verdict_code"] == "holds_up" and bf["verdict"].startswith("holds up within ±0.05")
  assert bf["equivalence_bound"] < 0.05 and bf["ci_holm"][0] < 0 < bf["ci_holm"][1]
  aa = rows["fp32-aa"]
  assert aa["seeds_used"] == 6 and aa["decided"] is False and aa["verdict_code"] == "undecided"
  assert aa["verdict"].startswith("undecided after 6 seeds")
  assert len(rows["fp32"]["final_metric"]) == 6
  floor = r.summary["floor"]
  assert floor["arm"] == "fp32-floor" and len(floor["deltas"]) == 6
  assert floor["rms"] is not None and floor["margin_below_floor"] is False
  assert "(one float32 ulp; the largest gradient on seed 0's first batch" in floor["nudge"]
  assert "**Chaos floor**" in r.markdown
  with open(os.path.join(out, "study.json")) as f:
    st = json.load(f)
  assert st["identity"]["sequential"]["max_seeds"] == 6
  assert st["identity"]["floor"] == _floor.RULE
  assert st["sequential_state"] == {"seeds": 6, "arm_seeds": [["bf16_mixed", 3]]}
  again = study.report_only(out)
  assert _report.comparable(again.summary) == _report.comparable(r.summary)


def _fake_cells(monkeypatch, metric):
  """The driver's cells replaced by records of `metric(arm, index)` (no training)."""
  from precision.study import _cells, _run
  ran = []

  def run_cell(task, cell, settings, out, on_step=None, retry_failed=False):
    del task, settings, on_step
    ran.append(cell.name)
    record = {"arm": cell.arm, "recipe": cell.recipe.name, "index": cell.index,
              "seed": cell.seed, "status": "ok", "final_metric": metric(cell.arm, cell.index)}
    os.makedirs(_cells.cell_dir(out, cell), exist_ok=True)
    _cells.write_atomic(os.path.join(_cells.cell_dir(out, cell), "done.json"),
                        json.dumps(record))
    return record

  monkeypatch.setattr(_run._cells, "run_cell", run_cell)
  monkeypatch.setattr(_run, "_task_of", lambda task, cfg, cell: task)
  return ran


def test_sequential_rounds_stop_each_recipe_at_its_decision(tmp_path, monkeypatch):
  """The driver on synthetic cells: a recipe worse on every seed stops at the look that
  decides it, one equal to the control stops on holds-up, a noisy one takes every round
  to the budget; the control and the floor run every seed any recipe uses; a rerun walks
  the finished rounds without training, and one killed mid-round finishes that round."""
  from precision.study import _config, _run, _sequential
  rng = np.random.default_rng(0)
  base = rng.normal(1.0, 0.1, 12)
  noise = {a: rng.normal(0.0, 1.0, 12) for a in ("bf16_mixed", "pure_bf16", "f16_mixed")}
  shift = {"bf16_mixed": (0.0, 0.001), "pure_bf16": (0.05, 0.005), "f16_mixed": (0.0, 0.02)}

  def metric(arm, i):
    if arm not in shift:  # the control and its floor
      return float(base[i])
    mu, sd = shift[arm]
    return float(base[i] + mu + sd * noise[arm][i])

  ran = _fake_cells(monkeypatch, metric)
  out = str(tmp_path)
  with open(os.path.join(out, "study.json"), "w") as f:
    json.dump({"identity": {}}, f)
  cfg0 = _config.make_config(["fp32", "bf16_mixed", "pure_bf16", "f16_mixed"], "auto", 10,
                             margin=0.01, max_seeds=12)
  cfg = _run._sequential_rounds(None, cfg0, None, out, False)
  seeds = {a: cfg.n_seeds(a) for a, _, _ in cfg.arms()}
  p = _config.sequential_plan(cfg)
  fam = {a: [metric(a, i) - base[i] for i in range(seeds[a])] for a in shift}
  dec = _sequential.replay(fam, p)
  assert dec["pure_bf16"].verdict == "worse" and seeds["pure_bf16"] == dec["pure_bf16"].n
  assert dec["bf16_mixed"].verdict == "holds up" and seeds["bf16_mixed"] < 12
  assert dec["f16_mixed"].verdict == "undecided" and seeds["f16_mixed"] == 12
  assert seeds["fp32"] == seeds["fp32-floor"] == 12 and len(ran) == sum(seeds.values())
  for a in shift:  # every look before the decision continued
    assert all(_sequential.decide(fam[a][:n], k, p).verdict == "continue"
               for k, n in enumerate(p.looks) if n < seeds[a])
  with open(os.path.join(out, "study.json")) as f:
    assert json.load(f)["sequential_state"]["seeds"] == 12
  ran.clear()
  assert _run._sequential_rounds(None, cfg0, None, out, False) == cfg and ran == []
  os.remove(os.path.join(out, "cells", "f16_mixed__s10", "done.json"))
  os.remove(os.path.join(out, "cells", "fp32__s11", "done.json"))
  assert _run._sequential_rounds(None, cfg0, None, out, False) == cfg
  assert sorted(ran) == ["f16_mixed__s10", "fp32__s11"]


@pytest.mark.slow  # two rounds, then a rerun after kills at random points
def test_sequential_study_killed_and_rerun_ends_the_same(tmp_path):
  ref = str(tmp_path / "ref")
  args = dict(seeds="auto", max_seeds=6, margin=0.0004, **SMALL)
  with user_code():
    r = study.run(task(), ["fp32", "bf16_mixed"], out=ref, **args)
  assert r.summary["recipes"]["bf16_mixed"]["seeds_used"] == 6  # two rounds
  out = str(tmp_path / "killed")
  script = (
      "import sys, jax, precision; precision.enable_faithful_rounding()\n"
      "from precision import study\n"
      f"t = study.load_task({os.path.join(TASKS, 'params_mlp.py:task')!r})\n"
      "with jax.numpy_rank_promotion('allow'), jax.numpy_dtype_promotion('standard'):\n"
      f"  study.run(t, ['fp32', 'bf16_mixed'], out={out!r}, **{args!r})\n")
  rng = np.random.default_rng(0)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  for _ in range(10):
    p = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=ROOT)
    try:
      p.wait(timeout=float(rng.uniform(3, 12)))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
  with user_code():
    final = study.run(task(), ["fp32", "bf16_mixed"], out=out, **args)
  assert _report.comparable(final.summary) == _report.comparable(r.summary)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    (dict(seeds="auto"), r"seeds='auto' needs a margin"),
    (dict(seeds="auto", margin=0.05, max_seeds=1), r"max_seeds=1; accepted: an integer >= 2"),
    (dict(seeds=3, max_seeds=6), r"max_seeds=6 is given with seeds=3"),
    (dict(seeds="many"), r"seeds='many'; accepted: an integer >= 2 or 'auto'"),
    (dict(seeds="auto", margin=0.05, shard="1/2"), r"shard 1/2 with seeds='auto'"),
    (dict(seeds=3, floor="yes"), r"floor='yes'"),
    (dict(seeds="auto", margin=0.05, test="sign_flip"), r"test='sign_flip' with seeds='auto'"),
])
def test_bad_input_touches_nothing(tmp_path, kwargs, match):
  out = str(tmp_path / "never")
  with pytest.raises(ValueError, match=match):
    with user_code():
      study.run(task(), ["fp32", "bf16_mixed"], out=out, **{**SMALL, **kwargs})
  assert not os.path.exists(out)


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = str(tmp_path / "never")
  for extra, want in ((["--seeds", "auto"], "needs a margin"),
                      (["--seeds", "auto", "--margin", "0.1", "--max-seeds", "1"],
                       "max_seeds=1")):
    p = subprocess.run([sys.executable, "-m", "precision.study",
                        os.path.join(TASKS, "params_mlp.py:task"), "--out", out, *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and want in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not os.path.exists(out)
