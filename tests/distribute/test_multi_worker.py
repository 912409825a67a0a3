"""MultiWorkerReplicator over 2 local worker processes (1 CPU replica each).

`MultiWorkerTest.setUpClass` launches `multi_worker_script.py` once as two
TF_CONFIG workers (bounded by WORKER_TIMEOUT seconds); every test method then
checks one section of what the workers recorded against numpy references.
A failed run fails each test with the workers' stderr tails.

`TfConfigValidationTest`, `SectionsTest` and `RunWorkersTest` need no
TensorFlow cluster.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import textwrap
import time
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import multi_worker_script as mws  # pylint: disable=g-import-not-at-top,wrong-import-position
import multi_worker_util  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_dct  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct import compression  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.compression import sparse_wire  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests import conservation  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.distribute.multi_worker import validate_tf_config  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_WORKERS = mws.NUM_WORKERS
NUM_REPLICAS = NUM_WORKERS          # one CPU replica per worker
WORKER_TIMEOUT = 240.0
SCRIPT = pathlib.Path(mws.__file__).resolve()


def f32(x):
  return np.asarray(x, np.float32)


@pytest.mark.slow(seconds=45)  # one 2-worker run of every section
class MultiWorkerTest(tf.test.TestCase):
  """Asserts on one 2-worker run of multi_worker_script.py."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.mkdtemp(prefix="tf_dct_test_mw_")
    start = time.monotonic()
    cls._results = multi_worker_util.run_workers(
        SCRIPT, num_workers=NUM_WORKERS, timeout=WORKER_TIMEOUT,
        result_dir=cls._tmp)
    cls._wall = time.monotonic() - start
    print(f"\n2-worker run took {cls._wall:.1f} s", file=sys.stderr)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls._tmp, ignore_errors=True)
    super().tearDownClass()

  # -- access to the recorded results -----------------------------------------------

  def workers(self) -> list[dict]:
    """Every worker's JSON; fails with the workers' output tails if the run did."""
    try:
      multi_worker_util.check_success(self._results)
    except multi_worker_util.WorkersFailed as e:
      self.fail(str(e))
    data = [r.result for r in self._results]
    not_done = [i for i, d in enumerate(data) if not d.get("done")]
    if not_done:
      self.fail(f"workers {not_done} did not finish:\n"
                f"{multi_worker_util.format_failure(self._results)}")
    return data

  def section(self, name: str) -> list:
    """Section `name` of every worker, in worker order (fails on its error)."""
    data = self.workers()
    errors = {i: d["errors"][name] for i, d in enumerate(data)
              if name in d["errors"]}
    if errors:
      self.fail(f"section {name!r} raised on worker(s) {sorted(errors)}:\n" +
                "\n".join(f"--- worker {i}:\n{tb}" for i, tb in errors.items()))
    return [d["sections"][name] for d in data]

  def replicas(self, per_worker: list) -> list:
    """Merges per-worker lists of local replica records, indexed by replica id."""
    records = [rec for worker in per_worker for rec in worker]
    ids = sorted(rec["replica_id"] for rec in records)
    self.assertEqual(ids, list(range(NUM_REPLICAS)))
    return sorted(records, key=lambda rec: rec["replica_id"])

  def assertSameOnEveryReplica(self, records, key, expected):
    for rec in records:
      self.assertAllEqual(f32(rec[key]), expected,
                          msg=f"{key} on replica {rec['replica_id']}")

  # -- the run -------------------------------------------------------------------------

  def test_every_worker_finished_without_errors(self):
    data = self.workers()
    self.assertEqual([d["task_index"] for d in data], list(range(NUM_WORKERS)))
    for i, d in enumerate(data):
      self.assertEqual(d["errors"], {}, msg=f"worker {i}: {d['errors']}")
    self.assertLess(self._wall, WORKER_TIMEOUT)

  def test_topology(self):
    meta = self.section("meta")
    for i, m in enumerate(meta):
      self.assertTrue(m["is_mwms"])
      self.assertEqual(m["num_replicas"], NUM_REPLICAS)
      self.assertEqual(m["num_replicas_in_sync"], NUM_REPLICAS)
      self.assertEqual(m["worker_index"], i)
      self.assertEqual(m["first_local_replica_id"], i)
      self.assertEqual(m["is_chief"], i == 0)
      self.assertEqual(m["replica_devices"],
                       [f"/job:worker/replica:0/task:{i}/device:CPU:0"])

  # -- input -----------------------------------------------------------------------------

  def test_per_worker_input(self):
    sections = self.section("per_worker_input")
    for i, s in enumerate(sections):
      self.assertEqual(s["contexts"], [{"num_input_pipelines": NUM_WORKERS,
                                        "input_pipeline_id": i,
                                        "num_replicas_in_sync": NUM_REPLICAS}])
    for step in range(mws.STEPS):
      records = self.replicas([s["steps"][step] for s in sections])
      for r, rec in enumerate(records):
        # One local replica: the replica gets its worker's whole batch.
        self.assertAllEqual(f32(rec["x"]), mws.per_worker_batch(r, step))

  def test_per_replica_input(self):
    sections = self.section("per_replica_input")
    for i, s in enumerate(sections):
      self.assertEqual(s["input_fn_ids"], [i])   # global replica id
      self.assertEqual(s["first_local_replica_id"], i)
    for step in range(mws.STEPS):
      records = self.replicas([s["steps"][step] for s in sections])
      elements = [mws.per_replica_element(r, step) for r in range(NUM_REPLICAS)]
      for r, rec in enumerate(records):
        self.assertAllEqual(f32(rec["x"]), elements[r])
        self.assertAllEqual(f32(rec["sum"]), np.sum(elements, axis=0))

  # -- primitives ------------------------------------------------------------------------

  def test_all_reduce_and_all_sum(self):
    records = self.replicas(self.section("reduce"))
    xs = np.stack([mws.replica_value(r) for r in range(NUM_REPLICAS)])
    total = xs.sum(axis=0)
    expected = {"sum": total, "reduce_op_sum": total, "all_sum": total,
                "mean": xs.mean(axis=0), "max": xs.max(axis=0),
                "min": xs.min(axis=0)}
    for key, value in expected.items():
      self.assertSameOnEveryReplica(records, key, value)
    for rec in records:
      nested = rec["all_sum_nested"]
      self.assertAllEqual(f32(nested["a"]), total)
      self.assertAllEqual(f32(nested["b"][0]), 2 * total)
      self.assertAllEqual(f32(nested["b"][1]), total[:2])
      self.assertAllEqual(f32(rec["max_nested"][0]), xs.max(axis=0))
      self.assertAllEqual(f32(rec["max_nested"][1]), (-xs).max(axis=0))

  def test_all_gather(self):
    records = self.replicas(self.section("gather"))
    ms = [mws.replica_matrix(r) for r in range(NUM_REPLICAS)]
    vs = [mws.replica_value(r) for r in range(NUM_REPLICAS)]
    self.assertSameOnEveryReplica(records, "axis0", np.concatenate(ms, axis=0))
    self.assertSameOnEveryReplica(records, "axis1", np.concatenate(ms, axis=1))
    self.assertSameOnEveryReplica(records, "axis_neg1", np.concatenate(ms, axis=1))
    self.assertSameOnEveryReplica(records, "vector", np.concatenate(vs))
    for rec in records:
      self.assertAllEqual(f32(rec["nested"]["m"]), np.concatenate(ms, axis=0))
      self.assertAllEqual(f32(rec["nested"]["v"]), np.concatenate(vs))

  def test_all_gather_unequal_sizes(self):
    # Works on MWMS: the collective pads to the largest size and unpads.
    records = self.replicas(self.section("gather_unequal"))
    rows = [mws.replica_rows(r) for r in range(NUM_REPLICAS)]
    self.assertEqual([len(r) for r in rows], [1, 2])
    self.assertSameOnEveryReplica(records, "axis0", np.concatenate(rows, axis=0))

  def test_sparse_wire_sends_exact_sizes_across_workers(self):
    records = self.replicas(self.section("sparse_wire_default"))
    expected = np.zeros(mws.WIRE_N, np.float32)
    for r in range(NUM_REPLICAS):
      idx, val = mws.wire_buffer(r)
      np.add.at(expected, idx[idx < mws.WIRE_N], val[idx < mws.WIRE_N])
    self.assertSameOnEveryReplica(records, "sum", expected)
    # Exact sizes: every replica's used index words and values, padded to
    # the longest, after a header (length, count) and TF's length word.
    enc = sparse_wire.make_encoding("auto", mws.WIRE_N, mws.WIRE_CAPACITY)
    longest = max(sparse_wire.sent_index_words(enc, u) + u for u in mws.WIRE_USED)
    for rec in records:
      self.assertEqual(float(rec["sent"]), 4 * (longest + 2) + 4)
      self.assertLess(float(rec["sent"]), sparse_wire.wire_bytes(
          mws.WIRE_N, mws.WIRE_CAPACITY, tf.float32))

  def test_broadcast(self):
    records = self.replicas(self.section("broadcast"))
    self.assertSameOnEveryReplica(records, "float_from_1", mws.replica_value(1))
    self.assertSameOnEveryReplica(records, "float_from_0", mws.replica_value(0))
    for rec in records:
      self.assertAllEqual(np.asarray(rec["int_from_1"], np.int32), mws.replica_int(1))
      self.assertEqual(rec["bool_from_1"], mws.replica_bool(1).tolist())
      self.assertAllEqual(f32(rec["nested_from_1"]["x"]), mws.replica_value(1))
      self.assertAllEqual(f32(rec["nested_from_1"]["m"]), mws.replica_matrix(1))

  def test_map_reduce_and_map_gather(self):
    records = self.replicas(self.section("map"))
    xs = np.stack([mws.replica_value(r) for r in range(NUM_REPLICAS)])
    self.assertSameOnEveryReplica(records, "map_reduce_sum_square",
                                  np.square(xs).sum(axis=0))
    self.assertSameOnEveryReplica(records, "map_reduce_max_abs",
                                  np.abs(xs).max(axis=0))
    self.assertSameOnEveryReplica(records, "map_reduce_mean_cumsum",
                                  np.cumsum(xs, axis=1).mean(axis=0))
    self.assertSameOnEveryReplica(records, "map_reduce_min_sum",
                                  xs.sum(axis=1).min())
    self.assertSameOnEveryReplica(records, "map_gather_sum", xs.sum(axis=1))
    self.assertSameOnEveryReplica(records, "map_gather_double", 2 * xs)

  # -- optimizers ------------------------------------------------------------------------

  @staticmethod
  def numpy_sgd(mse: bool):
    """Full-global-batch SGD in float64; mse=True also averages over outputs."""
    kernel, bias = (w.astype(np.float64) for w in mws.initial_weights())
    losses = []
    for step in range(mws.TRAIN_STEPS):
      x, y = (a.astype(np.float64) for a in mws.train_batch(step))
      err = x @ kernel + bias - y
      scale = mws.GLOBAL_BATCH * (y.shape[1] if mse else 1)
      losses.append([float(np.sum(np.square(err[rows])) / scale) for rows in
                     np.split(np.arange(mws.GLOBAL_BATCH), NUM_WORKERS)])
      kernel = kernel - mws.LR * 2 * x.T @ err / scale
      bias = bias - mws.LR * 2 * err.sum(axis=0) / scale
    return kernel, bias, np.array(losses)

  def check_custom_loop(self, section_name: str):
    sections = self.section(section_name)
    kernel, bias, losses = self.numpy_sgd(mse=False)
    for i, s in enumerate(sections):
      hook = s["hook"]
      self.assertTrue(hook["is_wrapped"])
      self.assertEqual(hook["compressor"], "Dense")
      self.assertNotEmpty(hook["calls"], msg="the wrapped hook never ran")
      self.assertEqual(set(hook["calls"]), {2}, msg="one call per (kernel, bias)")
      # Dense SUM aggregation is exactly the built-in aggregation.
      self.assertAllEqual(f32(s["wrapped"]["kernel"]), f32(s["plain"]["kernel"]))
      self.assertAllEqual(f32(s["wrapped"]["bias"]), f32(s["plain"]["bias"]))
      self.assertAllEqual(s["wrapped"]["losses"], s["plain"]["losses"])
      # ... and is synchronous full-global-batch SGD.
      self.assertAllClose(s["wrapped"]["kernel"], kernel, rtol=1e-5, atol=1e-6)
      self.assertAllClose(s["wrapped"]["bias"], bias, rtol=1e-5, atol=1e-6)
      self.assertAllClose(np.array(s["wrapped"]["losses"])[:, 0], losses[:, i],
                          rtol=1e-5, atol=1e-6)
    # Both workers hold the same weights.
    self.assertAllEqual(sections[0]["wrapped"]["kernel"],
                        sections[1]["wrapped"]["kernel"])
    self.assertAllEqual(sections[0]["wrapped"]["bias"],
                        sections[1]["wrapped"]["bias"])

  def test_tf_keras_custom_loop_wrapped_equals_plain(self):
    self.check_custom_loop("tf_keras_custom_loop")
    for s in self.section("tf_keras_custom_loop"):
      # The wrapped class keeps the base's name (serialization round-trips).
      self.assertEqual(s["wrapped_class"], "SGD")

  def test_every_compressor_conserves_mass_across_a_checkpoint(self):
    # CONSERVATION_STEPS steps of SGD(lr=1) on the 2 worker processes,
    # checkpoint + scramble + restore half-way: applied + what both workers
    # hold == all gradients.
    sections = self.section("conservation")
    self.assertLen(sections, 2)
    names = list(mws.conservation_compressors(compression))
    for name in names:
      runs = [s[name] for s in sections]
      for run in runs:
        self.assertTrue(run["scrambled"], msg=name)
        self.assertTrue(run["restored"], msg=f"{name}: state not restored exactly")
      for i in range(len(runs[0]["w"])):
        # Both workers applied the same aggregated updates.
        self.assertAllEqual(runs[0]["w"][i], runs[1]["w"][i], msg=name)
        conservation.assert_conserved(
            self, runs[0]["w0"][i], runs[0]["w"][i],
            [r for run in runs for r in run["residual"][i]],
            [g for run in runs for g in run["seen"][i]], f"{name} w{i}")
        if runs[0]["steps"][i] is not None:
          self.assertEqual(runs[0]["steps"][i], [mws.CONSERVATION_STEPS])
      if name != "Dense":  # something was held back
        held = np.concatenate([np.ravel(r) for run in runs for r in run["residual"][0]])
        self.assertGreater(np.abs(held).max(), 0.0, msg=name)

  def test_keras3_custom_loop_wrapped_equals_plain(self):
    self.check_custom_loop("keras3_custom_loop")

  def test_tf_keras_fit_wrapped_equals_plain(self):
    sections = self.section("tf_keras_fit")
    kernel, bias, losses = self.numpy_sgd(mse=True)
    for s in sections:
      self.assertNotEmpty(s["hook"]["calls"], msg="fit never used the hook")
      for kind in ("wrapped", "plain"):
        self.assertEqual(s[kind]["iterations"], mws.TRAIN_STEPS)
      self.assertAllEqual(f32(s["wrapped"]["kernel"]), f32(s["plain"]["kernel"]))
      self.assertAllEqual(f32(s["wrapped"]["bias"]), f32(s["plain"]["bias"]))
      self.assertAllEqual(s["wrapped"]["loss"], s["plain"]["loss"])
      self.assertAllClose(s["wrapped"]["kernel"], kernel, rtol=1e-5, atol=1e-6)
      self.assertAllClose(s["wrapped"]["bias"], bias, rtol=1e-5, atol=1e-6)
      self.assertAllClose(s["wrapped"]["loss"], [losses.sum(axis=1).mean()],
                          rtol=1e-5, atol=1e-6)
    self.assertAllEqual(sections[0]["wrapped"]["kernel"],
                        sections[1]["wrapped"]["kernel"])

  # -- per-replica state -----------------------------------------------------------------

  def test_per_replica_state_round_trips_per_replica(self):
    sections = self.section("per_replica_state")
    for r, s in enumerate(sections):   # worker r holds replica r
      initial = np.full(mws.STATE_SHAPE, r + 1.0, np.float32)
      after = initial * np.float32(10) + mws.state_input(r)
      self.assertAllEqual(f32(s["initial"]), [initial])
      self.assertEqual(len(s["step"]), 1)
      self.assertEqual(s["step"][0]["replica_id"], r)
      self.assertAllEqual(f32(s["step"][0]["value"]), after)
      self.assertAllEqual(f32(s["after_step"]), [after])
      self.assertAllEqual(f32(s["overwritten"]), [np.full(mws.STATE_SHAPE, -7.0)])
      # Exactly this replica's value comes back, not an average of replicas.
      self.assertAllEqual(f32(s["restored"]), [after])
      self.assertAllEqual(f32(s["step_after_restore"][0]["value"]),
                          after * np.float32(10) + mws.state_input(r))
      self.assertTrue(s["checkpoint_in_own_dir"])
      state_keys = [k for k in s["checkpoint_keys"] if k.startswith("st/")]
      self.assertEqual(state_keys,
                       [f"st/_values/replica_{r}/.ATTRIBUTES/VARIABLE_VALUE"])
    self.assertNotAllEqual(sections[0]["restored"], sections[1]["restored"])

  # -- workers set up differently ---------------------------------------------------

  def test_mismatched_replicator_and_compressor_settings_fail_fast(self):
    # A hang would hit the run's timeout (and fail every test); the check
    # itself takes seconds.
    for out in self.section("mixed_config"):
      self.assertRegex(out["replicator"],
                       r"workers disagree on replicator settings \(jit_compile\)")
      self.assertIn("worker 0: jit_compile=False; worker 1: jit_compile=True",
                    out["replicator"])
      self.assertRegex(out["wrap"], r"disagree on wrap_optimizer_1 settings "
                       r"\(sparsity\).*worker 0: sparsity=0.9; worker 1: sparsity=0.99")
      self.assertTrue(out["left_unwrapped"])
      self.assertTrue(out["same_wrapped"])


