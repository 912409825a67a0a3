"""Momentum correction and momentum-factor masking for sparsifying compressors.

Momentum SGD applied to a sparse aggregate trains worse than dense momentum
SGD: an entry held back for many steps reaches the optimizer late and in one
burst, and the optimizer's momentum then multiplies that burst instead of
the gradient history. Deep Gradient Compression (Lin et al., ICLR 2018,
§3.2, "momentum correction" and "momentum factor masking") moves the
momentum in front of the sparsification, on each replica:

    u <- m * u + g               velocity of this replica's own gradients
    acc = u + E                  error feedback adds the held-back part
    select, send; E <- acc - sent  (the compressor's own rule)
    u <- 0 where acc was sent    factor masking (optional, off by default)

and the optimizer applies the aggregate without momentum of its own (plain
SGD). Error feedback then conserves the velocity instead of the gradient:
sum over steps of what was sent plus E equals the sum of the velocities fed
in (tests/compression/test_momentum_correction.py checks it numerically).
Without masking and with nothing held back this is exactly momentum SGD;
masking drops the momentum of an entry once it was sent, which DGC uses to
keep a stale velocity from pushing an entry that was just updated in a
burst; it made training lag at the start (docs/quality.md), so it is off.

Variables a compressor does not sparsify (excluded, below `min_size`) keep
the optimizer's own momentum: the Keras adapters apply plain SGD only to the
variables for which `Compressor.corrects_momentum` is true.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dct.compression import error_feedback


def velocity(grad, old_velocity: tf.Tensor, momentum: float,
             variable: tf.Variable) -> tf.Tensor:
  """u = m * u + g in the variable's shape (dense; IndexedSlices rows are
  scatter-added, no table-sized gradient is built)."""
  scaled = tf.cast(momentum, old_velocity.dtype) * old_velocity
  return tf.reshape(error_feedback.accumulate(grad, scaled, variable),
                    variable.shape)


def sent_mask(corrected: tf.Tensor, old_residual: tf.Tensor,
              new_residual: tf.Tensor) -> tf.Tensor:
  """Where this replica sent its accumulator acc = u + E in this step.

  Every error-feedback compressor of tf_dct keeps acc where it holds an
  entry back and sets E to 0 where it sends it, and never sends a zero, so
  an entry was sent exactly where acc != 0 and the new E is 0.
  """
  acc = corrected + old_residual
  return tf.logical_and(tf.not_equal(acc, 0), tf.equal(new_residual, 0))


def masked(corrected: tf.Tensor, old_residual: tf.Tensor,
           new_residual: tf.Tensor) -> tf.Tensor:
  """The velocity to keep: `corrected` with the sent entries zeroed."""
  return tf.where(sent_mask(corrected, old_residual, new_residual),
                  tf.zeros_like(corrected), corrected)
