"""Keras 3 adapter: overrides the private aggregation method pinned in `_private`."""

from __future__ import annotations

import tensorflow as tf

from tf_dct import _private
from tf_dct import keras as keras_adapters


def accepts(optimizer) -> bool:
  try:
    base = _private.keras3_optimizer_base()
  except ImportError:
    return False
  return isinstance(optimizer, base)


class AggregateWithCompressor:
  """Mixin placed before a Keras 3 (TF backend) optimizer class.

  As in the tf-keras adapter, the variables whose momentum, Adam or Adagrad
  update the compressor runs itself (`Compressor.corrects_optimizer`) are
  applied as plain SGD.
  """

  def build(self, variables):
    with keras_adapters.in_replicator_scope(self._tf_dct_compressor.replicator):
      super().build(variables)
    compressor = self._tf_dct_compressor
    compressor.create_states(variables)
    self._tf_dct_plain = {_private.keras3_var_key(self, v) for v in variables
                          if compressor.corrects_optimizer(v)}

  def update_step(self, gradient, variable, learning_rate):
    if _private.keras3_var_key(self, variable) in getattr(
        self, "_tf_dct_plain", ()):
      lr = tf.cast(learning_rate, variable.dtype)
      variable.assign_sub(lr * tf.convert_to_tensor(gradient))
      return
    super().update_step(gradient, variable, learning_rate)

  def apply(self, grads, trainable_variables=None):
    with keras_adapters.updates_wait_for_aggregation():
      return super().apply(grads, trainable_variables)

  def _all_reduce_sum_gradients(self, grads_and_vars):
    return keras_adapters.aggregate(self, grads_and_vars,
                                    _private.keras3_var_key)

  def communication_stats(self) -> dict:
    """The compressor's statistics; see `Compressor.communication_stats`."""
    return self._tf_dct_compressor.communication_stats()


assert AggregateWithCompressor._all_reduce_sum_gradients.__name__ == (
    _private.KERAS3_AGGREGATION_METHOD)
