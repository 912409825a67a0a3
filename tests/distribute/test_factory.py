"""Tests for tf_dct.distribute.factory: kinds, the CPU split and argument errors."""

import os
import subprocess
import sys
from unittest import mock

import tensorflow as tf

import tf_dct
from tests import util


def setUpModule():
  util.setup_cpus()


class CreateReplicatorTest(tf.test.TestCase):

  def test_cpu_kind(self):
    repl = tf_dct.create_replicator("cpu", num_replicas=2, num_devices_per_replica=2)
    self.assertIsInstance(repl, tf_dct.Replicator)
    self.assertEqual(repl.num_replicas, 2)
    self.assertEqual(repl.num_devices_per_replica, 2)

  def test_auto_is_cpu_here(self):
    with mock.patch.dict("os.environ"):
      os.environ.pop("TF_CONFIG", None)
      repl = tf_dct.create_replicator(num_replicas=4)
    self.assertIsInstance(repl, tf_dct.Replicator)
    self.assertEqual(repl.num_replicas, 4)

  def test_split_already_initialized_differently(self):
    with self.assertRaisesRegex(RuntimeError, "need 2 logical CPU devices but TensorFlow "
                                "is already initialized with 4"):
      tf_dct.create_replicator("cpu", num_replicas=2)
    with self.assertRaisesRegex(RuntimeError, "already initialized with 4"):
      tf_dct.split_cpu(3)

  def test_argument_errors(self):
    with self.assertRaisesRegex(ValueError, "kind must be one of .*'cpu'.* got 'cuda'"):
      tf_dct.create_replicator("cuda")
    with self.assertRaisesRegex(ValueError, "num_replicas must be an int >= 1, got 0"):
      tf_dct.create_replicator("cpu", num_replicas=0)
    with self.assertRaisesRegex(ValueError, "num_devices_per_replica must be an int >= 1"):
      tf_dct.create_replicator("cpu", num_replicas=1, num_devices_per_replica=-2)
    with self.assertRaisesRegex(RuntimeError, "kind='gpu' but TensorFlow sees no GPU"):
      tf_dct.create_replicator("gpu")
    with self.assertRaisesRegex(ValueError, "num_replicas is not used by kind='multi_worker'"):
      tf_dct.create_replicator("multi_worker", num_replicas=2)
    with self.assertRaisesRegex(ValueError, "kind='async' supports num_devices_per_replica=1 only"):
      tf_dct.create_replicator("async", num_devices_per_replica=2)

  def test_cpu_advice_after_no_gpu_works_in_the_same_process(self):
    # A fresh process: this one's devices were split in setUpModule.
    code = ("import tf_dct\n"
            "try:\n  tf_dct.create_replicator('gpu')\n"
            "except RuntimeError as e:\n  print(e)\n"
            "print('replicas', tf_dct.create_replicator('cpu', num_replicas=2).num_replicas)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=True,
                         timeout=300).stdout
    self.assertIn("use kind='cpu'", out)
    self.assertIn("replicas 2", out)

  def test_async_kind_checks_tf_config_first(self):
    with mock.patch.dict("os.environ"):
      os.environ.pop("TF_CONFIG", None)
      with self.assertRaisesRegex(ValueError, "TF_CONFIG"):
        tf_dct.create_replicator("async")

  def test_malformed_tf_config_is_reported_before_anything_starts(self):
    with mock.patch.dict("os.environ", {"TF_CONFIG": "{not json"}):
      with self.assertRaisesRegex(ValueError, "TF_CONFIG is not valid JSON"):
        tf_dct.create_replicator("auto")
      with self.assertRaisesRegex(ValueError, "TF_CONFIG is not valid JSON"):
        tf_dct.create_replicator("multi_worker")


if __name__ == "__main__":
  tf.test.main()
