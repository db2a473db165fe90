"""Training loop gates on the tiny GPT: bit-exact resume, SIGKILL mid-save then --resume,
cross-recipe restore, restore into another model config."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import data as data_lib
from experiments import trainlib
from models import gpt as gpt_lib
import precision as mp
from precision import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ, STEPS = 2, 16, 4


def _cfg(recipe, **kw):
  return trainlib.TrainConfig(recipe=recipe, model="tiny", steps=STEPS, batch=BATCH, seq=SEQ,
                              warmup=1, progress=False, **kw)


@pytest.fixture(scope="module")
def corpus():
  return data_lib.load_corpus()


@pytest.fixture(scope="module")
def setups(corpus):
  """recipe -> (run, fresh state, compiled step); each recipe compiles once per module."""
  cache = {}

  def get(recipe):
    if recipe not in cache:
      run, state = trainlib.init_state(_cfg(recipe))
      tokens, _ = data_lib.sample_batch(corpus.train, data_lib.init_sampler(0), BATCH, SEQ)
      cache[recipe] = (run, state, trainlib.compile_step(run, state, tokens))
    run, state, compiled = cache[recipe]
    return run, jax.tree.map(jnp.copy, state), compiled  # fresh buffers: steps donate

  return get


def _steps(compiled, state, sampler, train_bytes, n):
  metrics = None
  for _ in range(n):
    tokens, sampler = data_lib.sample_batch(train_bytes, sampler, BATCH, SEQ)
    state, metrics = trainlib.step_once(compiled, state, tokens)
  return state, sampler, metrics


# bf16_master and f16_mixed resume through the same code as bf16_sr and fp32 (their extra
# state: master, loss scale, rides in the same checkpoint); they run with the slow set, and
# so does bf16_sr (tests/conftest.py MOVED_TO_SLOW).
@pytest.mark.parametrize("recipe", ["fp32", pytest.param("bf16_master", marks=pytest.mark.slow),
                                    "bf16_sr", pytest.param("f16_mixed", marks=pytest.mark.slow)])
def test_bit_exact_resume(tmp_path, setups, corpus, recipe):
  run, state, compiled = setups(recipe)
  straight, _, _ = _steps(compiled, state, data_lib.init_sampler(0), corpus.train, STEPS)

  _, state, _ = setups(recipe)
  half, sampler, _ = _steps(compiled, state, data_lib.init_sampler(0), corpus.train, STEPS // 2)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(STEPS // 2, half, recipe=run.recipe, model_config=run.model_config.to_dict(),
            data=sampler)
  ckpt.close()
  _, target, _ = setups(recipe)  # a freshly initialised state to restore into
  r = checkpoint.restore(tmp_path, target, model_config=run.model_config.to_dict())
  assert r.step == STEPS // 2 and r.converted == ()
  resumed, _, metrics = _steps(compiled, r.state, data_lib.SamplerState(**r.data),
                               corpus.train, STEPS - STEPS // 2)
  assert np.isfinite(metrics["loss"])
  assert trainlib.fingerprint(resumed) == trainlib.fingerprint(straight)


def test_cross_recipe_restore_continues(tmp_path, setups, corpus):
  src, state, compiled = setups("bf16_master")
  saved, sampler, _ = _steps(compiled, state, data_lib.init_sampler(0), corpus.train, 2)
  checkpoint.save(tmp_path, 2, saved, recipe=src.recipe, data=sampler)
  dst, target, dst_compiled = setups("fp32")
  r = checkpoint.restore(tmp_path, target, recipe=dst.recipe,
                         optimizer_for=trainlib.optimizer_for(dst.cfg))
  assert "recipe bf16_master -> fp32" in r.converted
  master = mp.optim.master_params(saved.opt_state, saved.params)
  leaves = jax.tree.leaves(r.state.params)
  assert all(x.dtype == jnp.float32 for x in leaves)
  for a, b in zip(leaves, jax.tree.leaves(master)):  # the bf16_master run's f32 master
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, _, metrics = _steps(dst_compiled, r.state, data_lib.SamplerState(**r.data), corpus.train, 2)
  assert np.isfinite(metrics["loss"]) and metrics["skipped_steps"] == 0


def test_restore_into_other_model_config_fails(tmp_path, setups):
  run, state, _ = setups("fp32")
  checkpoint.save(tmp_path, 1, state, recipe=run.recipe, model_config=run.model_config.to_dict())
  other_cfg = gpt_lib.CONFIGS["tiny"].replace(d_model=32)
  _, other = trainlib.init_state(dataclasses.replace(_cfg("fp32"), model=other_cfg))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"leaf 'params/blocks/0/attn/k_norm/scale': checkpoint has \(16,\) "
                           r"float32, the target expects \(8,\) float32; model config field "
                           r"'d_model': checkpoint 64, target 32"):
    checkpoint.restore(tmp_path, other, model_config=other_cfg.to_dict())


_CHILD = r"""
import sys, time
import precision as mp
mp.enable_faithful_rounding()
from precision.checkpoint import _integrity
_orig = _integrity.write_manifest
def _slow(step_dir, step, arrays):
  if step == 2:
    open(sys.argv[1], "w").close()  # tell the parent: step 2's arrays are on disk
    time.sleep(600)
  return _orig(step_dir, step, arrays)
