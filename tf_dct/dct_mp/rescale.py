"""Mass-preserving rescales of DCT-MP's split (options of DCT Algorithm 2).

DCT-MP (Algorithm 2 line 10) sends X ⊙ M: with 90% of a ReLU row dropped,
the row that reaches the layers after the split keeps only part of its
mass, so their input shrinks as soon as the mask is applied. With
rescale="l1" the kept entries of row i are multiplied by

    s_i = ||X_i||_1 / ||X_i ⊙ M_i||_1,

so the row crosses with the L1 norm of the dense row (after a ReLU, the
same sum), as dropout scales its kept units by 1 / keep. s_i = 1 when the
kept entries are all 0 (then so is the row).

The factor is computed on the sending side, which holds the whole row, and
multiplied into the k kept values before they cross, so the wire carries
nothing extra. In the backward pass s_i is a constant, as dropout's scale,
Algorithm 2's mask and Appendix B's per-step thresholds are: the gradient is s_i · (dY_i ⊙ M_i), still k
values per row; the sender, which kept s_i, applies it after the compact
gradient arrives.

rescale="l1_backward" scales the gradient only (forward X ⊙ M, gradient
s_i · (dY_i ⊙ M_i)): under SGD the layers before the split otherwise learn
from the gradient of k of d entries; docs/dct_mp.md has the measurements.

The sums are taken in float32 (float64 for float64 inputs), over the k
kept values in `tf.math.top_k`'s order, so the masked op and the compact
transfer get the same s_i bit for bit.
"""

from __future__ import annotations

import tensorflow as tf

RESCALES = ("none", "l1", "l1_backward")


def check_rescale(rescale, caller: str = "dct_mp") -> str:
  """Returns `rescale` if it is one of `RESCALES`."""
  if not isinstance(rescale, str) or rescale not in RESCALES:
    raise ValueError(f"{caller}: rescale must be one of {RESCALES}, got "
                     f"{rescale!r}")
  return rescale


def row_scale(x2: tf.Tensor, kept: tf.Tensor, rescale: str) -> tf.Tensor | None:
  """The factors s [N, 1] in x2's dtype, or None for rescale "none".

  Args:
    x2: the activation rows [N, d].
    kept: the kept values of each row: [N, k] (`compact`'s values), or
      [N, d] with the dropped entries 0.
    rescale: one of `RESCALES`.
  """
  if rescale == "none":
    return None
  wide = tf.float64 if x2.dtype == tf.float64 else tf.float32
  full = tf.reduce_sum(tf.abs(tf.cast(x2, wide)), axis=-1, keepdims=True)
  part = tf.reduce_sum(tf.abs(tf.cast(kept, wide)), axis=-1, keepdims=True)
  s = tf.where(part > 0, full / tf.where(part > 0, part, 1), 1)
  return tf.cast(s, x2.dtype)


def forward_scale(s: tf.Tensor | None, rescale: str) -> tf.Tensor | None:
  """The factor the forward values get: s for "l1", None otherwise."""
  return s if rescale == "l1" else None


def scaled(v: tf.Tensor, s: tf.Tensor | None) -> tf.Tensor:
  """v · s (rows of v times the row's factor); v itself when s is None."""
  return v if s is None else v * s
