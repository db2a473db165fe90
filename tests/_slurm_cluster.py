"""A one-node Slurm cluster on localhost for the tests: munged, slurmctld and slurmd.

`start()` writes a munge key and a slurm.conf into a new temporary folder (every state,
spool, log and socket file lives there), starts the three daemons in the
foreground as child processes, and returns once the node is idle; `Cluster.stop` cancels
what is left, waits for it, and stops the daemons it started (by their process ids).
The node is this machine as `slurmd -C` sees it (its CPUs and memory); processes are
tracked by /proc (proctrack/linuxproc), with no task binding (task/none) and no cgroups,
so it runs in a container. `missing()` names the programs that are not installed (the
Debian packages slurm-wlm and munge), for a skip.

The cluster's own settings that matter to the tests: a requeued job becomes eligible
again only after Slurm's requeue delay (about two minutes), which `start_now` cuts short,
and finished jobs stay visible to `scontrol show job` for an hour (MinJobAge), since
there is no accounting database to ask.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import NamedTuple

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo",
            "squeue")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def missing() -> list[str]:
  """The cluster's programs not found on PATH (plus /usr/sbin, where Debian puts them)."""
  path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
  return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _exe(name: str) -> str:
  path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
  return shutil.which(name, path=path)


def _node_hardware() -> tuple[int, int]:
  """(CPUs, RealMemory MiB) of this machine as slurmd reports it."""
  out = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True,
                       timeout=60).stdout
  cpus = re.search(r"\bCPUs=(\d+)", out)
  mem = re.search(r"\bRealMemory=(\d+)", out)
  if not cpus or not mem:
    raise RuntimeError(f"slurmd -C printed no CPUs/RealMemory: {out!r}")
  return int(cpus.group(1)), int(mem.group(1))


class Job(NamedTuple):
  """One job (or array task) as `scontrol show job` reports it."""

  id: str           # 12 or 12_3
  state: str        # PENDING, RUNNING, COMPLETED, ...
  reason: str
  exit_code: str    # "0:0": exit status:signal
  restarts: int


