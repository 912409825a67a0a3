"""Hard-threshold sparsification with error feedback (DEFT Table 1, §3.2).

Each replica sends, per variable, every entry of g + E whose magnitude
reaches a fixed threshold lambda, chosen before training and never recomputed,
and holds back the rest (DEFT Algorithm 1 lines 5-6, 11-12). Selection is one
O(n) comparison; how many entries pass is not controlled (DEFT §3.2:
"unpredictable density", and the replicas' selections build up in the union).

Conventions (tests/compression/reference_baselines.py follows them exactly):

* Mask |g + E| >= lambda, with lambda cast to the variable's dtype. lambda = 0
  selects every entry.
* The wire and exchange are DCTDP's: at most C = min(n, ceil(capacity_density
  * n)) entries per variable and replica, the first C selected ones in flat
  position order; selected entries that do not fit stay in the residual
  (counted in `overflow`), nothing is dropped.
* Dense variables (`min_size`), warmup, non-finite gradients and state as in
  TopK / DCTDP (see tf_dct/compression/error_feedback_compressor.py). State
  per compressed variable and replica: `residual`, and `scalars` packing
  `step`, `sent`, `overflow`.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import tensorflow as tf

from tf_dct.compression import error_feedback_compressor
from tf_dct.compression import sparse_wire
from tf_dct.compression import topk


class HardThreshold(error_feedback_compressor.ErrorFeedbackCompressor):
  """Fixed-threshold sparsification with error feedback.

  Args:
    threshold: lambda, a finite number >= 0 (DEFT §3.2: fixed for the run).
    capacity_density: wire slots per variable as a fraction of its entries,
      in (0, 1].
    min_size, warmup_steps, name, exclude, sparse_gradients,
      dense_gradients: as in
      `ErrorFeedbackCompressor`.
    value_dtype: None (default) or "bfloat16", as in `DCTDP`.
  """

  # Ops of the selection or its wire (e.g. tf.math.top_k) lack bfloat16 kernels.
  supported_dtypes = ("float16", "float32", "float64")

  def __init__(self, threshold: float, capacity_density: float = 0.05,
               min_size: int = 0, warmup_steps: int = 0,
               name: str | None = None, exclude: Sequence[str] = (),
               sparse_gradients: str = "auto",
               dense_gradients: str = "auto",
               value_dtype: str | None = None):
    super().__init__(min_size=min_size, warmup_steps=warmup_steps, name=name,
                     exclude=exclude, sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients, value_dtype=value_dtype)
    self.threshold = float(self._check("threshold", threshold, numbers.Real, 0,
                                       False))
    self.capacity_density = float(self._check(
        "capacity_density", capacity_density, numbers.Real, 0, True, 1, False))

  def capacity(self, n: int) -> int:
    """Wire slots of an n-entry variable: min(n, ceil(capacity_density * n))."""
    return topk.slots(n, n, self.capacity_density)

  def _exchange_bytes(self, n, dtype):
    return sparse_wire.wire_bytes(n, self.capacity(n), dtype), 0

  def _select(self, item):
    magnitude = tf.abs(item.acc)
    mask = magnitude >= tf.constant(self.threshold, magnitude.dtype)
    selected = tf.reduce_sum(tf.cast(mask, tf.int32))
    return mask, self.capacity(item.n), selected, {}

  def _fixed_threshold(self, item):
    return tf.constant(self.threshold, item.acc.dtype)
