"""A synchronous replicator fails, with a clear error, when a peer is gone.

Two local `MultiWorkerReplicator` workers (`tests/distribute/fault_worker_script.py`,
collective timeout TIMEOUT seconds) all-sum every ~0.1 s. Once worker 1 has
done a few steps the test SIGKILLs it (`multi_worker_util.Processes.kill`, a
crash without cleanup). Worker 0 must then exit on its own with a
`PeerFailureError` that says what happened (the collective timed out, or
lost its connection), within TIMEOUT + SLACK seconds of the kill. With a
worker that never starts, the other must give up after its start-up timeout,
naming the missing worker. `run_workers` kills every process it started,
also on failure. The other tests need no cluster: the wording of each kind
of collective failure, argument checks, and a port another process holds.

The asynchronous side (a killed and restarted worker, restart from a
checkpoint) is in tests/distribute/test_async_replicator.py.
"""

import concurrent.futures
import math
import os
import pathlib
import socket
import time
from unittest import mock

from absl.testing import parameterized
import tensorflow as tf

import tf_dct
from tf_dct import _private
from tf_dct.distribute import multi_worker
from tests.distribute import multi_worker_util

SCRIPT = pathlib.Path(__file__).resolve().parent / "fault_worker_script.py"
TIMEOUT = 5.0         # the collective timeout given to the replicator
STARTUP_TIMEOUT = 2.0  # the start-up timeout, with a worker that never starts
SLACK = 15.0          # detection, error handling and process exit, loaded CPU
KILL_AFTER_STEPS = 5

# What `PeerFailureError` says for each `reason` (collective timeout TIMEOUT).
SAYS = {
    "timeout": f"a collective did not complete within collective_timeout_seconds={TIMEOUT:g}",
    "connection": ("a collective lost the connection to a peer (connection "
                   "reset/refused): the peer probably died"),
    "aborted": ("a collective was aborted (by TensorFlow's health check, or "
                "because an earlier collective failed)"),
}


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
    # A dead peer's collective times out, or loses its connection first;
    # health checks (aborts) are slower than TIMEOUT.
    self.assertIn(error["reason"], ("timeout", "connection"), msg=error)
    self.assertIn(SAYS[error["reason"]], error["message"])
    self.assertEqual(survivor.result["collective_timeout_seconds"], TIMEOUT)
    # The survivor ran with its peer, then failed within the bound.
    self.assertGreaterEqual(survivor.result["steps"], KILL_AFTER_STEPS - 1)
    detect = error["time"] - killed_at["time"]
    exit_after = survivor.exit_time - killed_at["time"]
    print(f"\n[fault] kill -> error {detect:.1f}s, kill -> exit {exit_after:.1f}s "
          f"(timeout {TIMEOUT}s), original {error['original']}, run {elapsed:.0f}s")
    self.assertLess(detect, TIMEOUT + SLACK, msg=failure)
    self.assertLess(exit_after, TIMEOUT + SLACK, msg=failure)



class StartupTest(tf.test.TestCase):

  def test_a_worker_that_never_starts_fails_the_other_naming_it(self):
    # Worker 0 hosts the coordination service: with worker 1 absent it waits
    # for its registration; with worker 0 absent, worker 1 waits for an answer.
    def run(absent):
      return multi_worker_util.run_workers(
          SCRIPT, num_workers=2, timeout=150,
          args=["--timeout", TIMEOUT, "--absent", absent,
                "--startup_timeout", STARTUP_TIMEOUT])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      runs = dict(zip((1, 0), pool.map(run, (1, 0))))
    for absent, results in runs.items():
      failure = multi_worker_util.format_failure(results)
      gone, waiting = results[absent], results[1 - absent]
      self.assertEqual(gone.returncode, 0, msg=failure)
      self.assertEqual(waiting.returncode, 3, msg=failure)   # exited on its own
      self.assertFalse(waiting.killed or waiting.timed_out, msg=failure)
      error = waiting.result["error"]
      self.assertEqual(error["type"], "PeerFailureError")
      self.assertEqual(error["reason"], "timeout")
      self.assertIn(f"did not start within startup_timeout_seconds={STARTUP_TIMEOUT:g}: "
                    f"no answer from worker {absent} ({gone.result['address']})",
                    error["message"])
      self.assertIn("same TF_CONFIG", error["message"])
      self.assertIn("TensorFlow said: DeadlineExceededError", error["message"])

  def test_a_port_held_by_another_process_fails_before_the_server_starts(self):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
      # A TF server of another run: gRPC listens with SO_REUSEPORT, so TF's
      # own bind would succeed and share the port.
      holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
      holder.bind(("0.0.0.0", 0))
      holder.listen()
      address = f"localhost:{holder.getsockname()[1]}"
      config = multi_worker_util.tf_config({"worker": [address]}, 0)
      with mock.patch.dict(os.environ, {"TF_CONFIG": config}):
        with self.assertRaisesRegex(
            RuntimeError, rf"\(worker 0\): port \d+ of this task's address "
            rf"{address} is already in use by another process"):
          tf_dct.MultiWorkerReplicator()
    self.assertFalse(_private.coordination_service_configured())


