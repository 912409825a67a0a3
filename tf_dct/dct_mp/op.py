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
* rescale="l1" multiplies the kept entries of each row, forward and
  backward, by the row's L1 norm over theirs (tf_dct.dct_mp.rescale).
"""

from __future__ import annotations

import numbers

import tensorflow as tf

from tf_dct import validation
from tf_dct.dct_mp.rescale import check_rescale
from tf_dct.dct_mp.rescale import forward_scale
from tf_dct.dct_mp.rescale import row_scale
from tf_dct.dct_mp.rescale import scaled

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


def dct_mp(x, sparsity: float, rescale: str = "none") -> tf.Tensor:
  """Keeps the k = d - floor(d * sparsity) largest |x| per row; same mask backward.

  Args:
    x: float tensor [..., d] of rank >= 2 (float16, bfloat16, float32, float64).
    sparsity: eta in [0, 1), the fraction of each row dropped.
    rescale: "none"; "l1" to multiply each row's kept entries, and their
      gradient, by the row's L1 norm over theirs; "l1_backward" for the
      gradient only (`tf_dct.dct_mp.rescale`).

  Returns:
    X ⊙ M (times s_i per row with "l1"). The gradient is dY ⊙ M with the
    same M (Algorithm 2 lines 12-14), times s_i with either rescale.

  Example:
    With d = 4 and sparsity 0.5, the 2 largest |x| of each row stay:

    >>> x = tf.constant([[0.5, -2.0, 1.0, 0.25], [3.0, 0.0, -0.25, 0.5]])
    >>> dct_mp(x, 0.5).numpy().tolist()
    [[0.0, -2.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.5]]

    With rescale="l1" the kept entries of a row are scaled to the row's L1
    norm: by 3.75 / 3 in the first row, 2.5 / 2 in the second:

    >>> x = tf.constant([[0.5, -2.0, 1.0, 0.25], [1.5, 0.0, -0.5, 0.5]])
    >>> dct_mp(x, 0.5, rescale="l1").numpy().tolist()
    [[0.0, -2.5, 1.25, 0.0], [1.875, 0.0, -0.625, 0.0]]
  """
  x, d, k = check_input(x, sparsity, "dct_mp")
  rescale = check_rescale(rescale, "dct_mp")

  @tf.custom_gradient
  def masked(x):
    x2 = tf.reshape(x, [-1, d])
    indices = top_k_indices(x2, k)  # DCT Algorithm 2 lines 4-9
    mask = mask_from_indices(indices, d)
    s = (row_scale(x2, tf.gather(x2, indices, batch_dims=1), rescale)
         if rescale != "none" else None)
    y = tf.where(mask, scaled(x2, forward_scale(s, rescale)),
                 tf.zeros_like(x2))  # line 10

    def grad(dy):
      dy2 = tf.reshape(dy, [-1, d])
      # DCT Algorithm 2 line 13 (s_i a constant, as the mask is).
      return tf.reshape(tf.where(mask, scaled(dy2, s), tf.zeros_like(dy2)),
                        tf.shape(dy))

    return tf.reshape(y, tf.shape(x)), grad

  return masked(x)


WARMUPS = ("linear", "dense")


def kept_at(step, d: int, k: int, warmup_steps: int, warmup: str = "linear"):
  """Entries kept per row at training step `step` (0-based) of a warm-up.

  Before step `warmup_steps` the split keeps more than its final k: all d
  entries ("dense"), or k_t = d - floor((d - k) * t / W), falling linearly
  from d at t = 0 to k at t = W ("linear", i.e. the sparsity rises linearly
  from 0 to its target). From step W on, k. Integer arithmetic, so the
  schedule is exact. Why: layers after a split see their input change
  abruptly when a freshly initialised model is masked from the first step.

  Args:
    step: int or integer tensor, the number of training steps before this one.
    d: the row length.
    k: the final number kept per row (1 <= k <= d).
    warmup_steps: W >= 0; 0 means k from the first step.
    warmup: "linear" or "dense".

  Returns:
    k_t, an int32 tensor (or an int for an int `step`).

  Example:
    >>> [kept_at(t, d=10, k=2, warmup_steps=4) for t in range(6)]
    [10, 8, 6, 4, 2, 2]
    >>> [kept_at(t, d=10, k=2, warmup_steps=2, warmup="dense") for t in range(3)]
    [10, 10, 2]
  """
  if warmup not in WARMUPS:
    raise ValueError(f"kept_at: warmup must be one of {WARMUPS}, got {warmup!r}")
  if isinstance(step, numbers.Integral):
    if step >= warmup_steps:
      return k
    return d if warmup == "dense" else d - (d - k) * step // warmup_steps
  t = tf.minimum(tf.cast(step, tf.int64), warmup_steps)
  if warmup == "dense":
    kt = tf.where(t < warmup_steps, tf.constant(d, tf.int64), k)
  else:
    kt = d - (d - k) * t // max(warmup_steps, 1)
  return tf.cast(kt, tf.int32)


def dynamic_mask(x2: tf.Tensor, k) -> tf.Tensor:
  """The DCT-MP mask of [N, d] for a tensor k (same ties as the static op).

  Ranks every column by |x| with the order `top_k` uses (ties to the lower
  index) and keeps ranks below k, so for k fixed it equals the mask of
  `dct_mp_mask`.
  """
  d = x2.shape[-1]
  order = tf.math.top_k(tf.abs(x2), k=d, sorted=True).indices
  rank = tf.argsort(order, axis=-1, stable=True)
  return rank < tf.cast(k, rank.dtype)


def dct_mp_kept(x, k, rescale: str = "none") -> tf.Tensor:
  """DCT-MP keeping `k` (a scalar int tensor) entries per row, same mask backward.

  The variable-k form used during a split's warm-up; `dct_mp` is the
  static-k op. `rescale` as in `dct_mp`.
  """
  x = tf.convert_to_tensor(x)
  d = x.shape[-1]
  rescale = check_rescale(rescale, "dct_mp_kept")

  @tf.custom_gradient
  def masked(x):
    x2 = tf.reshape(x, [-1, d])
    mask = dynamic_mask(x2, k)
    s = (row_scale(x2, tf.where(mask, x2, tf.zeros_like(x2)), rescale)
         if rescale != "none" else None)
    y = tf.where(mask, scaled(x2, forward_scale(s, rescale)), tf.zeros_like(x2))

    def grad(dy):
      dy2 = tf.reshape(dy, [-1, d])
      return tf.reshape(tf.where(mask, scaled(dy2, s), tf.zeros_like(dy2)),
                        tf.shape(dy))

    return tf.reshape(y, tf.shape(x)), grad

  return masked(x)
