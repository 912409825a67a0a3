"""Tests for tf_dct.distribute.tpu. No TPU exists here: the path up to the resolver runs."""

from unittest import mock

import tensorflow as tf

import tf_dct
from tf_dct.distribute import tpu


class TpuReplicatorTest(tf.test.TestCase):

  def test_no_tpu_is_a_clear_error(self):
    with self.assertRaisesRegex(RuntimeError, r"no TPU could be used for tpu='local'"):
      tf_dct.TpuReplicator(tpu="local")
    with self.assertRaisesRegex(RuntimeError, r"no TPU could be used for tpu='local'"):
      tf_dct.create_replicator("tpu")

  def test_resolver_is_asked_with_the_given_name(self):
    resolver_cls = mock.Mock(side_effect=ValueError("not found"))
    with mock.patch.object(tf.distribute.cluster_resolver, "TPUClusterResolver", resolver_cls):
      with self.assertRaisesRegex(RuntimeError, r"tpu='my-tpu' \(not found\)"):
        tpu.resolve_tpu("my-tpu")
    resolver_cls.assert_called_once_with(tpu="my-tpu")

  def test_connects_and_initializes_when_a_tpu_answers(self):
    resolver = object()
    with mock.patch.object(tf.distribute.cluster_resolver, "TPUClusterResolver",
                           return_value=resolver), \
         mock.patch.object(tf.config, "experimental_connect_to_cluster") as connect, \
         mock.patch.object(tf.tpu.experimental, "initialize_tpu_system") as init:
      self.assertIs(tpu.resolve_tpu("local"), resolver)
    connect.assert_called_once_with(resolver)
    init.assert_called_once_with(resolver)

  def test_argument_errors(self):
    with self.assertRaisesRegex(NotImplementedError, "num_devices_per_replica=1 only, got 2"):
      tf_dct.TpuReplicator(num_devices_per_replica=2)
    with self.assertRaisesRegex(ValueError, "num_devices_per_replica must be an int >= 1"):
      tf_dct.TpuReplicator(num_devices_per_replica=0)


if __name__ == "__main__":
  tf.test.main()
