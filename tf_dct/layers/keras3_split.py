"""`DCTSplit` for Keras 3: a thin wrapper of `tf_dct.layers.dct_split.SplitCore`."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dct.layers.dct_split import SplitCore


@keras.saving.register_keras_serializable(package="tf_dct")
class DCTSplit(keras.layers.Layer):
  """DCT-MP split point (DCT Algorithm 2) as a Keras 3 layer (TF backend).

  Same arguments and behaviour as the tf-keras `tf_dct.layers.DCTSplit`; see
  `SplitCore`. State variables are per replica ("on_read").
  """

  def __init__(self, sparsity: float = 0.9, mode: str = "dct",
               apply_at_inference: bool | None = None,
               target_device: str | None = None,
               target_logical_device: int | None = None,
               sketch_seed: int = 0, feedback_rows: int | None = None,
               **kwargs):
    core = SplitCore(sparsity, mode, apply_at_inference, target_device,
                     target_logical_device, sketch_seed, feedback_rows)
    kwargs.setdefault("autocast", False)
    super().__init__(**kwargs)
    core.name = self.name
    self._core = core
    self._state = []

  def build(self, input_shape):
    self._core.build(input_shape, self._add_state)

  def _add_state(self, name: str, shape: list, dtype: tf.DType):
    var = keras.Variable(
        initializer="zeros", shape=shape, dtype=tf.as_dtype(dtype).name,
        trainable=False, aggregation="only_first_replica",
        synchronization="on_read", name=name)
    self._state.append(var)
    return var

  def call(self, inputs, training=None):
    return self._core(inputs, training=bool(training))

  def compute_output_shape(self, input_shape):
    return input_shape

  @property
  def sparsity(self) -> float:
    return self._core.sparsity

  @property
  def mode(self) -> str:
    return self._core.mode

  @property
  def residual(self):
    """The error-feedback residual ("xgrad_topk"), else None."""
    return self._core.residual

  def bytes_stats(self) -> dict[str, int]:
    """Accounting (last active call and totals, first replica) as ints."""
    return self._core.read_stats()

  def get_config(self):
    return {**super().get_config(), **self._core.config()}