class TfConfigValidationTest(tf.test.TestCase):
  """`validate_tf_config` errors; no cluster is started."""

  CLUSTER = {"worker": ["localhost:12345", "localhost:23456"]}

  def config(self, **overrides):
    config = {"cluster": self.CLUSTER, "task": {"type": "worker", "index": 0}}
    config.update(overrides)
    return json.dumps(config)

  def assertTfConfigError(self, raw, *fragments):
    with self.assertRaises(ValueError) as cm:
      validate_tf_config(raw)
    message = str(cm.exception)
    self.assertIn("TF_CONFIG", message)
    for fragment in fragments:
      self.assertIn(fragment, message)

  def test_valid_config(self):
    raw = self.config(task={"type": "worker", "index": 1})
    self.assertEqual(validate_tf_config(raw)["task"], {"type": "worker", "index": 1})
    chief = json.dumps({"cluster": {"chief": ["h:1"], "worker": ["h:2"]},
                        "task": {"type": "chief", "index": 0}})
    self.assertEqual(validate_tf_config(chief)["task"]["type"], "chief")
    # A side-car evaluator need not be listed in the cluster (TF allows it).
    evaluator = json.dumps({"cluster": {"worker": ["h:1", "h:2"]},
                            "task": {"type": "evaluator", "index": 0}})
    self.assertEqual(validate_tf_config(evaluator)["task"]["type"], "evaluator")
    self.assertRaisesRegex(ValueError, r"index.*must be an int in \[0, 1\), got 1",
                           validate_tf_config, evaluator.replace('"index": 0', '"index": 1'))

  def test_unset_or_empty_is_none(self):
    with mock.patch.dict(os.environ, {}, clear=False):
      os.environ.pop("TF_CONFIG", None)
      self.assertIsNone(validate_tf_config())
    self.assertIsNone(validate_tf_config(""))

  def test_reads_environment(self):
    with mock.patch.dict(os.environ, {"TF_CONFIG": "{oops"}):
      self.assertRaisesRegex(ValueError, "TF_CONFIG is not valid JSON",
                             validate_tf_config)

  def test_malformed_json(self):
    self.assertTfConfigError("{not json", "not valid JSON")
    self.assertTfConfigError('{"cluster": {"worker": ["h:1"]}', "not valid JSON")

  def test_not_an_object_or_missing_cluster(self):
    for raw in ("[1, 2]", "null", "3",
                json.dumps({"task": {"type": "worker", "index": 0}}),
                json.dumps({"cluster": ["h:1"], "task": {"type": "worker", "index": 0}})):
      self.assertTfConfigError(raw, '"cluster"')

  def test_cluster_without_workers(self):
    self.assertTfConfigError(json.dumps({"cluster": {}}), '"worker"')
    self.assertTfConfigError(json.dumps({"cluster": {"worker": []}}), '"worker"')

  def test_bad_addresses(self):
    self.assertTfConfigError(
        self.config(cluster={"worker": "localhost:1"}), '["worker"]', "host:port")
    self.assertTfConfigError(
        self.config(cluster={"worker": ["localhost"]}), '["worker"]', "host:port")
    self.assertTfConfigError(
        self.config(cluster={"worker": [1234]}), '["worker"]', "host:port")

  def test_duplicate_addresses(self):
    self.assertTfConfigError(
        self.config(cluster={"worker": ["localhost:1", "localhost:1"]}),
        '"localhost:1" twice (worker 0 and worker 1)', "an address of its own")
    self.assertTfConfigError(
        self.config(cluster={"chief": ["h:1"], "worker": ["h:2", "h:1"]}),
        '"h:1" twice (chief 0 and worker 1)')

  def test_missing_task(self):
    raw = json.dumps({"cluster": self.CLUSTER})
    self.assertTfConfigError(raw, '"task"')
    self.assertTfConfigError(self.config(task="worker"), '"task"')

  def test_bad_task_type(self):
    self.assertTfConfigError(self.config(task={"type": "ps", "index": 0}),
                             '["task"]["type"]', "'ps'")
    self.assertTfConfigError(self.config(task={"index": 0}), '["task"]["type"]')

  def test_bad_task_index(self):
    for index in (2, -1, "0", 0.0, True, None):
      with self.subTest(index=index):
        self.assertTfConfigError(
            self.config(task={"type": "worker", "index": index}),
            '["task"]["index"]', "[0, 2)")
    self.assertTfConfigError(self.config(task={"type": "worker"}),
                             '["task"]["index"]')

  def test_replicator_validates_before_starting(self):
    # The error comes before any strategy (or gRPC server) is created.
    with mock.patch.dict(os.environ, {"TF_CONFIG": self.config(
        task={"type": "worker", "index": 7})}):
      with self.assertRaisesRegex(ValueError, r'TF_CONFIG\["task"\]\["index"\]'):
        tf_dct.MultiWorkerReplicator()
    with self.assertRaisesRegex(NotImplementedError, "num_devices_per_replica=1"):
      tf_dct.MultiWorkerReplicator(num_devices_per_replica=2)


