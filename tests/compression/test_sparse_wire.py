"""Tests for tf_dct.compression.sparse_wire against numpy."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct.compression import sparse_wire
from tests import util


def setUpModule():
  util.setup_cpus()


def _np_compact(acc, mask, capacity):
  n = acc.size
  positions = np.flatnonzero(mask)[:capacity]
  idx = np.full(capacity, n, np.int32)
  val = np.zeros(capacity, acc.dtype)
  idx[:positions.size] = positions
  val[:positions.size] = acc[positions]
  fitted = np.zeros(n, bool)
  fitted[positions] = True
  return idx, val, positions.size, fitted


class CompactTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("sparse_fits", 50, 0.1, 20),
      ("overflow", 50, 0.6, 10),
      ("exactly_full", 8, 1.0, 8),
      ("nothing_selected", 30, 0.0, 5),
      ("capacity_one", 30, 0.5, 1),
      ("single_entry", 1, 1.0, 1),
  )
  def test_matches_numpy(self, n, density, capacity):
    rng = np.random.default_rng(n + capacity)
    acc = rng.normal(size=n).astype(np.float32)
    mask = rng.uniform(size=n) < density
    want = _np_compact(acc, mask, capacity)
    eager = sparse_wire.compact(tf.constant(acc), tf.constant(mask), capacity)
    jitted = tf.function(lambda a, m: sparse_wire.compact(a, m, capacity),
                         jit_compile=True)(tf.constant(acc), tf.constant(mask))
    for got in (eager, jitted):
      idx, val, count, fitted = [t.numpy() for t in got]
      self.assertEqual(idx.dtype, np.int32)
      self.assertAllEqual(idx, want[0])
      self.assertAllEqual(val, want[1])
      self.assertEqual(count, want[2])
      self.assertAllEqual(fitted, want[3])
      # What did not fit is exactly the selected remainder.
      self.assertAllEqual(mask & ~fitted, mask & ~want[3])

  def test_scatter_sum_drops_padding_and_sums_duplicates(self):
    idx = tf.constant([0, 2, 2, 4, 4], tf.int32)  # n = 4: index 4 is padding
    val = tf.constant([1.0, 2.0, 3.0, 0.0, 0.0])
    self.assertAllEqual(sparse_wire.scatter_sum(idx, val, 4), [1.0, 0.0, 5.0, 0.0])

  def test_bad_arguments(self):
    acc = tf.zeros([4])
    mask = tf.ones([4], tf.bool)
    with self.assertRaisesRegex(ValueError, "capacity must be a Python int >= 1"):
      sparse_wire.compact(acc, mask, 0)
    with self.assertRaisesRegex(ValueError, "acc_flat must be rank 1"):
      sparse_wire.compact(tf.zeros([2, 2]), mask, 2)


class ExchangeTest(tf.test.TestCase):

  def test_sums_every_replica_on_four_replicas(self):
    n, capacity = 12, 5
    replicas = util.NUM_CPUS
    rng = np.random.default_rng(1)
    accs = [rng.normal(size=n).astype(np.float32) for _ in range(replicas)]
    # Overlapping selections (duplicate positions across replicas), one
    # replica overflowing and one sending nothing (all padding).
    masks = [np.arange(n) < 4, np.arange(n) % 2 == 0, np.arange(n) >= 10,
             np.zeros(n, bool)]
    repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])

    def fn():
      ctx = tf.distribute.get_replica_context()
      r = tf.get_static_value(ctx.replica_id_in_sync_group)
      idx, val, count, _ = sparse_wire.compact(
          tf.constant(accs[r]), tf.constant(masks[r]), capacity)
      single = sparse_wire.exchange(ctx, idx, val, n)
      # Batched form: several vectors in one all-gather.
      many = sparse_wire.exchange_many(ctx, [(idx, val, n), (idx, val * 2, n)])
      return single, many, count

    out = util.local(repl, tf.function(lambda: repl.run(fn))())
    want = np.zeros(n, np.float64)
    for acc, mask in zip(accs, masks):
      fitted = _np_compact(acc, mask, capacity)[3]
      want += np.where(fitted, acc, 0)
    for single, many, _ in out:
      self.assertAllClose(single, want, atol=1e-6, rtol=0)
      self.assertAllClose(many[0], want, atol=1e-6, rtol=0)
      self.assertAllClose(many[1], 2 * want, atol=1e-6, rtol=0)
      self.assertAllEqual(single, out[0][0])  # identical on every replica
    self.assertEqual([o[2] for o in out], [4, 5, 2, 0])

  def test_compiles_with_xla_on_one_replica(self):
    repl = tf_dct.Replicator(["/cpu:0"], jit_compile=True)
    acc = np.array([0.5, -2.0, 0.1, 3.0], np.float32)

    def step_fn(a):
      ctx = tf.distribute.get_replica_context()
      idx, val, _, _ = sparse_wire.compact(a, tf.abs(a) >= 0.5, 2)
      return sparse_wire.exchange(ctx, idx, val, 4)

    out = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(acc).repeat())
    step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
    self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access
    self.assertAllEqual(out, [0.5, -2.0, 0.0, 0.0])


if __name__ == "__main__":
  tf.test.main()
