"""Runs a Python script as N local worker processes of one TF_CONFIG cluster.

Parent side (a test):

    results = multi_worker_util.run_workers(SCRIPT, num_workers=2, timeout=240)
    multi_worker_util.check_success(results)        # raises with stderr tails
    data = [r.result for r in results]              # each worker's JSON

Worker side (the script):

    args = multi_worker_util.parse_worker_args()    # --result_dir, extra args
    ...
    multi_worker_util.write_result(args.result_dir, {...})

or, for a script of named scenarios, `section = multi_worker_util.sections(
out, flush)` and `@section("name")` above each scenario (see `sections`).

A parameter-server cluster (1 chief running a script, workers and ps tasks
serving with `python -m launch.ps_cluster --serve`):

    run = multi_worker_util.run_cluster(CHIEF_SCRIPT, num_workers=2, num_ps=1)
    assert run.ok, run.failure()
    data = run.chief.result                         # chief_0.json

Both runners take `monitor=fn`, called on every poll with the `Processes`
of the run, which can `kill(type, index)` (SIGKILL, a crash) or
`restart(type, index)` (same address) a task mid-run.

Every worker gets `TF_CONFIG` (its own task index), `TF_CPP_MIN_LOG_LEVEL=2`,
`CUDA_VISIBLE_DEVICES=""` and a `PYTHONPATH` that starts with the repository
root, plus `--result_dir DIR` on its command line: it writes its results as
`DIR/<task type>_<index>.json` (see `result_path`). Each task runs in its
own process group, and every group is killed before `run_workers` /
`run_cluster` returns or raises, also on timeouts and exceptions.

This module imports neither TensorFlow nor tf_dct, so it is cheap to import
from a worker script before TensorFlow starts. The runners, which run in the
parent, import what they use when called: `tf_dct.distribute.ports.free_ports` for the
ports and `launch.ps_cluster.cluster_spec` for a parameter-server cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Mapping, Sequence

import numpy as np

# tests/distribute/multi_worker_util.py -> the repository root (which holds tf_dct/).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS_DIR = pathlib.Path(__file__).resolve().parent

BASE_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CUDA_VISIBLE_DEVICES": "",
}


# --- cluster description -----------------------------------------------------


def cluster_spec(ports: Sequence[int], host: str = "localhost") -> dict:
  """A cluster of workers only, one per port."""
  return {"worker": [f"{host}:{p}" for p in ports]}


def tf_config(cluster: Mapping[str, Sequence[str]], index: int,
              task_type: str = "worker") -> str:
  """The TF_CONFIG JSON string of task (`task_type`, `index`) in `cluster`."""
  return json.dumps({"cluster": {k: list(v) for k, v in cluster.items()},
                     "task": {"type": task_type, "index": index}})


# --- worker side -------------------------------------------------------------


def to_json(value):
  """Nested tensors / numpy / Python values -> JSON-friendly lists and numbers
  (what a worker's `write_result` may hold)."""
  if isinstance(value, dict):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  if hasattr(value, "numpy"):
    value = value.numpy()
  if isinstance(value, np.ndarray):
    if value.dtype.kind == "b":
      return value.astype(bool).tolist()
    if value.dtype.kind in "iu":
      return value.astype(np.int64).tolist()
    return value.astype(np.float64).tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value


def sections(out: dict, flush, label: str = "",
             include=lambda name: True):
  """The `@section(name)` decorator of a worker script's scenarios.

  A decorated function runs at once, where it is defined. Its return value
  goes to `out["sections"][name]` (through `to_json`), or, if it raises, the
  traceback to `out["errors"][name]` and to stderr, so one failing scenario
  does not stop the next; `out["timings"][name]` gets its (wall, CPU)
  seconds, and `flush()` writes `out` after each. A scenario runs only if
  `include(name)` is true and, when the environment variable
  `ONLY_SECTIONS` ("name,name") is set for debugging, it names it.
  `label` ("[worker 1] ") starts the stderr line.
  """
  only = os.environ.get("ONLY_SECTIONS")
  chosen = set(only.split(",")) if only else None

  def section(name: str):
    def decorator(fn):
      if not include(name) or (chosen is not None and name not in chosen):
        return fn
      wall, cpu = time.monotonic(), time.process_time()
      try:
        out["sections"][name] = to_json(fn())
      except Exception:  # pylint: disable=broad-except
        out["errors"][name] = traceback.format_exc()
        print(f"{label}section {name} failed:\n{out['errors'][name]}",
              file=sys.stderr, flush=True)
      out["timings"][name] = (time.monotonic() - wall,
                              time.process_time() - cpu)
      flush()
      return fn
    return decorator

  return section


def result_path(result_dir, index: int, task_type: str = "worker"
               ) -> pathlib.Path:
  """Where task (`task_type`, `index`) writes its JSON results."""
  return pathlib.Path(result_dir) / f"{task_type}_{index}.json"


def task_type() -> str:
  """This task's type, read from TF_CONFIG ("worker" when unset)."""
  raw = os.environ.get("TF_CONFIG")
  return str(json.loads(raw)["task"]["type"]) if raw else "worker"


def task_index() -> int:
  """This worker's task index, read from TF_CONFIG (0 when unset)."""
  raw = os.environ.get("TF_CONFIG")
  return int(json.loads(raw)["task"]["index"]) if raw else 0


def cluster_size() -> int:
  """Number of tasks in TF_CONFIG's cluster (1 when unset)."""
  raw = os.environ.get("TF_CONFIG")
  if not raw:
    return 1
  return sum(len(v) for v in json.loads(raw)["cluster"].values())


def parse_worker_args(argv: Sequence[str] | None = None,
                      parser: argparse.ArgumentParser | None = None
                     ) -> argparse.Namespace:
  """Parses `--result_dir` (always passed by `run_workers`) and any extra args."""
  parser = parser or argparse.ArgumentParser()
  parser.add_argument("--result_dir", required=True)
  return parser.parse_args(argv)


def write_result(result_dir, data, index: int | None = None) -> pathlib.Path:
  """Writes `data` (JSON-serializable) atomically as this task's result.

  The file is `<type>_<index>.json` of this task's TF_CONFIG entry (e.g.
  `worker_1.json`, `chief_0.json`); `index` overrides the index.
  """
  path = result_path(result_dir, task_index() if index is None else index,
                     task_type())
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
  os.replace(tmp, path)
  return path


def wait_for_peers(result_dir, num_workers: int, key: str = "done",
                   timeout: float = 60.0) -> bool:
  """Waits until every worker's result JSON has a true `key` (a file barrier).

  Call it after writing your own final result and before exiting, so that no
  worker leaves while a peer may still be inside a collective with it.
  Returns False on timeout.
  """
  deadline = time.monotonic() + timeout
  while True:
    done = 0
    for i in range(num_workers):
      try:
        done += bool(json.loads(result_path(result_dir, i).read_text()).get(key))
      except (OSError, ValueError, AttributeError):
        pass
    if done == num_workers:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.1)


