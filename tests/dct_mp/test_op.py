"""tf_dct.dct_mp.op against the numpy reference of DCT Algorithm 2."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct import dct_mp as ops
from tests import util
from tests.dct_mp import reference


def setUpModule():
  util.setup_cpus()


class DctMpTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.product(
      dtype=[tf.float32, tf.bfloat16, tf.float16],
      shape=[(4, 10), (3, 2, 16)],
      sparsity=[0.0, 0.5, 0.9])
  def test_matches_algorithm_2(self, dtype, shape, sparsity):
    x_np = reference.distinct(shape)  # exact in float16/bfloat16 (multiples of 1/4)
    dy_np = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    x, dy = tf.cast(x_np, dtype), tf.cast(dy_np, dtype)
    want = reference.threshold_mask(x_np, sparsity)
    self.assertAllEqual(want.sum(-1), np.full(shape[:-1], ops.num_kept(shape[-1], sparsity)))
    self.assertAllEqual(ops.dct_mp_mask(x, sparsity), want)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = ops.dct_mp(x, sparsity)
    self.assertEqual(y.dtype, dtype)
    self.assertAllEqual(y, reference.forward(x_np, want).astype(dtype.as_numpy_dtype))
    self.assertAllEqual(tape.gradient(y, x, output_gradients=dy),
                        reference.backward(dy.numpy(), want))

  def test_ties_keep_exactly_k_lowest_index_first(self):
    x = np.array([[1, 3, 3, 3, 0, 3, 0, 0, 2, 1],     # 4 tied at the k-th value
                  [0, 0, 0, 0, 0, 0, 0, 0, 0, 5],     # ReLU-like: ties at 0
                  [-2, 2, 2, -2, 1, 1, 1, 1, 1, 1]], np.float32)
    k = ops.num_kept(10, 0.7)
    self.assertEqual(k, 3)
    mask = ops.dct_mp_mask(x, 0.7).numpy()
    self.assertAllEqual(mask.sum(-1), [k, k, k])
    self.assertAllEqual(mask, reference.topk_mask(x, 0.7))
    self.assertAllEqual(np.flatnonzero(mask[0]), [1, 2, 3])  # 3 of the four 3s
    self.assertAllEqual(np.flatnonzero(mask[1]), [0, 1, 9])
    # The threshold rule of lines 7-8 keeps every tie; the op keeps a subset.
    rule = reference.threshold_mask(x, 0.7)
    self.assertAllEqual(rule.sum(-1), [4, 10, 4])
    self.assertTrue(np.all(rule[mask]))

  def test_gradient_is_that_of_x_times_fixed_mask(self):
    x = tf.constant(reference.distinct((3, 8), seed=2))
    mask = tf.cast(ops.dct_mp_mask(x, 0.75), tf.float32)
    theoretical, numerical = tf.test.compute_gradient(
        lambda v: ops.dct_mp(v, 0.75), [x], delta=1e-2)
    analytic = np.diag(mask.numpy().reshape(-1))  # d(x * M)/dx with M fixed
    self.assertAllClose(theoretical[0], analytic)
    self.assertAllClose(numerical[0], analytic, atol=1e-3)

  def test_sizes_use_the_decimal_value_of_sparsity(self):
    self.assertEqual(ops.num_dropped(100, 0.29), 29)  # not 28 (0.29 * 100 in binary)
    self.assertEqual(ops.num_kept(64, 0.9), 7)
    self.assertEqual(ops.num_kept(512, 0.95), 26)
    self.assertEqual(ops.num_kept(3, 0.0), 3)

  @parameterized.named_parameters(
      ("negative", -0.1), ("one", 1.0), ("above", 1.5), ("nan", float("nan")),
      ("bool", True), ("string", "0.5"))
  def test_bad_sparsity(self, sparsity):
    with self.assertRaisesRegex(ValueError, r"sparsity must be a number in \[0, 1\)"):
      ops.dct_mp(tf.ones([2, 4]), sparsity)

  def test_bad_inputs(self):
    with self.assertRaisesRegex(ValueError, "x must have rank >= 2"):
      ops.dct_mp(tf.constant(1.0), 0.5)
    with self.assertRaisesRegex(ValueError, "x must have rank >= 2"):
      ops.dct_mp(tf.ones([4]), 0.5)
    with self.assertRaisesRegex(TypeError, "x must be a floating-point tensor.*int32"):
      ops.dct_mp(tf.ones([2, 4], tf.int32), 0.5)
    with self.assertRaisesRegex(ValueError, r"k = d - floor\(d \* sparsity\) must be >= 1.*d = 0"):
      ops.dct_mp(tf.ones([2, 0]), 0.5)
    unknown_d = tf.function(lambda v: ops.dct_mp(v, 0.5),
                            input_signature=[tf.TensorSpec([None, None])])
    with self.assertRaisesRegex(ValueError, r"last axis of x \(d\) must be known"):
      unknown_d.get_concrete_function()
    for fn in (ops.dct_mp_mask, lambda v, s: ops.dct_mp_transfer(v, s, None),
               ops.gaussian_sketch):
      with self.assertRaisesRegex(ValueError, "sparsity"):
        fn(tf.ones([2, 4]), 1.0)


if __name__ == "__main__":
  tf.test.main()
