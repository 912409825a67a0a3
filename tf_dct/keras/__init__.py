"""Thin adapters that route each Keras flavour's gradient aggregation to a Compressor.

tf-keras exposes a public hook, `Optimizer.aggregate_gradients`; Keras 3 (TF
backend) aggregates in the private `TFOptimizer._all_reduce_sum_gradients`
(pinned in `tf_dct._private`). Either way the optimizer instance gets a
subclass of its own class that overrides that one method, so its state,
hyper-parameters, serialization and checkpoint layout stay as they were. The
mixins also add `communication_stats()`, a passthrough to the compressor,
and extend `build(variables)` to create the compressor's state as well.
"""

from __future__ import annotations

from tf_dct.compression.base import Compressor

_WRAPPED_CLASSES = {}


def _swap_class(optimizer, hook_mixin):
  base = type(optimizer)
  key = (base, hook_mixin)
  if key not in _WRAPPED_CLASSES:
    cls = type(base.__name__, (hook_mixin, base), {})
    # Keep the base's identity for Keras serialization (get_config round-trips
    # to the plain optimizer: compression is a runtime concern).
    cls.__qualname__ = base.__qualname__
    cls.__module__ = base.__module__
    _WRAPPED_CLASSES[key] = cls
  optimizer.__class__ = _WRAPPED_CLASSES[key]


def is_wrapped(optimizer) -> bool:
  return getattr(optimizer, "_tf_dct_compressor", None) is not None


def communication_stats(optimizer) -> dict:
  """`optimizer.communication_stats()` of a wrapped optimizer."""
  if not is_wrapped(optimizer):
    raise ValueError("optimizer is not wrapped by tf_dct.wrap_optimizer")
  return optimizer._tf_dct_compressor.communication_stats()  # pylint: disable=protected-access


def wrap_optimizer(optimizer, compressor: Compressor, replicator):
  """Wraps `optimizer` in place so it aggregates through `compressor`."""
  if not isinstance(compressor, Compressor):
    raise TypeError("compression must be a tf_dct.compression.Compressor, got "
                    f"{type(compressor).__name__}")
  if is_wrapped(optimizer):
    raise ValueError("optimizer is already wrapped by tf_dct.wrap_optimizer")
  from tf_dct.keras import keras3_optimizer, tf_keras_optimizer  # pylint: disable=g-import-not-at-top
  if tf_keras_optimizer.accepts(optimizer):
    mixin = tf_keras_optimizer.AggregateWithCompressor
  elif keras3_optimizer.accepts(optimizer):
    mixin = keras3_optimizer.AggregateWithCompressor
  else:
    raise TypeError(
        "optimizer must be a tf-keras (tf_keras.optimizers.Optimizer, not the "
        "legacy OptimizerV2) or Keras 3 optimizer, got "
        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
  compressor.bind(replicator)
  _swap_class(optimizer, mixin)
  optimizer._tf_dct_compressor = compressor  # tracked: per-replica state is checkpointed
  return optimizer
