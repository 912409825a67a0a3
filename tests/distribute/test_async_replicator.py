"""AsyncReplicator on a local cluster of 1 chief, 2 workers and 1 ps.

`setUpClass` runs `tests/distribute/async_chief_script.py` once, on one cluster
(`multi_worker_util.run_cluster`, which kills every process it started, also
on failure), section after section:

* training: the API and its errors, async training of a linear regression
  (y = xW + b, W 64x8, b 8; noise floor ~0.0099) with dense pushes and with
  DCTDP(0.99) pushes, push accounting, conservation with and without the
  stochastic drain, tf-keras `model.fit`;
* fault: after 50 healthy steps and a draining checkpoint, worker 1 is
  SIGKILLed once 25 more steps completed and restarted 1 s later; the steps
  scheduled meanwhile must finish (on worker 0), and once worker 1 is back
  it must take part in 100 more; then a restart from the checkpoint, and
  training goes on;
* last, a step whose closure fails (non-finite gradient).

Sync reference and tolerance. The asynchronous DCTDP run makes ASYNC_STEPS =
1000 pushes of a worker's batch of 64 (SGD, lr 0.03); the dense run makes
DENSE_STEPS = 500 at lr 0.06 (a dense push moves every weight, so it gets as
close in half the steps at twice the rate; a DCTDP(0.99) push moves ~7 of
520 entries and does not). The synchronous reference (`sync_reference`,
numpy) takes the same per-worker step synchronously: half as many steps,
each applying the SUM of both workers' gradients at the same weights
(MultiWorkerReplicator's dense aggregation), i.e. the same examples. Async
runs are not deterministic (which worker takes which step, staleness), so
we compare the final full-data loss, not weights: both must be within 2%
of the synchronous loss. The problem is convex with a noise floor, so every
run converges to the same optimum (the references end 0.8% and 1.2% above
it); the async losses we measured were within 0.4% of their reference.

DCTDP(0.99) runs with threshold_life=1000 and density_band=(0.5, 2.0): on
this convex problem the gradients shrink ~100x while converging, so a
threshold kept for the whole run is soon far too high (without the band the
run does not converge); the band refreshes it early when the density
drifts, and the early refreshes are counted and reported.
"""

import json
import os
import pathlib
import time
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import tf_dct
from tf_dct.distribute.async_replicator import AsyncReplicator, validate_ps_tf_config
from tf_dct.compression.async_push import AsyncPush
from tf_dct.compression.dct_dp import DCTDP
from tests.distribute import async_chief_script as acs
from tests.distribute import multi_worker_util

SCRIPT = pathlib.Path(__file__).resolve().parent / "async_chief_script.py"
TOLERANCE = 0.02
KILL_AFTER = acs.CHUNK   # completed phase-2 steps before worker 1 is killed
RESTART_AFTER = 1.0      # seconds between the kill and the restart


def _fault_monitor(state):
  def monitor(procs):
    progress = (procs.result("chief", 0) or {}).get("progress") or {}
    if "killed" not in state and progress.get("completed", 0) >= KILL_AFTER:
      procs.kill("worker", 1)
      state["killed"] = progress
      state["kill_time"] = time.time()
    if ("killed" in state and "restarted" not in state and
        time.time() >= state["kill_time"] + RESTART_AFTER):
      procs.restart("worker", 1)
      state["restarted"] = True
      (procs.result_dir / acs.RESTARTED).touch()   # the chief waits for it
  return monitor


