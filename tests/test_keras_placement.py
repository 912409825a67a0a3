"""Tests for tf_dct.keras.placement: a split model's stages on logical devices."""

from absl.testing import parameterized
import keras
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct.keras import placement
from tests import util

FLAVOURS = {
    "tf_keras": (tf_keras, tf_dct.dct_mp.DCTSplit),
    "keras3": (keras, tf_dct.dct_mp.Keras3DCTSplit),
}


def setUpModule():
  util.setup_cpus()


def _recorder(k):
  """An identity layer that remembers the device its op was placed on."""

  class Recorder(k.layers.Layer):

    def call(self, x):
      y = tf.identity(x)
      self.device = y.device
      return y

  return Recorder


def _model(flavour, target):
  k, split = FLAVOURS[flavour]
  recorder = _recorder(k)
  x = k.Input((8,))
  h = k.layers.Dense(8, name="a")(x)
  before = recorder(name="before")
  h = before(h)
  s = split(0.5, target_logical_device=target, name="split")
  h = s(h)
  after = recorder(name="after")
  y = after(k.layers.Dense(1, name="b")(h))
  return k.Model(x, y), s, before, after


class PlaceStagesTest(parameterized.TestCase, tf.test.TestCase):

  @parameterized.named_parameters(("tf_keras", "tf_keras"), ("keras3", "keras3"))
  def test_layers_after_the_split_run_on_its_target(self, flavour):
    devices = util.setup_cpus()[:4]
    repl = tf_dct.Replicator(devices, num_devices_per_replica=2)
    with repl.scope():
      model, split, before, after = _model(flavour, target=1)
    placed = placement.place_stages(model, [split], 2)
    self.assertEqual(placed["a"], 0)
    self.assertEqual(placed["split"], 0)
    self.assertEqual(placed["b"], 1)
    self.assertEqual(placed["after"], 1)

    @tf.function
    def step():
      return repl.run(lambda: model(tf.ones((2, 8)), training=True))

    step()
    # The last replica traced last: its devices are the last group.
    self.assertEqual(tf.DeviceSpec.from_string(before.device).device_index,
                     tf.DeviceSpec.from_string(devices[2]).device_index)
    self.assertEqual(tf.DeviceSpec.from_string(after.device).device_index,
                     tf.DeviceSpec.from_string(devices[3]).device_index)
    # Outside a replica the layers run where they are called.
    with tf.device(devices[0]):
      model(tf.ones((2, 8)))
    self.assertEqual(tf.DeviceSpec.from_string(after.device).device_index,
                     tf.DeviceSpec.from_string(devices[0]).device_index)

  def test_split_targeting_another_device_is_an_error(self):
    model, split, _, _ = _model("tf_keras", target=0)
    with self.assertRaisesRegex(ValueError, "split split targets device 0 but the "
                                "layers after it are on device 1"):
      placement.place_stages(model, [split], 2)


if __name__ == "__main__":
  tf.test.main()
