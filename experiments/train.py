"""Train the byte-level GPT on the embedded corpus under a precision recipe.

  python -m experiments.train --recipe bf16_master --model small --steps 300 --batch 8 \\
      --seq 256 --lr 3e-3 --seed 0 --ckpt-dir /tmp/run --save-every 100 [--resume] \\
      [--out steps.jsonl] [--eval-every 50]

Writes one JSON line per step to --out (loss, grad norm, loss scale, skipped steps,
non-finite counts, tokens/s, validation bits per byte every --eval-every steps), shows a
progress bar on stderr, and prints a JSON summary as its last line (final validation
BPB, compiled step memory, SHA-256 fingerprint of the final params and optimizer state).
The logic lives in experiments/trainlib.py (`train(TrainConfig(...))`).
"""

from __future__ import annotations

import argparse
import json

import precision as mp

mp.enable_faithful_rounding()  # before JAX starts: every bf16/f16 op rounds as stated

from experiments import trainlib  # noqa: E402  (after the faithful-rounding switch)


def parse_args(argv=None) -> trainlib.TrainConfig:
  d = trainlib.TrainConfig()
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--recipe", default=d.recipe, help=f"one of {', '.join(mp.PRESETS)}")
  ap.add_argument("--model", default=d.model, choices=["tiny", "small", "gpt2_124m"])
  ap.add_argument("--steps", type=int, default=d.steps)
  ap.add_argument("--batch", type=int, default=d.batch)
  ap.add_argument("--seq", type=int, default=None, help="default: the model's seq_len")
  ap.add_argument("--lr", type=float, default=d.lr)
  ap.add_argument("--warmup", type=int, default=None)
  ap.add_argument("--seed", type=int, default=d.seed)
  ap.add_argument("--eval-every", type=int, default=d.eval_every)
  ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
  ap.add_argument("--ckpt-dir", default=None)
  ap.add_argument("--save-every", type=int, default=d.save_every)
  ap.add_argument("--keep", type=int, default=d.keep)
  ap.add_argument("--resume", action="store_true")
  ap.add_argument("--stop-after", type=int, default=None,
                  help="stop after this many steps (the schedule still spans --steps)")
  ap.add_argument("--out", default=None, help="JSONL file of per-step metrics")
  ap.add_argument("--no-progress", action="store_true")
  a = ap.parse_args(argv)
  return trainlib.TrainConfig(
      recipe=a.recipe, model=a.model, steps=a.steps, batch=a.batch, seq=a.seq, lr=a.lr,
      warmup=a.warmup, seed=a.seed, eval_every=a.eval_every, eval_batches=a.eval_batches,
      ckpt_dir=a.ckpt_dir, save_every=a.save_every, keep=a.keep, resume=a.resume,
      stop_after=a.stop_after, out=a.out, progress=not a.no_progress)


def main(argv=None) -> dict:
  summary = trainlib.train(parse_args(argv))
  summary.pop("history")
  print(json.dumps(summary), flush=True)
  return summary


if __name__ == "__main__":
  main()
