"""python -m experiments.train --resume: changed hyperparameters are refused unless
allowed, and a --out log whose last record was cut by a kill resumes (issue 27 item 4)."""

import json
import os
import shutil
import sys
import warnings

import pytest

from experiments import train as train_cli
from experiments import trainlib

BASE = ["--model", "tiny", "--steps", "4", "--batch", "2", "--seq", "16", "--lr", "3e-3",
        "--eval-every", "0", "--eval-batches", "1", "--no-progress", "--save-every", "2"]


def _run(capsys, argv):
  try:
    summary = train_cli.main(BASE + argv)
    code = 0
  except SystemExit as e:
    summary, code = None, e.code
  out, err = capsys.readouterr()
  return code, summary, [l for l in err.strip().splitlines() if l]


@pytest.fixture(scope="module")
def _stopped(tmp_path_factory):
  """A run stopped after step 2 (checkpoint at 2, a 2-line log), written once, under a
  path Orbax would read as a glob pattern."""
  base = tmp_path_factory.mktemp("stopped") / "lr[3e-3] *?"
  base.mkdir()
  d, log = base / "ckpt", base / "log.jsonl"
  train_cli.main(BASE + ["--ckpt-dir", str(d), "--out", str(log), "--stop-after", "2"])
  return d, log


@pytest.fixture()
def interrupted(_stopped, tmp_path):
  """A copy of that run's checkpoint directory and log, for one test to resume."""
  d, log = tmp_path / "sweep[0]" / "ckpt", tmp_path / "log.jsonl"
  shutil.copytree(_stopped[0], d)
  shutil.copy(_stopped[1], log)
  return d, log


def test_resume_with_changed_hyperparameters_is_refused_in_one_line(interrupted, capsys):
  d, log = interrupted
  for argv, diff in ((["--batch", "4", "--lr", "1e-3"], "batch 2 -> 4; lr 0.003 -> 0.001"),
                     (["--steps", "6", "--seq", "8", "--warmup", "2"],
                      "steps 4 -> 6; seq 16 -> 8; warmup 1 -> 2")):
    code, _, err = _run(capsys, ["--ckpt-dir", str(d), "--resume"] + argv)
    assert code == 1 and len(err) == 1, err
    assert f"was trained with other hyperparameters: {diff}. " in err[0], err
    assert "--allow-change " in err[0] and "Traceback" not in err[0]
  # Allowed by name: continues, and says what changed.
  code, summary, err = _run(capsys, ["--ckpt-dir", str(d), "--resume", "--lr", "1e-3",
                                     "--allow-change", "lr", "--out", str(log)])
  assert code == 0, err
  assert summary["start_step"] == 2 and summary["steps"] == 4
  assert "hyperparameter changed on resume: lr 0.003 -> 0.001" in summary["converted"]


def test_a_step_without_checksums_resumes_only_with_the_flag(interrupted, capsys):
  d, _ = interrupted
  os.remove(d / "2" / "integrity.json")
  (d / "2" / "_CHECKPOINT_METADATA").write_text("{}")
  meta = json.load(open(d / "2" / "meta" / "metadata"))
  json.dump({**meta, "format": 1}, open(d / "2" / "meta" / "metadata", "w"))
  code, _, err = _run(capsys, ["--ckpt-dir", str(d), "--resume"])
  assert code == 1 and "step 2 carries no checksums" in err[-1], err
  assert "pass --allow-unverified" in err[-1] and "Traceback" not in "\n".join(err)
  code, summary, err = _run(capsys, ["--ckpt-dir", str(d), "--resume", "--allow-unverified"])
  assert code == 0 and summary["start_step"] == 2, err


def test_allow_change_names_are_checked(capsys, tmp_path):
  for argv, message in ((["--resume", "--ckpt-dir", str(tmp_path), "--allow-change", "lrr"],
                         "'lrr': accepted: a comma-separated list of steps, batch, seq"),
                        (["--allow-change", "lr"], "--allow-change: only with --resume"),
                        (["--allow-unverified"], "--allow-unverified: only with --resume")):
    code, _, err = _run(capsys, argv)
    assert code == 2 and len(err) == 1 and message in err[0], err
  with pytest.raises(trainlib.ConfigError, match="'momentum' is not a hyperparameter"):
    trainlib.TrainConfig(model="tiny", ckpt_dir=str(tmp_path), resume=True,
                         allow_change=("momentum",))


def test_a_torn_last_log_line_is_dropped_once(interrupted, capsys):
  d, log = interrupted
  with open(log, "a") as f:
    f.write('{"step": 3, "loss": 5.4')  # a kill in the middle of writing step 3
  with warnings.catch_warnings():  # printed as the CLI prints it, not recorded by pytest
    warnings.simplefilter("always")
    warnings.showwarning = lambda m, c, f, n, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(m, c, f, n, line))
    code, summary, err = _run(capsys, ["--ckpt-dir", str(d), "--resume", "--out", str(log)])
  assert code == 0, err
  torn = [l for l in err if "unreadable JSONL" in l]
  assert len(torn) == 1 and "at its last line" in torn[0], err
  assert torn[0].startswith(f"{train_cli.PROG}: warning: --out {log}: dropped 1"), err
  assert [json.loads(l)["step"] for l in open(log)] == [1, 2, 3, 4]
  # The next resume reads the log without a word.
  code, _, err = _run(capsys, ["--ckpt-dir", str(d), "--resume", "--out", str(log)])
  assert code == 0 and not [l for l in err if "JSONL" in l], err
