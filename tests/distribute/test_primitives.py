"""Tests for tf_dct.distribute.primitives against numpy references, on every
replicator kind of `replicator_test_utils.named_replicators`."""

import re

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct.distribute import primitives
from tests import util
from tests.distribute import replicator_test_utils

N = 4


def setUpModule():
  util.setup_cpus()


def _values(r):
  """Replica r's value: a nested structure with distinct numbers per replica."""
  a = np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) - 3 * r
  return {"a": a, "b": (np.array([r, -r, 2 * r], np.int32),)}


def _global_batch(n):
  """The PER_WORKER element whose split along axis 0 gives replica r `_values(r)`."""
  vals = [_values(r) for r in range(n)]
  return {"a": np.concatenate([v["a"] for v in vals]),
          "b": (np.concatenate([v["b"][0] for v in vals]),)}


def _expected(n):
  """What `_primitives_step` returns on every replica of n, from numpy."""
  vals = [_values(r) for r in range(n)]
  a = np.stack([v["a"] for v in vals])
  b = np.stack([v["b"][0] for v in vals])
  squares = np.sum(a ** 2, axis=2)  # map_reduce's fn, per replica
  return {
      "all_reduce_sum": a.sum(0), "all_reduce_mean": a.mean(0),
      "all_reduce_max": a.max(0), "all_reduce_min": a.min(0),
      "all_reduce_int_max": b.max(0),
      "all_sum": {"a": a.sum(0), "b": (b.sum(0),)},
      "all_gather_0": np.concatenate(list(a), axis=0),
      "all_gather_1": np.concatenate(list(a), axis=1),
      "all_gather_-1": np.concatenate(list(a), axis=-1),
      "all_gather_unequal": np.concatenate(
          [np.full([r + 1, 2], float(r), np.float32) for r in range(n)]),
      "broadcast_first": vals[0], "broadcast_last": vals[n - 1],
      "broadcast_bool": vals[n - 1]["a"] > 2.0,
      "map_reduce_sum": squares.sum(0), "map_reduce_max": squares.max(0),
      "map_gather": (a.max(axis=(1, 2)), b[:, :2]),
      "grad_all_sum": np.full([2, 3], float(n), np.float32),
  }


def _primitives_step(repl, n):
  """A step function calling every primitive once per variant."""

  def step_fn(v):
    r = repl.local_replica_index()
    x = v["a"]
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      total = tf.reduce_sum(repl.all_sum(x))
      from_last = tf.reduce_sum(repl.broadcast(x, n - 1))
    out = {f"all_reduce_{op}": repl.all_reduce({"a": x}, op)["a"]
           for op in ("sum", "mean", "max", "min")}
    out.update({f"all_gather_{axis}": repl.all_gather(x, axis=axis)
                for axis in (0, 1, -1)})
    squares = lambda t: tf.reduce_sum(t["a"] ** 2, axis=1)
    out.update({
        "all_reduce_int_max": repl.all_reduce(v["b"][0], "max"),
        "all_sum": repl.all_sum(v),
        # Replica r contributes r + 1 rows.
        "all_gather_unequal": repl.all_gather(tf.fill([r + 1, 2], float(r))),
        "broadcast_first": repl.broadcast(v, 0),
        "broadcast_last": repl.broadcast(v, n - 1),
        "broadcast_bool": repl.broadcast(x > 2.0, n - 1),
        "map_reduce_sum": repl.map_reduce(squares, v, "sum"),
        "map_reduce_max": repl.map_reduce(squares, v, "max"),
        "map_gather": repl.map_gather(
            lambda t: (tf.reduce_max(t["a"]), t["b"][0][:2]), v),
        # all_sum's gradient is the all_sum of the upstream ones; every
        # replica's use of broadcast(x, n - 1) flows back to replica n - 1.
        "grad_all_sum": tape.gradient(total, x),
        "grad_broadcast": tape.gradient(from_last, x),
    })
    return out

  return step_fn


