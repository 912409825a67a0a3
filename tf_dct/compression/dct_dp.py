"""DCT-DP: threshold sparsification with error feedback (DCT Algorithm 1).

Each replica compresses every variable's gradient on its own. It adds what it
held back on earlier steps (error feedback), sends the entries whose magnitude
reaches a threshold and holds back the rest. The threshold is an order
statistic of the magnitudes, recomputed only every `threshold_life` steps (the
paper's L), which keeps the costly selection off most steps.

`select` is Algorithm 1 for one variable, lines 3-11 in the paper's order: the
reference semantics. `DCTDP.reduce` adds line 2 (acc = g + E), runs `select`
(or one of the bit-identical fast paths of `dct_dp_fast`: small variables
selected together, or a native CPU kernel for all of a replica's variables),
exchanges line 12 (`sparse_wire`) and writes the new state only once the
collectives completed. `AsyncPush` runs the same `select`.

Beyond the paper, each can be turned off: at least `min_count` entries per
variable and step, a density guard that refreshes a stale threshold early
(`density_band`), momentum and Adam corrections, dense warm-up and sparsity
schedules as phases (`Compressor`), and embedding rows sent as TensorFlow
sends them (`sparse_gradients`). docs/dct_dp.md states the exact conventions
(order statistic, capacity, schedule, guard, dense steps, `IndexedSlices`,
non-finite gradients, accounting and state).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Sequence

import tensorflow as tf

from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import dct_dp_fast
from tf_dct.compression import error_feedback
from tf_dct.compression import sparse_wire
from tf_dct.compression.base import Compressor
from tf_dct.compression import native as native_ops

_check = functools.partial(validation.check_number, "DCTDP")

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


def schedule(k: tf.Tensor, threshold_life: int, warmup_steps: int = 0,
             phase_start: int | None = None):
  """Line 3 on step counters k: `(warm, due)`.

  warm: k < warmup_steps, a dense step decided in the graph (None when
  `warmup_steps` is 0). due: the threshold is refreshed, when k -
  warmup_steps is a multiple of `threshold_life` or k opens a stage of a
  sparsity schedule (`phase_start`).
  """
  if not warmup_steps:
    due = k % threshold_life == 0                                  # line 3
    if phase_start:
      due = tf.logical_or(due, tf.equal(k, phase_start))
    return None, due
  warm = k < warmup_steps
  return warm, tf.logical_and(tf.logical_not(warm),
                              (k - warmup_steps) % threshold_life == 0)


def corrected_threshold(tau: tf.Tensor, selected: tf.Tensor, expected,
                        gain: float, max_factor: float) -> tf.Tensor:
  """The threshold a reuse starts from after a step that selected `selected`.

  tau' = tau * clip(1 + gain * (selected / expected - 1), 1 / max_factor,
  max_factor), in float64, rounded to tau's dtype. A step that selected more
  than the expected count K raises the threshold, one that selected fewer
  lowers it, so the count stays near K between the order statistics of the
  schedule without computing one: with error feedback the held-back entries
  grow, and a fixed threshold selects more and more until the next refresh.
  The bound keeps one noisy step (or a count of 0) from moving tau far. Only
  +, *, / and comparisons: a numpy reference gives the same bits.

  Args:
    tau: thresholds used this step ([V] or scalar).
    selected: entries they selected, before the capacity cut (int, same shape).
    expected: K per variable (Python ints or a tensor of tau's shape).
    gain: in [0, 1]; 0 returns `tau` itself.
    max_factor: the largest factor per step, up or down, > 1.

  Returns:
    The corrected thresholds, tau's dtype and shape.
  """
  if gain == 0:
    return tau
  ratio = (tf.cast(selected, tf.float64)
           / tf.cast(tf.convert_to_tensor(expected), tf.float64))
  factor = tf.clip_by_value(1.0 + gain * (ratio - 1.0), 1.0 / max_factor,
                            max_factor)
  return tf.cast(tf.cast(tau, tf.float64) * factor, tau.dtype)


class Selection(NamedTuple):
  """What `select` picked for one variable on one replica."""
  tau: tf.Tensor        # the threshold of this step
  refresh: tf.Tensor    # whether it was recomputed (schedule or guard)
  early: tf.Tensor | None  # whether the guard recomputed it (None: no guard)
  selected: tf.Tensor   # int32 entries selected, before the capacity cut
  idx: tf.Tensor        # int32[capacity] positions sent (padding n)
  val: tf.Tensor        # values[capacity] sent (padding 0)
  residual: tf.Tensor   # the new residual E, flat


def select(acc: tf.Tensor, old_tau: tf.Tensor, due: tf.Tensor, below: int,
           capacity: int, band: tuple[float, float] | None = None,
           warm: tf.Tensor | None = None) -> Selection:
  """DCT Algorithm 1 lines 3-11 for one variable on one replica.

  Args:
    acc: g + E (line 2), a flat vector of static length n.
    old_tau: the threshold of the last step (scalar, acc's dtype).
    due: the schedule refreshes the threshold this step (line 3, `schedule`).
    below: m, entries below the new threshold (`num_below`).
    capacity: wire slots; the first `capacity` selected entries in position
      order are sent, the others stay in the residual.
    band: the density guard `(low, high)`, or None (Algorithm 1 exactly).
    warm: a dense warm-up step decided in the graph (selects nothing).

  Returns:
    A `Selection`.
  """
  magnitude = tf.abs(acc)
  # Zeros carry nothing: with tau = 0 (fewer than k non-zero entries, e.g. a
  # table whose rows were not touched yet) they would fill the wire.
  eligible = magnitude > 0
  if warm is not None:
    eligible = tf.logical_and(eligible, tf.logical_not(warm))

  def masked(tau):                                                 # line 9
    mask = tf.logical_and(magnitude >= tau, eligible)
    return mask, sparse_wire.prefix_count(mask)

  refresh, early, kept = due, None, None
  if band is not None:  # beyond the paper: the old tau's count leaves the band
    kept = masked(old_tau)
    count = tf.cast(kept[1][-1], tf.float64)
    expected = acc.shape[0] - below
    early = tf.logical_and(tf.logical_not(due), tf.logical_or(
        count < band[0] * expected, count > band[1] * expected))
    if warm is not None:
      early = tf.logical_and(early, tf.logical_not(warm))
    refresh = tf.logical_or(due, early)

  def fresh():                                                     # lines 4-5
    tau = order_statistic_threshold(magnitude, below)
    return (tau,) + masked(tau)

  def reuse():                                                     # line 7
    return (old_tau,) + (kept if kept is not None else masked(old_tau))

  tau, mask, ends = tf.cond(refresh, fresh, reuse)
  idx, val, _, fitted = sparse_wire.compact(acc, mask, capacity, ends=ends)  # line 10
  residual = tf.where(fitted, tf.zeros_like(acc), acc)             # line 11
  return Selection(tau, refresh, early, ends[-1], idx, val, residual)


class Group(NamedTuple):
  """Variables of one dtype selected together, as `DCTDP._unpack` reads them."""
  accs: list           # per variable: flat acc = g + E (native: (g, E))
  variables: list
  states: list
  sizes: list          # n per variable
  below: list          # m per variable (`num_below`)
  caps: list           # wire slots per variable (`capacity`)
  k: tf.Tensor         # int64[V] step counters before this step
  tau: tf.Tensor       # [V] thresholds of the last step
  warm: tf.Tensor | None  # bool[V] in-graph warm-up (None: no warm-up)
  due: tf.Tensor       # bool[V] the schedule refreshes tau (line 3)


class Picked(NamedTuple):
  """A group's selection, per variable ([V] tensors or lists)."""
  tau: tf.Tensor
  refresh: tf.Tensor
  early: tf.Tensor | None
  selected: tf.Tensor
  idxs: list
  vals: list
  residuals: list      # flat; a warm variable's is its whole accumulator
  seconds: tf.Tensor | None = None  # a native kernel's own run time


def _check_schedule(schedule) -> tuple[tuple[int, float], ...]:
  """Returns `schedule` as ((steps, sparsity), ...), or raises naming it."""
  try:
    pairs = tuple((steps, sparsity) for steps, sparsity in schedule)
  except (TypeError, ValueError):
    pairs = None
  if pairs is None or isinstance(schedule, (str, bytes)):
    raise ValueError("DCTDP: sparsity_schedule must be a sequence of pairs "
                     f"(steps, sparsity), got {schedule!r}")
  return tuple(
      (int(_check(f"sparsity_schedule[{i}] steps", steps, numbers.Integral, 1,
                  False)),
       float(_check(f"sparsity_schedule[{i}] sparsity", sparsity,
                    numbers.Real, 0, True, 1, True)))
      for i, (steps, sparsity) in enumerate(pairs))


def _check_band(band):
  """Returns `band` as a float pair, or raises ValueError naming density_band."""
  if band is None:
    return None
  try:
    low, high = (validation.as_python_number(b) for b in band)
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
      (a phase of its own; see docs/dct_dp.md).
    name: module name.
    density_band: `(low, high)` with 0 <= low <= 1 <= high, low < high:
      refresh tau early when this replica's local density of a variable
      leaves [low * K / N, high * K / N] (beyond the paper; it keeps a
      long `threshold_life` from starting on a stale tau). None turns the
      guard off: Algorithm 1 exactly.
    index_encoding: "auto", "int32", "chunk16", "chunk8" or "ef" (see
      `sparse_wire`).
    value_dtype: "auto" (default), "bfloat16" or None. "bfloat16": a
      float32 variable's values travel rounded to bfloat16, two to an int32
      word, and each replica keeps the rounding error in its residual
      (`sparse_wire.round_values`), so nothing is lost, only delayed; the
      sum is taken in float32. Other dtypes are sent as they are. None:
      values travel in the variable's dtype. "auto": "bfloat16", or None
      with `momentum_masking` (which reads "sent" off a zero residual).
    residual_decay: the factor each residual is multiplied by after a step
      (beyond the paper), a number in (0, 1]; 1 (default) keeps every
      held-back entry until it is sent (Algorithm 1). Under Adam correction
      a held-back entry's first moments pile up with no feedback from the
      model and land late as one jump; a decay below 1 bounds the pile
      (about 1 / (1 - r) steps of it) and drops the rest. It helps some
      models and hurts others (docs/compression.md, "Residual decay").
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are (`tf.IndexedSlices` stay sparse
      and are all-gathered) and keep no state, e.g. `("embedding",)` to
      compress only the dense layers, as DCT §3.1 does for DLRM.
    sparse_gradients: "auto" (default), "stock" or "compress": how
      `tf.IndexedSlices` gradients (embedding rows) are sent; "auto" sends
      them as TF does where that moves fewer bytes (`Compressor`).
    dense_gradients: "auto" (default) or "compress": "auto" sends a
      variable with a dense gradient whole (one all-reduce) where that
      moves no more bytes than compressing it (a bias, a small layer;
      `Compressor`).
    whole_below: with `dense_gradients="auto"`, every variable of fewer
      entries is also sent whole, an int >= 0 (default 0: by bytes alone).
      A small layer at a few entries a step can make training unstable
      under momentum SGD or Adam; `base.WHOLE_BELOW` (2048) sends such
      layers whole (docs/quality.md).
    native: use the native CPU kernels (`tf_dct.compression.native`, built on first
      use; results bit-identical to stock ops) for lines 2-11 of every
      variable and the long wire buffers (line 12). None
      (default): when they build, on CPU and outside XLA; False: never;
      True: the same, but raise at construction when they cannot be built.
    min_count: every compressed variable selects at least min(n, min_count)
      entries per step, an int >= 0 (beyond the paper; 0 is Algorithm 1
      exactly). At sparsity 0.99 a bias or a small layer would otherwise
      send 1-2 entries a step and fall far behind; 64 costs a few percent
      of the bytes on a large model and more on a tiny one, and kept
      quality under every optimizer measured (docs/quality.md).
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
      squared gradient, rows + columns floats per matrix), "sketched" (the
      same scaled to a 32-float count sketch of the summed gradient, which
      removes gradient noise's inflation of v) or "exact" (a dense
      all-reduce; for measurements).
    adam_select: "normalized" (default: error feedback and selection on the
      Adam-scaled gradient) or "raw" (on the gradient, the scale applied
      after the exchange).
    sparsity_schedule: ((steps, sparsity), ...) stages run in order after
      the warm-up, before `sparsity` holds for the rest of training (DGC's
      sparsity warm-up, e.g. ((500, 0.75), (500, 0.9375), (500, 0.984)));
      each stage is a phase and starts with a fresh threshold. A step traced
      without its phase (no driver, see docs/dct_dp.md) uses
      `sparsity`.
    threshold_gain: per-step correction of tau from the count it just
      selected (beyond the paper): after each compressed step the threshold
      the next reuse starts from is tau * (1 + threshold_gain * (selected /
      K - 1)), bounded by `threshold_max_factor` (`corrected_threshold`), so the
      count stays near K between refreshes. A number in [0, 1]; 0 turns it
      off (Algorithm 1's reuse).
    threshold_max_factor: the most the correction moves tau in one step, a
      factor > 1 up or down.
    adam_first_moment: "replica" (default: each replica keeps Adam's first
      moment of its own gradients and error feedback works on it, DGC's
      momentum correction for Adam) or "aggregate" (m averages what was
      sent; a held-back burst is then spread over the next steps).
    fuse_size: variables of at most this many entries (and one dtype) are
      selected together with stock ops, one set of ops for the group; 0:
      each on its own; None (default): `dct_dp_fast.FUSE_SIZE`. An int >= 0;
      a speed setting, the selection is the same.
    batch_capacity: wire buffers of at most this many slots are encoded and
      summed together on the stock-op path; 0: each on its own; None
      (default): `sparse_wire.BATCH_CAPACITY`. An int >= 0; a speed
      setting, the sums are the same.
    adagrad: Adagrad correction (`adagrad_correction`): the compressor runs
      Adagrad itself, with an accumulator fed every step through Adam
      correction's side channel, and error feedback on the Adagrad-scaled
      gradient; the optimizer applies the corrected variables as plain SGD.
      False (default): off; None: on with an Adagrad optimizer (tf-keras or
      Keras 3, `wrap_optimizer`); True: required.
    adagrad_accumulator: "factored" (default), "sketched" or "exact": the
      side channel of `adam_second_moment`.

  docs/dct_dp.md states the exact conventions.
  """

  exchanges_sparse_wire = True

  # Ops of the selection or its wire (e.g. tf.math.top_k) lack bfloat16 kernels.
  supported_dtypes = ("float16", "float32", "float64")

  def __init__(self, sparsity: float = 0.99, threshold_life: int = 1000,
               capacity_factor: float = 2.0, min_size: int = 0,
               warmup_steps: int = 0, name: str | None = None,
               density_band: tuple[float, float] | None = (0.5, 2.0),
               index_encoding: str = "auto", exclude: Sequence[str] = (),
               native: bool | None = None, min_count: int = 64,
               momentum: float | None = None, momentum_masking: bool = False,
               adam: bool | None = None, adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               adagrad: bool | None = False,
               adagrad_accumulator: str = "factored",
               sparsity_schedule: Sequence[tuple[int, float]] = (),
               sparse_gradients: str = "auto",
               dense_gradients: str = "auto",
               fuse_size: int | None = None,
               batch_capacity: int | None = None,
               threshold_gain: float = 0.0,
               threshold_max_factor: float = 2.0,
               value_dtype: str | None = "auto",
               residual_decay: float = 1.0,
               whole_below: int = 0):
    super().__init__(name=name, exclude=exclude,
                     sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients)
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
    self.threshold_gain = float(_check("threshold_gain", threshold_gain,
                                       numbers.Real, 0, False, 1, False))
    self.threshold_max_factor = float(_check(
        "threshold_max_factor", threshold_max_factor, numbers.Real, 1, True))
    self.sparsity_schedule = _check_schedule(sparsity_schedule)
    self._init_residual_decay(residual_decay)
    self._init_whole_below(whole_below)
    self.min_count = int(_check("min_count", min_count, numbers.Integral, 0,
                                False))
    self.fuse_size = (None if fuse_size is None else int(
        _check("fuse_size", fuse_size, numbers.Integral, 0, False)))
    self.batch_capacity = (None if batch_capacity is None else int(
        _check("batch_capacity", batch_capacity, numbers.Integral, 0, False)))
    self._init_momentum(momentum, momentum_masking)
    self._init_adam(adam, adam_second_moment, adam_select,
                    adam_first_moment)
    self._init_adagrad(adagrad, adagrad_accumulator)
    self._init_value_dtype(value_dtype, auto="bfloat16")
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
    variable = self._tf_variable(variable)
    n = variable.shape.num_elements()
    if self._is_dense(variable):
      return 0, n * variable.dtype.size
    cap = capacity(n, self.sparsity, self.capacity_factor, self.min_count)
    return sparse_wire.wire_bytes(
        n, cap, sparse_wire.wire_dtype(variable.dtype, self.value_dtype),
        self.index_encoding), 0

  def counter_names(self, variable):
    if self._is_dense(variable):
      return ()
    guard = ("early_refreshes",) if self.density_band is not None else ()
    return ("overflow", "refreshes") + guard

  def create_state(self, variable):
    self.check_variable(variable, sparse_wire.MAX_SIZE - 1)
    if self._is_dense(variable):
      return {}
    return self.residual_state(variable, "dct_dp")

  def scalar_dtypes(self, variable):
    return dict(zip(SCALARS, (variable.dtype, tf.int64, tf.int32, tf.int32)))

  def reduce(self, ctx, grads, variables, states):
    grads = error_feedback.densify_unless(grads, [bool(st) for st in states])
    native = dct_dp_fast.native_positions(self, grads, variables, states)
    groups = dct_dp_fast.groups(grads, variables, states, native,
                                fuse_size=self.fuse_size)
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
      if i not in native:                                          # line 2
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
      group = self._unpack([(accs[i], variables[i], states[i], values[i])
                            for i in members])
      with tf.control_dependencies([start] if stamped else []):
        if native_group:
          picked = dct_dp_fast.select_native(group, self.density_band,
                                             self.value_dtype)
        elif len(members) > 1:
          picked = dct_dp_fast.select_fused(group, self.density_band)
        else:
          picked = self._select_alone(group)
      items, dense_parts, write, group_reports = self._finish(group, picked)
      kernel_seconds.append(picked.seconds)
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
      exchanged = sparse_wire.exchange_many(                       # line 12
          ctx, [(idx, val, n) for _, idx, val, n, _ in sparse_items],
          encoding=self.index_encoding, presorted=True, nnz=counted,
          use_native=self.native is not False,
          batch_capacity=self.batch_capacity, payload=True,
          exact=self.exact_sizes)
      summed, nnzs, sent_bytes = (
          exchanged if counted
          else (exchanged[0], [None] * len(exchanged[0]), exchanged[1]))
      for (i, _, _, _, shape), flat, nnz, nbytes in zip(
          sparse_items, summed, nnzs, sent_bytes):
        results[i] = tf.reshape(flat, shape)
        reports[i][0]["gather_bytes"] = nbytes  # exact sizes: what was sent
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

  def _unpack(self, members) -> Group:
    """A `Group` from `(acc, variable, state, values)` per variable, the
    state's scalars as read after the gradient checks."""
    variables = [v for _, v, _, _ in members]
    sizes = [v.shape.num_elements() for v in variables]
    sparsity = self._phase_sparsity()
    # `unpack_scalars` for the whole group at once: one [V, 4] matrix.
    scalars = tf.stack([value["scalars"] for _, _, _, value in members])
    k = tf.cast(scalars[:, SCALARS.index("step")], tf.int64)
    warm, due = schedule(
        k, self.threshold_life,
        self.warmup_steps if self.in_graph_warmup else 0, self._phase_start())
    return Group(
        accs=[acc for acc, _, _, _ in members], variables=variables,
        states=[st for _, _, st, _ in members], sizes=sizes,
        below=[num_below(n, sparsity, self.min_count) for n in sizes],
        caps=[capacity(n, sparsity, self.capacity_factor, self.min_count)
              for n in sizes],
        k=k, tau=tf.cast(scalars[:, SCALARS.index("threshold")],
                         variables[0].dtype),
        warm=warm, due=due)

  def _select_alone(self, group: Group) -> Picked:
    """`select` for a group of one variable, as [1] vectors."""
    picked = select(group.accs[0], group.tau[0], group.due[0], group.below[0],
                    group.caps[0], self.density_band,
                    None if group.warm is None else group.warm[0])
    one = lambda t: None if t is None else t[None]
    return Picked(one(picked.tau), one(picked.refresh), one(picked.early),
                  one(picked.selected), [picked.idx], [picked.val],
                  [picked.residual])

  def _finish(self, group: Group, picked: Picked):
    """Dense parts, accounting and the deferred state write of a group.

    Returns per variable the wire buffers `(idx, val, n, shape)` and the
    dense part (in-graph warm-up only, else None); a closure that writes the
    new state of every variable of the group; and per variable what to
    report to the accounting (`record` arguments, and the warm-up flag).
    """
    variables, sizes, caps = group.variables, group.sizes, group.caps
    warm, selected, residuals = group.warm, picked.selected, picked.residuals
    # The value word: what rounding takes off a value stays in the residual
    # (the native kernel rounds itself: its bfloat16 values pass through).
    vals = list(picked.vals)
    if self.value_dtype is not None:
      residuals = list(residuals)
      for v in range(len(sizes)):
        vals[v], residuals[v] = sparse_wire.round_values(
            picked.idxs[v], vals[v], tf.reshape(residuals[v], [-1]),
            self.value_dtype)
    # A warm variable keeps its threshold and sends all n entries densely.
    tau = (picked.tau if warm is None
           else tf.where(warm, group.tau, picked.tau))
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
    taus, refreshes, counts, overflows = [tf.unstack(t) for t in (
        tau, tf.cast(picked.refresh, tf.int32), count, overflow)]
    early = picked.early
    earlies = (tf.unstack(tf.cast(early, tf.int32)) if early is not None
               else [None] * len(sizes))
    reports = []
    for v, var in enumerate(variables):
      counters = {"refreshes": refreshes[v], "overflow": overflows[v]}
      if early is not None:
        counters["early_refreshes"] = earlies[v]
      reports.append((dict(
          gather_bytes=sparse_wire.wire_bytes(
              sizes[v], caps[v],
              sparse_wire.wire_dtype(var.dtype, self.value_dtype),
              self.index_encoding),
          reduce_bytes=sizes[v] * var.dtype.size if self.in_graph_warmup else 0,
          sent=counts[v], threshold=taus[v], selection_seconds=None,  # set by reduce
          counters=counters), warms[v]))

    # The threshold the next step starts from: corrected by this step's
    # count (a warm variable keeps its own).
    carried = tau
    if self.threshold_gain:
      carried = corrected_threshold(
          picked.tau, picked.selected,
          [n - m for n, m in zip(sizes, group.below)], self.threshold_gain,
          self.threshold_max_factor)
      if warm is not None:
        carried = tf.where(warm, group.tau, carried)

    def write():
      # `pack_scalars` for the whole group at once, then one row each.
      columns = {"threshold": carried, "step": group.k + 1, "sent": count,
                 "overflow": overflow}
      scalars = tf.unstack(tf.stack(
          [tf.cast(columns[name], tf.float64) for name in SCALARS], axis=1))
      for v, (var, st) in enumerate(zip(variables, group.states)):
        st["residual"].local().assign(
            self.decay(tf.reshape(residuals[v], var.shape)))
        st["scalars"].local().assign(scalars[v])

    items = [(i, w, n, var.shape) for i, w, n, var in zip(
        picked.idxs, vals, sizes, variables)]
    return items, dense_parts, write, reports
