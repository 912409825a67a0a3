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

  @parameterized.parameters("linear", "dense")
  def test_warmup_schedule_and_variable_k(self, warmup):
    d, k, w = 10, 2, 4
    x_np = reference.distinct((3, d), seed=3)
    x = tf.constant(x_np)
    kept_t = tf.function(lambda t: ops.kept_at(t, d, k, w, warmup))
    for t in range(w + 3):
      want = reference.kept_at(t, d, k, w, warmup)
      self.assertEqual(ops.kept_at(t, d, k, w, warmup), want)
      self.assertEqual(int(kept_t(tf.constant(t, tf.int64))), want)
      mask = reference.topk_mask_k(x_np, want)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = ops.dct_mp_kept(x, tf.constant(want))
      self.assertAllEqual(y, reference.forward(x_np, mask))
      self.assertAllEqual(tape.gradient(y, x, output_gradients=2 * x),
                          reference.backward(2 * x_np, mask))
    self.assertEqual([ops.kept_at(t, d, k, w, warmup) for t in range(w + 1)],
                     {"linear": [10, 8, 6, 4, 2], "dense": [10, 10, 10, 10, 2]}[warmup])
    # With ties the variable-k mask is the static op's (lowest index first).
    ties = np.array([[1, 3, 3, 3, 0, 3, 0, 0, 2, 1], [0] * 9 + [5]], np.float32)
    self.assertAllEqual(ops.dct_mp_kept(ties, tf.constant(3)),
                        ops.dct_mp(ties, 0.7))
    with self.assertRaisesRegex(ValueError, "warmup must be one of"):
      ops.kept_at(0, d, k, w, "cosine")

  def test_gradient_is_that_of_x_times_fixed_mask(self):
    x = tf.constant(reference.distinct((3, 8), seed=2))
    mask = tf.cast(ops.dct_mp_mask(x, 0.75), tf.float32)
    theoretical, numerical = tf.test.compute_gradient(
        lambda v: ops.dct_mp(v, 0.75), [x], delta=1e-2)
    analytic = np.diag(mask.numpy().reshape(-1))  # d(x * M)/dx with M fixed
    self.assertAllClose(theoretical[0], analytic)
    self.assertAllClose(numerical[0], analytic, atol=1e-3)

  @parameterized.product(dtype=(tf.float32, tf.bfloat16, tf.float16),
                         rescale=("l1", "l1_backward"))
  def test_rescale_matches_reference(self, dtype, rescale):
    shape = (3, 2, 16)
    x_np = reference.distinct(shape, seed=4)  # exact sums in float32
    x = tf.cast(x_np, dtype)
    np_dtype = dtype.as_numpy_dtype
    dy_np = np.random.default_rng(2).normal(size=shape).astype(np_dtype)
    mask = reference.topk_mask(x_np, 0.75)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = ops.dct_mp(x, 0.75, rescale=rescale)
    self.assertEqual(y.dtype, dtype)
    want_y = (reference.rescaled_forward(x.numpy(), mask) if rescale == "l1"
              else reference.forward(x.numpy(), mask))  # Algorithm 2's forward
    self.assertAllEqual(y, want_y)
    g = tape.gradient(y, x, output_gradients=tf.constant(dy_np))
    self.assertAllEqual(g, reference.rescaled_backward(dy_np, x.numpy(), mask))
    # s_i >= 1: no row of the gradient is smaller than the masked one's.
    self.assertAllGreaterEqual(np.abs(g.numpy().astype(np.float64)).sum(-1) -
                               np.abs(reference.backward(dy_np, mask)).astype(
                                   np.float64).sum(-1), 0)
    if rescale == "l1":  # each row keeps its L1 norm (to rounding)
      self.assertAllClose(np.abs(y.numpy().astype(np.float64)).sum(-1),
                          np.abs(x_np.astype(np.float64)).sum(-1),
                          rtol=1e-2 if dtype != tf.float32 else 1e-6)

  def test_rescale_ties_and_zero_rows(self):
    x = np.array([[1, 3, 3, 3, 0, 3, 0, 0, 2, 1],     # 4 tied at the k-th value
                  [0] * 10,                            # nothing kept: s = 1
                  [0] * 9 + [5]], np.float32)          # all the mass kept: s = 1
    dy = np.arange(30, dtype=np.float32).reshape(3, 10) + 1
    x_t = tf.constant(x)
    with tf.GradientTape() as tape:
      tape.watch(x_t)
      y = ops.dct_mp(x_t, 0.7, rescale="l1")  # k = 3
    g = tape.gradient(y, x_t, output_gradients=tf.constant(dy))
    s = np.float32(16) / np.float32(9)  # row 0: L1 16, the three kept 3s 9
    want_y = np.zeros_like(x)
    want_y[0, [1, 2, 3]] = np.float32(3) * s
    want_y[2, 9] = 5
    want_g = np.zeros_like(dy)
    want_g[0, [1, 2, 3]] = dy[0, [1, 2, 3]] * s
    want_g[1, [0, 1, 2]] = dy[1, [0, 1, 2]]  # the zero row: mask, no scale
    want_g[2, [0, 1, 9]] = dy[2, [0, 1, 9]]
    self.assertAllEqual(y, want_y)
    self.assertAllEqual(g, want_g)
    self.assertAllEqual(ops.row_scale(x_t, tf.gather(x_t, [[1, 2, 3]] * 3, batch_dims=1),
                                      "l1"), [[s], [1], [1]])
    # The warm-up's variable-k form scales the same way.
    self.assertAllEqual(ops.dct_mp_kept(x, tf.constant(3), rescale="l1"), want_y)
    # "l1_backward": Algorithm 2's forward, the same scaled gradient, in
    # both forms.
    for op in (lambda v: ops.dct_mp(v, 0.7, rescale="l1_backward"),
               lambda v: ops.dct_mp_kept(v, tf.constant(3), rescale="l1_backward")):
      with tf.GradientTape() as tape:
        tape.watch(x_t)
        y = op(x_t)
      self.assertAllEqual(y, ops.dct_mp(x_t, 0.7))
      self.assertAllEqual(tape.gradient(y, x_t, output_gradients=tf.constant(dy)), want_g)

  @parameterized.parameters("l2", "L1", None, 1)
  def test_bad_rescale(self, rescale):
    msg = (r"rescale must be one of \('none', 'l1', 'l1_backward'\), got " +
           repr(rescale))
    with self.assertRaisesRegex(ValueError, "dct_mp: " + msg):
      ops.dct_mp(tf.ones([2, 4]), 0.5, rescale=rescale)
    with self.assertRaisesRegex(ValueError, "dct_mp_kept: " + msg):
      ops.dct_mp_kept(tf.ones([2, 4]), tf.constant(2), rescale=rescale)
    with self.assertRaisesRegex(ValueError, "dct_mp_transfer: " + msg):
      ops.dct_mp_transfer(tf.ones([2, 4]), 0.5, "/cpu:0", rescale=rescale)

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
