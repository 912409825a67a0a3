"""What the sparsifiers with error feedback share: TopK, HardThreshold, CLTK.

Each replica adds its held-back error E to the gradient of each variable
(acc = g + E, DEFT Algorithm 1 line 5), sends part of acc and holds back the
rest (lines 11-12). `ErrorFeedbackCompressor` does all but the choice of what
is sent, and behaves as DCTDP does:

* Variables with fewer than `min_size` entries go dense and keep no state.
* During the first `warmup_steps` steps a variable sends g + E densely and
  clears E (a step traced without its phase, `Compressor.in_phase`, issues
  both collectives).
* A NaN/Inf gradient raises and no replica's state advances.
* IndexedSlices gradients are not densified: their rows are scatter-added
  into a copy of the residual (`error_feedback.accumulate`). Variables below
  `min_size` are densified (dense all-reduce).

State per compressed variable and replica: `residual`, and `scalars`
packing `step` (int64), `sent` and `overflow` (int32, last step) and a
subclass's `_extra_state_keys`; see `Compressor.scalar_dtypes`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import tensorflow as tf

from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import error_feedback
from tf_dct.compression import sparse_wire
from tf_dct.compression.base import Compressor


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
    dense_gradients: "auto" (default) or "compress": "auto" sends a
      variable with a dense gradient whole (one all-reduce) where that
      moves no more bytes than compressing it (a bias, a small layer;
      `Compressor`).
    momentum, momentum_masking: momentum correction, as in `DCTDP` (here
      off by default: the baselines CLTK and HardThreshold keep their
      published form; TopK defaults to None, as DCTDP).
    adam, adam_second_moment, adam_select, adam_first_moment: Adam
      correction, as in `DCTDP` (off by default here: the baselines CLTK
      and HardThreshold keep their published form; TopK defaults to None,
      as DCTDP).
    adagrad, adagrad_accumulator: Adagrad correction, as in `DCTDP` (off
      by default).
    value_dtype: what the union exchange's values travel as, as in `DCTDP`
      (None: the variable's dtype; "bfloat16": rounded, the rounding error
      kept in the residual). A subclass with another exchange leaves it None.
    residual_decay: the factor residuals are multiplied by after a step, in
      (0, 1], as in `DCTDP` (1, the default: nothing held back is dropped).
  """

  # The union exchange (`_exchange`) goes through `sparse_wire.exchange_many`.
  exchanges_sparse_wire = True

  # Further per-variable scalars of the state, of the variable's dtype;
  # `_select` returns their new values in `extra` on every step.
  _extra_state_keys: tuple = ()

  def __init__(self, min_size: int = 0, warmup_steps: int = 0,
               name: str | None = None, exclude: Sequence[str] = (),
               momentum: float | None = 0.0, momentum_masking: bool = False,
               adam: bool | None = False, adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               adagrad: bool | None = False,
               adagrad_accumulator: str = "factored",
               sparse_gradients: str = "auto",
               dense_gradients: str = "auto",
               value_dtype: str | None = None,
               residual_decay: float = 1.0):
    super().__init__(name=name, exclude=exclude,
                     sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients)
    self._init_momentum(momentum, momentum_masking)
    self._init_adam(adam, adam_second_moment, adam_select,
                    adam_first_moment)
    self._init_adagrad(adagrad, adagrad_accumulator)
    self._init_value_dtype(value_dtype)
    self._init_residual_decay(residual_decay)
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
    variable = self._tf_variable(variable)
    n = variable.shape.num_elements()
    if self._is_dense(variable):
      return 0, n * variable.dtype.size
    return self._exchange_bytes(
        n, sparse_wire.wire_dtype(variable.dtype, self.value_dtype))

  def _exchange_bytes(self, n: int, dtype) -> tuple[int, int] | None:
    """(P, M) of an n-entry variable's compressed step (`compressed_bytes`);
    None: not known statically."""
    del n, dtype
    return None

  def create_state(self, variable):
    self.check_variable(variable, sparse_wire.MAX_SIZE - 1)
    if self._is_dense(variable):
      return {}
    return self.residual_state(variable, type(self).__name__.lower())

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
    st["residual"].local().assign(
        self.decay(tf.reshape(residual, variable.shape)))
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
      residual = tf.where(fitted, tf.zeros_like(it.acc), it.acc)  # lines 11-12
      # The value word: what rounding takes off a value stays in the residual.
      val, residual = sparse_wire.round_values(idx, val, residual,
                                               self.value_dtype)
      buffers.append((idx, val, it.n))                 # DEFT Algorithm 1 lines 7-9
      report = dict(
          gather_bytes=sparse_wire.wire_bytes(it.n, cap, val.dtype),
          threshold=extra.get("threshold", self._fixed_threshold(it)))
      kept.append((residual, count, selected - count, extra, report))
    kept[0][-1]["selection_seconds"] = accounting.stop_timer(
        start, [t for idx, val, _ in buffers for t in (idx, val)], timing)
    # compact() leaves positions increasing with the padding last.
    # With warmup a dense part is added to the sums, so their non-zeros are
    # counted on the results instead (`_report`), not here too.
    counted = not self.in_graph_warmup
    exchanged = sparse_wire.exchange_many(ctx, buffers, presorted=True,
                                          nnz=counted, payload=True,
                                          exact=self.exact_sizes)
    summed, nnzs, sent_bytes = (
        exchanged if counted
        else (exchanged[0], [None] * len(exchanged[0]), exchanged[1]))
    for k, nbytes in zip(kept, sent_bytes):
      k[-1]["gather_bytes"] = nbytes  # exact sizes: what was sent
    return [Outcome(s, *k, nnz=c) for s, k, c in zip(summed, kept, nnzs)]

  def _fixed_threshold(self, item: Item):
    """The threshold to report when `_select` keeps none in its state."""
    del item
    return None