# --- parent side -------------------------------------------------------------


@dataclasses.dataclass
class WorkerResult:
  """What one worker process did."""
  index: int
  returncode: int | None      # None: still running when killed
  stdout: str
  stderr: str
  result: object | None       # parsed worker_<index>.json, None if absent/bad
  timed_out: bool = False
  killed: bool = False        # killed because another worker failed first
  result_error: str | None = None
  task_type: str = "worker"
  exit_time: float | None = None   # time.time() when its exit was seen
  starts: int = 1                  # 1 + restarts (see `Processes.restart`)

  @property
  def name(self) -> str:
    return f"{self.task_type} {self.index}"

  @property
  def ok(self) -> bool:
    return (self.returncode == 0 and not self.timed_out and
            self.result is not None)

  def tail(self, lines: int = 40) -> str:
    def last(text):
      return "\n".join(text.rstrip().splitlines()[-lines:])
    state = ("timed out" if self.timed_out else
             "killed after another worker failed" if self.killed else
             f"exit code {self.returncode}")
    parts = [f"--- {self.name}: {state}"]
    if self.result_error:
      parts.append(f"result file: {self.result_error}")
    parts.append(f"--- {self.name} stdout (last {lines} lines):\n"
                 f"{last(self.stdout)}")
    parts.append(f"--- {self.name} stderr (last {lines} lines):\n"
                 f"{last(self.stderr)}")
    return "\n".join(parts)


class WorkersFailed(AssertionError):
  """Raised by `check_success`; the message holds every worker's output tail."""