class PrimitivesTest(parameterized.TestCase, tf.test.TestCase):
  """Every primitive against numpy on every replicator kind, through
  `run(step_fn, input_fn)` (XLA-compiled for the "xla" kind)."""

  # Not "two_by_two": the primitives do not depend on the devices of a
  # replica, and that layout runs all_sum in
  # test_replicator.PaperExamplesTest (batch norm, data and model parallel).
  @parameterized.named_parameters(*replicator_test_utils.named_replicators(
      "one_device", "four_devices", "xla", "multi_worker_local"))
  def test_every_primitive_matches_numpy(self, make_replicator):
    repl = make_replicator()
    n = repl.num_replicas_in_sync
    step_fn = _primitives_step(repl, n)
    input_fn = lambda ctx: tf.data.Dataset.from_tensors(_global_batch(n))
    got = util.local(repl, repl.run(step_fn, input_fn))
    if repl.jit_compile:
      # jit_compile=True makes any op XLA cannot compile an error, so running
      # the step proves it; check the step really is an XLA function too.
      step = repl._steps[(step_fn, input_fn)]  # pylint: disable=protected-access
      self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access
    self.assertLen(got, n)
    want = _expected(n)
    for r, out in enumerate(got):
      for key, value in want.items():
        compare = (self.assertAllClose if key == "all_reduce_mean"
                   else self.assertAllEqual)
        tf.nest.map_structure(lambda g, w, k=key, c=compare: c(g, w, msg=k),
                              out[key], value)
      self.assertAllEqual(out["grad_broadcast"], np.full(
          [2, 3], float(n) if r == n - 1 else 0.0), msg="grad_broadcast")


