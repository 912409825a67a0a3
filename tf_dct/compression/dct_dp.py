"""DCT-DP: threshold sparsification with error feedback (DCT Algorithm 1).

Each replica compresses the gradient of every variable on its own (layer-wise).
It adds the error it held back so far, keeps the entries whose magnitude
reaches a threshold, sends those and holds back the rest for later. The
threshold is an order statistic of the magnitudes, but it is recomputed only
every `threshold_life` steps and reused in between, which keeps the costly
selection off most steps.

Conventions (the numpy reference in tests/compression/reference.py follows
them exactly):

* Order statistic. With n entries and sparsity s, let m = floor(n * s), where
  the product is taken on the decimal value of s as written (so 0.29 * 100
  gives 29, not the 28 of binary floating point), and k = n - m. Sorting the
  magnitudes ascending as w_0 <= ... <= w_{n-1}, the new threshold is w_m, the
  k-th largest: the paper's pseudocode indexes the sorted list with
  floor(n * eta), which we read 0-based so that exactly k = n - floor(n * eta)
  entries are selected without ties (the count the issue and DCT-MP use).
  With ties every entry equal to the threshold is selected too (the test is
  `>=`). When m = 0 (k = n) the threshold is 0, so every entry is always
  selected, also on steps that reuse it.
* Capacity. The wire carries at most C = min(n, ceil(capacity_factor * K))
  entries per variable and replica, where K = n - m is the count the order
  statistic selects without ties (so capacity_factor = 1 suffices on
  refresh steps without ties). A reused threshold or ties can select more; the
  first C selected entries (in flat position order) are sent and the others
  stay in the residual. Nothing is dropped.
* Schedule. Each variable has a step counter k per replica, starting at 0 and
  advanced once per aggregation. The threshold is refreshed when
  k >= warmup_steps and (k - warmup_steps) is a multiple of threshold_life
  (for warmup_steps = 0: "L divides k", as in the paper).
* Dense variables and warmup. A variable with fewer than `min_size` entries
  always goes dense; every variable goes dense while k < warmup_steps. A dense
  step sends the whole accumulator g + E (all-reduce SUM) and zeroes E, so no
  held-back gradient is lost when switching. Variables below `min_size` keep
  no state at all. Because collectives cannot sit inside `tf.cond` under
  MirroredStrategy, a compressor with warmup_steps > 0 issues both the dense
  all-reduce and the sparse all-gather on every step (the unused one carries
  zeros); keep warmup_steps = 0 unless that cost is acceptable.
* Non-finite gradients are an error: every incoming gradient is checked with
  `tf.debugging.check_numerics` before any state of this step is read, so the
  residual is never updated with them. State is written only after the step's
  collectives complete, and those wait for every replica's checks, so when one
  replica fails no replica's state advances (replicas stay in step).
* IndexedSlices gradients (embeddings) are densified with
  `tf.convert_to_tensor`. TODO: a sparse-aware path.

State per compressed variable and replica: `residual` (E, variable shape),
`threshold` (tau, scalar), `step` (k, int64), and two int32 statistics of the
last step: `sent` (entries sent: packed on the wire, or n on a dense warmup
step) and `overflow` (entries that reached the threshold but did not fit).
"""

from __future__ import annotations

import decimal
import math
import numbers
import re

import tensorflow as tf

from tf_dct.compression import sparse_wire
from tf_dct.compression.base import Compressor


def num_below(n: int, sparsity: float) -> int:
  """m = floor(n * sparsity), computed on the decimal value of `sparsity`."""
  return math.floor(decimal.Decimal(repr(float(sparsity))) * n)


def expected_count(n: int, sparsity: float) -> int:
  """k = n - floor(n * sparsity): entries a fresh threshold selects, no ties."""
  return n - num_below(n, sparsity)


def capacity(n: int, sparsity: float, capacity_factor: float) -> int:
  """Wire slots per variable and replica: min(n, ceil(factor * expected))."""
  factor = decimal.Decimal(repr(float(capacity_factor)))
  return min(n, math.ceil(factor * expected_count(n, sparsity)))


