"""Epoch orders as a function of position: training streams that start anywhere.

A training stream of a data set of `n` examples is a sequence of batches
whose example `k` (counting across batches and epochs) is example
`permutation_e(k mod n)` of the data set, `e = k // n` its epoch. The
permutation of each epoch is TensorFlow's index shuffle (`RandomIndexShuffle`,
as in `tf.random.experimental.index_shuffle`) seeded by `(seed, e)`: a new order every epoch, the same orders for a seed, and
nothing materialized. The stream from batch `start` on is therefore made
directly (`tf.data.Dataset.range(start, ...)`), without generating and
dropping the batches before it: resuming training at step `s` starts the
stream at batch `s`, and the input needs no state in the checkpoint (a
`shuffle` buffer over the whole data set would put the data set in it).
"""

from __future__ import annotations

import tensorflow as tf

# Batch indices run to this bound: endless in practice.
ENDLESS = 1 << 62


def check_count(name: str, value) -> None:
  """Raises ValueError naming `name` unless `value` is an int >= 0."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_start(start) -> None:
  """Raises ValueError unless `start` (the first batch's index) is an int >= 0."""
  check_count("start (the index of the first batch)", start)


def batch_positions(start: int, batch_size: int) -> tf.data.Dataset:
  """int64 [batch_size] stream positions `k` of the batches from `start` on."""
  check_start(start)
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  offsets = tf.range(batch_size, dtype=tf.int64)
  return tf.data.Dataset.range(start, ENDLESS).map(lambda b: b * batch_size + offsets)


def shuffled_indices(positions: tf.Tensor, n: int, seed: int) -> tf.Tensor:
  """The data-set indices of stream `positions` (int64): every epoch of `n`
  examples a permutation seeded by `(seed, epoch)`."""
  if n < 1:
    raise ValueError(f"the data set must hold at least one example, got {n}")
  epochs = positions // n
  seeds = tf.stack([tf.fill(tf.shape(epochs), tf.constant(seed, tf.int64)), epochs,
                    tf.zeros_like(epochs)], -1)
  # The raw op: tf.random.experimental.index_shuffle pads a [batch, 2] seed
  # along the wrong axis and rejects it.
  return tf.raw_ops.RandomIndexShuffle(index=positions % n, seed=seeds,
                                       max_index=tf.constant(n - 1, tf.int64))


def shuffled_batches(arrays, batch_size: int, seed: int, start: int = 0) -> tf.data.Dataset:
  """Endless batches of `arrays` (a structure of equally long arrays), each
  epoch in its own seeded order, from batch `start` on; whole batches (an
  epoch's last batch continues into the next epoch)."""
  flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(arrays)]
  n = int(flat[0].shape[0])
  positions = batch_positions(start, batch_size)

  def gather(k):
    idx = shuffled_indices(k, n, seed)
    return tf.nest.pack_sequence_as(arrays, [tf.gather(a, idx) for a in flat])

  return positions.map(gather)
