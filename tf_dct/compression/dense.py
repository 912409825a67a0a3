"""Dense aggregation: one SUM all-reduce, exactly what the built-ins do."""

from __future__ import annotations

import tensorflow as tf

from tf_dct.compression.base import Compressor


class Dense(Compressor):
  """All-reduces every gradient with SUM in one batched collective."""

  def reduce(self, ctx, grads, variables, states):
    del states
    for grad, var in zip(grads, variables):  # N entries all-reduced, N non-zero
      self.record(var, reduce_bytes=var.shape.num_elements() * grad.dtype.size)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
