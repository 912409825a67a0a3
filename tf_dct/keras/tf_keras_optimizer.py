"""tf-keras adapter: overrides the public `Optimizer.aggregate_gradients` hook."""

from __future__ import annotations


def accepts(optimizer) -> bool:
  try:
    import tf_keras  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return isinstance(optimizer, tf_keras.optimizers.Optimizer)


class AggregateWithCompressor:
  """Mixin placed before a tf-keras optimizer class."""

  def build(self, var_list):
    super().build(var_list)
    self._tf_dct_compressor.create_states(var_list)

  def aggregate_gradients(self, grads_and_vars):
    return self._tf_dct_compressor.aggregate(grads_and_vars)

  def communication_stats(self) -> dict:
    """The compressor's statistics; see `Compressor.communication_stats`."""
    return self._tf_dct_compressor.communication_stats()
