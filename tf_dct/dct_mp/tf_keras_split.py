"""`DCTSplit` for tf-keras: `SplitLayerMixin` on a tf-keras layer."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf_dct.dct_mp.split import SplitLayerMixin


@tf_keras.utils.register_keras_serializable(package="tf_dct")
class DCTSplit(SplitLayerMixin, tf_keras.layers.Layer):
  """DCT-MP split point (DCT Algorithm 2) as a tf-keras layer.

  Place it after the ReLU of the last layer before a model split. See
  `SplitCore` for the arguments, the inference behaviour
  (`apply_at_inference`), modes, device fallback and accounting. Inputs are
  not autocast: the op runs in the input's dtype (float16, bfloat16,
  float32 or float64).
  """

  def _add_state(self, name: str, shape: list, dtype: tf.DType):
    return self.add_weight(
        name=name, shape=shape, dtype=dtype, initializer="zeros",
        trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
