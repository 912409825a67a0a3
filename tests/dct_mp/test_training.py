"""A model with DCTSplit(0.9) after a ReLU trains as well as without it.

Task: 8 Gaussian clusters in 16 dimensions, the label is the cluster's parity,
10% of labels flipped (the Bayes cross-entropy is 0.325). Model: Dense(64,
relu) -> [DCTSplit(0.9): k = 7 of 64] -> Dense(1). The criterion: the final
training loss with the split (evaluated on the whole training set with the
split applied, its default at inference) is at most 1% above the loss without
it. Held-out loss is only bounded loosely (5%): across seeds 3, 5 and 11 it
came out 0.2% to 2.7% above the model without the split (while the training
loss was 0.6% to 3.7% below), so a 1% held-out bound would pass on this seed
by luck, not by design.
"""

import keras
import numpy as np
import tensorflow as tf
import tf_keras

from tf_dct import dct_mp as layers
from tests import util

D, HIDDEN, CLUSTERS, SPARSITY = 16, 64, 8, 0.9


def setUpModule():
  util.setup_cpus()


def _data(n, seed, flip=0.1):
  centers = np.random.default_rng(0).normal(size=(CLUSTERS, D)) * 1.5
  rng = np.random.default_rng(seed)
  c = rng.integers(0, CLUSTERS, n)
  x = (centers[c] + rng.normal(size=(n, D))).astype(np.float32)
  y = (c % 2).astype(np.float32)
  flipped = rng.random(n) < flip
  y[flipped] = 1 - y[flipped]
  return x, y[:, None]


TRAIN, TEST = _data(2048, 1), _data(1024, 2)


class TrainingTest(tf.test.TestCase):

  def _tf_keras_losses(self, split):
    tf_keras.utils.set_random_seed(3)
    model = tf_keras.Sequential(
        [tf_keras.Input((D,)), tf_keras.layers.Dense(HIDDEN, activation="relu")]
        + ([layers.DCTSplit(SPARSITY)] if split else [])
        + [tf_keras.layers.Dense(1)])
    opt = tf_keras.optimizers.Adam(3e-3)
    opt.build(model.trainable_variables)  # slots first: fit traces its step once
    model.compile(opt, tf_keras.losses.BinaryCrossentropy(from_logits=True))
    model.fit(*TRAIN, batch_size=64, epochs=5, verbose=0, shuffle=True)
    return [model.evaluate(*data, batch_size=256, verbose=0) for data in (TRAIN, TEST)]

  def _keras3_losses(self, split):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((D,)), keras.layers.Dense(HIDDEN, activation="relu")]
        + ([layers.Keras3DCTSplit(SPARSITY)] if split else [])
        + [keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(3e-3)
    opt.build(model.trainable_variables)  # slots first: the step traces once
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
      with tf.GradientTape() as tape:
        loss = bce(y, model(x, training=True))
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    rng = np.random.default_rng(4)
    x, y = TRAIN
    for _ in range(5):
      order = rng.permutation(len(x))
      for i in range(0, len(x), 64):
        train_step(x[order[i:i + 64]], y[order[i:i + 64]])
    return [float(bce(data[1], model(data[0], training=False))) for data in (TRAIN, TEST)]

  def _check(self, base, dct):
    for name, b, s, tol in zip(("train", "held-out"), base, dct, (1.01, 1.05)):
      self.assertLessEqual(s, tol * b, f"{name} loss {s:.4f} vs {b:.4f} without DCT-MP")

  def test_tf_keras_fit(self):
    self._check(self._tf_keras_losses(False), self._tf_keras_losses(True))

  def test_keras3_custom_loop(self):
    self._check(self._keras3_losses(False), self._keras3_losses(True))


if __name__ == "__main__":
  tf.test.main()
