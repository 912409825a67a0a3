"""tf_dct._lazy: the packages' public names, imported on first use."""

import sys

import tensorflow as tf

import tf_dct
from tf_dct import distribute


class LazyExportsTest(tf.test.TestCase):
  """The packages import their public names on first use."""

  def test_every_public_name_resolves(self):
    for package in (tf_dct, distribute):
      for name in package.__all__:
        with self.subTest(package=package.__name__, name=name):
          self.assertIsNotNone(getattr(package, name))
          self.assertIn(name, dir(package))
    self.assertIs(tf_dct.Replicator, distribute.Replicator)
    self.assertIs(tf_dct.wrap_optimizer, tf_dct.keras.wrap_optimizer)
    self.assertIs(tf_dct.compression, sys.modules["tf_dct.compression"])

  def test_an_unknown_name_is_an_attribute_error(self):
    for package in (tf_dct, distribute):
      with self.assertRaisesRegex(AttributeError,
                                  rf"module '{package.__name__}' has no "
                                  r"attribute 'Replicatr'"):
        getattr(package, "Replicatr")


if __name__ == "__main__":
  tf.test.main()
