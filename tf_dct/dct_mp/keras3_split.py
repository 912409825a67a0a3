"""`DCTSplit` for Keras 3 (TF backend): `SplitLayerMixin` on a Keras 3 layer."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dct.dct_mp.split import SplitLayerMixin


@keras.saving.register_keras_serializable(package="tf_dct")
class DCTSplit(SplitLayerMixin, keras.layers.Layer):
  """DCT-MP split point (DCT Algorithm 2) as a Keras 3 layer (TF backend).

  Same arguments and behaviour as the tf-keras `tf_dct.dct_mp.DCTSplit`; see
  `SplitCore`.
  """

  def _add_state(self, name: str, shape: list, dtype: tf.DType):
    # keras.Variable, not add_weight: add_weight takes no `synchronization`.
    var = keras.Variable(
        initializer="zeros", shape=shape, dtype=tf.as_dtype(dtype).name,
        trainable=False, aggregation="only_first_replica",
        synchronization="on_read", name=name)
    # An attribute: tracked by Keras and by tf.train.Checkpoint.
    setattr(self, f"_state_{name}", var)
    return var