class FourReplicasTest(tf.test.TestCase, parameterized.TestCase):
  """What needs several replicas of one process: Keras 3 variables, errors,
  replicas that disagree."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.repl = tf_dct.Replicator()

  def _run(self, fn):
    repl = self.repl
    inputs = repl.experimental_distribute_values_from_function(
        lambda ctx: tf.nest.map_structure(tf.constant, _values(ctx.replica_id_in_sync_group)))
    return util.local(repl, tf.function(lambda v: repl.run(fn, args=(v,)))(inputs))

  def _all_equal(self, results, want):
    self.assertLen(results, N)
    for got in results:
      tf.nest.map_structure(self.assertAllEqual, got, want)

  def test_a_keras3_variable_as_its_tf_variable(self):
    # Eagerly too: TF's own eager all_gather returns a Keras 3 variable as it
    # is. Two replicas: each eager call runs every replica's collectives.
    repl = tf_dct.Replicator(util.setup_cpus()[:2])
    n = repl.num_replicas_in_sync
    with repl.scope():
      v = keras.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="v")
    calls = {
        "all_reduce": lambda x: repl.all_reduce(x, "max"),
        "all_sum": repl.all_sum,
        "all_gather": repl.all_gather,
        "all_gather(axis=-1)": lambda x: repl.all_gather(x, axis=-1),
        "broadcast": lambda x: repl.broadcast(x, 1),
        "map_gather": lambda x: repl.map_gather(tf.identity, x),
    }
    for name, call in calls.items():
      want = util.local(repl, repl.run(call, args=(v.value,)))
      got = util.local(repl, repl.run(call, args=(v,)))
      self.assertLen(got, n)
      for g, w in zip(got, want):
        self.assertAllEqual(g, w, msg=name)
      if name == "all_gather":
        self.assertAllEqual(got[0], np.tile(v.numpy(), [n, 1]))

  def test_errors(self):
    with self.assertRaisesRegex(RuntimeError, r"all_sum\(\) must be called inside step_fn"):
      with self.repl.scope():
        self.repl.all_sum(tf.constant(1.0))
    with self.assertRaisesRegex(RuntimeError, "outside a replica of this replicator"):
      self.repl.all_sum(tf.constant(1.0))
    with self.assertRaisesRegex(ValueError, r"op must be one of \['max', 'mean', 'min', 'sum'\]"):
      self._run(lambda v: self.repl.all_reduce(v["a"], "prod"))
    with self.assertRaisesRegex(ValueError, r"source_replica must be an int in \[0, 4\)"):
      self._run(lambda v: self.repl.broadcast(v["a"], 4))
    with self.assertRaisesRegex(ValueError, r"axis must be in \[-2, 2\)"):
      self._run(lambda v: self.repl.all_gather(v["a"], axis=2))
    with self.assertRaisesRegex(TypeError, "fn must be callable"):
      self._run(lambda v: self.repl.map_gather(None, v))
    with self.assertRaisesRegex(TypeError, "fn must be callable"):
      self._run(lambda v: self.repl.map_reduce(3, v))

  def test_replicas_that_disagree(self):
    # Checked while tracing, so no collective runs: the replicator stays usable.
    r = lambda: self.repl.local_replica_index()
    rows = lambda: tf.zeros([r() + 1, 2])
    every = lambda f: ", ".join(f"replica {i}: {f(i)}" for i in range(N))
    shapes = re.escape(every(lambda i: f"float32[{i + 1}, 2]"))
    with self.assertRaisesRegex(ValueError, r"all_sum\(\): x must have the same "
                                r"dtype and shape on every replica; got " + shapes):
      self._run(lambda v: self.repl.all_sum(rows()))
    with self.assertRaisesRegex(ValueError, r"broadcast\(\): x\['b'\]\[0\] must have "
                                r"the same dtype and shape on every replica; got "
                                r"replica 0: int32\[3\], replica 1: int64\[3\]"):
      self._run(lambda v: self.repl.broadcast(
          {"a": v["a"], "b": (tf.cast(v["b"][0], tf.int64) if r() % 2 else v["b"][0],)}))
    with self.assertRaisesRegex(ValueError, r"map_reduce\(\): fn\(x\) must have the "
                                r"same nested structure on every replica; got replica 0: "
                                r"\{'a': float32\[2, 3\]\}, replica 1: \{'c': float32\[2, 3\]\}"):
      self._run(lambda v: self.repl.map_reduce(lambda x: {"ac"[r() % 2]: x["a"]}, v, "max"))
    with self.assertRaisesRegex(ValueError, r"map_gather\(\): fn\(x\) must have the same "
                                r"nested structure on every replica; got replica 0: "
                                r"\(float32\[2, 3\],\), replica 1: \(float32\[2, 3\], "
                                r"float32\[2, 3\]\)"):
      self._run(lambda v: self.repl.map_gather(lambda x: (x["a"],) * (1 + r() % 2), v))
    # all_gather: the sizes along `axis` may differ, not the other dimensions.
    with self.assertRaisesRegex(ValueError, r"all_gather\(\): x must have the same dtype "
                                r"and shape \(except along axis -1\) on every replica; got "
                                + shapes):
      self._run(lambda v: self.repl.all_gather(rows(), axis=-1))
    with self.assertRaisesRegex(ValueError, r"all_reduce\(\): x must have the same dtype"):
      self._run(lambda v: self.repl.all_reduce(tf.zeros([2], "float64" if r() else "float32")))
    # Dimensions unknown when traced are not compared; after the errors above
    # the collectives still work.
    def unknown_rows(v):  # replica r: 3r + 1 rows, unknown when traced
      n = tf.cast(-v["a"][0, 0], tf.int32) + 1
      return self.repl.all_sum(tf.fill(tf.stack([n, 2]), 1.0)[:1])
    self._all_equal(self._run(unknown_rows), np.full([1, 2], float(N)))


class OutsideStrategyTest(tf.test.TestCase):

  def test_default_replica_context_is_one_replica(self):
    # With no strategy the primitives act on the single default replica.
    self.assertAllEqual(primitives.all_sum(tf.constant([1.0, 2.0])), [1.0, 2.0])
    self.assertAllEqual(primitives.map_gather(lambda t: t * 2, tf.constant(3.0)), [6.0])


if __name__ == "__main__":
  tf.test.main()
