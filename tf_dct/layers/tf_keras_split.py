"""`DCTSplit` for tf-keras: a thin wrapper of `tf_dct.layers.dct_split.SplitCore`."""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf_dct.layers.dct_split import SplitCore


@tf_keras.utils.register_keras_serializable(package="tf_dct")
class DCTSplit(tf_keras.layers.Layer):
  """DCT-MP split point (DCT Algorithm 2) as a tf-keras layer.

  Place it after the ReLU of the last layer before a model split. See
  `SplitCore` for the arguments, the inference behaviour
  (`apply_at_inference`), modes and accounting. Inputs are not autocast: the
  op runs in the input's dtype (float16, bfloat16, float32).
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

  def build(self, input_shape):
    self._core.build(input_shape, self._add_state)
    super().build(input_shape)

  def _add_state(self, name: str, shape: list, dtype: tf.DType):
    return self.add_weight(
        name=name, shape=shape, dtype=dtype, initializer="zeros",
        trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

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
