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
  no state at all. Warm-up and the compressed steps are phases
  (`Compressor.in_phase`): traced in its phase, as `Replicator.run` and
  `tf_dct.keras.phase_callback` do for a wrapped optimizer, a warm-up step
  issues only the dense all-reduce (and moves no counter: k counts the
  compressed steps) and a compressed step only the all-gather. A step traced
  without its phase decides in the graph and issues both (collectives cannot
  sit inside `tf.cond`; the unused one carries zeros).
* Non-finite gradients are an error: every incoming gradient is checked
  (`error_feedback.check_finite`) before any state of this step is read, so
  the residual is never updated with them. State is written only after the
  step's collectives complete, and those wait for every replica's checks, so
  when one replica fails no replica's state advances (replicas stay in step).
  Variables that go through the native kernel (see below) are checked by
  the kernel itself as it reads the gradients, with the same error; the
  all-gather carries every selected variable, so it waits for those checks
  too (the dense all-reduce of variables without state may complete first,
  which moves no state).
  Compiled with XLA, where nothing can raise, the step is undone instead:
  the state is put back and the aggregate is NaN (`Compressor.aggregate`).
* IndexedSlices gradients (embeddings) are not densified. Duplicate row ids
  are combined first (a static-shape sort and segment sum, summing in the
  order `tf.convert_to_tensor` would, so the result is bit-identical to the
  densified path), then the combined rows are scatter-added into a copy of
  the residual. What this saves: the table-sized dense gradient and the add
  with the residual. What it does not: the residual is table-shaped state,
  so the accumulator, the threshold and the mask still cover every entry
  (O(N) per step): an untouched row may hold residual above the threshold,
  and the paper's order statistic is over all N entries. The wire carries
  only the selected entries either way. Variables below `min_size` are
  densified (they go through a dense all-reduce).
* Density guard (beyond the paper, `density_band=(low, high)`, on by default
  with (0.5, 2.0)): on a step that would reuse tau, if the entries selecting
  with the old tau number fewer than low * K or more than high * K (local
  density outside [low * K / N, high * K / N]), tau is recomputed in the same
  step (no collective is involved, so it stays a local `tf.cond`). Such early
  refreshes are counted per variable and replica (`communication_stats()`,
  counter "early_refreshes"). The count is the prefix count the compaction
  needs anyway, so a step that keeps tau costs nothing extra; a step that
  refreshes builds its mask twice. Why on by default: Algorithm 1 as written takes
  its first tau at k = 0, from g_0 alone, before error feedback has built up
  any residual. Over the next steps |g + E| grows several times past it (3 to
  47x in docs/reproduction/dct_fig2_tau.md), so the reused tau selects 6-12 K
  per step for L - 1 steps (the capacity sends 2 K in flat order and starves
  the entries late in the layer), and the refresh at k = L, taken on that
  inflated residual, then selects almost nothing for another L steps. The
  guard refreshes as soon as the selection leaves [K / 2, 2 K]. While tau is
  as stable as the paper's Fig 2 it seldom fires on variables with a large
  K (4-5% of steps for the benchmark DLRM's kernels of 131k-188k entries).
  With a small K (a bias: K of 1 to 6 at sparsity 0.99) one step's count is
  too noisy to stay in the band, and it fires on 35-58% of steps, which is
  cheap for such small variables (docs/benchmarks.md).
  `density_band=None` gives Algorithm 1 exactly.
* Grouping (an implementation detail, not a change of algorithm): with
  stock ops, variables of at most `FUSE_SIZE` entries and one dtype are laid
  end to end and go through lines 3-11 together (one mask, one prefix count,
  one compaction), each still with its own tau, schedule, capacity and
  residual; the result is bit for bit that of one variable at a time
  (tested). On a step where any of them refreshes tau, all of them compute
  their order statistic and those not due keep their old tau.
* Native kernels (an implementation detail, `native=None` by default): on
  CPU and outside XLA, all of a replica's variables of one dtype go through
  lines 2-11 in one C++ op (`tf_dct.ops.native.select`, compiled on first
  use): per variable the finite check, acc = g + E, the schedule's refresh
  with an O(n) order statistic, the density guard, the mask, the compaction
  and the new residual. It replaces a dozen stock ops per variable, the
  `tf.cond` of the schedule and the grouping above. The wire (line 12) is
  native too: one kernel lays a replica's buffers into one payload, and
  after the all-gather one kernel decodes, sums and counts the non-zeros of
  every buffer (`sparse_wire.exchange_many`). Bit for bit the same results
  (tested).
  Without a compiler, on GPU, TPU and under XLA the stock ops run.
* Index encoding: `index_encoding` ("auto" by default) picks the wire layout
  of positions, see `sparse_wire`; the chunked layouts cut the index bytes
  to 1-2 per slot plus per-chunk counts.
* Accounting: per variable it reports the all-gather payload
  (`sparse_wire.wire_bytes`), the dense all-reduce of warmup-capable
  compressors, nnz of the aggregated update (n on dense steps), entries sent,
  tau, and the counters "refreshes", "overflow" (and "early_refreshes" with
  a density band); the step's selection time (accumulators to packed
  buffers, all variables in one span) goes with the first compressed one.
  When every selected variable goes through the native kernel, the span is
  the kernel's own run time (it times itself): timestamps around it would
  make the replicas' selections wait for each other (see `accounting`).

