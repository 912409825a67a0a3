"""DCT-MP across a device boundary: only the compact form crosses.

`dct_mp_transfer(x, sparsity, target_device)` computes the DCT-MP mask on the
source device (where `x` lives), sends per row the k kept values and their
column indices, and densifies on the target device. Backward, the target
gathers the incoming gradient at the same k indices, sends that compact
gradient back and the source densifies it. The result and the gradient are bit
for bit those of `dct_mp(x, sparsity)` (dropped entries are +0).

Wire format per row: k values in x's dtype plus k column indices, either
byte-aligned (uint8 for d <= 256, int16 for d <= 32768, int32 above) or
bit-packed (ceil(log2 d) bits each in int32 words), whichever is smaller; see
`tf_dct.dct_mp.index_wire`. The receiver unpacks (or casts) the indices to int32
for gather/scatter on its own device; only the encoded form crosses. All
shapes are static in d and k, so the op compiles with `jit_compile=True` (on
one device: XLA compiles a cluster for a single device). Nothing else
crosses: with at most one unknown axis (e.g. the batch) the receiver infers
the shape; with more, x's shape vector crosses too.

Backward placement. This op pins its own backward ops (gather on the target,
densify on the source). The backward ops of the layers after the split are
placed by TensorFlow: `tf.gradients` (inside a tf.function) puts each next to
its forward op, while `tf.GradientTape` puts them under the device scope where
`tape.gradient` is called, so with a tape the dense gradient of the layers on
the target may be computed on the source and cross before being compacted.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Union

import tensorflow as tf

from tf_dct.dct_mp.op import check_input
from tf_dct.dct_mp.op import top_k_indices
from tf_dct.dct_mp.index_wire import decode_indices
from tf_dct.dct_mp.index_wire import encode_indices
from tf_dct.dct_mp.index_wire import index_bytes_per_row
from tf_dct.dct_mp.rescale import check_rescale
from tf_dct.dct_mp.rescale import forward_scale
from tf_dct.dct_mp.rescale import row_scale
from tf_dct.dct_mp.rescale import scaled

DeviceLike = Union[str, Callable[[], ContextManager], None]


def compact_bytes(rows, d: int, k: int, dtype: tf.DType):
  """Bytes of the compact form of `rows` rows: k values plus encoded indices.

  `rows` may be an int or an integer tensor; the result has its type.

  Example:
    32 rows of d = 1024 float32 values, k = 256 kept: 256 values and 256
    10-bit indices (80 int32 words) per row, against the dense activation:

    >>> compact_bytes(32, d=1024, k=256, dtype=tf.float32)
    43008
    >>> dense_bytes(32, d=1024, dtype=tf.float32)
    131072
  """
  return rows * (k * tf.as_dtype(dtype).size + index_bytes_per_row(d, k))


def dense_bytes(rows: int, d: int, dtype: tf.DType) -> int:
  """Bytes of the dense [rows, d] activation."""
  return rows * d * tf.as_dtype(dtype).size


def device_scope(device: DeviceLike) -> ContextManager:
  """A device scope from a device string, a context factory or None."""
  if device is None or device == "":
    return contextlib.nullcontext()
  if isinstance(device, str):
    return tf.device(device)
  if callable(device):
    return device()
  raise TypeError(f"device must be a string, a callable returning a context "
                  f"manager, or None, got {device!r}")


def local_shape(x: tf.Tensor):
  """A reshape target for x's shape that needs no tensor from x's device.

  Static dimensions, with -1 for the unknown one if only one is unknown;
  otherwise `tf.shape(x)` (which then crosses to wherever it is used).
  """
  dims = x.shape.as_list()
  if dims.count(None) <= 1 and 0 not in dims:
    return [-1 if n is None else n for n in dims]
  return tf.shape(x)


def gradient_device_scope(device: str | None) -> ContextManager:
  """`device_scope(device)` for the ops of a gradient function.

  `tf.gradients` colocates the ops a gradient function creates with the
  forward op, which overrides device scopes; a gradient that must run on the
  other side of the boundary (the forward op's input's device) first leaves
  that colocation. A no-op colocation-wise when executing eagerly (tapes do
  not colocate).
  """
  if not device:
    return contextlib.nullcontext()
  stack = contextlib.ExitStack()
  if not tf.executing_eagerly():
    stack.enter_context(tf.compat.v1.get_default_graph().colocate_with(
        None, ignore_existing=True))
  stack.enter_context(tf.device(device))
  return stack


def compact(x2: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
  """Per row of [N, d]: the k values of largest |x| and their int32 indices."""
  indices = top_k_indices(x2, k)
  return tf.gather(x2, indices, batch_dims=1), indices


def densify(values: tf.Tensor, indices: tf.Tensor, d: int) -> tf.Tensor:
  """[N, d] with `values` [N, k] at `indices` [N, k] (int32) and +0 elsewhere.

  Example:
    The inverse of `compact`:

    >>> x = tf.constant([[0.5, -2.0, 1.0, 0.25], [3.0, 0.0, -0.25, 0.5]])
    >>> values, indices = compact(x, k=2)
    >>> values.numpy().tolist(), indices.numpy().tolist()
    ([[-2.0, 1.0], [3.0, 0.5]], [[1, 2], [0, 3]])
    >>> densify(values, indices, d=4).numpy().tolist()
    [[0.0, -2.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.5]]
  """
  n = tf.shape(values)[0]
  k = values.shape[-1]
  rows = tf.broadcast_to(tf.range(n)[:, None], [n, k])
  where = tf.stack([rows, indices], axis=-1)
  zeros = tf.zeros(tf.stack([n, d]), values.dtype)
  return tf.tensor_scatter_nd_update(zeros, where, values)


def dct_mp_transfer(x, sparsity: float, target_device: DeviceLike,
                    source_device: DeviceLike = None,
                    rescale: str = "none") -> tf.Tensor:
  """`dct_mp(x, sparsity, rescale)` with only the compact form crossing to a device.

  Args:
    x: float tensor [..., d] of rank >= 2, on the source device.
    sparsity: eta in [0, 1); k = d - floor(d * eta) entries per row cross.
    target_device: where the result is densified: a device string, a callable
      returning a device context (e.g. `lambda: repl.logical_device(1)`), or
      None (no device scope).
    source_device: where the selection and the backward densify run;
      default: the enclosing device scope.
    rescale: "none", "l1" or "l1_backward" (`tf_dct.dct_mp.rescale`): the
      source scales the kept values before they cross ("l1") and the compact
      gradient after it arrives (both), so nothing more crosses.

  Returns:
    X ⊙ M on the target device, the same values as
    `dct_mp(x, sparsity, rescale)`.
  """
  x, d, k = check_input(x, sparsity, "dct_mp_transfer")
  rescale = check_rescale(rescale, "dct_mp_transfer")
  shape = local_shape(x)  # keeps the shape tensor off the wire

  # Two single-device pieces, each under its own device scope, so that the
  # Identity ops tf.custom_gradient adds around a piece stay on that piece's
  # device (one piece spanning both devices would pull its dense input and
  # output across the boundary through them).
  @tf.custom_gradient
  def encode(x):
    x2 = tf.reshape(x, [-1, d])
    values, indices = compact(x2, k)  # DCT Algorithm 2 lines 4-9
    s = row_scale(x2, values, rescale)  # stays on the source
    wire_indices = encode_indices(indices, d)  # bit-packed or narrow ints
    source = wire_indices.device

    def grad(d_values, unused_d_indices):
      with device_scope(source or None):  # the compact gradient arrives here
        return tf.reshape(densify(scaled(d_values, s), indices, d), shape)

    return (scaled(values, forward_scale(s, rescale)), wire_indices), grad

  @tf.custom_gradient
  def decode(values, wire_indices):
    # DCT Algorithm 2 line 11: values and indices cross instead of X ⊙ M;
    # the indices are decoded here, on the receiving device.
    received = decode_indices(wire_indices, d, k)
    y = tf.reshape(densify(values, received, d), shape, name="densify")
    target = y.device

    def grad(dy):
      with device_scope(target or None):
        # DCT Algorithm 2 lines 13-14: the gradient crosses compact.
        return tf.gather(tf.reshape(dy, [-1, d]), received, batch_dims=1), None

    return y, grad

  with device_scope(source_device):
    values, wire_indices = encode(x)
  with device_scope(target_device):
    return decode(values, wire_indices)
