"""Plain numpy references of the baselines TopK, HardThreshold and CLTK.

One variable, one replica at a time, straight from DEFT Algorithm 1 with the
conventions of tf_dct/compression/{topk,hard_threshold,cltk}.py:
k = n - floor(n * (1 - density)) on decimal values; TopK sends every entry
above the k-th largest magnitude and fills up to C = min(n, ceil(factor * k))
slots with ties in flat order; HardThreshold sends |acc| >= lambda, the first
C = min(n, ceil(capacity_density * n)) in flat order; CLTK's leader at step t
is replica t mod n and its top k (ties: lower position) is everyone's support.
Dense steps (warmup, n < min_size) send acc and clear the residual. With
`residual_decay` r every residual is multiplied by r after the step.
"""

from __future__ import annotations

from decimal import Decimal
import math

import numpy as np

from tests.compression.reference import ReferenceStep


def count(n: int, density: float) -> int:
  return n - math.floor((1 - Decimal(repr(float(density)))) * n)


def capacity(n: int, k: int, factor: float) -> int:
  return min(n, math.ceil(Decimal(repr(float(factor))) * k))


def _first(mask: np.ndarray, cap: int) -> np.ndarray:
  """The first `cap` True entries of `mask` in flat order."""
  before = np.cumsum(mask) - mask
  return mask & (before < cap)


def _run(grads, select, min_size, warmup_steps, residual_decay=1.0):
  """Shared loop. `select(t, accs)` -> per replica (sent, selected, tau)."""
  first = np.asarray(grads[0][0])
  shape, dtype, n = first.shape, first.dtype, first.size
  replicas = len(grads[0])
  residual = [np.zeros(n, dtype) for _ in range(replicas)]
  out = []
  for t, per_replica in enumerate(grads):
    accs = [np.asarray(g, dtype).reshape(-1) + e                # line 5
            for g, e in zip(per_replica, residual)]
    if n < min_size or t < warmup_steps:
      picks = [(np.ones(n, bool), np.ones(n, bool), None)] * replicas
    else:
      picks = select(t, accs)                                   # line 6
    step = ReferenceStep([], [], [], [], np.zeros(n, np.float64))
    for r, (acc, (sent, selected, tau)) in enumerate(zip(accs, picks)):
      values = np.where(sent, acc, dtype.type(0))
      step.update += values                                     # lines 7-9
      residual[r] = acc - values                                # lines 11-12
      if residual_decay != 1:                                   # what stays fades
        residual[r] = residual[r] * dtype.type(residual_decay)
      step.masks.append(sent.reshape(shape))
      step.selected.append(selected.reshape(shape))
      step.taus.append(tau)
      step.residuals.append(residual[r].reshape(shape).copy())
    step.update = step.update.reshape(shape)
    out.append(step)
  return out


def topk_reference(grads, density, capacity_factor=1.0, min_size=0,
                   warmup_steps=0, min_count=0, residual_decay=1.0):
  """TopK on grads[t][r] (one variable); a list of `ReferenceStep`.

  min_count 0 is DEFT's Top-k as written; otherwise k >= min(n, min_count).
  """
  n = np.asarray(grads[0][0]).size
  k = max(count(n, density), min(n, min_count))
  cap = capacity(n, k, capacity_factor)

  def select(t, accs):
    del t
    picks = []
    for acc in accs:
      mag = np.abs(acc)
      w = np.sort(mag)                                          # ascending
      tau = w[n - k] if k < n else mag.dtype.type(0)            # k-th largest
      above, ties = mag > tau, mag == tau
      tie_rank = np.cumsum(ties) - ties
      sent = above | (ties & (tie_rank < cap - above.sum()))
      picks.append((sent, mag >= tau, tau))
    return picks

  return _run(grads, select, min_size, warmup_steps, residual_decay)


def hard_threshold_reference(grads, threshold, capacity_density=0.05,
                             min_size=0, warmup_steps=0):
  """HardThreshold on grads[t][r] (one variable)."""
  first = np.asarray(grads[0][0])
  cap = capacity(first.size, first.size, capacity_density)
  lam = first.dtype.type(threshold)

  def select(t, accs):
    del t
    picks = []
    for acc in accs:
      selected = np.abs(acc) >= lam
      picks.append((_first(selected, cap), selected, lam))
    return picks

  return _run(grads, select, min_size, warmup_steps)


def cltk_reference(grads, density, min_size=0, warmup_steps=0):
  """CLTK on grads[t][r] (one variable); masks are the leader's support."""
  n = np.asarray(grads[0][0]).size
  k = count(n, density)
  replicas = len(grads[0])

  def select(t, accs):
    leader = accs[t % replicas]
    top = np.argsort(-np.abs(leader), kind="stable")[:k]        # ties: lower first
    support = np.zeros(n, bool)
    support[top] = True
    return [(support, support, None)] * replicas

  return _run(grads, select, min_size, warmup_steps)
