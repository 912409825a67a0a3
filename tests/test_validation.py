"""tf_dct.validation: numpy scalars are taken as the number written."""

import numbers

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tf_dct import validation
from tf_dct import dct_mp as ops
from tests import util


def setUpModule():
  util.setup_cpus()


class AsPythonNumberTest(parameterized.TestCase):

  @parameterized.parameters(
      (np.float32(0.9), 0.9), (np.float16(0.1), 0.1), (np.float64(0.29), 0.29),
      (np.int64(7), 7), (np.int32(0), 0), (0.9, 0.9), (3, 3), ("x", "x"))
  def test_value_as_written(self, value, expected):
    got = validation.as_python_number(value)
    self.assertEqual(got, expected)
    self.assertIs(type(got), type(expected))

  def test_check_number_takes_numpy_scalars_as_written(self):
    self.assertEqual(validation.check_number(
        "DCTDP", "sparsity", np.float32(0.9), numbers.Real, 0, True, 1, True),
                     0.9)
    self.assertEqual(validation.check_number(
        "DCTDP", "min_count", np.int64(8), numbers.Integral, 0, False), 8)
    with self.assertRaisesRegex(ValueError, r"DCTDP: sparsity must be a number "
                                r"in \(0, 1\), got 1.5"):
      validation.check_number("DCTDP", "sparsity", np.float32(1.5),
                              numbers.Real, 0, True, 1, True)
    with self.assertRaisesRegex(ValueError, "must be an int >= 0, got True"):
      validation.check_number("DCTDP", "min_count", np.bool_(True),
                              numbers.Integral, 0, False)
    self.assertEqual(validation.floor_fraction(100, np.float32(0.29)), 29)

  @parameterized.named_parameters(
      ("DCTDP_sparsity", lambda x: compression.DCTDP(x), "sparsity", 0.9),
      ("DCTDP_capacity_factor",
       lambda x: compression.DCTDP(capacity_factor=x), "capacity_factor", 1.1),
      ("DCTDP_momentum", lambda x: compression.DCTDP(momentum=x), "momentum",
       0.9),
      ("DCTDP_density_band",
       lambda x: compression.DCTDP(density_band=(x, 2.0)), "density_band",
       (0.3, 2.0)),
      ("DCTDP_schedule", lambda x: compression.DCTDP(
          sparsity_schedule=((5, x),)), "sparsity_schedule", ((5, 0.7),)),
      ("TopK_density", lambda x: compression.TopK(x), "density", 0.07),
      ("DEFT_density", lambda x: compression.DEFT(x), "density", 0.07),
      ("CLTK_density", lambda x: compression.CLTK(x), "density", 0.07),
      ("HardThreshold_threshold", lambda x: compression.HardThreshold(x),
       "threshold", 0.3),
      ("HardThreshold_capacity_density",
       lambda x: compression.HardThreshold(0.5, capacity_density=x),
       "capacity_density", 0.3))
  def test_every_float_parameter(self, make, attribute, written):
    first = written[0][1] if attribute == "sparsity_schedule" else (
        written[0] if attribute == "density_band" else written)
    self.assertEqual(getattr(make(np.float32(first)), attribute), written)
    self.assertEqual(getattr(make(first), attribute), written)

  def test_dct_mp_sparsity(self):
    self.assertEqual(ops.num_kept(100, np.float32(0.9)), 10)
    self.assertEqual(ops.num_dropped(100, np.float32(0.29)), 29)


class SelectionTest(tf.test.TestCase):

  def _sent(self, sparsity):
    repl = tf_dct.Replicator(["/cpu:0"])
    c = compression.DCTDP(sparsity, min_count=0)
    c.bind(repl)
    with repl.scope():
      v = tf.Variable(tf.zeros([100]), name="w")
    g = tf.range(1, 101, dtype=tf.float32)
    out = tf.function(lambda: repl.run(lambda: c.aggregate([(g, v)])[0][0]))()
    return util.local(repl, out)[0]

  def test_numpy_float32_sparsity_selects_as_the_python_float(self):
    ours = self._sent(np.float32(0.9))
    self.assertEqual(np.count_nonzero(ours), 10)
    self.assertAllEqual(ours, self._sent(0.9))


if __name__ == "__main__":
  tf.test.main()
