"""Dense aggregation: one SUM all-reduce, exactly what the built-ins do."""

from __future__ import annotations

import tensorflow as tf

from tf_dct.compression.base import Compressor


class Dense(Compressor):
  """All-reduces every gradient with SUM in one batched collective.

  Accounting: a dense gradient is N entries all-reduced. A `tf.IndexedSlices`
  gradient (an embedding table) is not: TensorFlow's collectives all-gather
  its slices (values and row ids), so that is what is recorded, P = bytes of
  the values + bytes of the row ids of this replica (static shapes; with a
  dynamic number of slices the dense all-reduce is recorded, an upper bound).
  """

  def reduce(self, ctx, grads, variables, states):
    del states
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))
    for grad, var, out in zip(grads, variables, reduced):
      n = var.shape.num_elements()
      if (isinstance(grad, tf.IndexedSlices) and isinstance(out, tf.IndexedSlices)
          and grad.values.shape.is_fully_defined()
          and grad.indices.shape.is_fully_defined()):
        sent = grad.values.shape.num_elements()
        payload = (sent * grad.values.dtype.size
                   + grad.indices.shape.num_elements() * grad.indices.dtype.size)
        nnz = tf.minimum(tf.size(out.values, out_type=tf.int64), n)  # upper bound
        self.record(var, gather_bytes=payload, nnz=nnz, sent=min(sent, n))
      else:  # N entries all-reduced, N non-zero
        self.record(var, reduce_bytes=n * grad.dtype.size)
    return reduced
