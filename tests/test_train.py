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


@pytest.mark.parametrize("recipe", ["fp32", "bf16_master", "bf16_sr", "f16_mixed"])
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
from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh
_orig = jh.JsonCheckpointHandler.async_save
async def _slow(self, directory, item=None, args=None):
  if args is not None and args.item.get("step") == 2:
    open(sys.argv[1], "w").close()  # tell the parent: the state item is being written
    time.sleep(600)
  return await _orig(self, directory, item=item, args=args)
jh.JsonCheckpointHandler.async_save = _slow
from experiments import train
train.main(sys.argv[2:])
"""


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

  done = subprocess.run([sys.executable, "-m", "experiments.train", *args, "--resume"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  summary = json.loads(done.stdout.strip().splitlines()[-1])
  assert summary["start_step"] == 1 and summary["steps"] == 3
  assert np.isfinite(summary["final_loss"]) and summary["final_val_bpb"] < 8.5
  assert len(summary["fingerprint"]) == 64 and summary["memory"]["argument_plus_temp"] > 0
  assert checkpoint.Checkpointer(ckpt_dir).steps() == [1, 2, 3]
  steps = [json.loads(line)["step"] for line in open(tmp_path / "log.jsonl")]
  assert steps == [1, 2, 3]  # step 1 from the killed run, 2-3 appended by the resumed one
