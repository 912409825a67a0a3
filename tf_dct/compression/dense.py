"""Dense aggregation: one SUM all-reduce, exactly what the built-ins do."""

from __future__ import annotations

import tensorflow as tf

from tf_dct.compression.base import Compressor


class Dense(Compressor):
  """All-reduces every gradient with SUM in one batched collective.

  `tf.IndexedSlices` gradients (embedding tables) stay sparse and are
  all-gathered as they are, duplicate row ids included, as the built-ins
  do (no `dedup_rows`); the accounting records that (see
  `Compressor.reduce_as_is`).
  """

  dedup_rows = False

  def reduce(self, ctx, grads, variables, states):
    del states
    return self.reduce_as_is(ctx, grads, variables)
