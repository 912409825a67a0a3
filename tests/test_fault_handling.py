"""A synchronous replicator fails within its collective timeout when a peer dies.

Two local `MultiWorkerReplicator` workers (`tests/fault_worker_script.py`,
collective timeout TIMEOUT seconds) all-sum every ~0.1 s. Once worker 1 has
done a few steps the test SIGKILLs it (`multi_worker_util.Processes.kill`, a
crash without cleanup). Worker 0 must then exit on its own with a
`PeerFailureError` that names the timeout, within TIMEOUT + SLACK seconds of
the kill. `run_workers` kills every process it started, also on failure.

The asynchronous side (a killed and restarted worker, restart from a
checkpoint) is in tests/test_async_replicator.py.
"""

import pathlib
import time

import tensorflow as tf

from tests import multi_worker_util

SCRIPT = pathlib.Path(__file__).resolve().parent / "fault_worker_script.py"
TIMEOUT = 5.0         # the collective timeout given to the replicator
SLACK = 15.0          # detection, error handling and process exit, loaded CPU
KILL_AFTER_STEPS = 5


class SyncPeerFailureTest(tf.test.TestCase):

  def test_survivor_fails_within_the_collective_timeout(self):
    killed_at = {}

    def monitor(procs):
      if killed_at:
        return
      progress = procs.result("worker", 1)
      if progress and progress.get("steps", 0) >= KILL_AFTER_STEPS:
        procs.kill("worker", 1)
        killed_at["time"] = time.time()
        killed_at["steps"] = progress["steps"]

    start = time.monotonic()
    results = multi_worker_util.run_workers(
        SCRIPT, num_workers=2, args=["--timeout", TIMEOUT], timeout=150,
        fail_fast_grace=TIMEOUT + 2 * SLACK, monitor=monitor)
    elapsed = time.monotonic() - start
    failure = multi_worker_util.format_failure(results)
    self.assertIn("time", killed_at, msg="worker 1 never reached the kill point\n" + failure)
    survivor, victim = results
    self.assertEqual(victim.returncode, -9, msg=failure)
    self.assertEqual(survivor.returncode, 3, msg=failure)   # exited on its own
    self.assertFalse(survivor.killed or survivor.timed_out, msg=failure)
    error = survivor.result["error"]
    self.assertEqual(error["type"], "PeerFailureError")
    self.assertIn(f"collective_timeout_seconds={TIMEOUT:g}", error["message"])
    self.assertIn("peer worker", error["message"])
    self.assertEqual(survivor.result["collective_timeout_seconds"], TIMEOUT)
    # The survivor ran with its peer, then failed within the bound.
    self.assertGreaterEqual(survivor.result["steps"], KILL_AFTER_STEPS - 1)
    detect = error["time"] - killed_at["time"]
    exit_after = survivor.exit_time - killed_at["time"]
    print(f"\n[fault] kill -> error {detect:.1f}s, kill -> exit {exit_after:.1f}s "
          f"(timeout {TIMEOUT}s), original {error['original']}, run {elapsed:.0f}s")
    self.assertLess(detect, TIMEOUT + SLACK, msg=failure)
    self.assertLess(exit_after, TIMEOUT + SLACK, msg=failure)

  def test_timeout_argument_errors(self):
    import tf_dct  # pylint: disable=g-import-not-at-top
    for bad in (0, -1.0, "5", True):
      with self.assertRaisesRegex(ValueError, "collective_timeout_seconds"):
        tf_dct.MultiWorkerReplicator(collective_timeout_seconds=bad)
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=3)
    with self.assertRaisesRegex(ValueError, "give the collective timeout once"):
      tf_dct.MultiWorkerReplicator(communication_options=options,
                                   collective_timeout_seconds=5)


if __name__ == "__main__":
  tf.test.main()
