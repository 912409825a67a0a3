"""Gaussian sketching of the forward activation (DCT Appendix A baseline).

The source sends Z = X S, where S in R^{d x r} has i.i.d. N(0, 1/r) entries,
so E[S S^T] = I; the target reconstructs X S S^T. S is fixed: both devices
regenerate it from `seed` (`tf.random.stateless_normal`), so it never crosses.
The sketch width is r = k = d - floor(d * sparsity), the number of values
DCT-MP keeps per row: the forward sends N * r values and no indices, a
compression factor of d / r on the values.

The backward is not compressed (as in the paper): the dense gradient dY
[N, d] crosses back and the source computes the exact gradient of the
sketched forward, dX = dY S S^T.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dct.dct_mp import transfer as compact_transfer
from tf_dct.dct_mp.op import check_input


def sketch_matrix(d: int, r: int, seed: int, dtype: tf.DType) -> tf.Tensor:
  """The fixed sketch S [d, r] with N(0, 1/r) entries, from `seed`."""
  s = tf.random.stateless_normal([d, r], seed=[seed, d * 65537 + r],
                                 stddev=1.0 / r ** 0.5, dtype=tf.float32)
  return tf.cast(s, dtype)


def gaussian_sketch(x, sparsity: float, seed: int = 0,
                    target_device: compact_transfer.DeviceLike = None,
                    source_device: compact_transfer.DeviceLike = None
                   ) -> tf.Tensor:
  """X S S^T with X S crossing to `target_device`; dense gradient back.

  Args:
    x: float tensor [..., d] of rank >= 2.
    sparsity: eta in [0, 1); the sketch width is r = d - floor(d * eta).
    seed: seed of the fixed sketch matrix S.
    target_device: see `dct_mp_transfer`.
    source_device: see `dct_mp_transfer`.

  Returns:
    The reconstruction X S S^T, shaped like x, on the target device.
  """
  x, d, r = check_input(x, sparsity, "gaussian_sketch")

  shape = compact_transfer.local_shape(x)  # keeps the shape tensor off the wire
  with compact_transfer.device_scope(source_device):
    s_source = sketch_matrix(d, r, seed, x.dtype)
    z = tf.matmul(tf.reshape(x, [-1, d]), s_source)  # crosses: [N, r]
  source = z.device

  @tf.custom_gradient
  def reconstruct(z):
    s_target = sketch_matrix(d, r, seed, x.dtype)
    y = tf.reshape(tf.matmul(z, s_target, transpose_b=True), shape)

    def grad(dy):
      with compact_transfer.gradient_device_scope(source):  # dy crosses dense
        return tf.matmul(tf.reshape(dy, [-1, d]), s_source)

    return y, grad

  with compact_transfer.device_scope(target_device):
    return reconstruct(z)
