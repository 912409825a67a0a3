"""A small regression MLP on synthetic data with a learnable signal.

The targets come from a fixed random "teacher" (a one-hidden-layer network
plus a little noise), so a student trained on them has a real loss to drive
down. Used by the Quick-start job and by tests of the launcher.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from models.flavour import keras

from models.data import order

NUM_FEATURES = 16


def build_model(hidden: tuple[int, ...] = (64, 32), seed: int = 0) -> keras.Model:
  """The student: ReLU MLP with one linear output."""
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((NUM_FEATURES,))]
  layers += [keras.layers.Dense(n, activation="relu") for n in hidden]
  layers.append(keras.layers.Dense(1))
  return keras.Sequential(layers, name="mlp")


def make_dataset(batch_size: int, seed: int = 0, noise: float = 0.05,
                 start: int = 0) -> tf.data.Dataset:
  """Endless (features, target) batches labelled by a fixed random teacher.

  Batch `i` depends on `i` alone; the stream begins at batch `start` (made
  directly, for a resume).
  """
  rng = np.random.default_rng(seed)
  w1 = rng.normal(size=(NUM_FEATURES, 8)).astype(np.float32) / np.sqrt(NUM_FEATURES)
  w2 = rng.normal(size=(8, 1)).astype(np.float32)

  def label(x):
    y = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
    return x, y + noise * tf.random.stateless_normal(tf.shape(y), [seed, 1])

  def features(i):
    ints = tf.random.stateless_uniform([batch_size, NUM_FEATURES], tf.stack(
        [tf.constant(seed, tf.int64), i]), 0, 2001, tf.int64)
    return tf.cast(ints, tf.float32) / 1000.0 - 1.0

  order.check_start(start)
  return tf.data.Dataset.range(start, order.ENDLESS).map(features).map(label).prefetch(2)
