"""Adam correction: the compressor runs Adam, with a second moment that sees
every step and a selection on Adam-scaled gradients.

Adam divides each step by the running root mean square of a coordinate's
gradients. Error feedback delivers a held-back coordinate in bursts (about
T * g once every T steps instead of g every step); a burst inflates that
root mean square by about sqrt(T), so Adam moves the coordinate about
1 / sqrt(T) as far as dense training would (`bench/adam_bursts.py`). SGD and
momentum are linear in the gradient and do not suffer from this.

Holding entries back also delays them, and under Adam a delay costs more
than under SGD: Adam moves every coordinate about the learning rate per
step whatever the size of its gradient, so a coordinate whose gradient is
small (which a selection by |g| holds back longest) matters as much as a
large one.

The correction runs Adam inside the compressor. With the defaults, on
replica r:

    V = estimate of g^2 from a small dense side channel (below)
    v <- b2 * v + (1 - b2) * V          the second moment sees every step
    s = sqrt(1 - b2^t) / (sqrt(v) + eps)  Adam's per-entry step scale
    q_r = g_r * s                       select="normalized"
    m_r <- b1 * m_r + (1 - b1) * q_r    first_moment="replica"
    d = sum over replicas of what the compressor's own rule sends of
        m_r / (1 - b1^t), error feedback on m_r / (1 - b1^t)

and the optimizer applies d as plain SGD (`var -= lr * d`), as with
momentum correction. Selecting on q ranks entries by how far Adam would
move them, not by the raw gradient. v and t are equal on every replica
(they only see all-reduced values) and every replica applies the same d,
so the replicas stay identical. With select="raw" error feedback works on
the unscaled first moment and s is applied to d after the exchange; with
nothing held back and second_moment="exact" that is tf-keras Adam step for
step (tested). Variables whose gradient arrives as `tf.IndexedSlices`
(embedding rows) get no side channel: their Adam runs on the aggregate, as
the optimizer's own would.

Second-moment side channels (`second_moment`):

* "factored" (default): each replica sums its squared gradient over rows and
  over columns of the variable seen as a matrix [prod(shape[:-1]),
  shape[-1]], one all-reduce carries the row and column sums of every
  corrected variable, and V is their outer product over the total (the
  rank-1 estimate of Adafactor, Shazeer & Stern 2018). Vectors send their
  squares as they are. It costs rows + columns floats per matrix. Scaled by
  the replica count it is an unbiased estimate of the dense gradient's
  square where the signal dominates; where noise dominates it is larger
  (each replica's gradient is noisier than the sum), which only shortens
  those steps.
* "exact": the dense gradient itself is all-reduced and squared. It costs a
  dense all-reduce and is meant for measuring what the factored estimate
  loses.

First moments (`first_moment`):

* "replica" (default): DGC's momentum correction applied to Adam's first
  moment, as above. m is linear, so the replicas' m_r sum to the dense m:
  with nothing held back this is Adam with the shared v, and a held-back
  entry accumulates the distance dense Adam would have moved it. Error
  feedback conserves the sum of m_r / (1 - b1^t).
* "aggregate": error feedback on q, and one m, equal on every replica,
  averages what was sent: m <- b1 m + (1 - b1) sent, d = m / (1 - b1^t).
  A burst released after T held-back steps is then spread by m over the
  next ~1 / (1 - b1) steps, a further delay; it trained worse on three of
  our four models (docs/quality.md).
"""

from __future__ import annotations

import tensorflow as tf

SECOND_MOMENTS = ("factored", "exact")
SELECTIONS = ("normalized", "raw")
FIRST_MOMENTS = ("aggregate", "replica")


def as_matrix_shape(shape: tf.TensorShape) -> tuple[int, int] | None:
  """(rows, columns) of the factored estimate, or None for a vector."""
  if shape.rank is None or shape.rank < 2:
    return None
  cols = int(shape[-1])
  return shape.num_elements() // max(cols, 1), cols


def side_channel(grad: tf.Tensor, variable: tf.Variable, mode: str) -> tf.Tensor:
  """The flat vector this replica all-reduces (SUM) for V."""
  g = tf.convert_to_tensor(grad)
  if mode == "exact":
    return tf.reshape(g, [-1])
  sq = tf.square(g)
  dims = as_matrix_shape(variable.shape)
  if dims is None:
    return tf.reshape(sq, [-1])
  sq = tf.reshape(sq, dims)
  return tf.concat([tf.reduce_sum(sq, axis=1), tf.reduce_sum(sq, axis=0)], 0)


def side_channel_size(variable: tf.Variable, mode: str) -> int:
  """Entries of `side_channel` for `variable`."""
  dims = as_matrix_shape(variable.shape)
  if mode == "exact" or dims is None:
    return variable.shape.num_elements()
  return dims[0] + dims[1]


def second_moment(summed: tf.Tensor, variable: tf.Variable, mode: str,
                  num_replicas: int) -> tf.Tensor:
  """V in the variable's shape from the all-reduced side channel."""
  if mode == "exact":
    return tf.reshape(tf.square(summed), variable.shape)
  summed = summed * tf.cast(num_replicas, summed.dtype)
  dims = as_matrix_shape(variable.shape)
  if dims is None:
    return tf.reshape(summed, variable.shape)
  rows, cols = summed[:dims[0]], summed[dims[0]:]
  total = tf.reduce_sum(rows)
  outer = rows[:, None] * cols[None, :] / tf.maximum(
      total, tf.constant(1e-30, summed.dtype))
  return tf.reshape(outer, variable.shape)


def second_moment_step(v: tf.Tensor, t: tf.Tensor, second: tf.Tensor,
                       beta_2: float):
  """v <- b2 v + (1 - b2) V and t <- t + 1."""
  b2 = tf.cast(beta_2, v.dtype)
  return v + (second - v) * (1 - b2), t + 1


def scale(v: tf.Tensor, t: tf.Tensor, beta_2: float, epsilon: float):
  """Adam's per-entry step scale sqrt(1 - b2^t) / (sqrt(v) + eps)."""
  b2 = tf.cast(beta_2, v.dtype)
  return tf.sqrt(1 - tf.pow(b2, t)) / (tf.sqrt(v) + tf.cast(epsilon, v.dtype))


def first_moment_step(m: tf.Tensor, t: tf.Tensor, sent: tf.Tensor,
                      beta_1: float):
  """m <- b1 m + (1 - b1) sent; returns (m, m / (1 - b1^t))."""
  b1 = tf.cast(beta_1, m.dtype)
  m = m + (sent - m) * (1 - b1)
  return m, m / (1 - tf.pow(b1, t))