def format_failure(results: Sequence[WorkerResult], lines: int = 40) -> str:
  return "\n".join(r.tail(lines) for r in results)


def check_success(results: Sequence[WorkerResult], lines: int = 40) -> None:
  """Raises `WorkersFailed` (with stdout/stderr tails) unless all workers ok."""
  if not all(r.ok for r in results):
    bad = [r.index for r in results if not r.ok]
    raise WorkersFailed(f"multi-worker run failed on worker(s) {bad}:\n"
                        f"{format_failure(results, lines)}")


def _kill_group(proc: subprocess.Popen) -> None:
  """SIGKILLs the process group of `proc` (it leads its own session)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  with contextlib.suppress(ProcessLookupError):
    proc.kill()
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=10)


def _read_result(path: pathlib.Path):
  if not path.exists():
    return None, f"{path} was not written"
  try:
    return json.loads(path.read_text()), None
  except (OSError, ValueError) as e:
    return None, f"{path} is not valid JSON: {e}"


def run_workers(script, num_workers: int = 2, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None, timeout: float = 240.0,
                result_dir=None, fail_fast_grace: float = 15.0,
                python: str | None = None, host: str = "localhost",
                port_retries: int = 1, monitor=None) -> list[WorkerResult]:
  """Runs `script` as `num_workers` workers of one cluster and waits for them.

  Args:
    script: path of the worker program. It is called as
      `python script --result_dir DIR *args`.
    num_workers: cluster size; worker i gets TF_CONFIG task index i.
    args: extra command-line arguments for every worker.
    env: extra environment variables (override the inherited environment and
      the defaults; TF_CONFIG and PYTHONPATH are always set here).
    timeout: seconds for the whole run; then every worker still running is
      killed and marked `timed_out`.
    result_dir: where workers write their JSON (and anything else, e.g.
      checkpoints); default a fresh temporary directory that is removed
      afterwards (results are read before that).
    fail_fast_grace: once a worker exits non-zero, the others get this many
      seconds to finish (they usually hang in a collective) before being
      killed.
    python: interpreter; default `sys.executable`.
    host: the host name in the worker addresses.
    port_retries: how many times to start over with fresh ports (within the
      same `timeout`) when a worker could not bind its port.
    monitor: optional `monitor(processes)`, called on every poll with the
      `Processes` of this attempt (e.g. to kill a worker mid-run).

  Returns:
    One `WorkerResult` per worker, in task index order.
  """
  if num_workers < 1:
    raise ValueError(f"num_workers must be >= 1, got {num_workers}")
  deadline = time.monotonic() + timeout
  with contextlib.ExitStack() as stack:
    if result_dir is None:
      result_dir = stack.enter_context(
          tempfile.TemporaryDirectory(prefix="tf_dct_mw_"))
    result_dir = pathlib.Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(port_retries + 1):
      for i in range(num_workers):
        result_path(result_dir, i).unlink(missing_ok=True)
      results = _run_once(script, num_workers, args, env,
                          deadline - time.monotonic(), result_dir,
                          fail_fast_grace, python, host, monitor)
      if attempt == port_retries or not port_clash(
          r for r in results if not r.ok):
        return results
  raise AssertionError("unreachable")


# What a task whose port another process took says (TF's gRPC server, or
# MultiWorkerReplicator's check before it starts one).
PORT_IN_USE = ("Could not start gRPC server", "is already in use by another process")


def port_clash(results) -> bool:
  """Whether one of `results` failed because its port was taken."""
  return any(text in r.stderr for r in results for text in PORT_IN_USE)



class Processes:
  """Local task processes of one cluster, each in its own process group.

  A `monitor` callback given to `run_workers` / `run_cluster` receives this
  object on every poll (about 5 times a second) and may `kill` or `restart`
  tasks, e.g. to fail a worker mid-run. Tasks are named `(task_type, index)`.
  `stop_all` (always called by the runners) SIGKILLs every process group.
  """

  def __init__(self, log_dir: pathlib.Path, result_dir: pathlib.Path):
    self.log_dir = log_dir
    self.result_dir = result_dir
    self.procs: dict[tuple[str, int], subprocess.Popen] = {}
    self.exit_times: dict[tuple[str, int], float] = {}
    self.starts: dict[tuple[str, int], int] = {}
    self.events: list[tuple[float, str, str, int]] = []  # (time, what, type, i)
    self._launch_args = {}
    self._logs = []
    self.start_time = time.time()

  def start(self, task_type: str, index: int, argv: Sequence[str],
            env: Mapping[str, str]) -> subprocess.Popen:
    """Starts a task; stdout/stderr append to its log files."""
    key = (task_type, index)
    self._launch_args[key] = (list(argv), dict(env))
    out = open(self.log_dir / f"{task_type}_{index}.out", "ab")
    err = open(self.log_dir / f"{task_type}_{index}.err", "ab")
    self._logs.append((out, err))
    self.procs[key] = subprocess.Popen(
        list(argv), env=dict(env), cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
        stdout=out, stderr=err, start_new_session=True)
    self.exit_times.pop(key, None)
    self.starts[key] = self.starts.get(key, 0) + 1
    self.events.append((time.time(), "start", task_type, index))
    return self.procs[key]

  def kill(self, task_type: str, index: int) -> None:
    """SIGKILLs a task's process group (a crash: no cleanup runs)."""
    _kill_group(self.procs[(task_type, index)])
    self.poll()
    self.events.append((time.time(), "kill", task_type, index))

  def restart(self, task_type: str, index: int) -> None:
    """Kills a task if it still runs and starts it again, same address."""
    key = (task_type, index)
    if self.procs[key].poll() is None:
      self.kill(task_type, index)
    self.start(task_type, index, *self._launch_args[key])

  def alive(self, task_type: str, index: int) -> bool:
    return self.procs[(task_type, index)].poll() is None

  def result(self, task_type: str, index: int):
    """The task's current result JSON, or None (absent or half-written)."""
    data, _ = _read_result(result_path(self.result_dir, index, task_type))
    return data

  def poll(self) -> dict[tuple[str, int], int | None]:
    """Return codes by task (None: running); records first-seen exit times."""
    codes = {}
    for key, p in self.procs.items():
      codes[key] = p.poll()
      if codes[key] is not None and key not in self.exit_times:
        self.exit_times[key] = time.time()
    return codes

  def stop_all(self) -> None:
    for p in self.procs.values():
      _kill_group(p)
    self.poll()
    for out, err in self._logs:
      out.close()
      err.close()
    self._logs = []

  def collect(self, key, timed_out=False, killed=False) -> WorkerResult:
    task_type, index = key
    data, error = _read_result(result_path(self.result_dir, index, task_type))
    p = self.procs[key]
    return WorkerResult(
        index=index,
        returncode=None if (timed_out or killed) else p.returncode,
        stdout=(self.log_dir / f"{task_type}_{index}.out").read_text(errors="replace"),
        stderr=(self.log_dir / f"{task_type}_{index}.err").read_text(errors="replace"),
        result=data, timed_out=timed_out, killed=killed, result_error=error,
        task_type=task_type, exit_time=self.exit_times.get(key),
        starts=self.starts.get(key, 1))


