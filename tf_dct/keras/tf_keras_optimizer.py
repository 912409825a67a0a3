"""tf-keras adapter: overrides the public `Optimizer.aggregate_gradients` hook."""

from __future__ import annotations

import tensorflow as tf

from tf_dct import _private
from tf_dct import keras as keras_adapters


def accepts(optimizer) -> bool:
  try:
    import tf_keras  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(optimizer, tf_keras.optimizers.Optimizer)


class AggregateWithCompressor:
  """Mixin placed before a tf-keras optimizer class.

  With momentum, Adam or Adagrad correction
  (`Compressor.corrects_optimizer`) the compressor runs the optimizer's
  momentum, Adam or Adagrad update of a variable itself, so the optimizer
  applies what the compressor returns as plain SGD; every other variable
  keeps the optimizer's own update.
  """

  def build(self, var_list):
    with keras_adapters.in_replicator_scope(self._tf_dct_compressor.replicator):
      super().build(var_list)
    compressor = self._tf_dct_compressor
    compressor.create_states(var_list)
    self._tf_dct_plain = {_private.tf_keras_var_key(self, v) for v in var_list
                          if compressor.corrects_optimizer(v)}

  def update_step(self, gradient, variable):
    if _private.tf_keras_var_key(self, variable) in getattr(
        self, "_tf_dct_plain", ()):
      lr = tf.cast(self.learning_rate, variable.dtype)
      variable.assign_add(-lr * tf.convert_to_tensor(gradient))
      return
    super().update_step(gradient, variable)

  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    with keras_adapters.updates_wait_for_aggregation():
      return super().apply_gradients(grads_and_vars, *args, **kwargs)

  def aggregate_gradients(self, grads_and_vars):
    return keras_adapters.aggregate(self, grads_and_vars,
                                    _private.tf_keras_var_key)

  def communication_stats(self) -> dict:
    """The compressor's statistics; see `Compressor.communication_stats`."""
    return self._tf_dct_compressor.communication_stats()
