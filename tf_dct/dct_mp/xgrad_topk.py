"""Top-k compression of the backward X_grad with error feedback (DCT App. A).

The forward activation crosses dense (identity). Backward, the target adds
the residual E to the incoming gradient, G = dY + E, keeps the k = d -
floor(d * sparsity) largest |G| per row (`tf.math.top_k`, ties to the lower
index), sends those values and indices to the source and stores the rest,
E <- G - C(G). A non-finite incoming gradient raises
`InvalidArgumentError` before the residual is read or written. The indices cross in the encoding of `tf_dct.dct_mp.index_wire`
(bit-packed or byte-aligned, whichever is smaller), as in `dct_mp_transfer`.

The residual is per row, [N, d], for a fixed number of rows N (the per-replica
batch times any middle axes): error feedback needs an error of the same shape
as what it corrects. Row i of one step's error is added to row i of the next
step's gradient, which is a different example, exactly what plain error
feedback on X_grad does (and one reason it does not work, per Appendix A).
"""

from __future__ import annotations

import tensorflow as tf

from tf_dct.dct_mp import transfer as compact_transfer
from tf_dct.dct_mp import index_wire
from tf_dct.dct_mp.op import check_input


def xgrad_topk(x, sparsity: float, residual: tf.Variable,
               target_device: compact_transfer.DeviceLike = None,
               source_device: compact_transfer.DeviceLike = None) -> tf.Tensor:
  """Identity forward; top-k + error feedback on the gradient backward.

  Args:
    x: float tensor [..., d] of rank >= 2 whose rows (all but the last axis)
      number exactly `residual.shape[0]`.
    sparsity: eta in [0, 1); k = d - floor(d * eta) gradient entries per row
      cross back.
    residual: float variable [N, d], the error-feedback state (updated each
      time the gradient is computed).
    target_device: see `dct_mp_transfer`.
    source_device: see `dct_mp_transfer`.

  Returns:
    x, placed on the target device.
  """
  x, d, k = check_input(x, sparsity, "xgrad_topk")
  rows = 1
  for n in x.shape[:-1]:
    rows = None if n is None or rows is None else rows * n
  if tuple(residual.shape) != (rows, d):
    raise ValueError(
        f"xgrad_topk: the residual has shape {tuple(residual.shape)} but x "
        f"{x.shape} has {rows} rows of d = {d}; the number of rows "
        "(per-replica batch, times middle axes) must be static and match")

  shape = compact_transfer.local_shape(x)  # keeps the shape tensor off the wire
  with compact_transfer.device_scope(source_device):
    x = tf.identity(x)
  source = x.device

  @tf.custom_gradient
  def receive(x):
    y = tf.identity(x)  # the dense activation crosses
    target = y.device

    def grad(dy):
      with compact_transfer.device_scope(target or None):
        # A non-finite gradient raises before the residual is read, so it
        # never enters it (under XLA the check compiles away, as for the
        # gradient compressors; see `error_feedback.check_finite`).
        dy = tf.debugging.check_numerics(
            dy, "xgrad_topk: non-finite gradient at the split")
        g = tf.reshape(dy, [-1, d]) + tf.cast(residual, dy.dtype)
        values, indices = compact_transfer.compact(g, k)
        kept = compact_transfer.densify(values, indices, d)
        update = residual.assign(tf.cast(g - kept, residual.dtype))
        wire_indices = index_wire.encode_indices(indices, d)
      with compact_transfer.gradient_device_scope(source), \
          tf.control_dependencies([update]):
        received = index_wire.decode_indices(wire_indices, d, k)
        dx = compact_transfer.densify(values, received, d)
        return tf.reshape(dx, shape)

    return y, grad

  with compact_transfer.device_scope(target_device):
    return receive(x)