def _base_env(env: Mapping[str, str] | None) -> dict:
  base_env = dict(os.environ)
  base_env.pop("TF_CONFIG", None)
  base_env.update(BASE_ENV)
  base_env.update(env or {})
  pythonpath = [str(REPO_ROOT)] + [
      p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
  base_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
  return base_env


def _run_once(script, num_workers, args, env, timeout, result_dir,
              fail_fast_grace, python, host, monitor=None) -> list[WorkerResult]:
  """One attempt of `run_workers` (result_dir exists)."""
  with tempfile.TemporaryDirectory(prefix="tf_dct_mw_logs_") as log_dir:
    from tf_dct.distribute.ports import free_ports  # pylint: disable=g-import-not-at-top
    cluster = cluster_spec(free_ports(num_workers), host)
    base_env = _base_env(env)
    procs = Processes(pathlib.Path(log_dir), result_dir)
    keys = [("worker", i) for i in range(num_workers)]
    timed_out = dict.fromkeys(keys, False)
    killed = dict.fromkeys(keys, False)
    try:
      for i in range(num_workers):
        procs.start("worker", i, [python or sys.executable, str(script),
                                  "--result_dir", str(result_dir), *map(str, args)],
                    dict(base_env, TF_CONFIG=tf_config(cluster, i)))
      deadline = time.monotonic() + timeout
      fail_deadline = None
      while True:
        if monitor is not None:
          monitor(procs)
        codes = procs.poll()
        if all(c is not None for c in codes.values()):
          break
        now = time.monotonic()
        if fail_deadline is None and any(c not in (None, 0) for c in codes.values()):
          fail_deadline = now + fail_fast_grace
        if now >= deadline or (fail_deadline is not None and now >= fail_deadline):
          flags = timed_out if now >= deadline else killed
          for key, c in codes.items():
            flags[key] = c is None
          break
        time.sleep(0.2)
    finally:
      procs.stop_all()
    return [procs.collect(k, timed_out[k], killed[k]) for k in keys]


# --- a parameter-server cluster -------------------------------------------------

SERVER_MODULE = "launch.ps_cluster"   # `python -m launch.ps_cluster --serve`


@dataclasses.dataclass
class ClusterResult:
  """What a `run_cluster` run did: the chief and every server task."""
  chief: WorkerResult
  servers: list[WorkerResult]
  events: list                 # (time.time(), "start"|"kill", type, index)

  @property
  def ok(self) -> bool:
    return self.chief.ok

  def failure(self, lines: int = 40) -> str:
    return format_failure([self.chief, *self.servers], lines)


def run_cluster(chief_script, num_workers: int = 2, num_ps: int = 1,
                args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                timeout: float = 240.0, result_dir=None, monitor=None,
                python: str | None = None, host: str = "localhost",
                port_retries: int = 1) -> ClusterResult:
  """Runs a parameter-server cluster: 1 chief, workers and ps tasks.

  The workers and ps tasks run `python -m launch.ps_cluster --serve` (a
  `tf.distribute.Server` that serves until killed); the chief runs
  `python chief_script --result_dir DIR *args` and writes `chief_0.json`.
  The run ends when the chief exits (or at `timeout`, marking it
  `timed_out`); every process group is then killed, also on exceptions.
  A server task that dies on its own does not end the run (the chief
  decides what a lost worker means); `monitor(processes)` is polled as in
  `run_workers`. Port clashes are retried like `run_workers`.
  """
  deadline = time.monotonic() + timeout
  with contextlib.ExitStack() as stack:
    if result_dir is None:
      result_dir = stack.enter_context(
          tempfile.TemporaryDirectory(prefix="tf_dct_ps_"))
    result_dir = pathlib.Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(port_retries + 1):
      result_path(result_dir, 0, "chief").unlink(missing_ok=True)
      result = _run_cluster_once(chief_script, num_workers, num_ps, args, env,
                                 deadline - time.monotonic(), result_dir,
                                 monitor, python, host)
      tasks = [result.chief, *result.servers]
      if attempt == port_retries or not port_clash(tasks):
        return result
  raise AssertionError("unreachable")


def _run_cluster_once(chief_script, num_workers, num_ps, args, env, timeout,
                      result_dir, monitor, python, host) -> ClusterResult:
  with tempfile.TemporaryDirectory(prefix="tf_dct_ps_logs_") as log_dir:
    from launch import ps_cluster  # pylint: disable=g-import-not-at-top
    cluster = ps_cluster.cluster_spec(num_workers, num_ps, host)
    base_env = _base_env(env)
    python = python or sys.executable
    procs = Processes(pathlib.Path(log_dir), result_dir)
    servers = [("ps", i) for i in range(num_ps)] + [
        ("worker", i) for i in range(num_workers)]
    chief = ("chief", 0)
    timed_out = False
    try:
      for task_type, i in servers:
        procs.start(task_type, i, [python, "-m", SERVER_MODULE, "--serve"],
                    dict(base_env, TF_CONFIG=tf_config(cluster, i, task_type)))
      procs.start("chief", 0, [python, str(chief_script), "--result_dir",
                               str(result_dir), *map(str, args)],
                  dict(base_env, TF_CONFIG=tf_config(cluster, 0, "chief")))
      deadline = time.monotonic() + timeout
      while True:
        if monitor is not None:
          monitor(procs)
        if procs.poll()[chief] is not None:
          break
        if time.monotonic() >= deadline:
          timed_out = True
          break
        time.sleep(0.2)
    finally:
      procs.stop_all()
    return ClusterResult(
        chief=procs.collect(chief, timed_out=timed_out),
        servers=[procs.collect(k) for k in servers], events=list(procs.events))
