"""DCTSplit with a tf_dct Replicator: the in-place fallback outside a replica,
and the per-replica error-feedback residual of mode "xgrad_topk" (both Keras
flavours; 2 replicas x 2 logical CPUs)."""

from unittest import mock
import warnings

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import dct_mp as layers
from tf_dct import dct_mp as ops
from tf_dct.dct_mp import split as split_lib
from tests import util
from tests.dct_mp import reference

FLAVOURS = (("tf_keras", tf_keras, layers.DCTSplit),
            ("keras3", keras, layers.Keras3DCTSplit))


def setUpModule():
  util.setup_cpus()


class SplitReplicasTest(tf.test.TestCase, parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.repl = tf_dct.Replicator(num_devices_per_replica=2)

  @parameterized.named_parameters(*FLAVOURS)
  def test_target_logical_device_outside_a_replica_runs_in_place(self, k, cls):
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 16)), tf.float32)
    want = ops.dct_mp(x, 0.75)
    # Eager, no strategy: the values of the compact transfer, no device move.
    with tf.device("/cpu:2"):
      y = cls(0.75, target_logical_device=1)(x, training=True)
    self.assertAllEqual(y, want)
    self.assertIn("CPU:2", y.device)
    # A functional model built in the replicator's scope (a symbolic call).
    with self.repl.scope():
      k.utils.set_random_seed(0)
      inputs = k.Input((16,))
      split = cls(0.75, target_logical_device=1)
      hidden = split(k.layers.Dense(16, activation="relu")(inputs))
      model = k.Model(inputs, k.layers.Dense(1)(hidden))
      model.compile(k.optimizers.SGD(0.1), "mse")
    target = np.ones((8, 1), np.float32)
    with mock.patch.object(split_lib, "dct_mp_transfer",
                           wraps=ops.dct_mp_transfer) as transfer:
      direct = model(x, training=False).numpy()  # no strategy: in place
      self.assertEqual(transfer.call_count, 0)
      # Keras runs evaluate in the replicas: the compact transfer, same loss.
      loss = model.evaluate(x, target, batch_size=8, verbose=0)
      self.assertGreater(transfer.call_count, 0)
    self.assertAllClose(loss, np.mean((direct - target) ** 2))
    with self.repl.scope():
      with self.assertRaisesRegex(
          ValueError, r"target_logical_device must be in \[0, 2\) .* got 2"):
        cls(0.9, target_logical_device=2).build((4, 16))

  @parameterized.named_parameters(*FLAVOURS)
  def test_xgrad_topk_residual_is_checkpointed_per_replica(self, k, cls):
    del k
    with self.repl.scope():  # d = 64, k = 16: the indices cross bit-packed
      layer = cls(0.75, mode="xgrad_topk", target_logical_device=1)
      layer.build((4, 64))
    self.assertIsInstance(layer.residual, tf_dct.PerReplicaState)
    data = np.random.default_rng(1).normal(size=(3, 8, 64)).astype(np.float32)
    input_fn = lambda ctx: tf.data.Dataset.from_tensor_slices(data)

    def step_fn(x):
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.square(layer(x, training=True)))
      return tape.gradient(loss, x)

    want = [np.zeros((4, 64), np.float32) for _ in range(2)]
    for step in range(3):
      with warnings.catch_warnings():  # each flavour's input is new on purpose
        warnings.filterwarnings("ignore", "run.step_fn, input_fn.: this input_fn")
        dx = util.local(self.repl, self.repl.run(step_fn, input_fn))
      for r in range(2):  # replica r gets rows 4r..4r+3 of the global batch
        g = 2 * data[step, 4 * r:4 * r + 4] + want[r]
        mask = reference.topk_mask(g, 0.75)
        self.assertAllClose(dx[r], np.where(mask, g, 0))
        want[r] = np.where(mask, 0, g)
    saved = layer.residual.numpy()
    for r in range(2):
      self.assertAllClose(saved[r], want[r])
    self.assertNotAllClose(saved[0], saved[1])

    ckpt = tf.train.Checkpoint(layer=layer)
    path = ckpt.save(self.create_tempdir().full_path + "/ckpt")
    keys = [n for n, _ in tf.train.list_variables(path) if "residual" in n]
    self.assertLen(keys, 2, keys)  # one checkpoint key per replica
    layer.residual.assign_all([np.full((4, 64), 7.0, np.float32)] * 2)
    ckpt.restore(path).assert_existing_objects_matched()
    restored = layer.residual.numpy()
    for r in range(2):
      self.assertAllEqual(restored[r], saved[r])
    with self.assertRaisesRegex(ValueError, "residual is kept per replica"):
      layer(tf.ones([4, 64]), training=True)  # which replica's residual?
    self.assertAllEqual(layer.residual.numpy(), restored)

  def test_xgrad_topk_residual_needs_its_replicator(self):
    mirrored = util.builtin_mirrored(["/cpu:0", "/cpu:1"])
    with mirrored.scope():
      with self.assertRaisesRegex(
          ValueError, "residual per replica.*tf_dct replicator.*"
          "MirroredStrategy with 2 replicas"):
        layers.DCTSplit(0.75, mode="xgrad_topk").build((4, 8))
    layer = layers.DCTSplit(0.75, mode="xgrad_topk")
    layer.build((4, 8))  # no strategy: one plain variable
    self.assertIsInstance(layer.residual, tf.Variable)
    with self.assertRaisesRegex(ValueError, "built outside a tf_dct replicator's "
                                "scope.*2 replicas"):
      self.repl.run(lambda x: layer(x, training=True),
                    lambda ctx: tf.data.Dataset.from_tensors(tf.ones([8, 8])))


if __name__ == "__main__":
  tf.test.main()
