"""Adagrad correction: the compressor runs Adagrad, with an accumulator that
sees every step.

Adagrad divides each step by the root of a coordinate's accumulated squared
gradients, acc = acc0 + sum over steps of g^2. Error feedback delivers a
held-back coordinate in bursts (about T * g once every T steps instead of g
every step); a burst adds about T^2 g^2 to the accumulator instead of the
T g^2 of dense training, so every later step of that coordinate is about
sqrt(T) times shorter than dense Adagrad's, for the rest of training. SGD
and momentum are linear in the gradient and do not suffer from this; Adam
does, with a running mean instead of a sum (`adam_correction`).

The correction runs Adagrad inside the compressor, as Adam correction runs
Adam. On replica r:

    V = estimate of g^2 from the dense side channel of `adam_correction`
    acc <- acc + V                  the accumulator sees every step
    q_r = g_r / sqrt(acc + eps)     lr-free Adagrad step of this replica
    d = sum over replicas of what the compressor's own rule sends of q_r,
        error feedback on q_r

and the optimizer applies d as plain SGD (`var -= lr * d`). Selecting on q
ranks entries by how far Adagrad would move them. acc is equal on every
replica (it only sees all-reduced values) and every replica applies the same
d, so the replicas stay identical. Error feedback conserves the sum of the
q_r fed in. acc starts at the optimizer's `initial_accumulator_value`; with
nothing held back and the exact side channel (`accumulator="exact"`) this
is tf-keras (and Keras 3) Adagrad step for step (tested).

The side channel is Adam correction's (`adam_correction.side_channel`):
"factored" (default) all-reduces each replica's squared gradient summed
over rows and over columns, rows + columns floats per matrix, and V is
their rank-1 outer product; "exact" all-reduces the dense gradient, for
measurements. The factored V, scaled by the replica count, estimates the
square of the summed gradient where the signal dominates; where noise
dominates it is larger, which only shortens those steps.

Variables whose gradient arrives as `tf.IndexedSlices` (embedding rows) get
no side channel: their Adagrad runs on the aggregate (acc += d^2 on the
rows sent), as the optimizer's own would.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dct.compression import adam_correction

ACCUMULATORS = adam_correction.SECOND_MOMENTS


def accumulate(acc: tf.Tensor, second: tf.Tensor) -> tf.Tensor:
  """acc + V: Adagrad's accumulator after this step's squared gradient."""
  return acc + second


def step(grad: tf.Tensor, acc: tf.Tensor, epsilon: float) -> tf.Tensor:
  """Adagrad's step without the learning rate, g / sqrt(acc + eps)."""
  return grad / tf.sqrt(acc + tf.cast(epsilon, acc.dtype))
