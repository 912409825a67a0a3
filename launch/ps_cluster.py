"""A local parameter-server cluster: 1 chief, N workers, M ps tasks.

    python -m launch.ps_cluster                      # the built-in demo chief
    python -m launch.ps_cluster -- python my_chief.py --flag=1
    python -m launch.ps_cluster --workers=2 --ps=1 --timeout=600 -- CMD...

Picks free localhost ports, starts every worker and ps task as
`python -m launch.ps_cluster --serve` (a `tf.distribute.Server` serving until
killed) with its own `TF_CONFIG`, then runs the chief command with the chief's
`TF_CONFIG` in the foreground (its output goes to this terminal; the servers'
to `--log_dir`, default a temporary directory). When the chief exits, on
Ctrl-C, SIGTERM or `--timeout`, every server process group is killed. The
exit code is the chief's.

The demo chief (`--demo`) trains a linear regression with
`tf_dct.AsyncReplicator` and DCT-DP pushes and prints its loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def cluster_spec(num_workers: int = 2, num_ps: int = 1,
                 host: str = "localhost") -> dict:
  """A {"chief", "worker", "ps"} cluster on free ports of `host`."""
  # `tf_dct.distribute.ports` loads no TensorFlow (the packages import their
  # modules on first use), so the launcher process stays light.
  from tf_dct.distribute.ports import free_ports  # pylint: disable=g-import-not-at-top
  ports = free_ports(1 + num_workers + num_ps)
  return {"chief": [f"{host}:{ports[0]}"],
          "worker": [f"{host}:{p}" for p in ports[1:1 + num_workers]],
          "ps": [f"{host}:{p}" for p in ports[1 + num_workers:]]}


def tf_config(cluster: dict, task_type: str, index: int) -> str:
  return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def serve() -> None:
  """Runs this process's worker/ps task from TF_CONFIG until it is killed."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  if resolver.task_type not in ("worker", "ps"):
    raise SystemExit(f"--serve runs worker or ps tasks, TF_CONFIG says "
                     f"{resolver.task_type!r}")
  server = tf.distribute.Server(
      resolver.cluster_spec(), job_name=resolver.task_type,
      task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc",
      start=True)
  print(f"serving {resolver.task_type}:{resolver.task_id} at {server.target}",
        flush=True)
  server.join()


def _kill_group(proc: subprocess.Popen) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=10)


def run(chief_cmd: list[str], num_workers: int = 2, num_ps: int = 1,
        timeout: float | None = None, log_dir: str | None = None) -> int:
  """Starts the cluster, runs `chief_cmd` as the chief, tears everything down."""
  cluster = cluster_spec(num_workers, num_ps)
  env = dict(os.environ)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  procs = []

  def terminate(signum, frame):
    del frame
    raise SystemExit(128 + signum)

  old = signal.signal(signal.SIGTERM, terminate)
  with contextlib.ExitStack() as stack:
    logs = pathlib.Path(log_dir or stack.enter_context(
        tempfile.TemporaryDirectory(prefix="ps_cluster_")))
    logs.mkdir(parents=True, exist_ok=True)
    try:
      for task_type, count in (("ps", num_ps), ("worker", num_workers)):
        for i in range(count):
          out = stack.enter_context(open(logs / f"{task_type}_{i}.log", "wb"))
          procs.append(subprocess.Popen(
              [sys.executable, "-m", "launch.ps_cluster", "--serve"],
              env=dict(env, TF_CONFIG=tf_config(cluster, task_type, i)),
              cwd=str(REPO_ROOT), stdin=subprocess.DEVNULL, stdout=out,
              stderr=subprocess.STDOUT, start_new_session=True))
      print(f"ps_cluster: {json.dumps(cluster)}; server logs in {logs}",
            file=sys.stderr, flush=True)
      chief = subprocess.Popen(chief_cmd, env=dict(
          env, TF_CONFIG=tf_config(cluster, "chief", 0)), start_new_session=True)
      procs.append(chief)
      try:
        return chief.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        print(f"ps_cluster: chief still running after {timeout}s; stopping",
              file=sys.stderr, flush=True)
        return 124
      except KeyboardInterrupt:
        return 130
    finally:
      for p in procs:
        _kill_group(p)
      signal.signal(signal.SIGTERM, old)


def demo(steps: int = 1000) -> None:
  """Chief of the demo: async linear regression with DCT-DP pushes."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dct.distribute.async_replicator import AsyncReplicator  # pylint: disable=g-import-not-at-top
  from tf_dct.compression import DCTDP  # pylint: disable=g-import-not-at-top
  from tf_dct.compression.async_push import AsyncPush  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  x = rng.normal(size=(4096, 64)).astype(np.float32)
  w_true = rng.normal(size=(64, 1)).astype(np.float32)
  y = (x @ w_true + 0.1 * rng.normal(size=(4096, 1))).astype(np.float32)
  repl = AsyncReplicator()
  with repl.scope():
    w = tf.Variable(tf.zeros([64, 1]), name="w")
  push = AsyncPush(repl, DCTDP(0.99, threshold_life=1000, density_band=(0.5, 2.0)),
                   learning_rate=0.01, variables=[w])
  def input_fn(ctx):
    del ctx
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096).repeat().batch(64)
  def step_fn(batch):
    xb, yb = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(xb @ w - yb))
    push(tape.gradient(loss, [w]), [w])
    return loss
  start = time.time()
  for _ in range(steps):
    repl.run(step_fn, input_fn)
  repl.join()
  loss = float(np.mean(np.square(x @ w.numpy() - y)))
  stats = push.stats()
  print(f"demo: {steps} async steps on {repl.num_workers} workers in "
        f"{time.time() - start:.1f}s; loss {loss:.5f} (noise floor 0.01); "
        f"pushed {stats['bytes_pushed'] / stats['steps']:.0f} B/step vs dense "
        f"{stats['dense_bytes'] / stats['steps']:.0f} B/step")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  command = []
  if "--" in argv:
    cut = argv.index("--")
    argv, command = argv[:cut], argv[cut + 1:]
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--serve", action="store_true",
                      help="run this process's worker/ps task from TF_CONFIG")
  parser.add_argument("--demo", action="store_true", help="run the demo chief")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--ps", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=None,
                      help="seconds before the chief and cluster are stopped")
  parser.add_argument("--log_dir", default=None, help="where server logs go")
  args = parser.parse_args(argv)
  if args.serve:
    serve()
    return 0
  if args.demo:
    demo()
    return 0
  if args.workers < 1 or args.ps < 1:
    parser.error("--workers and --ps must be >= 1")
  command = command or [sys.executable, "-m", "launch.ps_cluster", "--demo"]
  return run(command, args.workers, args.ps, args.timeout, args.log_dir)


if __name__ == "__main__":
  sys.exit(main())
