"""Adam correction: the compressor runs Adam, with a second moment that sees
every step and a selection on Adam-scaled gradients.

Error feedback delivers a held-back coordinate in bursts (about T * g once
every T steps), which inflates Adam's root mean square by about sqrt(T): the
coordinate moves about 1 / sqrt(T) as far as dense training would
(`bench/adam_bursts.py`). So the compressor keeps, per replica, Adam's first
moment of its Adam-scaled gradient, selects and feeds back error on that,
and the optimizer applies the sum of what was sent as plain SGD. The second
moment is fed every step by a small dense side channel (a factored, rank-1
estimate of g^2 by default) and is equal on every replica, so the replicas
stay identical. With nothing held back, `second_moment="exact"` and
`select="raw"` this is tf-keras Adam step for step.

docs/compression.md ("Adam correction: the update") has the update and the
options `second_moment`, `first_moment` and `select`.
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
