"""Shared test helpers."""

import tensorflow as tf

import tf_dct

NUM_CPUS = 4


def setup_cpus() -> list[str]:
  """Splits the CPU into NUM_CPUS logical devices (idempotent across modules)."""
  return tf_dct.split_cpu(NUM_CPUS)


def builtin_mirrored(devices) -> tf.distribute.MirroredStrategy:
  """A plain built-in MirroredStrategy with its own collective key range.

  Every built-in instance starts its collective keys at the same base, so two
  of them over the same devices in one process clash; TF's own tests bump the
  class attribute the same way (strategy_combinations.py).
  """
  tf.distribute.MirroredStrategy._collective_key_base += 100_000  # pylint: disable=protected-access
  return tf.distribute.MirroredStrategy(devices)


def local(strategy, value):
  """Per-replica results of `value` as a list of numpy arrays (nested ok)."""
  return [tf.nest.map_structure(lambda t: t.numpy(), v)
          for v in strategy.experimental_local_results(value)]
