"""Top-k sparsification with error feedback (DEFT Table 1, "Top-k").

Every step, each replica adds its held-back error to the gradient of each
variable (layer-wise), sends the k entries of largest magnitude and holds back
the rest (DEFT Algorithm 1 lines 5-6, 11-12). Replicas choose independently, so
the aggregate's support is the union of their choices: up to n * k entries on
n replicas ("gradient build-up", DEFT §1 and §3.1). The exchange is DCT-DP's:
every replica all-gathers the others' (index, value) buffers and scatter-adds
them (DEFT Algorithm 1 lines 7-9, duplicates summed).

k = ceil(n * density) on the decimal value of `density`; ties at the k-th
magnitude fill the wire's capacity in flat position order. docs/sparsifiers.md
fixes the conventions; tests/compression/reference_baselines.py follows them.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import tensorflow as tf

from tf_dct import validation
from tf_dct.compression import dct_dp
from tf_dct.compression import sparse_wire
from tf_dct.compression.error_feedback_compressor import ErrorFeedbackCompressor


def selected_count(n: int, density: float, min_count: int = 0) -> int:
  """k = n - floor(n * (1 - density)), on the decimal value of `density`,
  and at least min(n, min_count)."""
  k = n - math.floor((1 - validation.as_decimal(density)) * n)
  return max(k, min(n, min_count))


def slots(n: int, count: int, factor: float) -> int:
  """Wire capacity: min(n, ceil(factor * count)), on decimal values."""
  return min(n, math.ceil(validation.as_decimal(factor) * count))


class TopK(ErrorFeedbackCompressor):
  """Per-variable top-k with error feedback; replicas' selections are unioned.

  Args:
    density: fraction of each variable's entries a replica sends, in (0, 1].
    min_size: variables with fewer entries always go dense, an int >= 0.
    warmup_steps: steps during which every variable goes dense, an int >= 0.
    capacity_factor: wire slots per variable as a multiple of k, a number
      >= 1; only threshold ties can use slots beyond k.
    name: module name.
    min_count: every compressed variable sends at least min(n, min_count)
      entries per step (beyond DEFT's Top-k; 0: k = ceil(n * density)
      exactly), as in `DCTDP`.
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are and keep no state (see
      `Compressor.reduce_as_is`).
    momentum, momentum_masking: momentum correction, as in `DCTDP` (None:
      on with a momentum SGD optimizer).
    adam, adam_second_moment, adam_select, adam_first_moment: Adam
      correction, as in `DCTDP` (None, the default: on with an Adam or
      AdamW optimizer without amsgrad, each replica keeping Adam's first
      moment; False: off).
    adagrad, adagrad_accumulator: Adagrad correction, as in `DCTDP` (off
      by default).
    sparse_gradients, dense_gradients: as in `ErrorFeedbackCompressor`.
    whole_below: with `dense_gradients="auto"`, every variable of fewer
      entries is also sent whole, an int >= 0 (default 0: by bytes alone).
      A small layer at a handful of entries a step can make training
      unstable under momentum SGD or Adam; `base.WHOLE_BELOW` (2048) sends
      such layers whole (docs/quality.md).
    value_dtype: None (default) or "bfloat16", as in `DCTDP`.
    residual_decay: the factor residuals are multiplied by after a step, in
      (0, 1], as in `DCTDP` (default 1).

  See the module docstring for the exact conventions.
  """

  # Ops of the selection or its wire (e.g. tf.math.top_k) lack bfloat16 kernels.
  supported_dtypes = ("float16", "float32", "float64")

  _extra_state_keys = ("threshold",)

  def __init__(self, density: float = 0.01, min_size: int = 0,
               warmup_steps: int = 0, capacity_factor: float = 1.0,
               name: str | None = None, exclude: Sequence[str] = (),
               min_count: int = 8, momentum: float | None = None,
               momentum_masking: bool = False, adam: bool | None = None,
               adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               adagrad: bool | None = False,
               adagrad_accumulator: str = "factored",
               sparse_gradients: str = "auto",
               dense_gradients: str = "auto",
               value_dtype: str | None = None,
               residual_decay: float = 1.0,
               whole_below: int = 0):
    super().__init__(min_size=min_size, warmup_steps=warmup_steps, name=name,
                     exclude=exclude, momentum=momentum,
                     momentum_masking=momentum_masking, adam=adam,
                     adam_second_moment=adam_second_moment,
                     adam_select=adam_select,
                     adam_first_moment=adam_first_moment,
                     adagrad=adagrad, adagrad_accumulator=adagrad_accumulator,
                     sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients, value_dtype=value_dtype,
                     residual_decay=residual_decay)
    self.density = float(self._check("density", density, numbers.Real, 0, True,
                                     1, False))
    self.min_count = int(self._check("min_count", min_count, numbers.Integral,
                                     0, False))
    self.capacity_factor = float(self._check(
        "capacity_factor", capacity_factor, numbers.Real, 1, False))
    self._init_whole_below(whole_below)

  def _exchange_bytes(self, n, dtype):
    k = selected_count(n, self.density, self.min_count)
    return sparse_wire.wire_bytes(n, slots(n, k, self.capacity_factor),
                                  dtype), 0

  def _select(self, item):
    k = selected_count(item.n, self.density, self.min_count)
    cap = slots(item.n, k, self.capacity_factor)
    magnitude = tf.abs(item.acc)
    # The k-th largest magnitude, refreshed every step (DCT Algorithm 1
    # lines 3-5 with L = 1); 0 when k = n.
    tau = dct_dp.order_statistic_threshold(magnitude, item.n - k)
    above = magnitude > tau
    ties = tf.equal(magnitude, tau)
    # Entries above tau always fit (fewer than k <= cap of them); ties fill
    # the remaining slots in flat order (tf.math.top_k's tie rule).
    room = cap - tf.reduce_sum(tf.cast(above, tf.int32))
    tie_rank = sparse_wire.prefix_count(ties) - tf.cast(ties, tf.int32)  # ties before
    mask = tf.logical_or(above, tf.logical_and(ties, tie_rank < room))
    selected = tf.reduce_sum(tf.cast(magnitude >= tau, tf.int32))  # line 9
    return mask, cap, selected, {"threshold": tau}
