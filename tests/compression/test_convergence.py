"""Convergence: DCTDP(0.99) and DEFT(0.01) train as well as Dense.

Also DEFT's defaults under Adam (`DEFTUnderAdamTest`), and TopK and DCTDP
with the small layers sent whole under momentum SGD and Adam
(`SmallLayersWholeTest`).

A small MLP (16 -> 256 ReLU -> 1) learns a fixed random teacher network on
synthetic Gaussian inputs (plus a little label noise) over 4 logical CPU
replicas of one `tf_dct.Replicator`. Each compressor is plugged in with
`repl.wrap_optimizer(SGD, compression=...)`; the run is repeated with tf-keras
`model.fit` (fed per replica, each replica the rows fit would give it) and
with a Keras 3 custom loop (`GradientTape` step driven by
`repl.run(step_fn, input_fn)`). Same data, same initial weights, same batches
for every compressor. The criterion is the issue's: the final loss (mean
squared error over the whole training set, evaluated after training) of each
compressor is within 1% of Dense's.

Sizes: at sparsity 0.99 the 16 x 256 kernel sends 41 entries per replica and
step, the 256-entry bias and 256 x 1 kernel 3 each. Error feedback delays
updates instead of dropping them, so with enough steps and a modest learning
rate the compressed runs catch up with Dense. The label noise (std 0.3, loss
floor 0.09 against 1.1 at the start) keeps the task a regression with a floor
that every run approaches; threshold_life=5 keeps tau tracking the shrinking
gradients.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tf_dct.compression import base
from tests import util

IN, HIDDEN = 16, 256
SAMPLES = 1024
BATCH = 64          # global; 16 per replica
EPOCHS = 16         # 16 steps per epoch -> 256 steps
LR = 0.02
NOISE = 0.3       # label noise std: the loss floor is NOISE**2
TOLERANCE = 0.01    # the "within 1% of Dense"
ADAM_LR = 0.01
# Under Adam, 256 steps leave DEFT's defaults a few percent above Dense's
# loss (error feedback's delay), the former defaults several times above.
ADAM_TOLERANCE = 0.15
# Momentum SGD at the same effective step as SGD's LR: lr / (1 - momentum).
MOMENTUM_LR = 0.002


def setUpModule():
  util.setup_cpus()


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SAMPLES, IN)).astype(np.float32)
  w1 = rng.normal(size=(IN, 32)) / np.sqrt(IN)
  w2 = rng.normal(size=(32, 1)) / np.sqrt(32)
  y = np.tanh(x @ w1) @ w2 * 2.0
  y += NOISE * rng.normal(size=y.shape)
  return x, y.astype(np.float32)


def _initial_weights():
  rng = np.random.default_rng(1)
  return [rng.normal(size=(IN, HIDDEN)).astype(np.float32) / np.sqrt(IN),
          np.zeros(HIDDEN, np.float32),
          rng.normal(size=(HIDDEN, 1)).astype(np.float32) / np.sqrt(HIDDEN),
          np.zeros(1, np.float32)]


def _model(k):
  model = k.Sequential([k.Input((IN,)), k.layers.Dense(HIDDEN, activation="relu"),
                        k.layers.Dense(1)])
  model.set_weights(_initial_weights())
  return model


def _compressors():
  return {"dense": compression.Dense(),
          # The papers' settings (min_count 0 / 1, every variable
          # compressed, DEFT's budget split by norms): the criterion is
          # two-sided, and with the default floor, or with the small biases
          # all-reduced whole, they end over 1% *below* dense's loss on this
          # small model. (DEFT's budget split by size with a floor of 1
          # leaves the 256-entry output kernel 2 entries a step: 12% above.)
          "dctdp": compression.DCTDP(0.99, threshold_life=5, min_count=0,
                                     dense_gradients="compress"),
          "deft": compression.DEFT(0.01, min_count=1, budget="norm",
                                   dense_gradients="compress")}


def _final_loss(model, x, y):
  pred = np.asarray(model(x, training=False))
  return float(np.mean((pred - y) ** 2))


def _per_replica_input(repl, x, y):
  """fit's input: the replica with input pipeline r reads rows [r b, (r + 1) b)
  of every global batch (b = BATCH / replicas), as fit splits a global batch
  of x, y itself (same batches, same losses bit for bit), from its own
  dataset without tf.data autotune. fit's own input (a multi-device
  iterator) starts autotune threads that ignore the dataset's options and
  block its teardown at the end of every fit() for up to a minute."""
  per_replica = BATCH // repl.num_replicas_in_sync

  def dataset_fn(ctx):
    rows = slice(ctx.input_pipeline_id * per_replica,
                 (ctx.input_pipeline_id + 1) * per_replica)
    return util.without_autotune(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).map(
            lambda xb, yb: (xb[rows], yb[rows])).repeat())

  return repl.distribute_datasets_from_function(
      dataset_fn, tf.distribute.InputOptions(
          experimental_replication_mode=tf.distribute.InputReplicationMode
          .PER_REPLICA,
          experimental_place_dataset_on_device=True,
          experimental_fetch_to_device=False))


def _fit_tf_keras(compressor):
  x, y = _data()
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(util.NUM_CPUS)])
  with repl.scope():
    model = _model(tf_keras)
    opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(LR), compression=compressor)
    model.compile(optimizer=opt, loss="mse")
  opt.build(model.trainable_variables)  # state first: fit traces its step once
  model.fit(_per_replica_input(repl, x, y), epochs=EPOCHS,
            steps_per_epoch=SAMPLES // BATCH, verbose=0)
  return _final_loss(model, x, y)


def _custom_loop_keras3(compressor, make_optimizer=lambda: keras.optimizers.SGD(LR)):
  x, y = _data()
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(util.NUM_CPUS)])
  with repl.scope():
    model = _model(keras)
    opt = repl.wrap_optimizer(make_optimizer(), compression=compressor)
    opt.build(model.trainable_variables)  # state first: the step traces once

  def input_fn(ctx):
    del ctx
    return util.without_autotune(tf.data.Dataset.from_tensor_slices(
        (x, y)).batch(BATCH, drop_remainder=True).repeat(EPOCHS))

  def step_fn(batch):
    xb, yb = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / BATCH
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  for _ in range(EPOCHS * SAMPLES // BATCH):
    repl.run(step_fn, input_fn)
  return _final_loss(model, x, y)


@pytest.mark.slow(seconds=25)  # 6 trainings of 256 steps on 4 replicas
class ConvergenceTest(tf.test.TestCase):

  def _check(self, train):
    losses = {name: train(c) for name, c in _compressors().items()}
    print(f"final losses ({train.__name__}): {losses}")
    x, y = _data()
    start = _final_loss(_model(tf_keras), x, y)
    # Training did something: Dense learned most of the signal.
    self.assertLess(losses["dense"], 0.2 * start)
    for name in ("dctdp", "deft"):
      self.assertLessEqual(
          abs(losses[name] - losses["dense"]), TOLERANCE * losses["dense"],
          msg=f"{name}: final loss {losses[name]:.6f} vs dense "
              f"{losses['dense']:.6f} (start {start:.6f})")

  def test_tf_keras_fit(self):
    self._check(_fit_tf_keras)

  def test_keras3_custom_loop(self):
    self._check(_custom_loop_keras3)


@pytest.mark.slow(seconds=20)  # 3 trainings of 256 steps on 4 replicas
class DEFTUnderAdamTest(tf.test.TestCase):
  """DEFT's defaults under Adam: Adam correction, and the variables under
  `base.WHOLE_BELOW` entries (both biases and the 256-entry output kernel)
  sent whole. With every variable compressed and no correction (the
  former defaults) the output kernel sends 8 entries a step in all and the
  run ends far above dense's loss."""

  def test_defaults_train_close_to_dense(self):
    adam = lambda: keras.optimizers.Adam(ADAM_LR)
    losses = {name: _custom_loop_keras3(c, adam) for name, c in (
        ("dense", compression.Dense()), ("deft", compression.DEFT(0.01)),
        ("former", compression.DEFT(0.01, adam=False, whole_below=0)))}
    print(f"final losses under Adam: {losses}")
    self.assertLessEqual(losses["deft"], (1 + ADAM_TOLERANCE) * losses["dense"])
    # The criterion tells the two apart: the former defaults fail it.
    self.assertGreater(losses["former"], (1 + ADAM_TOLERANCE) * losses["dense"])


