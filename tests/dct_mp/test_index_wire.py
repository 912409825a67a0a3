"""Column indices on the wire: bit-packing layout, round trips, choice, XLA."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct import dct_mp as ops


def _indices(d, k, rows=5, seed=0):
  idx = np.random.default_rng(seed).integers(0, d, size=(rows, k))
  idx[0] = d - 1  # every bit of b set
  idx[1] = 0
  return tf.constant(idx.astype(np.int32))


class IndexWireTest(tf.test.TestCase, parameterized.TestCase):

  def test_sizes_and_choice(self):
    self.assertEqual([ops.index_bits(d) for d in (1, 2, 3, 256, 257, 512, 2**31)],
                     [0, 1, 2, 8, 9, 9, 31])
    # d = 512, k = 26 (sparsity 0.95): 234 bits in 8 words, not 52 int16 bytes.
    self.assertEqual(ops.words_per_row(512, 26), 8)
    self.assertEqual(ops.index_bytes_per_row(512, 26), 32)
    self.assertEqual(ops.index_bytes_per_row(64, 16), 12)   # 96 bits < 16 uint8
    self.assertEqual(ops.index_bytes_per_row(64, 7), 7)     # 2 words > 7 uint8
    self.assertEqual(ops.index_bytes_per_row(256, 40), 40)  # 8 bits: a tie, bytes
    self.assertEqual(ops.index_bytes_per_row(40000, 3), 8)  # 48 bits < 12 int32
    self.assertEqual(ops.index_bytes_per_row(1, 1), 0)      # the index is 0
    self.assertEqual(ops.compact_bytes(256, 512, 26, tf.float32),
                     256 * (26 * 4 + 32))
    # DCT §2.2 setting: >= 15x with everything that crosses counted.
    self.assertGreaterEqual(ops.dense_bytes(256, 512, tf.float32) /
                            ops.compact_bytes(256, 512, 26, tf.float32), 15)

  def test_layout(self):
    # 3 bits each, least significant first: 1 | 2 << 3 | 3 << 6.
    self.assertAllEqual(ops.pack_indices([[1, 2, 3]], 8), [[1 | 2 << 3 | 3 << 6]])
    # 4 x 9 bits of ones: word 0 full (bit 31 is the sign), 4 bits in word 1.
    self.assertAllEqual(ops.pack_indices([[511] * 4], 512), [[-1, 15]])
    self.assertAllEqual(ops.encode_indices(tf.constant([[3, 60]]), 64).dtype, tf.uint8)
    self.assertAllEqual(ops.pack_indices(tf.zeros([3, 4], tf.int32), 1).shape, [3, 0])

  @parameterized.parameters((1, 3), (2, 5), (3, 7), (257, 26), (512, 26),
                            (512, 64), (1000, 1), (32769, 33), (2**31, 9), (40000, 0))
  def test_round_trip(self, d, k):
    idx = _indices(d, k)
    words = ops.pack_indices(idx, d)
    self.assertEqual(words.shape, (5, ops.words_per_row(d, k)))
    self.assertEqual(words.dtype, tf.int32)
    self.assertAllEqual(ops.unpack_indices(words, d, k), idx)
    self.assertAllEqual(ops.decode_indices(ops.encode_indices(idx, d), d, k), idx)

  def test_xla_and_dynamic_rows(self):
    idx = _indices(512, 26, rows=6)
    spec = tf.TensorSpec([None, 26], tf.int32)
    round_trip = lambda v: ops.unpack_indices(ops.pack_indices(v, 512), 512, 26)
    for jit in (False, True):
      fn = tf.function(round_trip, jit_compile=jit, input_signature=[spec])
      self.assertAllEqual(fn(idx), idx)
    packed = tf.function(lambda v: ops.pack_indices(v, 512), input_signature=[spec])
    self.assertEqual(packed.get_concrete_function().output_shapes.as_list(), [None, 8])

  def test_errors(self):
    for bad in (0, -3, True, 2.0, 2**31 + 1):
      with self.assertRaisesRegex(ValueError, r"d must be an int in \[1, 2\*\*31\]"):
        ops.pack_indices(tf.zeros([2, 3], tf.int32), bad)
      with self.assertRaisesRegex(ValueError, r"d must be an int in \[1, 2\*\*31\]"):
        ops.index_bits(bad)
      with self.assertRaisesRegex(ValueError, r"d must be an int in \[1, 2\*\*31\]"):
        ops.index_dtype_for(bad)
    for bad in (-1, 1.5, None):
      with self.assertRaisesRegex(ValueError, "k must be an int >= 0"):
        ops.unpack_indices(tf.zeros([2, 1], tf.int32), 512, bad)
      with self.assertRaisesRegex(ValueError, "k must be an int >= 0"):
        ops.words_per_row(512, bad)
      with self.assertRaisesRegex(ValueError, "k must be an int >= 0"):
        ops.index_bytes_per_row(512, bad)
    with self.assertRaisesRegex(TypeError, "indices must be int32, got int64"):
      ops.pack_indices(tf.zeros([2, 3], tf.int64), 512)
    with self.assertRaisesRegex(ValueError, "indices must have rank 2"):
      ops.pack_indices(tf.zeros([3], tf.int32), 512)
    with self.assertRaisesRegex(TypeError, "words must be int32"):
      ops.unpack_indices(tf.zeros([2, 8], tf.uint8), 512, 26)
    with self.assertRaisesRegex(ValueError, r"W = ceil\(k \* b / 32\) = 8 columns"):
      ops.unpack_indices(tf.zeros([2, 7], tf.int32), 512, 26)


if __name__ == "__main__":
  tf.test.main()