_integrity.write_manifest = _slow
from experiments import train
train.main(sys.argv[2:])
"""


@pytest.mark.slow  # run by CI when time allows (python -m pytest -m slow)
def test_sigkill_mid_save_then_resume(tmp_path):
  ckpt_dir, sentinel = tmp_path / "ckpt", tmp_path / "saving"
  args = ["--recipe", "fp32", "--model", "tiny", "--steps", "3", "--batch", str(BATCH),
          "--seq", str(SEQ), "--lr", "1e-3", "--seed", "1", "--ckpt-dir", str(ckpt_dir),
          "--save-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
          "--out", str(tmp_path / "log.jsonl")]
  env = {**os.environ, "PYTHONPATH": ROOT}
  child = subprocess.Popen([sys.executable, "-c", _CHILD, str(sentinel), *args], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + 120
  while not sentinel.exists() and child.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert sentinel.exists(), child.communicate()[1][-2000:]
  os.kill(child.pid, signal.SIGKILL)
  child.wait()
  assert child.returncode == -signal.SIGKILL
  assert checkpoint.Checkpointer(ckpt_dir).steps() == [1]  # step 2 never completed
  assert [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-2-")]  # its unfinished save

  done = subprocess.run([sys.executable, "-m", "experiments.train", *args, "--resume"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary["start_step"] == 1 and summary["steps"] == 3
  assert np.isfinite(summary["final_loss"]) and summary["final_val_bpb"] < 8.5
  assert len(summary["fingerprint"]) == 64 and summary["memory"]["argument_plus_temp"] > 0
  assert checkpoint.Checkpointer(ckpt_dir).steps() == [1, 2, 3]
  assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".")]  # removed on resume
  steps = [json.loads(line)["step"] for line in open(tmp_path / "log.jsonl")]
  assert steps == [1, 2, 3]  # step 1 from the killed run, 2-3 appended by the resumed one


# ---------------------------------------------------------------------------------------
# A damaged newest checkpoint: the previous step is resumed, bit-exactly.


def _flip_middle(path):
  b = bytearray(open(path, "rb").read())
  b[len(b) // 2] ^= 0x01
  open(path, "wb").write(bytes(b))


_DAMAGE = {"byte flip": _flip_middle,
           "truncation": lambda p: os.truncate(p, os.path.getsize(p) // 2),
           "deleted file": os.remove}


@pytest.mark.parametrize("damage", list(_DAMAGE))
def test_damaged_newest_step_resumes_the_previous_one_bit_exactly(tmp_path, setups, corpus,
                                                                  damage):
  run, state, compiled = setups("fp32")
  straight, _, _ = _steps(compiled, state, data_lib.init_sampler(0), corpus.train, STEPS)

  _, state, _ = setups("fp32")
  sampler = data_lib.init_sampler(0)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    for step in (1, 2, 3):
      state, sampler, _ = _steps(compiled, state, sampler, corpus.train, 1)
      ckpt.save(step, state, recipe=run.recipe, model_config=run.model_config.to_dict(),
                seed=0, data=sampler)
  step_dir = tmp_path / "3"
  biggest = max((os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs),
                key=os.path.getsize)
  _DAMAGE[damage](biggest)
  _, target, _ = setups("fp32")
  with pytest.warns(checkpoint.CheckpointFallbackWarning,
                    match=rf"step 3 is damaged: file {os.path.relpath(biggest, step_dir)}"):
    r = checkpoint.restore(tmp_path, target, model_config=run.model_config.to_dict())
  assert r.step == 2 and len(r.skipped) == 1 and r.seed == 0
  resumed, _, metrics = _steps(compiled, r.state, data_lib.SamplerState(**r.data),
                               corpus.train, STEPS - 2)
  assert np.isfinite(metrics["loss"])
  assert trainlib.fingerprint(resumed) == trainlib.fingerprint(straight)


# ---------------------------------------------------------------------------------------
# A checkpoint written by plain Orbax, brought into bf16_master.


def test_import_plain_orbax_checkpoints_into_bf16_master(tmp_path, setups, corpus):
  import orbax.checkpoint as ocp
  from flax import nnx
  src, state, compiled = setups("fp32")
  trained, _, _ = _steps(compiled, state, data_lib.init_sampler(0), corpus.train, 2)
  model = nnx.merge(src.graphdef, trained.params, trained.model_state)
  f32_values = jax.tree.leaves(jax.tree.map(np.asarray, trained.params))
  # As Flax's examples write them: the model's state with a StandardCheckpointer, and a
  # CheckpointManager step with an item of the user's naming (and a JSON item beside it).
  with ocp.StandardCheckpointer() as std:
    std.save(tmp_path / "standard", nnx.state(model))
  mgr = ocp.CheckpointManager(tmp_path / "manager")
  mgr.save(7, args=ocp.args.Composite(model=ocp.args.StandardSave({"params": nnx.state(
      model, nnx.Param), "step": 7}), notes=ocp.args.JsonSave({"lr": 1e-3})))
  mgr.wait_until_finished()
  mgr.close()

  dst, target, dst_compiled = setups("bf16_master")
  tx = dst.tx
  for path, step, where in ((tmp_path / "standard", None, ""),
                            (tmp_path / "manager", 7, "params")):
    imp = checkpoint.import_orbax(path, jax.tree.map(jnp.copy, target), dst.recipe,
                                  optimizer=tx)
    assert imp.step == step and imp.params_path == where, imp
    master = mp.optim.master_params(imp.state.opt_state, imp.state.params)
    for got, want in zip(jax.tree.leaves(master), f32_values):  # bit for bit
      assert got.dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    dtypes = lambda t: [(x.shape, x.dtype) for x in jax.tree.leaves(t)]
    assert dtypes(imp.state.params) == dtypes(target.params)          # bf16 params
    assert dtypes(imp.state.opt_state) == dtypes(target.opt_state)
    assert jax.tree.structure(imp.state.opt_state) == jax.tree.structure(target.opt_state)
    _, _, metrics = _steps(dst_compiled, imp.state, data_lib.init_sampler(0), corpus.train, 2)
    assert np.isfinite(metrics["loss"]) and metrics["skipped_steps"] == 0
  # Mismatched and missing input: named, and nothing created.
  other_cfg = gpt_lib.CONFIGS["tiny"].replace(d_model=32)
  _, other = trainlib.init_state(dataclasses.replace(_cfg("bf16_master"), model=other_cfg))
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"standard: leaf 'blocks/0/attn/k_norm/scale': checkpoint has "
                           r"\(16,\) float32, the target expects \(8,\) bfloat16"):
    checkpoint.import_orbax(tmp_path / "standard", other, dst.recipe, optimizer=tx)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.import_orbax(tmp_path / "nope", target, dst.recipe, optimizer=tx)
  assert not (tmp_path / "nope").exists()


# ---------------------------------------------------------------------------------------
# The CLI: bad input refused before any work, one line, exit 2; runs that cannot start or
# continue: one line, exit 1; a run that diverges never exits 0.

from experiments import train as train_cli  # noqa: E402

_TINY = ["--model", "tiny", "--steps", "3", "--batch", str(BATCH), "--seq", str(SEQ),
         "--eval-every", "0", "--eval-batches", "1", "--no-progress"]

_BAD_FLAGS = [
    (["--seq", "0"], "argument --seq: '0': accepted: an integer >= 1"),
    (["--seq", "-3"], "argument --seq"),
    (["--lr", "inf"], "argument --lr: 'inf': accepted: a finite number > 0"),
    (["--lr", "nan"], "argument --lr"),
    (["--lr", "0"], "argument --lr"),
    (["--lr", "abc"], "argument --lr"),
    (["--warmup", "-5"], "argument --warmup"),
    (["--warmup", "7"], "--warmup 7; accepted: an integer in [0, 3]"),
    (["--stop-after", "-1"], "argument --stop-after"),
    (["--stop-after", "0"], "argument --stop-after"),
    (["--stop-after", "9"], "--stop-after 9; accepted: an integer in [1, 3]"),
    (["--steps", "0"], "argument --steps"),
    (["--steps", "1.5"], "argument --steps"),
    (["--batch", "0"], "argument --batch"),
    (["--seed", "-1"], "argument --seed"),
    (["--seed", str(2 ** 32)], "argument --seed"),
    (["--eval-every", "-1"], "argument --eval-every"),
    (["--eval-batches", "0"], "argument --eval-batches"),
    (["--save-every", "-2"], "argument --save-every"),
    (["--keep", "0"], "argument --keep"),
    (["--max-nonfinite-steps", "0"], "argument --max-nonfinite-steps"),
    (["--recipe", "bf17"], "argument --recipe: invalid choice: 'bf17'"),
    (["--model", "huge"], "argument --model: invalid choice"),
    (["--resume"], "argument --resume: needs --ckpt-dir"),
    (["--resume-or-start"], "argument --resume-or-start: needs --ckpt-dir"),
    (["--convert"], "argument --convert: only with --resume"),
    (["--resume", "--resume-or-start", "--ckpt-dir", "x"], "not allowed with argument"),
    (["--ckpt-dir", ""], "argument --ckpt-dir: '' cannot hold checkpoints"),
    (["--ckpt-dir", "/proc/precision-ckpt"], "/proc is not writable"),
    (["--out", "/proc/x/steps.jsonl"], "argument --out"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv, message", _BAD_FLAGS, ids=[" ".join(a) for a, _ in _BAD_FLAGS])
def test_cli_refuses_bad_flags_in_one_line(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    train_cli.main(_TINY + argv)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert message in err[0] and err[0].startswith(f"{train_cli.PROG}: error:"), err


def test_cli_refuses_unusable_checkpoint_and_out_paths(capsys, tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for flag, path, message in (("--ckpt-dir", a_file, "it exists and is not a directory"),
                              ("--ckpt-dir", a_file / "sub", "is not a directory"),
                              ("--out", tmp_path, "it is a directory"),
                              ("--out", tmp_path / "no" / "log.jsonl", "does not exist")):
    with pytest.raises(SystemExit) as e:
      train_cli.main(_TINY + [flag, str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
  assert not (tmp_path / "no").exists()


def _fails(capsys, argv, code, message):
  with pytest.raises(SystemExit) as e:
    train_cli.main(_TINY + argv)
  out, err = capsys.readouterr()
  err = err.strip().splitlines()
  assert e.value.code == code, err
  assert message in err[-1] and "Traceback" not in "\n".join(err), err
  return out


def test_cli_nothing_to_resume_other_runs_and_locks(capsys, tmp_path, setups):
  """All refused before the model is built: one line, exit 1."""
  empty, missing = tmp_path / "empty", tmp_path / "missing"
  empty.mkdir()
  for d in (empty, missing):
    _fails(capsys, ["--ckpt-dir", str(d), "--resume"], 1,
           f"--resume: nothing to resume in {d}: no complete checkpoint; pass "
           "--resume-or-start")
  (empty / ".tmp-1-0123abcd").mkdir()  # a kill during the very first save
  _fails(capsys, ["--ckpt-dir", str(empty), "--resume"], 1,
         "(found '.tmp-1-0123abcd' (an unfinished save, removed))")
  # A directory of another run (fp32, seed 0): other seed / recipe refused, as is a fresh
  # run that would overwrite its checkpoints.
  run, state, _ = setups("fp32")
  owned = tmp_path / "owned"
  checkpoint.save(owned, 1, state, recipe=run.recipe, model_config=run.model_config.to_dict(),
                  seed=0, data=data_lib.init_sampler(0))
  base = ["--ckpt-dir", str(owned)]
  _fails(capsys, base + ["--resume", "--seed", "1"], 1,
         "not to this run: seed: the directory's run uses 0, this one 1. Pass --convert")
  _fails(capsys, base + ["--resume", "--recipe", "bf16_master"], 1,
         "recipe: the directory's run uses 'fp32', this one 'bf16_master'")
  _fails(capsys, base, 1, "holds the checkpoints (steps [1]) of run")
  with checkpoint.Checkpointer(owned) as holder:
    holder.acquire()
    _fails(capsys, base + ["--resume"], 1,
           f"is being written by another process (pid {os.getpid()}")
  assert checkpoint.Checkpointer(owned).steps() == [1]


def test_cli_stops_a_run_that_only_produces_nonfinite_steps(capsys, tmp_path, monkeypatch):
  """NaN loss at every step: stopped after --max-nonfinite-steps, exit 1, no NaN printed
  as a result; --resume-or-start started it in an empty directory."""
  real_loss = trainlib.gpt_lib.loss_fn
  monkeypatch.setattr(trainlib.gpt_lib, "loss_fn", lambda m, t: real_loss(m, t) * jnp.nan)
  ckpt_dir = tmp_path / "ckpt"
  out = _fails(capsys, ["--steps", "20", "--max-nonfinite-steps", "3", "--ckpt-dir",
                        str(ckpt_dir), "--resume-or-start", "--save-every", "1", "--out",
                        str(tmp_path / "log.jsonl")], 1,
               "the run diverged: step 3: 3 consecutive optimizer steps had non-finite "
               "gradients (limit 3)")
  summary = json.loads(out.strip().splitlines()[-1])  # strict JSON: no NaN
  assert summary["status"] == "diverged" and summary["steps"] == 3
  assert summary["final_loss"] is None and summary["nonfinite_steps"] == 3
  assert [json.loads(l)["step"] for l in open(tmp_path / "log.jsonl")] == [1, 2, 3]
  # The two steps before the stop were saved (they skipped their updates: the state is
  # the initial one); the stopped step was not.
  assert checkpoint.Checkpointer(ckpt_dir).steps() == [1, 2]
