"""Tests for tf_dct.distribute.primitives on 4 replicas, each against a numpy reference."""

import re

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct.distribute import primitives
from tests import util

N = 4


def setUpModule():
  util.setup_cpus()


def _values(r):
  """Replica r's value: a nested structure with distinct numbers per replica."""
  a = np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) - 3 * r
  return {"a": a, "b": (np.array([r, -r, 2 * r], np.int32),)}


class PrimitivesTest(tf.test.TestCase, parameterized.TestCase):

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

  @parameterized.parameters(("sum", np.sum), ("mean", np.mean), ("max", np.max),
                            ("min", np.min))
  def test_all_reduce(self, op, np_op):
    want = {"a": np_op(np.stack([_values(r)["a"] for r in range(N)]), axis=0)}
    got = self._run(lambda v: self.repl.all_reduce({"a": v["a"]}, op))
    for g in got:
      self.assertAllClose(g["a"], want["a"], rtol=1e-6)

  def test_all_reduce_int_max(self):
    want = np.max(np.stack([_values(r)["b"][0] for r in range(N)]), axis=0)
    self._all_equal(self._run(lambda v: self.repl.all_reduce(v["b"][0], "max")), want)

  def test_all_sum_nested(self):
    want = tf.nest.map_structure(lambda *xs: np.sum(np.stack(xs), axis=0),
                                 *[_values(r) for r in range(N)])
    self._all_equal(self._run(self.repl.all_sum), want)

  @parameterized.parameters(0, 1, -1)
  def test_all_gather(self, axis):
    want = np.concatenate([_values(r)["a"] for r in range(N)], axis=axis)
    self._all_equal(self._run(lambda v: self.repl.all_gather(v["a"], axis=axis)), want)

  def test_all_gather_unequal_sizes(self):
    # Replica r contributes r + 1 rows.
    def fn(v):
      r = self.repl.local_replica_index()
      return self.repl.all_gather(tf.fill([r + 1, 2], float(r)), axis=0)
    want = np.concatenate([np.full([r + 1, 2], float(r), np.float32) for r in range(N)])
    self._all_equal(self._run(fn), want)

  def test_a_keras3_variable_as_its_tf_variable(self):
    # Eagerly too: TF's own eager all_gather returns a Keras 3 variable as it is.
    repl = self.repl
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
      self.assertLen(got, N)
      for g, w in zip(got, want):
        self.assertAllEqual(g, w, msg=name)
      if name == "all_gather":
        self.assertAllEqual(got[0], np.tile(v.numpy(), [N, 1]))

  @parameterized.parameters(0, 2, 3)
  def test_broadcast(self, source):
    self._all_equal(self._run(lambda v: self.repl.broadcast(v, source)), _values(source))

  def test_broadcast_bool(self):
    def fn(v):
      return self.repl.broadcast(v["a"] > 2.0, 1)
    self._all_equal(self._run(fn), _values(1)["a"] > 2.0)

  def test_map_reduce(self):
    fn = lambda x: tf.reduce_sum(x["a"] ** 2, axis=1)
    want = np.sum([np.sum(_values(r)["a"] ** 2, axis=1) for r in range(N)], axis=0)
    got = self._run(lambda v: self.repl.map_reduce(fn, v, "sum"))
    for g in got:
      self.assertAllClose(g, want, rtol=1e-6)
    want_max = np.max([np.sum(_values(r)["a"] ** 2, axis=1) for r in range(N)], axis=0)
    self._all_equal(self._run(lambda v: self.repl.map_reduce(fn, v, "max")), want_max)

  def test_map_gather(self):
    fn = lambda x: (tf.reduce_max(x["a"]), x["b"][0][:2])
    want = (np.stack([np.max(_values(r)["a"]) for r in range(N)]),
            np.stack([_values(r)["b"][0][:2] for r in range(N)]))
    self._all_equal(self._run(lambda v: self.repl.map_gather(fn, v)), want)

  def test_gradients(self):
    # d/dx_r sum_s(all_sum(x)^2 summed) and broadcast: flows back per semantics.
    def fn(v):
      x = v["a"]
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        total = tf.reduce_sum(self.repl.all_sum(x))
        from_source = tf.reduce_sum(self.repl.broadcast(x, 2))
      return tape.gradient(total, x), tape.gradient(from_source, x)
    got = self._run(fn)
    for r, (g_sum, g_bcast) in enumerate(got):
      # all_sum's gradient is the all_sum of upstream ones: N everywhere.
      self.assertAllEqual(g_sum, np.full([2, 3], float(N)))
      # Every replica uses x_2; all gradient reaches replica 2.
      self.assertAllEqual(g_bcast, np.full([2, 3], float(N) if r == 2 else 0.0))

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


class XlaTest(tf.test.TestCase):
  """TPU-readiness proxy: each primitive and a wrapped optimizer step compile.

  TF's Mirrored strategy cannot XLA-compile multi-replica CPU collectives (it
  needs merge_call), so the whole step is compiled on a one-replica
  Replicator: every op our code adds around the collectives goes through XLA.
  """

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.repl = tf_dct.Replicator(["/cpu:0"], jit_compile=True)

  def _assert_compiled(self, step):
    # jit_compile=True makes any op XLA cannot compile an error, so running
    # the step proves it; check the step really is an XLA function too.
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access

  def test_every_primitive_compiles(self):
    repl = self.repl
    x = np.arange(6, dtype=np.float32).reshape(2, 3)

    def step_fn(v):
      return {
          "all_reduce_max": repl.all_reduce(v, "max"),
          "all_reduce_mean": repl.all_reduce(v, "mean"),
          "all_sum": repl.all_sum(v),
          "all_gather": repl.all_gather(v, axis=1),
          "broadcast": repl.broadcast(v, 0),
          "map_reduce": repl.map_reduce(lambda t: t * 2.0, v, "min"),
          "map_gather": repl.map_gather(tf.reduce_sum, v),
      }

    out = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(x).repeat())
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self._assert_compiled(step)
    for key in ("all_reduce_max", "all_reduce_mean", "all_sum", "broadcast"):
      self.assertAllEqual(out[key], x)
    self.assertAllEqual(out["map_reduce"], 2 * x)
    self.assertAllEqual(out["map_gather"], [x.sum()])

  def test_wrapped_optimizer_step_compiles(self):
    repl = self.repl
    with repl.scope():
      model = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(1)])
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1))
    w0 = [w.copy() for w in model.get_weights()]
    data = (np.ones([4, 3], np.float32), np.ones([4, 1], np.float32))

    def step_fn(batch):
      xb, yb = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    input_fn = lambda ctx: tf.data.Dataset.from_tensors(data).repeat()
    repl.run(step_fn, input_fn)
    self._assert_compiled(repl._steps[(step_fn, input_fn)])  # pylint: disable=protected-access
    self.assertNotAllClose(model.get_weights()[0], w0[0])


class OutsideStrategyTest(tf.test.TestCase):

  def test_default_replica_context_is_one_replica(self):
    # With no strategy the primitives act on the single default replica.
    self.assertAllEqual(primitives.all_sum(tf.constant([1.0, 2.0])), [1.0, 2.0])
    self.assertAllEqual(primitives.map_gather(lambda t: t * 2, tf.constant(3.0)), [6.0])


if __name__ == "__main__":
  tf.test.main()
