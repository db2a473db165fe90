"""The README's "On a Slurm cluster" on a real one-node Slurm cluster on localhost.

tests/_slurm_cluster.py starts munged, slurmctld and slurmd (Debian's slurm-wlm and munge;
the tests are skipped, with the reason, where they are not installed). Each test writes the README's
my_task.py into a folder of its own, runs the README's --slurm-script command there as
written and submits the script it wrote with `bash`, as a user does; the array of 4
tasks and the report job must end with what one process running the same study writes:
summary.json (verdicts, every number but wall-clock timing), results.jsonl (every step
record and each cell's outcome with its fingerprint, less step times).

  * the plain run;
  * a task sent Slurm's warning signal mid-cell (`scancel --signal=USR1 --batch`): it
    saves, records the stop, requeues its own array task, exits 75, and the requeued task
    resumes from the step it saved;
  * a task SIGKILLed mid-cell (`scancel --signal=KILL --batch`): it fails, the report job
    is cancelled (its dependency can never be met), and the script submitted again
    finishes the study (the killed cell resumes from its last checkpoint).

Run: python -m pytest -q -m slurm -n0 -p no:randomly (as root; .ci/run does).
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

import _slurm_cluster
from test_study_signals import readme_slurm_section, results_without_time, summary

pytestmark = pytest.mark.slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_OF_CELL = {"fp32__s0": 0, "fp32__s1": 1, "bf16_mixed__s0": 2, "bf16_mixed__s1": 3}
JOB_TIMEOUT = 900


def _readme_task() -> str:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  section = text[text.index("## Study your own model"):]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def _env(cluster=None):
  env = dict(cluster.env if cluster else os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # as a user runs it: the study sets what it needs
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  for k in list(env):
    if k.startswith("SLURM_") and k != "SLURM_CONF":
      env.pop(k)  # a job's own variables, were the tests themselves run under Slurm
  return env


@pytest.fixture(scope="module")
def cluster():
  missing = _slurm_cluster.missing()
  if missing:
    pytest.skip(f"Slurm is not installed (no {', '.join(missing)} on PATH; Debian: apt-get "
                "install slurm-wlm munge)")
  if os.geteuid() != 0:
    pytest.skip("the local Slurm cluster runs its daemons as root (slurmd starts jobs)")
  c = _slurm_cluster.start()
  yield c
  c.stop()


class Study:
  """The README's task and --slurm-script command in folder `folder`."""

  def __init__(self, folder, cluster=None):
    self.folder, self.cluster = str(folder), cluster
    os.makedirs(self.folder, exist_ok=True)
    with open(os.path.join(self.folder, "my_task.py"), "w") as f:
      f.write(_readme_task())
    command, _ = readme_slurm_section()
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "precision.study"]
    self.script = argv[argv.index("--slurm-script") + 1]
    self.out = os.path.join(self.folder, argv[argv.index("--out") + 1])
    p = subprocess.run([sys.executable, *argv[1:]], cwd=self.folder, env=_env(cluster),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(self.folder, self.script)) as f:
      self.text = f.read()

  def one_process(self):
    """The study the array runs, in this process's child, whole (slice 1/1)."""
    line = next(l for l in self.text.splitlines()
                if l.startswith("exec ") and "--requeue" in l)
    argv = shlex.split(line)[1:]
    p = subprocess.run(argv, cwd=self.folder, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]

  def submit(self):
    """`bash SCRIPT`; (array job id, report job id)."""
    p = subprocess.run(["bash", self.script], cwd=self.folder, env=_env(self.cluster),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"array job (\d+) \(4 tasks\), report job (\d+)", p.stdout)
    assert m, p.stdout
    return m.group(1), m.group(2)

  def steps_of(self, cell):
    from precision.study import _cells  # pylint: disable=g-import-not-at-top
    return _cells.read_jsonl(os.path.join(self.out, "cells", cell, "steps.jsonl"))

  def attempts(self, cell):
    from precision.study import _cells  # pylint: disable=g-import-not-at-top
    return [(a["event"], a["step"]) for a in
            _cells.read_jsonl(os.path.join(self.out, "cells", cell, "attempts.jsonl"))]

  def log(self, array, task):
    path = os.path.join(self.out, ".slurm", f"{array}_{task}.out")
    with open(path) as f:
      return f.read()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  s = Study(tmp_path_factory.mktemp("one_process"))
  s.one_process()
  return s.out


def _wait_steps(cluster, study, cell, n, job):
  """Waits until `cell` has written `n` step records (its task running)."""
  deadline = time.time() + JOB_TIMEOUT
  while len(study.steps_of(cell)) < n:
    if time.time() > deadline:
      raise TimeoutError(f"{cell}: {len(study.steps_of(cell))} steps\n{cluster.jobs(job)}")
    time.sleep(0.05)