class SectionsTest(tf.test.TestCase):
  """The `@section(name)` decorator the worker scripts share."""

  def test_results_errors_filters_and_flushes(self):
    out = {"sections": {}, "errors": {}, "timings": {}}
    flushes = []
    with mock.patch.dict(os.environ, {"ONLY_SECTIONS": "ok,fails,excluded"}):
      section = multi_worker_util.sections(
          out, lambda: flushes.append(sorted(out["timings"])),
          include=lambda name: name != "excluded")
    ran = []
    for name, value in (("ok", lambda: ran.append("ok") or np.float32(2.5)),
                        ("fails", lambda: ran.append("fails") or 1 / 0),
                        ("excluded", lambda: ran.append("excluded")),
                        ("not_chosen", lambda: ran.append("not_chosen"))):
      self.assertIs(section(name)(value), value)
    self.assertEqual(ran, ["ok", "fails"])
    self.assertEqual(out["sections"], {"ok": 2.5})
    self.assertEqual(list(out["errors"]), ["fails"])
    self.assertIn("ZeroDivisionError", out["errors"]["fails"])
    self.assertEqual(flushes, [["ok"], ["fails", "ok"]])
    for wall, cpu in out["timings"].values():
      self.assertGreaterEqual(wall, 0.0)
      self.assertGreaterEqual(cpu, 0.0)


