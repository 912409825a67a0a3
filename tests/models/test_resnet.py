"""Tests for models/resnet.py: CIFAR ResNet-18 and its data under a Replicator."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_dct
from models import resnet
from models.data import cifar
from tests import util


def setUpModule():
  util.setup_cpus()


class ModelTest(tf.test.TestCase):

  def test_resnet18_shape(self):
    model = resnet.resnet()
    convs = [l for l in model.layers if isinstance(l, tf_keras.layers.Conv2D)]
    # 1 stem + 8 blocks x 2 convs + 3 projection shortcuts, +1 dense = 18 weight layers
    # in the main path.
    self.assertLen(convs, 1 + 16 + 3)
    self.assertEqual(model.output_shape, (None, 10))
    self.assertEqual(model.get_layer("stage3_block1_out").output_shape, (None, 4, 4, 512))
    # The usual CIFAR ResNet-18 count (trainable; BN moving statistics excluded).
    self.assertEqual(sum(int(np.prod(v.shape)) for v in model.trainable_variables),
                     11_173_962)

  @pytest.mark.slow(seconds=12)
  def test_trains_under_replicator(self):
    # 2 data-parallel replicas over the 4 logical CPUs (the second device of
    # each idles): half the replica graphs of the default 4 x 1 to trace, the
    # same global batch.
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    global_batch = 32
    with repl.scope():
      # Two stages keep the trace short.
      model = resnet.build_model(seed=0, widths=(8, 16), blocks_per_stage=1)
      optimizer = repl.wrap_optimizer(tf_keras.optimizers.Adam(1e-2))
      optimizer.build(model.trainable_variables)  # slots first: the step traces once
    dataset = resnet.make_dataset(global_batch, seed=0)
    input_fn = lambda ctx: dataset

    def step_fn(batch):
      images, labels = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(resnet.loss(labels, model(images, training=True))) / global_batch
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    losses = [sum(float(t) for t in repl.experimental_local_results(repl.run(step_fn, input_fn)))
              for _ in range(25)]
    self.assertLess(np.mean(losses[-5:]), 0.75 * np.mean(losses[:5]))
    self.assertGreater(resnet.evaluate(model, batch_size=256)["accuracy"], 0.2)


class DataDirTest(tf.test.TestCase):

  def test_reads_cifar_dir(self):
    d = self.create_tempdir().full_path
    rng = np.random.default_rng(0)
    for i, name in enumerate(cifar.TRAIN_FILES + cifar.TEST_FILES):
      labels = np.array([i, (i + 1) % 10, 9], np.uint8)
      pixels = rng.integers(0, 256, (3, 3072), np.uint8)
      with open(os.path.join(d, name), "wb") as f:
        f.write(np.concatenate([labels[:, None], pixels], 1).tobytes())
    train = resnet.make_dataset(6, data_dir=d)
    images, labels = next(iter(train))
    self.assertEqual(images.shape, (6, 32, 32, 3))
    self.assertEqual(images.dtype, tf.float32)
    test = list(resnet.make_dataset(2, data_dir=d, split="test"))
    self.assertLen(test, 2)  # 3 records: a full batch and a short one
    self.assertAllEqual(np.concatenate([y for _, y in test]), [5, 6, 9])
    self.assertAllClose(tf.reduce_mean(test[0][0], [0, 1, 2]), tf.reduce_mean(
        cifar.normalize(cifar.load(d, "test")[0][:2]), [0, 1, 2]))
    with self.assertRaisesRegex(ValueError, "split must be 'train' or 'test'"):
      resnet.make_dataset(2, data_dir=d, split="valid")
    with self.assertRaisesRegex(FileNotFoundError, "missing_dir"):
      resnet.make_dataset(2, data_dir=os.path.join(d, "missing_dir"))


if __name__ == "__main__":
  tf.test.main()