def order_statistic_threshold(magnitudes: tf.Tensor, m: int) -> tf.Tensor:
  """w_m of the ascending, 0-based sort of rank-1 `magnitudes`; 0 when m == 0."""
  n = magnitudes.shape[0]
  if m == 0:  # k = n: everything goes, whatever later magnitudes are
    return tf.zeros([], magnitudes.dtype)
  # w_m is the (n - m)-th largest; top_k keeps duplicates, so this is the
  # exact order statistic, ties included. k is a Python int (one XLA compile).
  k = n - m
  return tf.math.top_k(magnitudes, k=k, sorted=True).values[k - 1]


def _check_number(name, value, kind, lo, lo_open, hi=None, hi_open=False):
  """Raises ValueError naming `name` unless `value` is a `kind` in range."""
  if hi is None:
    allowed = f"{'>' if lo_open else '>='} {lo}"
  else:
    allowed = (f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")
  what = "an int" if kind is numbers.Integral else "a number"
  ok = (not isinstance(value, bool) and isinstance(value, kind)
        and math.isfinite(value)
        and (value > lo if lo_open else value >= lo)
        and (hi is None or (value < hi if hi_open else value <= hi)))
  if not ok:
    raise ValueError(f"DCTDP: {name} must be {what} {allowed}, got {value!r}")
  return value


class DCTDP(Compressor):
  """DCT-DP gradient compressor (per variable, per replica error feedback).

  Args:
    sparsity: fraction of entries held back, in the open interval (0, 1);
      0.99 sends about 1% of each gradient.
    threshold_life: steps a threshold is reused before it is recomputed
      (the paper's L), an int >= 1.
    capacity_factor: wire slots per variable as a multiple of the count a
      fresh threshold selects, a number >= 1. Larger absorbs threshold drift
      at the cost of bandwidth; what does not fit stays in the residual.
    min_size: variables with fewer entries are always all-reduced densely,
      an int >= 0.
    warmup_steps: steps during which every variable goes dense, an int >= 0.
    name: module name.

  See the module docstring for the exact conventions. TODO: IndexedSlices
  gradients are converted to dense tensors for now.
  """

  def __init__(self, sparsity: float = 0.99, threshold_life: int = 1000,
               capacity_factor: float = 2.0, min_size: int = 0,
               warmup_steps: int = 0, name: str | None = None):
    super().__init__(name=name)
    self.sparsity = float(_check_number("sparsity", sparsity, numbers.Real,
                                        0, True, 1, True))
    self.threshold_life = int(_check_number("threshold_life", threshold_life,
                                            numbers.Integral, 1, False))
    self.capacity_factor = float(_check_number(
        "capacity_factor", capacity_factor, numbers.Real, 1, False))
    self.min_size = int(_check_number("min_size", min_size, numbers.Integral,
                                      0, False))
    self.warmup_steps = int(_check_number("warmup_steps", warmup_steps,
                                          numbers.Integral, 0, False))

  def _is_dense(self, variable) -> bool:
    n = variable.shape.num_elements()
    return n == 0 or n < self.min_size

  def create_state(self, variable):
    if not variable.dtype.is_floating:
      raise TypeError(f"DCTDP compresses floating-point variables only; "
                      f"variable {variable.name!r} has dtype "
                      f"{variable.dtype.name}")
    n = variable.shape.num_elements()
    if n is None:
      raise ValueError(f"DCTDP needs a static shape; variable {variable.name!r} "
                       f"has shape {variable.shape}")
    if n >= sparse_wire.MAX_SIZE:
      raise ValueError(f"DCTDP: variable {variable.name!r} has {n} entries; the "
                       f"wire's int32 positions allow at most "
                       f"{sparse_wire.MAX_SIZE - 1}")
    if self._is_dense(variable):
      return {}
    base = "dct_dp/" + re.sub(r"[^A-Za-z0-9_]+", "_", variable.name.split(":")[0])
    return {
        "residual": self.per_replica_state(
            tf.zeros(variable.shape, variable.dtype), name=f"{base}/residual"),
        "threshold": self.per_replica_state(
            tf.zeros([], variable.dtype), name=f"{base}/threshold"),
        "step": self.per_replica_state(
            tf.zeros([], tf.int64), name=f"{base}/step"),
        "sent": self.per_replica_state(
            tf.zeros([], tf.int32), name=f"{base}/sent"),
        "overflow": self.per_replica_state(
            tf.zeros([], tf.int32), name=f"{base}/overflow"),
    }

  def reduce(self, ctx, grads, variables, states):
    # TODO(issue 3): IndexedSlices are densified here; add a sparse-aware path.
    grads = [tf.convert_to_tensor(g) for g in grads]
    checked = [
        tf.debugging.check_numerics(
            g, f"DCTDP: non-finite gradient for variable {v.name}")
        for g, v in zip(grads, variables)]
    results = [None] * len(grads)
    dense_items = []    # (position in results, tensor to all-reduce)
    sparse_items = []   # (position, idx, val, n, shape)
    writes = []         # deferred state updates, one closure per variable
    # No state is read before every gradient of this replica passed the check.
    with tf.control_dependencies(checked):
      for i, (g, v, st) in enumerate(zip(checked, variables, states)):
        if not st:  # below min_size (or empty): plain dense SUM, no state
          dense_items.append((i, tf.identity(g)))
          continue
        item, dense_part, write = self._sparsify(g, v, st)
        sparse_items.append((i,) + item)
        writes.append(write)
        if dense_part is not None:
          dense_items.append((i, dense_part))
      if sparse_items:
        summed = sparse_wire.exchange_many(  # DCT Algorithm 1 line 12
            ctx, [(idx, val, n) for _, idx, val, n, _ in sparse_items])
        for (i, _, _, _, shape), flat in zip(sparse_items, summed):
          results[i] = tf.reshape(flat, shape)
      if dense_items:
        reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                 [t for _, t in dense_items])
        for (i, _), t in zip(dense_items, reduced):
          results[i] = t if results[i] is None else results[i] + t
    # State is written only once the collectives completed. Every replica's
    # contribution depends on all of its gradient checks, so when any replica
    # meets a non-finite gradient the collectives never complete and no
    # replica updates its state (no replica runs ahead of the others).
    with tf.control_dependencies([r for r in results if r is not None]):
      for write in writes:
        write()
    return results

  def _sparsify(self, grad, variable, st):
    """Lines 2-11 for one variable on this replica.

    Returns the wire buffers `(idx, val, n, shape)`, the dense part (warmup
    only, else None) and a closure that writes the new state.
    """
    n = variable.shape.num_elements()
    m = num_below(n, self.sparsity)
    cap = capacity(n, self.sparsity, self.capacity_factor)
    residual = st["residual"].local()
    threshold = st["threshold"].local()
    step = st["step"].local()

    k = step.read_value()
    acc = tf.reshape(grad, [-1]) + tf.reshape(residual.read_value(), [-1])  # DCT Algorithm 1 line 2
    magnitude = tf.abs(acc)
    warm = None
    if self.warmup_steps:
      warm = k < self.warmup_steps
      refresh = tf.logical_and(
          tf.logical_not(warm),
          (k - self.warmup_steps) % self.threshold_life == 0)
    else:
      refresh = k % self.threshold_life == 0                      # DCT Algorithm 1 line 3
    tau = tf.cond(
        refresh,
        lambda: order_statistic_threshold(magnitude, m),           # DCT Algorithm 1 lines 4-5
        threshold.read_value)                                      # DCT Algorithm 1 line 7
    mask = magnitude >= tau                                        # DCT Algorithm 1 line 9
    if warm is not None:
      mask = tf.logical_and(mask, tf.logical_not(warm))
    idx, val, count, fitted = sparse_wire.compact(acc, mask, cap)
    zero = tf.zeros_like(acc)
    # Line 10 sends acc * mask; here only the entries that fit on the wire are
    # sent, the selected ones that did not fit are kept like unselected ones.
    new_residual = tf.where(fitted, zero, acc)                     # DCT Algorithm 1 lines 10-11
    dense_part = None
    if warm is not None:
      dense_part = tf.reshape(tf.where(warm, acc, zero), variable.shape)
      new_residual = tf.where(warm, zero, new_residual)
    selected = tf.reduce_sum(tf.cast(mask, tf.int32))
    if warm is not None:  # a dense step sends all n entries, none overflow
      count = tf.where(warm, n, count)
      selected = tf.where(warm, n, selected)

    def write():
      residual.assign(tf.reshape(new_residual, variable.shape))
      threshold.assign(tau)
      step.assign_add(1)
      st["sent"].local().assign(count)
      st["overflow"].local().assign(selected - count)

    return (idx, val, n, variable.shape), dense_part, write