class Cluster:
  """A running one-node cluster; `env` is the environment its clients need (SLURM_CONF)."""

  def __init__(self, root: str):
    self.root = root
    self.conf = os.path.join(root, "slurm.conf")
    self.env = dict(os.environ, SLURM_CONF=self.conf)
    self.env["PATH"] = self.env.get("PATH", "") + os.pathsep + "/usr/sbin"
    self._procs: list[tuple[str, subprocess.Popen]] = []
    self.remove_root = False
    self.user = subprocess.run(["id", "-un"], capture_output=True, text=True,
                               check=True).stdout.strip()

  # -------------------------------------------------------------- clients
  def cmd(self, *args: str, check: bool = True, timeout: float = 60) -> str:
    p = subprocess.run([_exe(args[0]), *args[1:]], capture_output=True, text=True,
                       env=self.env, timeout=timeout)
    if check and p.returncode != 0:
      raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stdout}{p.stderr}"
                         f"\n{self.logs()}")
    return p.stdout

  def jobs(self, job_id: str) -> list[Job]:
    """The job `job_id` (every task of an array); [] when Slurm no longer knows it."""
    out = self.cmd("scontrol", "show", "job", "-o", job_id, check=False)
    found = []
    for line in out.splitlines():
      f = dict(re.findall(r"(\w+)=(\S*)", line))
      if "JobId" not in f:
        continue
      tid = f.get("ArrayTaskId")
      name = f"{f['ArrayJobId']}_{tid}" if tid and "-" not in tid and "%" not in tid \
          else f["JobId"]
      found.append(Job(name, f.get("JobState", ""), f.get("Reason", ""),
                       f.get("ExitCode", ""), int(f.get("Restarts", "0") or 0)))
    return found

  def job(self, job_id: str) -> Job:
    js = [j for j in self.jobs(job_id) if j.id == job_id]
    if len(js) != 1:
      raise RuntimeError(f"scontrol show job {job_id}: {js}")
    return js[0]

  def wait(self, job_id: str, until, timeout: float, what: str) -> list[Job]:
    """Polls the job's tasks until `until(tasks)`; raises (with the logs) at `timeout`."""
    deadline = time.time() + timeout
    while True:
      js = self.jobs(job_id)
      if js and until(js):
        return js
      if time.time() > deadline:
        raise TimeoutError(f"{what}: job {job_id} after {timeout:.0f} s: {js}\n{self.logs()}")
      time.sleep(0.5)

  def wait_final(self, job_id: str, timeout: float) -> list[Job]:
    return self.wait(job_id, lambda js: all(j.state in FINAL for j in js), timeout,
                     "not finished")

  def signal_batch(self, job_id: str, sig: str, until, timeout: float, what: str) -> list[Job]:
    """``scancel --signal=SIG --batch JOB`` (the batch shell: the study, which `exec`s),
    then waits for `until(tasks of JOB)`. scancel is left running meanwhile and stopped
    after: when the signal ends or requeues the job, slurmctld answers scancel "Job can
    not be altered now, try again later" and scancel retries (for minutes), which must not
    reach the job's next run."""
    p = subprocess.Popen([_exe("scancel"), f"--signal={sig}", "--batch", job_id],
                         env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
      return self.wait(job_id, until, timeout, what)
    finally:
      if p.poll() is None:
        p.terminate()
      p.communicate(timeout=30)

  def start_now(self, job_id: str) -> None:
    """Makes a requeued (pending) job eligible now instead of after the requeue delay."""
    self.cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")

  def logs(self, lines: int = 30) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log", "munged.log"):
      path = os.path.join(self.root, "log", name)
      if os.path.exists(path):
        with open(path, errors="replace") as f:
          tail = f.readlines()[-lines:]
        out.append(f"--- {path}\n{''.join(tail)}")
    return "\n".join(out)

  # -------------------------------------------------------------- daemons
  def _spawn(self, name: str, *argv: str) -> None:
    log = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
    p = subprocess.Popen([_exe(argv[0]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                         env=self.env, start_new_session=True)
    log.close()
    self._procs.append((name, p))

  def start(self, timeout: float = 90) -> "Cluster":
    r = self.root
    for d in ("munge", "munge/key", "state", "spool", "log"):
      os.makedirs(os.path.join(r, d), exist_ok=True)
    # munged refuses a key others can read and a socket folder others cannot enter.
    os.chmod(r, 0o755)
    os.chmod(os.path.join(r, "munge"), 0o755)
    os.chmod(os.path.join(r, "munge", "key"), 0o700)
    key = os.path.join(r, "munge", "key", "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    sock = os.path.join(r, "munge", "munge.sock")
    host = socket.gethostname().split(".")[0]
    cpus, mem = _node_hardware()
    user = self.user
    with open(self.conf, "w") as f:
      f.write(f"""\
ClusterName=precision-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MinJobAge=3600
KillWait=30
MailProg=/bin/true
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
    try:
      self._spawn("munged", "munged", "--foreground", f"--key-file={key}", f"--socket={sock}",
                  f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/log/munged.log",
                  f"--seed-file={r}/munge/munged.seed")
      self._wait_for(lambda: os.path.exists(sock), 30, "munged's socket")
      self._spawn("slurmctld", "slurmctld", "-D", "-f", self.conf)
      self._wait_for(lambda: self.cmd("sinfo", "-h", check=False, timeout=10).strip() != "",
                     timeout, "slurmctld answering")
      self._spawn("slurmd", "slurmd", "-D", "-f", self.conf)
      self._wait_for(lambda: self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False,
                                      timeout=10).strip() == "idle", timeout, "node idle")
    except BaseException:
      self.stop()
      raise
    return self

  def _wait_for(self, ok, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not ok():
      for name, p in self._procs:
        if p.poll() is not None:
          raise RuntimeError(f"{name} exited with status {p.returncode} while waiting for "
                             f"{what}\n{self._outs()}\n{self.logs()}")
      if time.time() > deadline:
        raise TimeoutError(f"no {what} after {timeout} s\n{self._outs()}\n{self.logs()}")
      time.sleep(0.2)

  def _outs(self) -> str:
    out = []
    for name, _ in self._procs:
      path = os.path.join(self.root, "log", f"{name}.out")
      with open(path, errors="replace") as f:
        out.append(f"--- {name} stdout/stderr\n{f.read()[-3000:]}")
    return "\n".join(out)

  def cancel_all(self, timeout: float = 60) -> None:
    """Cancels every job and waits until none runs (their processes gone)."""
    if not any(n == "slurmctld" and p.poll() is None for n, p in self._procs):
      return
    self.cmd("scancel", "--full", "--user", self.user, check=False)
    deadline = time.time() + timeout
    while time.time() < deadline:
      out = self.cmd("squeue", "-h", "-t", "PD,R,CG,S,CF", check=False, timeout=10)
      if not out.strip():
        return
      time.sleep(0.5)

  def stop(self) -> None:
    """Cancels what is left, then stops the daemons this object started, newest first."""
    try:
      self.cancel_all()
    finally:
      for name, p in reversed(self._procs):
        if p.poll() is None:
          p.send_signal(signal.SIGTERM)
          try:
            p.wait(timeout=30)
          except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
      self._procs.clear()
      if self.remove_root:
        shutil.rmtree(self.root, ignore_errors=True)


def start() -> Cluster:
  """A running one-node cluster with its files in a new folder under the system's
  temporary folder (not pytest's: munged wants every folder above its socket open to
  all, and pytest's are its owner's alone); `Cluster.stop` removes it."""
  root = tempfile.mkdtemp(prefix="precision-slurm-")
  c = Cluster(root)
  c.remove_root = True
  return c.start()
