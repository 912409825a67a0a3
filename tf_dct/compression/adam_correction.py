"""Adam correction: the compressor runs Adam, with a second moment that sees
every step and a selection on Adam-scaled gradients.

Error feedback delivers a held-back coordinate in bursts (about T * g once
every T steps), which inflates Adam's root mean square by about sqrt(T): the
coordinate moves about 1 / sqrt(T) as far as dense training would
(`bench/adam_bursts.py`). So the compressor keeps, per replica, Adam's first
moment of its Adam-scaled gradient, selects and feeds back error on that,
and the optimizer applies the sum of what was sent as plain SGD. The second
moment is fed every step by a small dense side channel (a factored, rank-1
estimate of g^2 by default; "sketched" scales it to a sketch of the square
of the replicas' summed gradient) and is equal on every replica, so the
replicas stay identical. With nothing held back, `second_moment="exact"` and
`select="raw"` this is tf-keras Adam step for step.

docs/compression.md ("Adam correction: the update") has the update and the
options `second_moment`, `first_moment` and `select`.
"""

from __future__ import annotations

import tensorflow as tf

SECOND_MOMENTS = ("factored", "sketched", "exact")
SELECTIONS = ("normalized", "raw")
FIRST_MOMENTS = ("aggregate", "replica")

# Floats of the count sketch that scales a matrix's "sketched" estimate.
SKETCH_SIZE = 32


def as_matrix_shape(shape: tf.TensorShape) -> tuple[int, int] | None:
  """(rows, columns) of the factored estimate, or None for a vector."""
  if shape.rank is None or shape.rank < 2:
    return None
  cols = int(shape[-1])
  return shape.num_elements() // max(cols, 1), cols


def factors(variable: tf.Variable, mode: str) -> tuple[int, int] | None:
  """(rows, columns) when `variable`'s V is a rank-1 estimate, else None.

  "factored" and "sketched" factor matrices; "sketched" not a matrix whose
  channel (rows + columns + the sketch) would be no smaller than the
  gradient. "exact" factors nothing.
  """
  dims = as_matrix_shape(variable.shape)
  if mode == "exact" or dims is None or (
      mode == "sketched"
      and sum(dims) + SKETCH_SIZE >= variable.shape.num_elements()):
    return None
  return dims


def sketch_signs(n: int, step) -> tf.Tensor:
  """The +-1 signs of the count sketch of an n-entry gradient.

  Drawn by TensorFlow's stateless generator from `step` (Adam's step count,
  equal on every replica): the same on every replica, new every step, so
  the sketch's errors average out in v. Entry i goes to bucket i mod
  `SKETCH_SIZE` (`sketch`).
  """
  seed = tf.stack([tf.cast(step, tf.int32), tf.constant(0x5EED, tf.int32)])
  u = tf.random.stateless_uniform([n], seed)
  return tf.where(u < 0.5, -1.0, 1.0)


def sketch(g: tf.Tensor, signs: tf.Tensor) -> tf.Tensor:
  """sum over i in bucket b of signs[i] * g[i], b = 0 .. SKETCH_SIZE - 1, for a
  flat g (entry i in bucket i mod SKETCH_SIZE)."""
  pad = -g.shape[0] % SKETCH_SIZE
  x = tf.pad(g * tf.cast(signs, g.dtype), [[0, pad]])
  return tf.reduce_sum(tf.reshape(x, [-1, SKETCH_SIZE]), axis=0)


def side_channel(grad: tf.Tensor, variable: tf.Variable, mode: str,
                 step=0) -> tf.Tensor:
  """The flat vector this replica all-reduces (SUM) for V.

  A factored matrix: the row and column sums of the squared gradient, and
  under "sketched" a count sketch of the gradient (`SKETCH_SIZE` floats,
  signs from `step`). Otherwise the squared gradient ("factored"
  vectors) or the gradient itself.
  """
  g = tf.reshape(tf.convert_to_tensor(grad), [-1])
  dims = factors(variable, mode)
  if dims is None:
    return tf.square(g) if mode == "factored" else g
  sq = tf.reshape(tf.square(g), dims)
  parts = [tf.reduce_sum(sq, axis=1), tf.reduce_sum(sq, axis=0)]
  if mode == "sketched":
    parts.append(sketch(g, sketch_signs(g.shape[0], step)))
  return tf.concat(parts, 0)


def side_channel_size(variable: tf.Variable, mode: str) -> int:
  """Entries of `side_channel` for `variable`."""
  dims = factors(variable, mode)
  if dims is None:
    return variable.shape.num_elements()
  return dims[0] + dims[1] + (SKETCH_SIZE if mode == "sketched" else 0)


def second_moment(summed: tf.Tensor, variable: tf.Variable, mode: str,
                  num_replicas: int) -> tf.Tensor:
  """V in the variable's shape from the all-reduced side channel.

  "factored": P times the replicas' summed squares (P = `num_replicas`),
  rank-1 for a matrix (Adafactor, Shazeer & Stern 2018): the square of the
  replicas' summed gradient where they agree, up to P times larger where
  gradient noise dominates. "sketched": the same rank-1 shape scaled so its
  total is the sketch's unbiased estimate of |sum of the gradients|^2, kept
  between the summed squares (independent noise) and P times them (equal
  gradients); unfactored variables the square of the sum, as "exact".
  """
  dims = factors(variable, mode)
  p = tf.cast(num_replicas, summed.dtype)
  tiny = tf.constant(1e-30, summed.dtype)
  if mode == "factored":
    summed = summed * p
    if dims is None:
      return tf.reshape(summed, variable.shape)
    rows, cols = summed[:dims[0]], summed[dims[0]:]
    outer = rows[:, None] * cols[None, :] / tf.maximum(tf.reduce_sum(rows), tiny)
    return tf.reshape(outer, variable.shape)
  if dims is None:
    return tf.reshape(tf.square(summed), variable.shape)
  rows, cols, sketched = tf.split(summed, [dims[0], dims[1], SKETCH_SIZE])
  total = tf.maximum(tf.reduce_sum(rows), tiny)
  norm = tf.clip_by_value(tf.reduce_sum(tf.square(sketched)), total, total * p)
  outer = rows[:, None] * cols[None, :] * (norm / tf.square(total))
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
