"""Worker program for tests/distribute/test_fault_handling.py (run by multi_worker_util).

Each of 2 workers builds a `MultiWorkerReplicator` with a collective timeout
and runs up to `--steps` all-sum steps, about `--step_seconds` apart, writing
`{"steps": n, "time": t}` to its result file after every step. The test kills
one worker mid-run; the survivor's next collective fails and it records
`{"error": {"type", "message", "reason", "original", "time"}}` and exits with
code 3. With `--absent I`, worker I records its address and exits at once (a
peer that never starts); the others fail the same way while starting
(`--startup_timeout`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


def main() -> None:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import multi_worker_util  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser()
  parser.add_argument("--timeout", type=float, required=True)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--step_seconds", type=float, default=0.1)
  parser.add_argument("--absent", type=int, default=-1)
  parser.add_argument("--startup_timeout", type=float, default=120.0)
  args = multi_worker_util.parse_worker_args(parser=parser)
  out = {"steps": 0, "done": False}

  def flush():
    multi_worker_util.write_result(args.result_dir, out)

  if multi_worker_util.task_index() == args.absent:
    out["address"] = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][args.absent]
    out["done"] = True
    flush()
    return

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  from tf_dct.distribute import multi_worker  # pylint: disable=g-import-not-at-top

  try:
    repl = tf_dct.MultiWorkerReplicator(
        collective_timeout_seconds=args.timeout,
        startup_timeout_seconds=args.startup_timeout)
    out["collective_timeout_seconds"] = repl.collective_timeout_seconds

    def input_fn(ctx):
      return tf.data.Dataset.from_tensors(
          tf.fill([1], float(ctx.input_pipeline_id + 1))).repeat()

    def step_fn(x):
      return repl.all_sum(x)

    for _ in range(args.steps):
      total = repl.experimental_local_results(repl.run(step_fn, input_fn))[0]
      out["steps"] += 1
      out["sum"] = float(total.numpy()[0])
      out["time"] = time.time()
      flush()
      time.sleep(args.step_seconds)
  except multi_worker.PeerFailureError as e:
    out["error"] = {"type": type(e).__name__, "message": str(e),
                    "reason": e.reason, "original": type(e.original).__name__,
                    "time": time.time()}
    flush()
    sys.stderr.flush()
    os._exit(3)
  out["done"] = True
  flush()
  os._exit(0)  # skip the strategy's exit-time teardown


if __name__ == "__main__":
  main()