def _assert_equal(study, reference):
  assert summary(study.out) == summary(reference)
  assert results_without_time(study.out) == results_without_time(reference)


def test_the_array_and_its_report_job_equal_one_process(cluster, reference, tmp_path):
  s = Study(tmp_path, cluster)
  array, report = s.submit()
  tasks = cluster.wait_final(array, JOB_TIMEOUT)
  assert sorted((j.id, j.state, j.exit_code) for j in tasks) == [
      (f"{array}_{t}", "COMPLETED", "0:0") for t in range(4)]
  rep = cluster.wait_final(report, JOB_TIMEOUT)
  assert [(j.state, j.exit_code) for j in rep] == [("COMPLETED", "0:0")]
  _assert_equal(s, reference)
  for cell, t in TASK_OF_CELL.items():  # each task trained its own cell, once
    assert s.attempts(cell) == [("start", 0)]
    # "slice done", or the report (written by the task that finished the grid).
    log = s.log(array, t)
    assert "slice done: my_study" in log or '"verdicts"' in log, log[-2000:]


def test_a_task_sent_the_warning_signal_saves_requeues_itself_and_resumes(
    cluster, reference, tmp_path):
  s = Study(tmp_path, cluster)
  array, report = s.submit()
  cell, t = "fp32__s1", 1
  job = f"{array}_{t}"
  _wait_steps(cluster, s, cell, 150, array)
  # It requeues itself: pending again, one restart. Slurm holds a requeued job back for
  # its requeue delay (about two minutes); the test lets it start at once.
  cluster.signal_batch(job, "USR1",
                       lambda js: js[0].restarts >= 1 and js[0].state == "PENDING",
                       JOB_TIMEOUT, "not requeued")
  cluster.start_now(job)
  tasks = cluster.wait_final(array, JOB_TIMEOUT)
  assert sorted((j.id, j.state, j.restarts) for j in tasks) == [
      (f"{array}_{i}", "COMPLETED", int(i == t)) for i in range(4)]
  assert [j.state for j in cluster.wait_final(report, JOB_TIMEOUT)] == ["COMPLETED"]
  with open(os.path.join(s.out, "stops", "slice-2-of-4.json")) as f:
    rec = json.load(f)
  assert (rec["signal"], rec["cell"], rec["slurm_job"], rec["requeued"]) == (
      "SIGUSR1", cell, job, True), rec
  saved = rec["saved_at_step"]
  assert 150 <= saved < 2000
  assert s.attempts(cell) == [("start", 0), ("resume", saved)]
  log = s.log(array, t)  # appended to by both runs
  assert f"stopped by SIGUSR1 in cell {cell} at step {saved}" in log, log[-2000:]
  _assert_equal(s, reference)


def test_a_task_killed_outright_and_the_script_submitted_again_ends_equal(
    cluster, reference, tmp_path):
  s = Study(tmp_path, cluster)
  array, report = s.submit()
  cell, t = "bf16_mixed__s0", 2
  _wait_steps(cluster, s, cell, 350, array)  # past its checkpoints at steps 100..300
  job = f"{array}_{t}"
  cluster.signal_batch(job, "KILL", lambda js: js[0].state in _slurm_cluster.FINAL,
                       JOB_TIMEOUT, "not ended")
  tasks = {j.id: j for j in cluster.wait_final(array, JOB_TIMEOUT)}
  assert tasks[f"{array}_{t}"].state == "FAILED", tasks
  assert tasks[f"{array}_{t}"].exit_code == "0:9", tasks  # killed by signal 9
  # Its dependency can never be met: the report job is cancelled, not left pending.
  rep = cluster.wait_final(report, JOB_TIMEOUT)
  assert [j.state for j in rep] == ["CANCELLED"], rep
  assert not os.path.exists(os.path.join(s.out, "summary.json"))
  array2, report2 = s.submit()
  tasks2 = cluster.wait_final(array2, JOB_TIMEOUT)
  assert [j.state for j in tasks2] == ["COMPLETED"] * 4, tasks2
  assert [j.state for j in cluster.wait_final(report2, JOB_TIMEOUT)] == ["COMPLETED"]
  attempts = s.attempts(cell)
  assert attempts[0] == ("start", 0) and attempts[1][0] == "resume" and attempts[1][1] >= 300
  assert len(attempts) == 2
  for other in set(TASK_OF_CELL) - {cell}:
    assert s.attempts(other) == [("start", 0)]  # finished cells are not rerun
  _assert_equal(s, reference)
