"""Tests for models/data/order.py: seeded epoch orders that start anywhere."""

import numpy as np
import tensorflow as tf

from models.data import order
from tests import util


def setUpModule():
  util.setup_cpus()


class OrderTest(tf.test.TestCase):

  def test_every_epoch_a_permutation_of_its_own(self):
    n, batch = 7, 3
    # 5 epochs of 7 examples in batches of 3: an epoch ends mid-batch.
    ds = order.shuffled_batches(np.arange(n) * 10, batch, seed=4)
    stream = np.concatenate([b.numpy() for b in ds.take(5 * n // batch)]) // 10
    epochs = [stream[e * n:(e + 1) * n] for e in range(len(stream) // n)]
    for epoch in epochs:
      self.assertAllEqual(np.sort(epoch), np.arange(n))
    self.assertGreater(len({tuple(e) for e in epochs}), 1)  # reshuffled per epoch
    again = order.shuffled_batches(np.arange(n) * 10, batch, seed=4)
    self.assertAllEqual(next(iter(again)).numpy() // 10, stream[:batch])
    other = order.shuffled_batches(np.arange(n) * 10, batch, seed=5)
    self.assertNotAllEqual(np.concatenate([b.numpy() for b in other.take(4)]) // 10,
                           stream[:12])

  def test_start_is_the_stream_from_that_batch(self):
    arrays = (np.arange(5), np.arange(5) * 2.0)
    full = list(order.shuffled_batches(arrays, 2, seed=1).take(9))
    late = list(order.shuffled_batches(arrays, 2, seed=1, start=6).take(3))
    for want, got in zip(full[6:], late):
      tf.nest.map_structure(self.assertAllEqual, got, want)

  def test_bad_start_and_sizes(self):
    for bad in (-1, 1.5, True, None):
      with self.assertRaisesRegex(ValueError, r"start \(the index of the first batch\) "
                                  r"must be an int >= 0"):
        order.batch_positions(bad, 4)
    with self.assertRaisesRegex(ValueError, "batch_size must be >= 1, got 0"):
      order.batch_positions(0, 0)
    with self.assertRaisesRegex(ValueError, "at least one example, got 0"):
      order.shuffled_indices(tf.constant([0], tf.int64), 0, 0)


if __name__ == "__main__":
  tf.test.main()