class ArgumentTest(parameterized.TestCase):

  @parameterized.product(
      name=["collective_timeout_seconds", "startup_timeout_seconds"],
      bad=[0, -1.0, "5", True, math.nan, math.inf])
  def test_timeout_argument_errors(self, name, bad):
    with self.assertRaisesRegex(
        ValueError, rf"MultiWorkerReplicator: {name} must be a number > 0, "
        r"got .* \(or None: no timeout\)"):
      tf_dct.MultiWorkerReplicator(**{name: bad})

  def test_collective_timeout_given_twice(self):
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=3)
    with self.assertRaisesRegex(ValueError, "give the collective timeout once"):
      tf_dct.MultiWorkerReplicator(communication_options=options,
                                   collective_timeout_seconds=5)


class CollectiveFailureTest(parameterized.TestCase):
  """How each TF error of a collective is worded; no cluster."""

  CLUSTER = {"worker": ["localhost:1", "localhost:2"]}

  @parameterized.named_parameters(
      ("deadline", tf.errors.DeadlineExceededError, "Deadline Exceeded", "timeout"),
      ("deadline_of_a_connect", tf.errors.DeadlineExceededError,
       "failed to connect to all addresses", "timeout"),
      ("unavailable", tf.errors.UnavailableError, "Socket closed", "connection"),
      ("aborted_connection_reset", tf.errors.AbortedError,
       "Collective ops is aborted by: Connection reset by peer", "connection"),
      ("unknown_connection_refused", tf.errors.UnknownError,
       "Collective ops is aborted by: connect: Connection refused", "connection"),
      ("aborted_timed_out", tf.errors.AbortedError,
       "Collective ops is aborted by: Barrier timed out", "timeout"),
      ("aborted_health_check", tf.errors.AbortedError,
       "Collective ops is aborted by: cluster check alive failed, "
       "/job:worker/replica:0/task:1 is down", "aborted"),
      ("cancelled", tf.errors.CancelledError, "Cancelled", "aborted"))
  def test_reason_and_message(self, error_class, text, reason):
    error = error_class(None, None, text + "\nAdditional GRPC error information")
    failure = multi_worker.collective_failure(error, TIMEOUT, 1, self.CLUSTER)
    self.assertIsInstance(failure, tf_dct.PeerFailureError)
    self.assertEqual(failure.reason, reason)
    self.assertIs(failure.original, error)
    self.assertEqual(failure.timeout_seconds, TIMEOUT)
    message = str(failure)
    self.assertStartsWith(message, f"MultiWorkerReplicator (worker 1): {SAYS[reason]}")
    self.assertIn(str(self.CLUSTER), message)
    self.assertEndsWith(message, f"TensorFlow said: {error_class.__name__}: {text}")
    self.assertEqual(reason == "timeout", "collective_timeout_seconds" in message)

  def test_timeout_without_a_collective_timeout(self):
    failure = multi_worker.collective_failure(
        tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded"), None, 0, {})
    self.assertIn("did not complete within TensorFlow's own deadline", str(failure))
    self.assertIsNone(failure.timeout_seconds)

  @parameterized.named_parameters(
      ("invalid_argument", tf.errors.InvalidArgumentError(None, None, "Connection reset")),
      ("not_a_tf_error", ValueError("timed out")))
  def test_other_errors_are_not_peer_failures(self, error):
    self.assertIsNone(multi_worker.peer_failure_reason(error))
    self.assertIsNone(multi_worker.collective_failure(error, TIMEOUT, 0, {}))


if __name__ == "__main__":
  tf.test.main()
