"""Adagrad correction: the compressor runs Adagrad, with an accumulator that
sees every step.

A held-back coordinate released as a burst of T gradients adds about
T^2 g^2 to Adagrad's accumulator instead of dense training's T g^2, so every
later step of it is about sqrt(T) shorter. The correction runs Adagrad
inside the compressor, as `adam_correction` runs Adam. On replica r:

    V = estimate of g^2 from the side channel of `adam_correction`
    acc <- acc + V                  the accumulator sees every step
    q_r = g_r / sqrt(acc + eps)     lr-free Adagrad step of this replica
    d = sum over replicas of what the compressor's own rule sends of q_r,
        error feedback on q_r

and the optimizer applies d as plain SGD (`var -= lr * d`). acc only sees
all-reduced values, so it is equal on every replica and the replicas stay
identical; acc starts at the optimizer's `initial_accumulator_value`. With
nothing held back and `accumulator="exact"` this is Adagrad step for step.
Embedding rows (`tf.IndexedSlices`) get no side channel: their Adagrad runs
on the aggregate. docs/compression.md has the details and the measurements.
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