@pytest.mark.slow(seconds=80)  # one parameter-server cluster, ~2,000 async steps
class AsyncReplicatorTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.fault_state = {}
    # One cluster for every section, one after the other: a second cluster
    # would start 4 more TensorFlow processes (some 20 s of CPU) on the same
    # cores.
    cls.train = cls.fault = multi_worker_util.run_cluster(
        SCRIPT, args=["--mode=all"], timeout=360,
        monitor=_fault_monitor(cls.fault_state))

  def run_ok(self, run):
    self.assertTrue(run.ok, msg=run.failure())
    result = run.chief.result
    self.assertTrue(result["done"], msg=run.failure())
    return result

  def section(self, name, run=None):
    result = self.run_ok(run or self.train)
    self.assertNotIn(name, result["errors"],
                     msg=result["errors"].get(name, "") + run_tail(run or self.train))
    return result["sections"][name]

  # -- API ---------------------------------------------------------------------

  def test_topology(self):
    meta = self.section("meta")
    self.assertTrue(meta["is_pss"])
    self.assertEqual(meta["num_workers"], 2)
    self.assertEqual(meta["num_ps"], 1)
    self.assertEqual(meta["num_replicas_in_sync"], 1)
    self.assertEqual(meta["variable_device"], "/job:ps/replica:0/task:0/device:CPU:0")

  def test_unsupported_primitives_say_so(self):
    messages = self.section("unsupported")
    for name in ("all_reduce", "all_sum", "all_gather", "broadcast",
                 "map_reduce", "map_gather"):
      self.assertIsNotNone(messages[name], msg=name)
      self.assertIn(f"{name}() is not supported", messages[name])
      self.assertIn("MultiWorkerAsyncReplicator", messages[name])
    self.assertIn("logical_device() is not supported", messages["logical_device"])
    self.assertIn("per_worker_variable", messages["per_replica_state"])
    self.assertIn("AsyncPush", messages["wrap_optimizer"])
    self.assertIn("all_sum() is not supported", messages["in_step"])

  # -- training -------------------------------------------------------------------

  def test_async_dense_matches_sync(self):
    dense = self.section("dense_async")
    reference = acs.sync_reference(steps=acs.DENSE_STEPS // 2, lr=acs.DENSE_LR)
    print(f"\n[async] sync {reference:.6f}, async dense {dense['loss']:.6f}, "
          f"optimum {acs.optimum_loss():.6f}, {dense['seconds']:.1f}s, "
          f"steps per worker {dense['steps_per_worker']}")
    self.assertLess(abs(dense["loss"] - reference) / reference, TOLERANCE)
    self.assertEqual(sum(dense["steps_per_worker"]), acs.DENSE_STEPS)
    self.assertTrue(all(s > 0 for s in dense["steps_per_worker"]))  # both worked
    self.assertGreater(dense["first_losses"][0], 10.0)  # started far off
    # A dense push sends every entry of W and b: (512 + 8) * 4 bytes.
    self.assertEqual(dense["bytes_per_step"], [520 * 4.0] * 5)

  def test_async_dctdp_matches_sync(self):
    sparse = self.section("dctdp_async")
    reference = acs.sync_reference()
    stats = sparse["stats"]
    print(f"\n[async] sync {reference:.6f}, async DCTDP(0.99) {sparse['loss']:.6f} "
          f"(after drain {sparse['loss_after_drain']:.6f}), {sparse['seconds']:.1f}s, "
          f"refreshes {stats['refreshes']} (early {stats['early_refreshes']}) "
          f"of {2 * acs.ASYNC_STEPS} variable-steps")
    self.assertLess(abs(sparse["loss"] - reference) / reference, TOLERANCE)
    self.assertLess(abs(sparse["loss_after_drain"] - reference) / reference, TOLERANCE)
    self.assertEqual(stats["steps"], acs.ASYNC_STEPS)

  def test_pushed_bytes_are_about_k_entries(self):
    sparse = self.section("dctdp_async")
    # k = n - floor(0.99 n): 512 - 506 = 6 for W, 8 - 7 = 1 for b; the wire
    # holds at most ceil(2 k) per variable (capacity_factor 2).
    k = 6 + 1
    entry = 4 + 4   # float32 value + int32 flat position
    steps, entries, step_bytes = (np.array(sparse[f]) for f in (
        "step_dense_bytes", "step_entries", "step_bytes"))
    self.assertTrue(np.all(steps == 520 * 4))
    self.assertTrue(np.all(step_bytes == entries * entry))   # nothing else is sent
    self.assertTrue(np.all(entries >= 1))
    self.assertTrue(np.all(entries <= 2 * 6 + 2))             # wire capacity
    mean = entries.mean()
    print(f"\n[async] DCTDP(0.99) push: {mean:.2f} entries = {step_bytes.mean():.1f} B "
          f"per step vs dense 2080 B ({2080 / step_bytes.mean():.0f}x less)")
    self.assertBetween(mean, 0.8 * k, 1.5 * k)
    self.assertLess(step_bytes.mean(), 2080 / 20)

  def test_non_finite_gradient_raises_and_pushes_nothing(self):
    record = self.section("non_finite")
    self.assertIsNotNone(record["error"])
    self.assertIn("AsyncPush: non-finite gradient for variable b", record["error"])
    self.assertEqual(record["w_moved"], 0.0)
    self.assertEqual(record["residual_moved"], 0.0)

  def test_conservation(self):
    record = self.section("conservation")
    for label in ("plain", "drain"):
      r = record[label]
      for name in ("w", "b"):
        # w_0 - w_T + lr * sum_workers residual_T = lr * sum_steps g  (w_0 = 0)
        lhs = -np.array(r[name]) + acs.LR * np.array(r[f"residual_{name}"])
        rhs = acs.LR * np.array(r[f"grad_sum_{name}"])
        self.assertAllClose(lhs, rhs, rtol=1e-5, atol=1e-5 * np.abs(rhs).max(),
                            msg=f"{label}/{name}")
      # After drain(): the residuals are in the model.
      drained = -np.array(r["w_drained"])
      self.assertAllClose(drained, acs.LR * np.array(r["grad_sum_w"]), rtol=1e-5,
                          atol=1e-5 * np.abs(drained).max())
      self.assertAllEqual(r["residual_w_drained"], np.zeros_like(r["w"]))
    self.assertEqual(record["plain"]["stats"]["drains"], 0)
    # drain_every=5 over 50 steps: 10 drains expected (binomial, sd 2.8).
    self.assertEqual(acs.CONSERVE_STEPS // acs.DRAIN_EVERY, 10)
    self.assertBetween(record["drain"]["stats"]["drains"], 2, 25)

  def test_tf_keras_fit(self):
    fit = self.section("keras_fit")
    self.assertLen(fit["loss_history"], 2)
    self.assertLess(fit["loss_history"][1], fit["loss_history"][0])
    self.assertLess(fit["loss"], fit["loss_history"][0])

  def test_keras3_fit_is_not_supported_by_keras(self):
    # Keras 3 has no ParameterServerStrategy support (no ClusterCoordinator):
    # its fit calls the strategy outside a scheduled function.
    error = self.section("keras3_fit")["error"]
    self.assertIsNotNone(error)
    self.assertIn("ClusterCoordinator", error)

  # -- faults ---------------------------------------------------------------------

  def test_worker_restart_finishes_and_checkpoint_conserves(self):
    s = self.section("worker_restart", self.fault)
    self.assertIn("killed", self.fault_state, msg=self.fault.failure())
    self.assertTrue(self.fault_state.get("restarted"), msg=self.fault.failure())
    worker1 = [r for r in self.fault.servers if r.task_type == "worker" and r.index == 1][0]
    self.assertEqual(worker1.starts, 2)
    print(f"\n[async fault] killed worker 1 after {self.fault_state['killed']}, "
          f"phase 2 finished {s['phase2_steps_completed']} steps in "
          f"{s['phase2_seconds']:.1f}s, steps per worker {s['steps_per_worker']}")
    # The run went on: chunks scheduled after the kill completed (worker 1
    # was dead or starting), then AFTER_RESTART steps with both workers.
    killed_at = self.fault_state["killed"]["completed"]
    self.assertIsNotNone(s["phase2_steps_before_wait"], msg="no restart seen")
    self.assertGreater(s["phase2_steps_before_wait"], killed_at)
    self.assertEqual(s["phase2_steps_completed"],
                     s["phase2_steps_before_wait"] + acs.AFTER_RESTART)
    # The restarted worker worked. Its step counter is a per-worker variable
    # that restarts from 0 with the process, so it counts only steps after
    # the restart: the steps worker 1 made before the kill (at least its
    # phase-1 steps) are missing from the total (+ 1: a step in flight at the
    # kill runs again on worker 0).
    steps = s["steps_per_worker"]
    self.assertGreater(s["phase1_steps_per_worker"][1], 0)
    self.assertLessEqual(sum(steps), acs.FAULT_STEPS + s["phase2_steps_completed"]
                         + 1 - s["phase1_steps_per_worker"][1])
    self.assertGreater(steps[1], 0)
    # Restart from the last checkpoint: model as saved, residuals zero, and
    # no gradient mass lost over phase 1 + phase 3.
    self.assertTrue(s["restored_equals_saved"])
    self.assertEqual(s["residual_after_restore"], 0.0)
    for name in ("w", "b"):
      lhs = -np.array(s[name]) + acs.LR * np.array(s[f"residual_{name}"])
      rhs = acs.LR * np.array(s[f"grad_sum_{name}"])
      self.assertAllClose(lhs, rhs, rtol=1e-5, atol=1e-5 * np.abs(rhs).max(), msg=name)


class AsyncValidationTest(tf.test.TestCase):
  """Errors raised before any cluster is contacted."""

  CLUSTER = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]}

  def config(self, cluster=None, task_type="chief"):
    return json.dumps({"cluster": cluster or self.CLUSTER,
                       "task": {"type": task_type, "index": 0}})

  def test_tf_config(self):
    self.assertEqual(validate_ps_tf_config(self.config())["task"]["type"], "chief")
    with mock.patch.dict(os.environ, {}, clear=False):
      os.environ.pop("TF_CONFIG", None)
      with self.assertRaisesRegex(ValueError, "launch.ps_cluster"):
        validate_ps_tf_config()
      with self.assertRaisesRegex(ValueError, "needs TF_CONFIG"):
        AsyncReplicator()
    no_ps = {"chief": ["h:1"], "worker": ["h:2"]}
    self.assertRaisesRegex(ValueError, 'must list "ps"', validate_ps_tf_config,
                           self.config(no_ps))
    two_chiefs = dict(self.CLUSTER, chief=["h:1", "h:5"])
    self.assertRaisesRegex(ValueError, "exactly one", validate_ps_tf_config,
                           self.config(two_chiefs))
    self.assertRaisesRegex(ValueError, "chief \\(coordinator\\) process only",
                           validate_ps_tf_config, self.config(task_type="worker"))
    self.assertRaisesRegex(ValueError, "not valid JSON", validate_ps_tf_config, "{")

  def test_constructor_and_push_arguments(self):
    with self.assertRaisesRegex(NotImplementedError, "PER_WORKER only"):
      AsyncReplicator(input_replication=tf_dct.PER_REPLICA)
    with self.assertRaisesRegex(TypeError, "AsyncReplicator"):
      AsyncPush(object(), None)
    with self.assertRaisesRegex(ValueError, r"momentum correction \(momentum="
                                r"0.9\) is not available here"):
      AsyncPush(object(), DCTDP(momentum=0.9))
    with self.assertRaisesRegex(ValueError, r"Adam correction \(adam=True\) "
                                r"is not available here"):
      AsyncPush(object(), DCTDP(adam=True))
    with self.assertRaisesRegex(ValueError, r"Adagrad correction \(adagrad="
                                r"True\) is not available here"):
      AsyncPush(object(), DCTDP(adagrad=True))
    with self.assertRaisesRegex(ValueError, r"AsyncPush: workers push on "
                                r"their own clocks, so a sparsity_schedule"):
      AsyncPush(object(), DCTDP(sparsity_schedule=[(5, 0.9)]))


def run_tail(run) -> str:
  return "\n" + run.failure(20)


if __name__ == "__main__":
  tf.test.main()
