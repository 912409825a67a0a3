"""Plain numpy reference of DCT-DP (DCT Algorithm 1) for one variable.

Written straight from the algorithm, one replica at a time, with the
conventions documented in tf_dct/compression/dct_dp.py: 0-based ascending order
statistic w_m with m = floor(n * sparsity), i.e. the k-th largest with
k = n - m (threshold 0 when m = 0), `>=` mask
(ties selected) over the non-zero entries (a zero carries nothing), at most C entries on the wire (the first ones in flat order),
threshold refresh when (k - warmup_steps) % L == 0, dense steps (warmup or
n < min_size) that send g + E and clear E. A sparsity schedule (steps,
sparsity) runs its stages after the warm-up, each starting with a refresh.
"""

from __future__ import annotations

import dataclasses
from decimal import Decimal
import math

import numpy as np


def reference_below(n: int, sparsity: float, min_count: int = 0) -> int:
  """m = floor(n * sparsity) on the decimal sparsity, so that n - m >= min(n, min_count)."""
  return min(math.floor(Decimal(repr(float(sparsity))) * n), n - min(n, min_count))


def reference_capacity(n: int, sparsity: float, capacity_factor: float,
                       min_count: int = 0) -> int:
  m = reference_below(n, sparsity, min_count)
  expected = n - m
  return min(n, math.ceil(Decimal(repr(float(capacity_factor))) * expected))


def reference_corrected_threshold(tau, selected, expected, gain, max_factor):
  """tau * clip(1 + gain * (selected / expected - 1), 1 / max_factor,
  max_factor), in float64, rounded to tau's dtype."""
  factor = 1.0 + gain * (np.float64(selected) / np.float64(expected) - 1.0)
  factor = min(max(factor, 1.0 / max_factor), max_factor)
  return tau.dtype.type(np.float64(tau) * factor)


@dataclasses.dataclass
class ReferenceStep:
  masks: list          # per replica: bool array, entries sent (after capacity)
  selected: list       # per replica: bool array, |acc| >= tau (before capacity)
  taus: list           # per replica: threshold used at this step
  residuals: list      # per replica: residual after this step
  update: np.ndarray   # sum over replicas of what was sent (float64)
  # per replica: threshold the next step starts from
  next_taus: list = dataclasses.field(default_factory=list)


def dct_dp_reference(grads_per_step_per_replica, sparsity, threshold_life,
                     capacity_factor, min_size=0, warmup_steps=0, min_count=0,
                     sparsity_schedule=(), threshold_gain=0.0,
                     threshold_max_factor=2.0, residual_decay=1.0):
  """Runs DCT-DP on a fixed gradient sequence of one variable.

  Args:
    grads_per_step_per_replica: grads[t][r] is replica r's gradient at step t
      (all the same shape and float dtype).
    sparsity, threshold_life, capacity_factor, min_size, warmup_steps,
      min_count, sparsity_schedule, threshold_gain, threshold_max_factor,
      residual_decay: as in `DCTDP` (min_count 0: Algorithm 1 as written;
      the schedule as a phase driver runs it; threshold_gain 0: no
      correction; residual_decay 1: none).

  Returns:
    A list of `ReferenceStep`, one per step.
  """
  first = np.asarray(grads_per_step_per_replica[0][0])
  shape, dtype = first.shape, first.dtype
  n = first.size
  replicas = len(grads_per_step_per_replica[0])
  stages, start = [], warmup_steps  # (first step, sparsity) after warmup
  for steps, stage_sparsity in sparsity_schedule:
    stages.append((start, stage_sparsity))
    start += steps
  stages.append((start, sparsity))
  residual = [np.zeros(n, dtype) for _ in range(replicas)]
  tau = [dtype.type(0) for _ in range(replicas)]
  out = []
  for k, grads in enumerate(grads_per_step_per_replica):
    begins, now = stages[0]  # the stage that step k is in
    for first, stage_sparsity in stages:
      if first <= k:
        begins, now = first, stage_sparsity
    m = reference_below(n, now, min_count)
    cap = reference_capacity(n, now, capacity_factor, min_count)
    step = ReferenceStep([], [], [], [], np.zeros(n, np.float64))
    for r in range(replicas):
      g = np.asarray(grads[r], dtype).reshape(-1)
      acc = g + residual[r]                                   # line 2
      if n < min_size or k < warmup_steps:                    # dense step
        selected = np.ones(n, bool)
        sent_mask = selected
      else:
        if (k - warmup_steps) % threshold_life == 0 or k == begins:  # line 3
          w = np.sort(np.abs(acc))                            # line 4, ascending
          tau[r] = w[m] if m >= 1 else dtype.type(0)          # line 5, 0-based w_m
        selected = (np.abs(acc) >= tau[r]) & (acc != 0)       # line 9, zeros carry nothing
        before = np.cumsum(selected) - selected               # selected entries before
        sent_mask = selected & (before < cap)                 # what fits the wire
      sent = np.where(sent_mask, acc, dtype.type(0))          # line 10
      residual[r] = acc - sent                                # line 11
      if residual_decay != 1:                                 # what stays fades
        residual[r] = residual[r] * dtype.type(residual_decay)
      step.update += sent                                     # line 12
      step.masks.append(sent_mask.reshape(shape))
      step.selected.append(selected.reshape(shape))
      step.taus.append(tau[r])
      if threshold_gain and not (n < min_size or k < warmup_steps):
        tau[r] = reference_corrected_threshold(tau[r], selected.sum(), n - m,
                                               threshold_gain,
                                               threshold_max_factor)
      step.next_taus.append(tau[r])
      step.residuals.append(residual[r].reshape(shape).copy())
    step.update = step.update.reshape(shape)
    out.append(step)
  return out