class RunWorkersTest(tf.test.TestCase):
  """The process helper itself, with tiny scripts (no TensorFlow)."""

  def write_script(self, body: str) -> pathlib.Path:
    path = pathlib.Path(self.get_temp_dir()) / f"script_{self.id().split('.')[-1]}.py"
    path.write_text(textwrap.dedent("""\
        import json, os, subprocess, sys, time
        import multi_worker_util as u
        args = u.parse_worker_args()
        """) + textwrap.dedent(body))
    return path

  def test_environment_and_results(self):
    script = self.write_script("""\
        import importlib.util
        u.write_result(args.result_dir, {
            "tf_config": json.loads(os.environ["TF_CONFIG"]),
            "tf_dct": importlib.util.find_spec("tf_dct").origin,
            "log_level": os.environ["TF_CPP_MIN_LOG_LEVEL"],
            "cuda": os.environ["CUDA_VISIBLE_DEVICES"],
            "extra": os.environ["EXTRA"], "argv": sys.argv[1:]})
        print("hello from", u.task_index())
        """)
    # The user's PYTHONPATH is kept after the repo root.
    env = {"EXTRA": "x", "PYTHONPATH": str(multi_worker_util.TESTS_DIR)}
    results = multi_worker_util.run_workers(
        script, num_workers=3, env=env, timeout=60)
    multi_worker_util.check_success(results)
    workers = results[0].result["tf_config"]["cluster"]["worker"]
    self.assertLen(set(workers), 3)
    for i, r in enumerate(results):
      self.assertEqual(r.stdout.strip(), f"hello from {i}")
      self.assertEqual(r.result["tf_config"]["task"], {"type": "worker", "index": i})
      self.assertEqual(r.result["tf_config"]["cluster"]["worker"], workers)
      # The repo root is on PYTHONPATH (without importing TensorFlow here).
      self.assertEqual(r.result["tf_dct"], tf_dct.__file__)
      self.assertEqual(r.result["log_level"], "2")
      self.assertEqual(r.result["cuda"], "")
      self.assertEqual(r.result["extra"], "x")
      self.assertEqual(r.result["argv"][0], "--result_dir")

  def test_timeout_kills_the_process_group(self):
    pid_dir = pathlib.Path(self.get_temp_dir()) / "pids"
    pid_dir.mkdir()
    script = self.write_script(f"""\
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.path.join({str(pid_dir)!r}, str(child.pid)), "w").close()
        time.sleep(600)
        """)
    env = {"PYTHONPATH": str(multi_worker_util.TESTS_DIR)}
    start = time.monotonic()
    results = multi_worker_util.run_workers(script, num_workers=2, env=env,
                                            timeout=5)
    self.assertLess(time.monotonic() - start, 30)
    self.assertTrue(all(r.timed_out and not r.ok for r in results))
    with self.assertRaisesRegex(multi_worker_util.WorkersFailed, "timed out"):
      multi_worker_util.check_success(results)
    pids = [int(p.name) for p in pid_dir.iterdir()]
    self.assertLen(pids, 2)
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.1)
    for pid in pids:   # the grandchildren are gone too (or zombies)
      self.assertFalse(_alive(pid), msg=f"grandchild {pid} survived")

  def test_a_failed_worker_ends_the_run(self):
    script = self.write_script("""\
        if u.task_index() == 1:
          sys.exit("worker 1 gives up")
        time.sleep(600)   # e.g. stuck in a collective with worker 1
        """)
    env = {"PYTHONPATH": str(multi_worker_util.TESTS_DIR)}
    start = time.monotonic()
    results = multi_worker_util.run_workers(script, num_workers=2, env=env,
                                            timeout=120, fail_fast_grace=1)
    self.assertLess(time.monotonic() - start, 60)
    self.assertTrue(results[0].killed)
    self.assertEqual(results[1].returncode, 1)
    self.assertIn("worker 1 gives up", multi_worker_util.format_failure(results))

  def test_port_clash_is_retried_with_fresh_ports(self):
    marker = pathlib.Path(self.get_temp_dir()) / "first_attempt_done"
    script = self.write_script(f"""\
        marker = {str(marker)!r}
        if u.task_index() == 0 and not os.path.exists(marker):
          open(marker, "w").close()
          sys.exit("E0000 grpc_server_lib.cc] Could not start gRPC server")
        u.write_result(args.result_dir, {{"cluster": os.environ["TF_CONFIG"]}})
        """)
    env = {"PYTHONPATH": str(multi_worker_util.TESTS_DIR)}
    results = multi_worker_util.run_workers(script, num_workers=2, env=env,
                                            timeout=60, fail_fast_grace=1)
    multi_worker_util.check_success(results)
    self.assertTrue(marker.exists())


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


if __name__ == "__main__":
  tf.test.main()
