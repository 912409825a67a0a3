"""Fails loudly when a private TF / Keras API that tf_dct pins has drifted."""

import tensorflow as tf

import tf_dct
from tf_dct import _private
from tests import util


def setUpModule():
  util.setup_cpus()


class PrivateApiTest(tf.test.TestCase):

  def test_pinned_apis_exist(self):
    _private.check()

  def test_in_xla_context_sees_jit_compile_and_its_inner_functions(self):
    seen = {}

    def probe(key):
      seen[key] = _private.in_xla_context()
      return tf.constant(0)

    probe("eager")
    tf.function(lambda: probe("graph"))()
    tf.function(lambda: probe("xla"), jit_compile=True)()
    inner = tf.function(lambda: probe("inner"))
    tf.function(lambda: inner(), jit_compile=True)()  # pylint: disable=unnecessary-lambda
    self.assertEqual(seen, {"eager": False, "graph": False, "xla": True,
                            "inner": True})

  def test_each_replicator_has_its_own_collective_keys(self):
    a, b = tf_dct.Replicator(), tf_dct.Replicator()
    base_a = a.extended._collective_keys._group_key  # pylint: disable=protected-access
    base_b = b.extended._collective_keys._group_key  # pylint: disable=protected-access
    self.assertGreater(base_a, 0)
    self.assertNotEqual(base_a, base_b)
    self.assertEqual(tf.distribute.MirroredStrategy._collective_key_base % 100_000, 0)  # pylint: disable=protected-access

  def test_unmirrored_variable_escapes_the_strategy_creator(self):
    repl = tf_dct.Replicator()
    with repl.scope():
      var = _private.unmirrored_variable(1.0, "v", repl.replica_devices[2])
      mirrored = tf.Variable(1.0)
    self.assertNotIsInstance(var, tf.distribute.DistributedValues)
    self.assertIsInstance(mirrored, tf.distribute.DistributedValues)
    self.assertEqual(var.device, repl.replica_devices[2])


if __name__ == "__main__":
  tf.test.main()
