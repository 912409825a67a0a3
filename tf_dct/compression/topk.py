"""Top-k sparsification with error feedback (DEFT Table 1, "Top-k").

Every step, each replica adds its held-back error to the gradient of each
variable (layer-wise), sends the k entries of largest magnitude and holds back
the rest (DEFT Algorithm 1 lines 5-6, 11-12). Replicas choose independently, so
the aggregate's support is the union of their choices: up to n * k entries on
n replicas ("gradient build-up", DEFT §1 and §3.1). The exchange is DCT-DP's:
every replica all-gathers the others' (index, value) buffers and scatter-adds
them (DEFT Algorithm 1 lines 7-9, duplicates summed).

Conventions (tests/compression/reference_baselines.py follows them exactly):

* Count. A variable of n entries sends k = n - floor(n * (1 - density))
  entries, the count DCTDP uses for sparsity 1 - density. The difference is
  taken on the decimal value of `density` as written, so k = ceil(n * density)
  exactly (0.07 of 100 is 7, not the 8 that binary 1 - 0.07 would give).
* Relation to DCT-DP. The threshold is the k-th largest magnitude tau (DCT
  Algorithm 1 lines 4-5, refreshed every step: L = 1) and every entry with
  magnitude >= tau is selected (line 9). The wire holds C = min(n,
  ceil(capacity_factor * k)) entries. When ties at tau select more than C,
  every entry above tau is sent and the remaining slots go to the ties in
  flat position order (the tie rule of `tf.math.top_k`); the other ties stay
  in the residual. So capacity_factor = 1 sends exactly the top k, and a
  capacity that holds all ties gives exactly DCTDP(1 - density,
  threshold_life=1) (DCTDP instead fills its capacity in flat order, which
  may hold back an entry above tau).
* Dense variables, warmup, non-finite gradients and state discipline are
  shared with HardThreshold and CLTK through `ErrorFeedbackCompressor` (below)
  and behave as in DCTDP: variables with fewer than `min_size` entries go
  dense and keep no state; during the first `warmup_steps` steps a variable
  sends g + E densely and clears E (a step traced without its phase,
  `Compressor.in_phase`, issues both collectives); a NaN/Inf gradient raises
  and no replica's state advances.
* IndexedSlices gradients are not densified: their rows are scatter-added
  into a copy of the residual (`error_feedback.accumulate`), as in DCTDP.
  Variables below `min_size` are densified (dense all-reduce).

State per compressed variable and replica: `residual`, and `scalars`
packing `step` (int64), `sent` and `overflow` (int32, last step, as in
DCTDP) and `threshold` (tau of the last step); see
`Compressor.scalar_dtypes`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Sequence

import tensorflow as tf

from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import error_feedback
from tf_dct.compression import dct_dp
from tf_dct.compression import sparse_wire
from tf_dct.compression.base import Compressor


def selected_count(n: int, density: float, min_count: int = 0) -> int:
  """k = n - floor(n * (1 - density)), on the decimal value of `density`,
  and at least min(n, min_count)."""
  k = n - math.floor((1 - validation.as_decimal(density)) * n)
  return max(k, min(n, min_count))


def slots(n: int, count: int, factor: float) -> int:
  """Wire capacity: min(n, ceil(factor * count)), on decimal values."""
  return min(n, math.ceil(validation.as_decimal(factor) * count))


@dataclasses.dataclass
class Item:
  """One compressed variable on this replica, this step."""
  acc: tf.Tensor             # flat g + E (DEFT Algorithm 1 line 5)
  step: tf.Tensor            # this variable's step counter before the step
  warm: tf.Tensor | None     # True on a dense warmup step (None: no warmup)
  n: int


@dataclasses.dataclass
class Outcome:
  """What `_exchange` produced for one item."""
  summed: tf.Tensor          # flat sum over replicas of what was sent
  residual: tf.Tensor        # flat new residual (warmup is applied later)
  sent: tf.Tensor            # int32 entries this replica sent
  overflow: tf.Tensor        # int32 entries selected but held back
  extra: dict                # further state key -> new value
  report: dict               # `Compressor.record` arguments (bytes, time, ...)
  nnz: tf.Tensor | None = None  # int64 non-zeros of `summed` (None: not counted)


class ErrorFeedbackCompressor(Compressor):
  """Residuals, warmup, min_size and the non-finite discipline, shared.

  Subclasses choose what each replica sends: either `_select` (a mask and a
  capacity; the union exchange of `sparse_wire` does the rest) or, for another
  exchange, `_exchange` itself.

  Args:
    min_size: variables with fewer entries always go dense, an int >= 0.
    warmup_steps: steps during which every variable goes dense, an int >= 0.
    name: module name.
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are and keep no state (see
      `Compressor.reduce_as_is`).
    sparse_gradients: "auto" (default), "stock" or "compress": how
      `tf.IndexedSlices` gradients (embedding rows) are sent; "auto" sends
      them as TF does where that moves fewer bytes (`Compressor`).
    momentum, momentum_masking: momentum correction, as in `DCTDP` (here
      off by default: the baselines CLTK and HardThreshold keep their
      published form; TopK defaults to None, as DCTDP).
    adam, adam_second_moment, adam_select, adam_first_moment: Adam
      correction, as in `DCTDP` (off by default here and in TopK: with
      exactly k entries a step it was no better overall than without it in
      our runs, docs/quality.md).
  """

  # Further per-variable scalars of the state, of the variable's dtype;
  # `_select` returns their new values in `extra` on every step.
  _extra_state_keys: tuple = ()

  def __init__(self, min_size: int = 0, warmup_steps: int = 0,
               name: str | None = None, exclude: Sequence[str] = (),
               momentum: float | None = 0.0, momentum_masking: bool = False,
               adam: bool | None = False, adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               sparse_gradients: str = "auto"):
    super().__init__(name=name, exclude=exclude,
                     sparse_gradients=sparse_gradients)
    self._init_momentum(momentum, momentum_masking)
    self._init_adam(adam, adam_second_moment, adam_select,
                    adam_first_moment)
    self.min_size = int(self._check("min_size", min_size, numbers.Integral, 0,
                                    False))
    self.warmup_steps = int(self._check("warmup_steps", warmup_steps,
                                        numbers.Integral, 0, False))

  def _check(self, *args, **kwargs):
    return validation.check_number(type(self).__name__, *args, **kwargs)

  def _is_dense(self, variable) -> bool:
    n = variable.shape.num_elements()
    return n == 0 or n < self.min_size

  def counter_names(self, variable):
    return () if self._is_dense(variable) else ("overflow",)

  def compressed_bytes(self, variable):
    n = variable.shape.num_elements()
    if self._is_dense(variable):
      return 0, n * variable.dtype.size
    return self._exchange_bytes(n, variable.dtype)

  def _exchange_bytes(self, n: int, dtype) -> tuple[int, int] | None:
    """(P, M) of an n-entry variable's compressed step (`compressed_bytes`);
    None: not known statically."""
    del n, dtype
    return None

  def create_state(self, variable):
    n = self.check_variable(variable, sparse_wire.MAX_SIZE - 1)
    if self._is_dense(variable):
      return {}
    base = type(self).__name__.lower() + "/" + re.sub(r"[^A-Za-z0-9_]+", "_",
                                        variable.name.split(":")[0])
    return {"residual": self.per_replica_state(
                tf.zeros(variable.shape, variable.dtype), name=f"{base}/residual"),
            "scalars": self.scalars_state(variable, f"{base}/scalars")}

  def scalar_dtypes(self, variable):
    dtypes = {"step": tf.int64, "sent": tf.int32, "overflow": tf.int32}
    dtypes.update({key: variable.dtype for key in self._extra_state_keys})
    return dtypes

  def reduce(self, ctx, grads, variables, states):
    grads = error_feedback.densify_unless(grads, [bool(st) for st in states])
    # No state is read before every gradient of this replica passed its check
    # (see `error_feedback.checked_reads`); variables without state (below
    # min_size, or empty) go to a plain dense SUM.
    checked, values, dense = error_feedback.checked_reads(
        type(self).__name__, grads, variables, states, ("residual", "scalars"))
    results = [None] * len(grads)
    items = []    # (position, variable, state, Item)
    for i, (g, v, st, value) in enumerate(zip(checked, variables, states, values)):
      if not st:
        continue
      acc = error_feedback.accumulate(             # DEFT Algorithm 1 line 5
          g, value["residual"], v)
      step = self.unpack_scalars(v, value["scalars"])["step"]
      warm = step < self.warmup_steps if self.in_graph_warmup else None
      items.append((i, v, st, Item(acc, step, warm, v.shape.num_elements())))
      if warm is not None:
        dense.append((i, tf.reshape(tf.where(warm, acc, tf.zeros_like(acc)),
                                    v.shape)))
    outcomes = self._exchange(ctx, [it for *_, it in items]) if items else []
    for (i, v, _, _), out in zip(items, outcomes):
      results[i] = tf.reshape(out.summed, v.shape)
    self.add_dense_sums(ctx, dense, results)
    # Writes wait for the collectives, which wait for every replica's checks:
    # when one replica meets a non-finite gradient, no replica's state moves.
    with tf.control_dependencies(error_feedback.gate(results)):
      for (_, v, st, it), out in zip(items, outcomes):
        self._write(v, st, it, out)
    self._report(variables, results, items, outcomes)
    return results

  def _report(self, variables, results, items, outcomes) -> None:
    """Hands this step's per-variable facts to the base's accounting."""
    sparse = {i: (it, out) for (i, _, _, it), out in zip(items, outcomes)}
    for i, (v, r) in enumerate(zip(variables, results)):
      if i not in sparse:  # dense variable: all-reduced as it is
        self.record_dense(v)
        continue
      it, out = sparse[i]
      n = v.shape.num_elements()
      report = dict(out.report)
      # Counted by the exchange, except with warmup (see `_exchange`).
      nnz = (out.nnz if out.nnz is not None
             else self.aggregate_nnz(r, it.warm))  # it.warm: None without warmup
      sent, overflow = out.sent, out.overflow
      if self.in_graph_warmup:  # the dense all-reduce is issued on every step
        report["reduce_bytes"] = report.get("reduce_bytes", 0) + n * v.dtype.size
        sent = tf.where(it.warm, n, sent)
        overflow = tf.where(it.warm, 0, overflow)
      self.record(v, nnz=nnz, sent=sent, counters={"overflow": overflow},
                  **report)

  def _write(self, variable, st, item, out):
    residual, sent, overflow = out.residual, out.sent, out.overflow
    if item.warm is not None:  # a dense step sends all n and holds back nothing
      residual = tf.where(item.warm, tf.zeros_like(residual), residual)
      sent = tf.where(item.warm, item.n, sent)
      overflow = tf.where(item.warm, 0, overflow)
    st["residual"].local().assign(tf.reshape(residual, variable.shape))
    st["scalars"].local().assign(self.pack_scalars(variable, dict(
        out.extra, step=item.step + 1, sent=sent, overflow=overflow)))

  def _select(self, item: Item):
    """Returns `(mask, capacity, selected, extra)` for the union exchange.

    `mask` marks the entries to send; the first `capacity` of them in flat
    order fit on the wire. `selected` (int32) is what the rule chose before
    the capacity, `extra` the further state to write.
    """
    raise NotImplementedError

  def _exchange(self, ctx, items: list) -> list:
    """Union exchange: each replica sends its selection, duplicates summed."""
    buffers, kept = [], []
    timing = self.timing_enabled
    # One selection-time span for all variables (see `accounting`).
    start = accounting.start_timer([it.acc for it in items], timing)
    for it in items:
      with tf.control_dependencies([start] if timing else []):
        mask, cap, selected, extra = self._select(it)
      if it.warm is not None:
        mask = tf.logical_and(mask, tf.logical_not(it.warm))
      idx, val, count, fitted = sparse_wire.compact(it.acc, mask, cap)
      buffers.append((idx, val, it.n))                 # DEFT Algorithm 1 lines 7-9
      residual = tf.where(fitted, tf.zeros_like(it.acc), it.acc)  # lines 11-12
      report = dict(
          gather_bytes=sparse_wire.wire_bytes(it.n, cap, it.acc.dtype),
          threshold=extra.get("threshold", self._fixed_threshold(it)))
      kept.append((residual, count, selected - count, extra, report))
    kept[0][-1]["selection_seconds"] = accounting.stop_timer(
        start, [t for idx, val, _ in buffers for t in (idx, val)], timing)
    # compact() leaves positions increasing with the padding last.
    # With warmup a dense part is added to the sums, so their non-zeros are
    # counted on the results instead (`_report`), not here too.
    counted = not self.in_graph_warmup
    exchanged = sparse_wire.exchange_many(ctx, buffers, presorted=True,
                                          nnz=counted)
    summed, nnzs = (exchanged if counted
                    else (exchanged, [None] * len(exchanged)))
    return [Outcome(s, *k, nnz=c) for s, k, c in zip(summed, kept, nnzs)]

  def _fixed_threshold(self, item: Item):
    """The threshold to report when `_select` keeps none in its state."""
    del item
    return None


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

  See the module docstring for the exact conventions.
  """

  _extra_state_keys = ("threshold",)

  def __init__(self, density: float = 0.01, min_size: int = 0,
               warmup_steps: int = 0, capacity_factor: float = 1.0,
               name: str | None = None, exclude: Sequence[str] = (),
               min_count: int = 8, momentum: float | None = None,
               momentum_masking: bool = False, adam: bool | None = False,
               adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               sparse_gradients: str = "auto"):
    super().__init__(min_size=min_size, warmup_steps=warmup_steps, name=name,
                     exclude=exclude, momentum=momentum,
                     momentum_masking=momentum_masking, adam=adam,
                     adam_second_moment=adam_second_moment,
                     adam_select=adam_select,
                     adam_first_moment=adam_first_moment,
                     sparse_gradients=sparse_gradients)
    self.density = float(self._check("density", density, numbers.Real, 0, True,
                                     1, False))
    self.min_count = int(self._check("min_count", min_count, numbers.Integral,
                                     0, False))
    self.capacity_factor = float(self._check(
        "capacity_factor", capacity_factor, numbers.Real, 1, False))

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
