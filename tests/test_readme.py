"""The README's program and every Python block of docs/ run as written.

The "In one screen" block is copied verbatim into a file and run as a script (a fresh
Python, its own XLA flags: one CPU device) under fp32, bf16_master, f16_mixed and
fp8_hybrid, two at a time; each run must exit 0, print every section, and end with a lower
loss than it started with.
"""

import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = ("fp32", "bf16_master", "f16_mixed", "fp8_hybrid")


def python_blocks(text: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _run(script: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # as a user runs it: the script sets what it needs
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("JAX_PLATFORMS", "cpu")
  return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                        env=env, cwd=script.parent, timeout=600)


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
  readme = (ROOT / "README.md").read_text()
  section = readme[readme.index("## In one screen"):]
  script = tmp_path_factory.mktemp("readme") / "train.py"
  script.write_text(python_blocks(section)[0])
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    return dict(zip(RECIPES, pool.map(lambda r: _run(script, r), RECIPES)))


# Slow: four subprocesses training the README's program (about 80 s of both cores).
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_readme_program_trains_under(recipe, readme_runs):
  run = readme_runs[recipe]
  assert run.returncode == 0, run.stderr[-3000:]
  losses = [float(x) for x in re.findall(rf"{recipe} step \d+: loss ([\d.]+)", run.stdout)]
  assert len(losses) == 2 and losses[1] < 0.6 * losses[0], run.stdout
  assert "Counter({" in run.stdout and f"under {recipe}" in run.stdout
  assert re.search(r"data parallel loss [\d.]+", run.stdout), run.stdout
  # The audit printed the GEMMs the recipe promises.
  want = {"fp32": "('f32', 'f32'", "bf16_master": "('bf16', 'bf16'",
          "f16_mixed": "('f16', 'f16'", "fp8_hybrid": "('e4m3', 'e4m3'"}[recipe]
  assert want in run.stdout, run.stdout


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_python_blocks_run(doc, tmp_path):
  for i, block in enumerate(python_blocks(doc.read_text())):
    script = tmp_path / f"block{i}.py"
    script.write_text(block)
    run = _run(script)
    assert run.returncode == 0, f"{doc.name} block {i}:\n{run.stderr[-3000:]}"


@pytest.mark.slow  # 20 cells, about a minute: CI runs it (python -m pytest -m slow)
def test_study_section_runs_as_written(tmp_path):
  readme = (ROOT / "README.md").read_text()
  section = readme[readme.index("## Study your own model"):]
  section = section[:section.index("\n## ", 3)]
  (tmp_path / "my_task.py").write_text(python_blocks(section)[0])
  command = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0].strip()
  assert command.startswith("python -m precision.study my_task.py:task")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.setdefault("JAX_PLATFORMS", "cpu")
  run = subprocess.run([sys.executable] + command.split()[1:] + ["--no-progress"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  import json
  rows = json.loads((tmp_path / "my_study" / "summary.json").read_text())["recipes"]
  assert list(rows) == ["fp32", "bf16_mixed", "pure_bf16", "f16_mixed"]
  assert rows["pure_bf16"]["verdict_code"] == "worse"  # as the README says
  for name in ("bf16_mixed", "pure_bf16", "f16_mixed"):
    assert rows[name]["verdict_code"] in ("worse", "better", "no_difference"), rows[name]
  for name in ("loss_curves.png", "loss_scale.png", "results.jsonl", "summary.md"):
    assert (tmp_path / "my_study" / name).stat().st_size > 0
