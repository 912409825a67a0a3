"""DCT-MP: per-row top-k masking of an activation (DCT Algorithm 2).

Conventions (the numpy reference in tests/dct_mp/reference.py follows them):

* Sizes. For the last axis of size d and sparsity eta, m = floor(d * eta) is
  computed on the decimal value of eta as written (0.29 * 100 gives 29), and
  k = d - m entries are kept per row. 0 <= eta < 1 gives 1 <= k <= d.
* Threshold. tau_i is the k-th largest |x| of row i, i.e. the (m + 1)-th
  smallest. That is the threshold the paper's text describes ("greater than
  d * eta values") and that keeps k entries without ties. Line 6 of Algorithm 2
  read literally with 1-based sorting (tau_i = x_m) would keep k + 1 entries
  (tf_dct.compression.DCTDP uses that literal reading for gradients).
* Ties. The op keeps exactly k entries per row: those `tf.math.top_k` picks on
  |x|, which breaks ties towards the lower column index. Without ties this is
  the threshold rule |x| >= tau_i of lines 7-8; with ties at tau_i the rule
  would keep more than k, and the op keeps the tied entries of lowest index
  only. Exactly k is what a static-shape compact transfer needs. After a ReLU
  the common tie is at 0 (a row with fewer than k positives); the dropped
  zeros have a zero ReLU gradient anyway, so the training step is the same.
* Dropped entries become +0 (`tf.where`, not a multiply), so the compact
  transfer reproduces the dense form bit for bit.
* Rank > 2 inputs ([batch, time, features]) are masked over the last axis
  independently at every leading position.
"""

from __future__ import annotations

import numbers

import tensorflow as tf

from tf_dct import validation

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def check_sparsity(sparsity, caller: str = "dct_mp") -> float:
  """Returns `sparsity` as a float if it is a real number in [0, 1)."""
  return float(validation.check_number(caller, "sparsity", sparsity,
                                       numbers.Real, 0, False, 1, True))


def num_dropped(d: int, sparsity: float) -> int:
  """m = floor(d * sparsity), on the decimal value of `sparsity`."""
  return validation.floor_fraction(d, sparsity)


def num_kept(d: int, sparsity: float) -> int:
  """k = d - floor(d * sparsity): entries kept per row.

  Example:
    >>> num_kept(100, 0.29)  # floor(100 * 0.29) = 29 dropped, as written
    71
  """
  return d - num_dropped(d, sparsity)


def check_input(x, sparsity, caller: str = "dct_mp") -> tuple[tf.Tensor, int, int]:
  """Validates an activation; returns (x as a tensor, d, k).

  Raises:
    ValueError: sparsity not in [0, 1), rank < 2 or unknown, last axis unknown,
      or k = d - floor(d * sparsity) < 1 (d = 0).
    TypeError: `x` is not a floating-point tensor.
  """
  sparsity = check_sparsity(sparsity, caller)
  x = tf.convert_to_tensor(x)
  if x.dtype not in FLOAT_DTYPES:
    raise TypeError(f"{caller}: x must be a floating-point tensor (float16, "
                    f"bfloat16, float32 or float64), got {x.dtype.name}")
  rank = x.shape.rank
  if rank is None or rank < 2:
    raise ValueError(f"{caller}: x must have rank >= 2 ([batch, ..., d]), got "
                     f"shape {x.shape}")
  d = x.shape[-1]
  if d is None:
    raise ValueError(f"{caller}: the last axis of x (d) must be known "
                     f"statically, got shape {x.shape}")
  k = num_kept(d, sparsity)
  if k < 1:
    raise ValueError(f"{caller}: k = d - floor(d * sparsity) must be >= 1, got "
                     f"k = {k} for d = {d}, sparsity = {sparsity}")
  return x, d, k


def top_k_indices(x2: tf.Tensor, k: int) -> tf.Tensor:
  """Column indices [N, k] (int32) of the k largest |x| per row of [N, d]."""
  # DCT Algorithm 2 lines 5-6: sorting |X_i| and taking tau_i; top_k does both
  # and breaks ties towards the lower index.
  return tf.math.top_k(tf.abs(x2), k=k, sorted=True).indices


def mask_from_indices(indices: tf.Tensor, d: int) -> tf.Tensor:
  """Boolean mask [N, d] with True at `indices` [N, k]."""
  return tf.reduce_any(tf.one_hot(indices, d, on_value=True, off_value=False,
                                  dtype=tf.bool), axis=-2)


def dct_mp_mask(x, sparsity: float) -> tf.Tensor:
  """The boolean DCT-MP mask M of `x` (same shape), exactly k True per row."""
  x, d, k = check_input(x, sparsity, "dct_mp_mask")
  x2 = tf.reshape(x, [-1, d])
  # DCT Algorithm 2 lines 4-9: one mask row m_i per activation row.
  mask = mask_from_indices(top_k_indices(x2, k), d)
  return tf.reshape(mask, tf.shape(x))


def dct_mp(x, sparsity: float) -> tf.Tensor:
  """Keeps the k = d - floor(d * sparsity) largest |x| per row; same mask backward.

  Args:
    x: float tensor [..., d] of rank >= 2 (float16, bfloat16, float32, float64).
    sparsity: eta in [0, 1), the fraction of each row dropped.

  Returns:
    X ⊙ M. The gradient is dY ⊙ M with the same M (Algorithm 2 lines 12-14).

  Example:
    With d = 4 and sparsity 0.5, the 2 largest |x| of each row stay:

    >>> x = tf.constant([[0.5, -2.0, 1.0, 0.25], [3.0, 0.0, -0.25, 0.5]])
    >>> dct_mp(x, 0.5).numpy().tolist()
    [[0.0, -2.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.5]]
  """
  x, _, _ = check_input(x, sparsity, "dct_mp")

  @tf.custom_gradient
  def masked(x):
    mask = dct_mp_mask(x, sparsity)
    y = tf.where(mask, x, tf.zeros_like(x))  # DCT Algorithm 2 line 10

    def grad(dy):
      return tf.where(mask, dy, tf.zeros_like(dy))  # DCT Algorithm 2 line 13

    return y, grad

  return masked(x)
