"""Runs a Python script as N local worker processes of one TF_CONFIG cluster.

Parent side (a test):

    results = multi_worker_util.run_workers(SCRIPT, num_workers=2, timeout=240)
    multi_worker_util.check_success(results)        # raises with stderr tails
    data = [r.result for r in results]              # each worker's JSON

Worker side (the script):

    args = multi_worker_util.parse_worker_args()    # --result_dir, extra args
    ...
    multi_worker_util.write_result(args.result_dir, {...})

Every worker gets `TF_CONFIG` (its own task index), `TF_CPP_MIN_LOG_LEVEL=2`,
`CUDA_VISIBLE_DEVICES=""` and a `PYTHONPATH` that starts with the repository
root, plus `--result_dir DIR` on its command line: it writes its results as
`DIR/worker_<index>.json` (see `result_path`). Each worker runs in its own
process group, and every group is killed before `run_workers` returns or
raises, also on timeouts and exceptions.

This module imports neither TensorFlow nor tf_dct, so it is cheap to import
from a worker script before TensorFlow starts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Sequence

# tests/multi_worker_util.py -> the repository root (which holds tf_dct/).
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS_DIR = pathlib.Path(__file__).resolve().parent

BASE_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "CUDA_VISIBLE_DEVICES": "",
}


# --- cluster description -----------------------------------------------------


def free_ports(n: int) -> list[int]:
  """Returns `n` distinct TCP ports that are free right now.

  TF's gRPC server binds `0.0.0.0:<port>`, so the ports are probed there. All
  sockets are held open until every port is picked, so the ports are
  distinct; another process may still take one before the workers bind it
  (`run_workers` retries that case with fresh ports).
  """
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("0.0.0.0", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def cluster_spec(ports: Sequence[int], host: str = "localhost") -> dict:
  """A cluster of workers only, one per port."""
  return {"worker": [f"{host}:{p}" for p in ports]}


def tf_config(cluster: Mapping[str, Sequence[str]], index: int,
              task_type: str = "worker") -> str:
  """The TF_CONFIG JSON string of task (`task_type`, `index`) in `cluster`."""
  return json.dumps({"cluster": {k: list(v) for k, v in cluster.items()},
                     "task": {"type": task_type, "index": index}})


# --- worker side -------------------------------------------------------------


def result_path(result_dir, index: int) -> pathlib.Path:
  """Where worker `index` writes its JSON results."""
  return pathlib.Path(result_dir) / f"worker_{index}.json"


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
  """Writes `data` (JSON-serializable) atomically as this worker's result."""
  path = result_path(result_dir, task_index() if index is None else index)
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
    parts = [f"--- worker {self.index}: {state}"]
    if self.result_error:
      parts.append(f"result file: {self.result_error}")
    parts.append(f"--- worker {self.index} stdout (last {lines} lines):\n"
                 f"{last(self.stdout)}")
    parts.append(f"--- worker {self.index} stderr (last {lines} lines):\n"
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
                port_retries: int = 1) -> list[WorkerResult]:
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
                          fail_fast_grace, python, host)
      if attempt == port_retries or not any(
          PORT_IN_USE in r.stderr for r in results if not r.ok):
        return results
  raise AssertionError("unreachable")


PORT_IN_USE = "Could not start gRPC server"


def _run_once(script, num_workers, args, env, timeout, result_dir,
              fail_fast_grace, python, host) -> list[WorkerResult]:
  """One attempt of `run_workers` (result_dir exists)."""
  with contextlib.ExitStack() as stack:
    log_dir = pathlib.Path(stack.enter_context(
        tempfile.TemporaryDirectory(prefix="tf_dct_mw_logs_")))
    cluster = cluster_spec(free_ports(num_workers), host)

    base_env = dict(os.environ)
    base_env.pop("TF_CONFIG", None)
    base_env.update(BASE_ENV)
    base_env.update(env or {})
    pythonpath = [str(REPO_ROOT)] + [
        p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_env["PYTHONPATH"] = os.pathsep.join(pythonpath)

    procs: list[subprocess.Popen] = []
    logs = []
    timed_out = [False] * num_workers
    killed = [False] * num_workers
    try:
      for i in range(num_workers):
        worker_env = dict(base_env, TF_CONFIG=tf_config(cluster, i))
        out = open(log_dir / f"worker_{i}.out", "wb")
        err = open(log_dir / f"worker_{i}.err", "wb")
        logs.append((out, err))
        procs.append(subprocess.Popen(
            [python or sys.executable, str(script), "--result_dir",
             str(result_dir), *map(str, args)],
            env=worker_env, cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, start_new_session=True))

      deadline = time.monotonic() + timeout
      fail_deadline = None
      while True:
        running = [p.poll() is None for p in procs]  # polls every process
        if not any(running):
          break
        now = time.monotonic()
        if fail_deadline is None and any(
            p.returncode not in (None, 0) for p in procs):
          fail_deadline = now + fail_fast_grace
        if now >= deadline:
          for i, p in enumerate(procs):
            if p.poll() is None:
              timed_out[i] = True
          break
        if fail_deadline is not None and now >= fail_deadline:
          for i, p in enumerate(procs):
            if p.poll() is None:
              killed[i] = True
          break
        time.sleep(0.2)
    finally:
      for p in procs:
        _kill_group(p)
      for out, err in logs:
        out.close()
        err.close()

    results = []
    for i, p in enumerate(procs):
      data, error = _read_result(result_path(result_dir, i))
      results.append(WorkerResult(
          index=i,
          returncode=None if (timed_out[i] or killed[i]) else p.returncode,
          stdout=(log_dir / f"worker_{i}.out").read_text(errors="replace"),
          stderr=(log_dir / f"worker_{i}.err").read_text(errors="replace"),
          result=data, timed_out=timed_out[i], killed=killed[i],
          result_error=error))
    return results