@pytest.mark.slow(seconds=35)  # 7 trainings of 256 steps on 4 replicas
class SmallLayersWholeTest(tf.test.TestCase):
  """TopK and DCTDP with the layers under `base.WHOLE_BELOW` entries (both
  biases and the 256-entry output kernel) sent whole. TopK compressing
  them too (8 entries of 256 a step) is unstable under momentum SGD (with
  momentum correction): the delayed updates of the output layer, amplified
  by momentum, blow the loss up; under Adam it ends far behind."""

  def test_under_momentum(self):
    sgd = lambda: keras.optimizers.SGD(MOMENTUM_LR, momentum=0.9)
    losses = {name: _custom_loop_keras3(c, sgd) for name, c in (
        ("dense", compression.Dense()),
        ("topk", compression.TopK(0.01, whole_below=base.WHOLE_BELOW)),
        ("dctdp", compression.DCTDP(0.99, threshold_life=5,
                                    whole_below=base.WHOLE_BELOW)),
        ("topk_small_compressed", compression.TopK(0.01, whole_below=0)))}
    print(f"final losses under momentum SGD: {losses}")
    x, y = _data()
    self.assertLess(losses["dense"], 0.2 * _final_loss(_model(keras), x, y))
    for name in ("topk", "dctdp"):
      self.assertLessEqual(abs(losses[name] - losses["dense"]),
                           TOLERANCE * losses["dense"], msg=name)
    # The criterion tells the two apart.
    self.assertGreater(losses["topk_small_compressed"], 1.5 * losses["dense"])

  def test_under_adam(self):
    adam = lambda: keras.optimizers.Adam(ADAM_LR)
    losses = {name: _custom_loop_keras3(c, adam) for name, c in (
        ("dense", compression.Dense()),
        ("topk", compression.TopK(0.01, whole_below=base.WHOLE_BELOW)),
        ("topk_small_compressed", compression.TopK(0.01, whole_below=0)))}
    print(f"final losses under Adam: {losses}")
    self.assertLessEqual(losses["topk"], (1 + ADAM_TOLERANCE) * losses["dense"])
    self.assertGreater(losses["topk_small_compressed"],
                       (1 + ADAM_TOLERANCE) * losses["dense"])


if __name__ == "__main__":
  tf.test.main()