State per compressed variable and replica: `residual` (E, variable shape)
and `scalars`, float64[4] holding `SCALARS`: tau, k, and two statistics of
the last step, `sent` (entries sent: packed on the wire, or n on a dense
warmup step) and `overflow` (entries that reached the threshold but did not
fit). The four share one variable because every variable a step touches
costs a few microseconds per call of the step function, whatever it holds
(dropping just the `sent` and `overflow` variables took 4-5% off
DCTDP(L=1000)'s step on the benchmark, docs/benchmarks.md). float64 holds
each exactly: tau is a float of at most 64 bits, k < 2^53, the counts
< 2^31. `Compressor.state_values` reads them by name.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import error_feedback
from tf_dct.compression import sparse_wire
from tf_dct.compression.base import Compressor
from tf_dct.ops import native as native_ops

_check = functools.partial(validation.check_number, "DCTDP")


# With stock ops (the native kernel takes every variable in one op), variables
# of at most this many entries (biases, small kernels) are selected together,
# laid end to end in one flat vector (`DCTDP._sparsify`); larger ones one by
# one. Grouping saves ops per variable (faster steps and a much faster trace
# for models with many small variables, see docs/benchmarks.md) but costs per
# entry: an entry finds its variable's tau through a gather,
# and a step on which any member of a group refreshes tau computes the order
# statistic of every member. Same-process A/Bs on the DLRM benchmark (4 CPU
# replicas, DCTDP(L=1000) vs Dense): 2.81x with 8192, 2.92x with 40000, 5.07x
# with every variable in one group, 2.90x with none.
FUSE_SIZE = 8192

# The per-variable scalars of the state, in the order of `scalars`.
SCALARS = ("threshold", "step", "sent", "overflow")


def num_below(n: int, sparsity: float, min_count: int = 0) -> int:
  """m = floor(n * sparsity), computed on the decimal value of `sparsity`,
  lowered where needed so that k = n - m is at least min(n, min_count)."""
  return min(validation.floor_fraction(n, sparsity), n - min(n, min_count))


def expected_count(n: int, sparsity: float, min_count: int = 0) -> int:
  """k = n - m (`num_below`): entries a fresh threshold selects, no ties."""
  return n - num_below(n, sparsity, min_count)


def capacity(n: int, sparsity: float, capacity_factor: float,
             min_count: int = 0) -> int:
  """Wire slots per variable and replica: min(n, ceil(factor * expected))."""
  factor = validation.as_decimal(capacity_factor)
  return min(n, math.ceil(factor * expected_count(n, sparsity, min_count)))


def order_statistic_threshold(magnitudes: tf.Tensor, m: int) -> tf.Tensor:
  """w_m of the ascending, 0-based sort of rank-1 `magnitudes`; 0 when m == 0."""
  n = magnitudes.shape[0]
  if m == 0:  # k = n: everything goes, whatever later magnitudes are
    return tf.zeros([], magnitudes.dtype)
  # w_m is the (n - m)-th largest; top_k keeps duplicates, so this is the
  # exact order statistic, ties included. k is a Python int (one XLA compile).
  k = n - m
  return tf.math.top_k(magnitudes, k=k, sorted=True).values[k - 1]


def _check_schedule(schedule) -> tuple[tuple[int, float], ...]:
  """Returns `schedule` as ((steps, sparsity), ...), or raises naming it."""
  try:
    pairs = tuple((steps, sparsity) for steps, sparsity in schedule)
  except (TypeError, ValueError):
    pairs = None
  if pairs is None or isinstance(schedule, (str, bytes)):
    raise ValueError("DCTDP: sparsity_schedule must be a sequence of pairs "
                     f"(steps, sparsity), got {schedule!r}")
  for i, (steps, sparsity) in enumerate(pairs):
    _check(f"sparsity_schedule[{i}] steps", steps, numbers.Integral, 1, False)
    _check(f"sparsity_schedule[{i}] sparsity", sparsity, numbers.Real, 0,
           True, 1, True)
  return tuple((int(steps), float(sparsity)) for steps, sparsity in pairs)


def _check_band(band):
  """Returns `band` as a float pair, or raises ValueError naming density_band."""
  if band is None:
    return None
  try:
    low, high = band
    ok = all(isinstance(b, numbers.Real) and not isinstance(b, bool)
             and math.isfinite(b) for b in (low, high))
    ok = ok and 0 <= low <= 1 <= high and low < high
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError("DCTDP: density_band must be None or a pair (low, high) "
                     f"of numbers with 0 <= low <= 1 <= high and low < high, "
                     f"got {band!r}")
  return float(low), float(high)


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
    warmup_steps: steps during which every variable goes dense, an int >= 0
      (a phase of its own; see the module docstring).
    name: module name.
    density_band: `(low, high)` with 0 <= low <= 1 <= high, low < high:
      refresh tau early when this replica's local density of a variable
      leaves [low * K / N, high * K / N] (beyond the paper; it keeps a
      long `threshold_life` from starting on a stale tau). None turns the
      guard off: Algorithm 1 exactly.
    index_encoding: "auto", "int32", "chunk16" or "chunk8" (see
      `sparse_wire`).
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are (`tf.IndexedSlices` stay sparse
      and are all-gathered) and keep no state, e.g. `("embedding",)` to
      compress only the dense layers, as DCT §3.1 does for DLRM.
    sparse_gradients: "auto" (default), "stock" or "compress": how
      `tf.IndexedSlices` gradients (embedding rows) are sent; "auto" sends
      them as TF does where that moves fewer bytes (`Compressor`).
    native: use the native CPU kernels (`tf_dct.ops.native`, built on first
      use; results bit-identical to stock ops) for lines 2-11 of every
      variable and the long wire buffers (line 12). None
      (default): when they build, on CPU and outside XLA; False: never;
      True: the same, but raise at construction when they cannot be built.
    min_count: every compressed variable selects at least min(n, min_count)
      entries per step, an int >= 0 (beyond the paper; 0 is Algorithm 1
      exactly). At sparsity 0.99 a bias or a small layer would otherwise
      send 1-2 entries a step and fall far behind; 8 costs a few hundred
      bytes per step on a whole model (docs/quality.md).
    momentum: momentum correction (`momentum_correction`): each replica
      keeps the velocity u = momentum * u + g of its gradients and feeds it
      to error feedback; the optimizer must then be plain SGD for the
      corrected variables. None (default): taken from a momentum SGD
      optimizer by `wrap_optimizer` (tf-keras or Keras 3), else 0; 0: off.
    momentum_masking: zero a replica's velocity where it sent an entry
      (DGC's momentum factor masking). Off by default: in our runs it
      made the start of training lag (docs/quality.md); without it the
      correction is exactly momentum SGD when nothing is held back.
    adam: Adam correction (`adam_correction`): the compressor runs Adam
      itself, with a second moment that sees every step's gradient through
      a small dense side channel and a selection on Adam-scaled gradients;
      the optimizer applies the corrected variables as plain SGD. None
      (default): on with an Adam or AdamW optimizer without amsgrad
      (tf-keras or Keras 3, `wrap_optimizer`), else off; False: off; True:
      required.
    adam_second_moment: "factored" (default; row and column sums of the
      squared gradient, rows + columns floats per matrix) or "exact" (a
      dense all-reduce; for measurements).
    adam_select: "normalized" (default: error feedback and selection on the
      Adam-scaled gradient) or "raw" (on the gradient, the scale applied
      after the exchange).
    sparsity_schedule: ((steps, sparsity), ...) stages run in order after
      the warm-up, before `sparsity` holds for the rest of training (DGC's
      sparsity warm-up, e.g. ((500, 0.75), (500, 0.9375), (500, 0.984)));
      each stage is a phase and starts with a fresh threshold. A step traced
      without its phase (no driver, see the module docstring) uses
      `sparsity`.
    adam_first_moment: "replica" (default: each replica keeps Adam's first
      moment of its own gradients and error feedback works on it, DGC's
      momentum correction for Adam) or "aggregate" (m averages what was
      sent; a held-back burst is then spread over the next steps).

  See the module docstring for the exact conventions.
  """

  def __init__(self, sparsity: float = 0.99, threshold_life: int = 1000,
               capacity_factor: float = 2.0, min_size: int = 0,
               warmup_steps: int = 0, name: str | None = None,
               density_band: tuple[float, float] | None = (0.5, 2.0),
               index_encoding: str = "auto", exclude: Sequence[str] = (),
               native: bool | None = None, min_count: int = 8,
               momentum: float | None = None, momentum_masking: bool = False,
               adam: bool | None = None, adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               sparsity_schedule: Sequence[tuple[int, float]] = (),
               sparse_gradients: str = "auto"):
    super().__init__(name=name, exclude=exclude,
                     sparse_gradients=sparse_gradients)
    self.sparsity = float(_check("sparsity", sparsity, numbers.Real, 0, True,
                                 1, True))
    self.threshold_life = int(_check("threshold_life", threshold_life,
                                     numbers.Integral, 1, False))
    self.capacity_factor = float(_check("capacity_factor", capacity_factor,
                                        numbers.Real, 1, False))
    self.min_size = int(_check("min_size", min_size, numbers.Integral, 0, False))
    self.warmup_steps = int(_check("warmup_steps", warmup_steps,
                                   numbers.Integral, 0, False))
    self.density_band = _check_band(density_band)
    self.sparsity_schedule = _check_schedule(sparsity_schedule)
    self.min_count = int(_check("min_count", min_count, numbers.Integral, 0,
                                False))
    self._init_momentum(momentum, momentum_masking)
    self._init_adam(adam, adam_second_moment, adam_select,
                    adam_first_moment)
    if index_encoding != "auto" and index_encoding not in sparse_wire.ENCODINGS:
      raise ValueError(f"DCTDP: index_encoding must be 'auto' or one of "
                       f"{sparse_wire.ENCODINGS}, got {index_encoding!r}")
    self.index_encoding = index_encoding
    if not isinstance(native, (bool, type(None))):
      raise ValueError(f"DCTDP: native must be None, True or False, got "
                       f"{native!r}")
    if native and not native_ops.available():
      raise RuntimeError("DCTDP: native=True, but the native kernels cannot be "
                         "built or loaded here (see the logged warning); pass "
                         "native=None or False to use stock TensorFlow ops")
    self.native = native

  def phase_starts(self) -> tuple[int, ...]:
    """The warm-up (if any), each stage of `sparsity_schedule`, then
    `sparsity` for the rest of training."""
    durations = ([self.warmup_steps] if self.warmup_steps else []) + [
        steps for steps, _ in self.sparsity_schedule]
    starts = [0]
    for steps in durations:
      starts.append(starts[-1] + steps)
    return tuple(starts)

  def _phase_sparsity(self) -> float:
    """The sparsity of the phase being traced (`sparsity` without one)."""
    stage = (-1 if self.phase is None
             else self.phase - (1 if self.warmup_steps else 0))
    if 0 <= stage < len(self.sparsity_schedule):
      return self.sparsity_schedule[stage][1]
    return self.sparsity

  def _phase_start(self) -> int | None:
    """The value of the step counter k (compressed steps) at the start of
    the compressed phase being traced; None without a phase."""
    if self.phase is None:
      return None
    return self.phase_starts()[self.phase] - self.warmup_steps

  def _is_dense(self, variable) -> bool:
    n = variable.shape.num_elements()
    return n == 0 or n < self.min_size

  def compressed_bytes(self, variable):
    n = variable.shape.num_elements()
    if self._is_dense(variable):
      return 0, n * variable.dtype.size
    cap = capacity(n, self.sparsity, self.capacity_factor, self.min_count)
    return sparse_wire.wire_bytes(n, cap, variable.dtype,
                                  self.index_encoding), 0

  def counter_names(self, variable):
    if self._is_dense(variable):
      return ()
    guard = ("early_refreshes",) if self.density_band is not None else ()
    return ("overflow", "refreshes") + guard

  def create_state(self, variable):
    n = self.check_variable(variable, sparse_wire.MAX_SIZE - 1)
    if self._is_dense(variable):
      return {}
    base = "dct_dp/" + re.sub(r"[^A-Za-z0-9_]+", "_", variable.name.split(":")[0])
    return {
        "residual": self.per_replica_state(
            tf.zeros(variable.shape, variable.dtype), name=f"{base}/residual"),
        "scalars": self.scalars_state(variable, f"{base}/scalars"),
    }

  def scalar_dtypes(self, variable):
    return dict(zip(SCALARS, (variable.dtype, tf.int64, tf.int32, tf.int32)))

  def reduce(self, ctx, grads, variables, states):
    grads = error_feedback.densify_unless(grads, [bool(st) for st in states])
    native = self._native_positions(grads, variables, states)
    groups = self._groups(grads, variables, states, native)
    # No state is read before every gradient of this replica passed the check
    # (see `error_feedback.checked_reads`); the native kernel checks the dense
    # gradients it reads itself.
    checked, values, dense_items = error_feedback.checked_reads(
        "DCTDP", grads, variables, states, ("residual", "scalars"),
        checked_by_caller=[i in native and not isinstance(g, tf.IndexedSlices)
                           for i, g in enumerate(grads)])
    results = [None] * len(grads)
    sparse_items = []   # (position, idx, val, n, shape)
    writes = []         # deferred state updates, one closure per group
    reports = {}        # position -> (record kwargs, warm) of sparse variables
    timing = self.timing_enabled
    accs = {}  # no state: below min_size (or empty), plain dense SUM
    for i, (g, v, st) in enumerate(zip(checked, variables, states)):
      if not st:
        continue
      if i not in native:                                          # DCT Algorithm 1 line 2
        accs[i] = error_feedback.accumulate(g, values[i]["residual"], v)
      elif isinstance(g, tf.IndexedSlices):  # the kernel adds nothing more
        accs[i] = (error_feedback.accumulate(g, values[i]["residual"], v),
                   tf.zeros([], v.dtype))
      else:  # the kernel adds the residual (line 2) as it reads
        accs[i] = (tf.reshape(g, [-1]), tf.reshape(values[i]["residual"], [-1]))
    # Selection time: the native kernels time themselves (summed). With
    # stock ops, one span of timestamps around all variables (see
    # `accounting`); it is kept off a native-only step, whose timestamps
    # would run the replicas' selections one after another.
    stamped = timing and not all(native_group for native_group, _ in groups)
    start = accounting.start_timer(tf.nest.flatten(list(accs.values())),
                                   stamped)
    kernel_seconds = []
    for native_group, members in groups:
      sparsify = self._select_native if native_group else self._sparsify
      items, dense_parts, write, group_reports, seconds = sparsify(
          [(accs[i], variables[i], states[i], values[i]) for i in members],
          start if stamped else None)
      kernel_seconds.append(seconds)
      sparse_items += [(i,) + item for i, item in zip(members, items)]
      dense_items += [(i, d) for i, d in zip(members, dense_parts)
                      if d is not None]
      writes.append(write)
      reports.update(zip(members, group_reports))
    sparse_items.sort(key=lambda item: item[0])
    sparse_nnz = {}  # position -> non-zeros of its exchanged sum
    if sparse_items:
      first = sparse_items[0][0]
      reports[first][0]["selection_seconds"] = (
          accounting.stop_timer(start, [t for _, idx, val, _, _ in sparse_items
                                        for t in (idx, val)], stamped)
          if stamped or not timing else tf.add_n(kernel_seconds))
      # With warmup a dense part is added to the sums, so their non-zeros
      # are counted on the results instead (`_report`), not here too.
      counted = not self.in_graph_warmup
      exchanged = sparse_wire.exchange_many(  # DCT Algorithm 1 line 12
          ctx, [(idx, val, n) for _, idx, val, n, _ in sparse_items],
          encoding=self.index_encoding, presorted=True, nnz=counted,
          use_native=self.native is not False)
      summed, nnzs = (exchanged if counted
                      else (exchanged, [None] * len(exchanged)))
      for (i, _, _, _, shape), flat, nnz in zip(sparse_items, summed, nnzs):
        results[i] = tf.reshape(flat, shape)
        if nnz is not None:
          sparse_nnz[i] = nnz
    self.add_dense_sums(ctx, dense_items, results)
    # State is written only once the collectives completed. Every replica's
    # contribution depends on all of its gradient checks, so when any replica
    # meets a non-finite gradient the collectives never complete and no
    # replica updates its state (no replica runs ahead of the others).
    with tf.control_dependencies(error_feedback.gate(results)):
      for write in writes:
        write()
    self._report(variables, results, reports, sparse_nnz)
    return results

  def _report(self, variables, results, reports, sparse_nnz) -> None:
    """Hands this step's per-variable facts to the accounting of the base.

    The non-zeros of an exchanged sum are those of the result, unless a
    warmup's dense part was added to it (then they are counted anew).
    """
    for i, (v, r) in enumerate(zip(variables, results)):
      if i not in reports:  # dense variable: all-reduced as it is
        self.record_dense(v)
        continue
      report, warm = reports[i]
      nnz = (sparse_nnz[i] if i in sparse_nnz
             else self.aggregate_nnz(r, warm))
      self.record(v, nnz=nnz, **report)

  def _groups(self, grads, variables, states, native
              ) -> list[tuple[bool, list[int]]]:
    """Positions of the variables selected together, in variable order.

    Each group is `(native, positions)`. The variables of `native` of one
    dtype form one group for the native kernel. Of the others, those of at
    most `FUSE_SIZE` entries and one dtype form one group; every larger one
    is a group of its own (see `FUSE_SIZE`).
    """
    fused, groups = {}, []
    for i, (g, v, st) in enumerate(zip(grads, variables, states)):
      if not st:
        continue
      key = (i in native, g.dtype)
      if i in native or v.shape.num_elements() <= FUSE_SIZE:
        if key not in fused:
          fused[key] = []
          groups.append((i in native, fused[key]))
        fused[key].append(i)
      else:
        groups.append((False, [i]))
    return groups

  def _native_positions(self, grads, variables, states) -> set[int]:
    """Variables whose lines 2-11 run in the native kernel.

    Those with state, of float32/float64, placed on a CPU, outside XLA, when
    the kernel is available and not turned off.
    """
    if self.native is False:
      return set()
    return {i for i, (g, v, st) in enumerate(zip(grads, variables, states))
            if st and native_ops.usable(g.dtype, v.device)}

  def _schedule(self, k):
    """Per variable (from the step counters k): (warm, due), warm None
    without warmup; due: the schedule refreshes tau (line 3)."""
    if not self.in_graph_warmup:
      due = k % self.threshold_life == 0                        # DCT Algorithm 1 line 3
      start = self._phase_start()
      if start:  # a new stage of the sparsity schedule: a fresh tau
        due = tf.logical_or(due, tf.equal(k, start))
      return None, due
    warm = k < self.warmup_steps
    return warm, tf.logical_and(
        tf.logical_not(warm),
        (k - self.warmup_steps) % self.threshold_life == 0)

  def _unpack(self, group):
    """A group's accumulators, variables, states, sizes n, m (`num_below`),
    capacities, and its step counters k (int64) and thresholds (of the
    variables' dtype) as [V] tensors."""
    variables = [v for _, v, _, _ in group]
    sizes = [v.shape.num_elements() for v in variables]
    sparsity = self._phase_sparsity()
    # `unpack_scalars` for the whole group at once: one [V, 4] matrix.
    scalars = tf.stack([value["scalars"] for _, _, _, value in group])
    return ([acc for acc, _, _, _ in group], variables,
            [st for _, _, st, _ in group], sizes,
            [num_below(n, sparsity, self.min_count) for n in sizes],
            [capacity(n, sparsity, self.capacity_factor, self.min_count)
             for n in sizes],
            tf.cast(scalars[:, SCALARS.index("step")], tf.int64),
            tf.cast(scalars[:, SCALARS.index("threshold")], variables[0].dtype))

  def _select_native(self, group, start):
    """Lines 2-11 for a group of variables of one dtype in one native op.

    The arguments and results are those of `_sparsify`; `group` has `(g, E)`
    as flat vectors instead of acc (E may be a scalar 0), and the kernel
    checks g and adds E (`native_ops.select`). Every variable keeps its own
    threshold, schedule, capacity and residual; the kernel takes each one's
    branch (refresh, guard, reuse) itself, so no `tf.cond` is built. The
    last result is the kernel's own run time (float64 seconds).
    """
    pairs, variables, states, sizes, below, caps, k, old_tau = self._unpack(
        group)
    dtype = pairs[0][0].dtype
    warm, due = self._schedule(k)
    if self.density_band is None:
      reuse = native_ops.FIXED
      lowest, highest = [0] * len(sizes), [0] * len(sizes)
    else:  # the guard's band on the count, as integers: c < x iff c < ceil(x)
      reuse = native_ops.GUARDED
      low, high = self.density_band
      expected = np.asarray([n - m for n, m in zip(sizes, below)], np.float64)
      lowest = [int(math.ceil(x)) for x in low * expected]
      highest = [int(math.floor(x)) for x in high * expected]
    modes = tf.where(due, native_ops.REFRESH, reuse)
    taus = old_tau
    if warm is not None:  # a warm variable selects nothing: tau = inf
      modes = tf.where(warm, native_ops.FIXED, modes)
      taus = tf.where(warm, tf.constant(np.inf, dtype), old_tau)
    with tf.control_dependencies([start] if start is not None else []):
      idxs, vals, residuals, tau, selected, early, seconds = native_ops.select(
          [g for g, _ in pairs], [e for _, e in pairs], taus, modes, caps,
          below, lowest, highest,
          [error_feedback.non_finite_message("DCTDP", v) for v in variables])
    if warm is not None:  # the threshold of a warm variable stays as it was
      tau = tf.where(warm, old_tau, tau)
    refresh = tf.logical_or(due, early)
    return self._finish(variables, states, sizes, caps, k, tau, refresh,
                        early if self.density_band is not None else None,
                        warm, selected, idxs, vals, residuals) + (seconds,)

  def _sparsify(self, group, start):
    """Lines 3-11 for a group of variables of one dtype, with stock ops.

    Each variable keeps its own threshold, schedule, capacity and residual
    (layer-wise, as Algorithm 1). The variables of a group are laid end to
    end in one flat vector, so the mask's prefix count, the compaction and
    the residual run once for all of them; per-variable scalars (tau, k) are
    vectors here, and an entry meets its variable's tau through a gather by
    segment.

    Args:
      group: `(acc, variable, state, values)` per variable, acc = g + E
        (line 2) as a flat vector, all of one dtype, and `values` the state's
        step and threshold as read after the gradient checks.
      start: the step's selection timer (every selection op waits for it),
        or None when selection is not stamped.

    Returns:
      Per variable the wire buffers `(idx, val, n, shape)` and the dense part
      (warmup only, else None); a closure that writes the new state of every
      variable of the group; per variable what to report to the accounting
      (`record` arguments, and the warmup flag); and the seconds a native
      kernel measured itself (None here).
    """
    accs, variables, states, sizes, below, caps, k, old_tau = self._unpack(
        group)
    one = len(sizes) == 1
    seg = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    # Per entry, the value of its variable in a vector of per-variable values.
    per_entry = (lambda t: t[0]) if one else (lambda t: tf.gather(t, seg))
    split = (lambda t: [t]) if one else (lambda t: tf.split(t, sizes))
    timed = [start] if start is not None else []
    flat = accs[0] if one else tf.concat(accs, 0)
    with tf.control_dependencies(timed):
      magnitude = tf.abs(flat)
    # DCT Algorithm 1 line 9, zeros excepted: they carry nothing, and with
    # tau = 0 (fewer than k non-zero entries, e.g. an embedding table whose
    # rows were not touched yet) they would fill the wire in flat order and
    # hold back the non-zero entries behind them until the next refresh.
    eligible = magnitude > 0
    warm, refresh = self._schedule(k)
    if warm is not None:
      eligible = tf.logical_and(eligible, tf.logical_not(per_entry(warm)))

    def select(tau):  # the mask, its prefix count, selected per variable
      mask = tf.logical_and(magnitude >= per_entry(tau), eligible)
      ends = sparse_wire.prefix_count(mask)
      if one:
        return mask, ends, ends[-1:]
      through = tf.gather(ends, np.cumsum(sizes).astype(np.int32) - 1)
      return mask, ends, through - tf.concat([[0], through[:-1]], 0)

    early = None
    if self.density_band is None:
      old = None
    else:  # beyond the paper: density guard on what the old tau selects
      low, high = self.density_band
      expected = np.asarray([n - m for n, m in zip(sizes, below)], np.float64)
      old = select(old_tau)
      reused = tf.cast(old[-1], tf.float64)  # selected per variable
      early = tf.logical_and(
          tf.logical_not(refresh),
          tf.logical_or(reused < low * expected, reused > high * expected))
      if warm is not None:  # warm variables select nothing
        early = tf.logical_and(early, tf.logical_not(warm))
      refresh = tf.logical_or(refresh, early)

    def fresh():  # a new tau for the variables due, the old one for the rest
      # A group of several holds small variables only, so each of them
      # takes its order statistic (cheap) rather than a branch of its own.
      tau = tf.stack([order_statistic_threshold(p, m)              # DCT Algorithm 1 lines 4-5
                      for p, m in zip(split(magnitude), below)])
      if not one:
        tau = tf.where(refresh, tau, old_tau)
      return (tau,) + select(tau)

    def reuse():                                                   # DCT Algorithm 1 line 7
      return (old_tau,) + (old if old is not None else select(old_tau))

    # One branch for the group: a step that keeps every tau (most steps with
    # a long threshold_life) builds no order statistic.
    tau, mask, ends, selected = tf.cond(tf.reduce_any(refresh), fresh, reuse)
    idx, val, _, fitted = sparse_wire.compact_segments(flat, mask, ends,
                                                       sizes, caps)
    # Line 10 sends acc * mask; here only the entries that fit on the wire
    # are sent, the selected ones that did not fit are kept like unselected
    # ones.
    new_residual = tf.where(fitted, tf.zeros_like(flat), flat)    # DCT Algorithm 1 lines 10-11
    split_slots = (lambda t: [t]) if one else (lambda t: tf.split(t, caps))
    return self._finish(variables, states, sizes, caps, k, tau, refresh, early,
                        warm, selected, split_slots(idx), split_slots(val),
                        split(new_residual)) + (None,)

  def _finish(self, variables, states, sizes, caps, k, tau, refresh, early,
              warm, selected, idxs, vals, residuals):
    """What `_sparsify` returns, from a group's selection.

    Args:
      variables, states, sizes, caps: per variable of the group.
      k: [V] step counters before this step.
      tau, refresh, early, warm, selected: [V] tau of this step, whether it
        was refreshed, by the guard (None: no guard), warm (None: no
        warmup), entries selected before the capacity cut.
      idxs, vals, residuals: per variable its wire buffers and flat new
        residual (a warm variable's is its whole accumulator).
    """
    count = tf.minimum(selected, caps)
    dense_parts = [None] * len(sizes)
    if warm is not None:  # a dense step sends all n entries, none overflow
      warms = tf.unstack(warm)
      dense_parts = [tf.reshape(tf.where(w, r, tf.zeros_like(r)), v.shape)
                     for w, r, v in zip(warms, residuals, variables)]
      residuals = [tf.where(w, tf.zeros_like(r), r)
                   for w, r in zip(warms, residuals)]
      count = tf.where(warm, sizes, count)
      selected = tf.where(warm, sizes, selected)
    else:
      warms = [None] * len(sizes)
    overflow = selected - count
    taus, refreshes, counts, overflows = [
        tf.unstack(t) for t in (tau, tf.cast(refresh, tf.int32), count, overflow)]
    earlies = (tf.unstack(tf.cast(early, tf.int32)) if early is not None
               else [None] * len(sizes))
    reports = []
    for v, var in enumerate(variables):
      counters = {"refreshes": refreshes[v], "overflow": overflows[v]}
      if early is not None:
        counters["early_refreshes"] = earlies[v]
      reports.append((dict(
          gather_bytes=sparse_wire.wire_bytes(sizes[v], caps[v], var.dtype,
                                              self.index_encoding),
          reduce_bytes=sizes[v] * var.dtype.size if self.in_graph_warmup else 0,
          sent=counts[v], threshold=taus[v], selection_seconds=None,  # set by reduce
          counters=counters), warms[v]))

    def write():
      # `pack_scalars` for the whole group at once, then one row each.
      columns = {"threshold": tau, "step": k + 1, "sent": count,
                 "overflow": overflow}
      scalars = tf.unstack(tf.stack(
          [tf.cast(columns[name], tf.float64) for name in SCALARS], axis=1))
      for v, (var, st) in enumerate(zip(variables, states)):
        st["residual"].local().assign(tf.reshape(residuals[v], var.shape))
        st["scalars"].local().assign(scalars[v])

    items = [(i, w, n, var.shape) for i, w, n, var in zip(
        idxs, vals, sizes, variables)]
    return items, dense_parts, write, reports
