"""The seam between gradient aggregation and the optimizers.

A `Compressor` receives, on every replica, that replica's gradient of each
variable and returns what every replica applies: the sum over replicas of what
was sent (dense SUM for `Dense`). It may keep per-replica state per variable
(error-feedback residuals, thresholds) in `PerReplicaState`, created lazily the
first time it sees a variable and tracked for checkpoints. Compressors know
nothing of Keras; `tf_dct.keras` adapts each Keras flavour to this interface.

Phases: a compressor with `warmup_steps > 0` has two, dense (steps before
`warmup_steps`) then compressed. A driver that knows the step
(`Replicator.run` through `wrap_optimizer`, `tf_dct.keras.phase_callback` for
`fit`) traces one step function per phase under `in_phase`, so a dense step
issues only the dense all-reduce and a compressed one only the compressor's
exchange. Traced without a driver (`phase` None), each step decides in the
graph and issues both collectives (collectives cannot sit in `tf.cond`).
One compressor's steps are traced either all with a driver or all without.

Accounting: inside `reduce`, a compressor calls `record(variable, ...)` once
per variable with what this replica gathered / all-reduced, the nnz of the
aggregate, its threshold and selection time; `aggregate` turns the records
into per-replica statistics (see `tf_dct.compression.accounting` for the byte
model), readable with `communication_stats()` and written as summaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import re
import sys
import threading
from typing import Sequence

from absl import logging
import numpy as np
import tensorflow as tf

from tf_dct import _private
from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import adagrad_correction
from tf_dct.compression import adam_correction
from tf_dct.compression import error_feedback
from tf_dct.compression import momentum_correction
from tf_dct.compression import sparse_wire


def state_key(position: int) -> str:
  """Checkpoint key of the state of the `position`-th variable first seen.

  Keyed by order, not by name: Keras makes layer names unique per process
  (`dense` then `dense_1` ...), so a model rebuilt in the same process to
  restore a checkpoint would not find name-keyed state.
  """
  return f"v{position:03d}"


def state_name(prefix: str, variable, what: str) -> str:
  """Name of one state variable of `variable`: `prefix/<variable>/what`.

  `<variable>` is the variable's name without its ":0" suffix, every run of
  characters other than letters, digits and "_" made one "_". Checkpoints
  hold the state under these names, so they must not change.
  """
  return "/".join((prefix, re.sub(r"[^A-Za-z0-9_]+", "_",
                                  variable.name.split(":")[0]), what))


def _check_exclude(owner: str, exclude) -> tuple[str, ...]:
  """`exclude` as a tuple of regular expressions, or a ValueError naming it."""
  if isinstance(exclude, (str, bytes)) or not isinstance(exclude, (list, tuple)):
    raise ValueError(f"{owner}: exclude must be a list or tuple of regular "
                     f"expressions (strings), got {exclude!r}")
  for pattern in exclude:
    if not isinstance(pattern, str):
      raise ValueError(f"{owner}: exclude must hold strings, got {pattern!r}")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"{owner}: exclude pattern {pattern!r} is not a valid "
                       f"regular expression: {e}") from None
  return tuple(exclude)


# How `tf.IndexedSlices` gradients (embedding lookups) are sent: see
# `Compressor`'s `sparse_gradients`.
SPARSE_GRADIENTS = ("auto", "stock", "compress")
# How dense gradients are sent: see `Compressor`'s `dense_gradients`.
DENSE_GRADIENTS = ("auto", "compress")


def as_tf_variable(variable, owner: str, arg: str = "variable") -> tf.Variable:
  """The tf.Variable that `variable` stands for: itself, or the one behind a
  Keras 3 variable.

  Keras 3 optimizers aggregate and apply through each `keras.Variable`'s
  `value`, the tf.Variable it wraps under the TensorFlow backend; state,
  per-variable decisions and `exclude` are keyed by that tf.Variable (and
  its name, the Keras 3 variable's `path`), so the public methods that take
  a variable accept either and give the same answer.

  Raises:
    TypeError: `variable` is neither, naming `owner` and `arg`.
  """
  if isinstance(variable, tf.Variable):
    return variable
  keras = sys.modules.get("keras")  # a Keras 3 variable means keras is loaded
  keras_variable = getattr(keras, "Variable", None)
  if keras_variable is not None and isinstance(variable, keras_variable):
    value = variable.value
    if isinstance(value, tf.Variable):
      return value
    raise TypeError(
        f"{owner}: {arg} {variable.path!r} is a Keras 3 variable whose value "
        f"is not a tf.Variable but {type(value).__name__}; look it up outside "
        "autocast and stateless scopes")
  raise TypeError(f"{owner}: {arg} must be a tf.Variable or a Keras 3 "
                  f"variable (keras.Variable), got {type(variable).__name__}")


def sum_per_dtype(ctx: tf.distribute.ReplicaContext, values: Sequence) -> list:
  """SUM all-reduces of `values` (tensors or `tf.IndexedSlices`), one batch
  per dtype (TF packs a batch into one buffer, which needs one dtype), in
  the order given. Each dense tensor passes through `tf.identity` so it has
  this replica's device (a step's input under XLA has none, and TF's batch
  all-reduce takes a tensor's device as its destination)."""
  values = [v if isinstance(v, tf.IndexedSlices) else tf.identity(v)
            for v in values]
  out = [None] * len(values)
  dtypes = list(dict.fromkeys(v.dtype for v in values))
  for dtype in dtypes:
    picked = [i for i, v in enumerate(values) if v.dtype == dtype]
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                            [values[i] for i in picked])
    for i, t in zip(picked, summed):
      out[i] = t
  return out


def sum_duplicate_rows(slices: tf.IndexedSlices) -> tf.IndexedSlices:
  """`slices` with one row per distinct row id, its rows summed.

  Dynamic shapes (`tf.unique`), so not for XLA (`error_feedback.combine_rows`
  is the static-shape form). Row ids keep the order of their first
  appearance and each sum adds the rows in their order, so the dense value
  is that of `slices` up to floating-point summation order.
  """
  ids, segment = tf.unique(slices.indices)
  values = tf.math.unsorted_segment_sum(slices.values, segment, tf.size(ids))
  return tf.IndexedSlices(values, ids, slices.dense_shape)


def longest_rows(ctx: tf.distribute.ReplicaContext,
                 slices: Sequence[tf.IndexedSlices]) -> list:
  """Per `tf.IndexedSlices`, the largest row count over the replicas (int32),
  from one all-gather of this replica's counts (`ROW_COUNT_BYTES` each):
  TensorFlow pads every replica's rows to that count when they differ."""
  counts = tf.stack([tf.size(s.indices, out_type=tf.int32) for s in slices])
  gathered = ctx.all_gather(counts[None], axis=0)  # [replicas, len(slices)]
  return tf.unstack(tf.reduce_max(gathered, 0), num=len(slices))


# Bytes per table of `longest_rows`'s all-gather (one int32 row count).
ROW_COUNT_BYTES = 4

# `DEFT`'s `whole_below` default: variables of fewer entries (biases, small
# layers: a few KiB each) are sent whole. `TopK` and `DCTDP` compress them
# unless given `whole_below` (docs/quality.md).
WHOLE_BELOW = 2048


def _replicas_priced() -> int:
  """The replica count `sparse_gradients`/`dense_gradients` "auto" price
  with: the replicas in sync, at least 2 (with one nothing moves)."""
  ctx = tf.distribute.get_replica_context()
  return max(ctx.num_replicas_in_sync if ctx is not None else 1, 2)


class Compressor(tf.Module):
  """Base class: per-variable state management and the aggregation contract.

  Args:
    name: module name.
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are and keep no state
      (`reduce_as_is`).
    sparse_gradients: how a variable whose gradient is a `tf.IndexedSlices`
      (an embedding table's rows) is sent. "stock": through TensorFlow's
      all-gather of the touched rows, exact and without state (each
      replica's duplicate rows summed first, `dedup_rows`). "compress":
      by the compressor, with a table-sized residual. "auto" (default): as
      "stock" where that moves no more bytes than the compressor would
      (`stock_is_cheaper`: the distinct rows estimated from static shapes,
      `accounting.distinct_rows`), else compressed. The choice is made at a
      variable's first gradient and kept (`sends_as_is`); under XLA "auto"
      compresses (TF's sparse all-gather has no XLA kernel). The state
      `create_states` made for a variable sent as it is stays unused (zeros;
      name the variable in `exclude` to have none).
    dense_gradients: how a variable whose gradient is a dense tensor is sent.
      "auto" (default): whole, one all-reduce of its accumulator (g + E,
      then E = 0, as in a dense phase), where that moves no more bytes per
      replica than the compressor's exchange would (`dense_is_cheaper`): a
      bias or a small layer, whose wire slots and indices outweigh its
      entries. The break-even size grows with the number of replicas (an
      all-gather's bytes do, an all-reduce's do not). The variable keeps
      the compressor's momentum, Adam or Adagrad correction, so it is
      updated by the same rule as the compressed ones. A compressor whose
      `whole_below` is above 0 (`DEFT` by default) also sends whole every
      variable with fewer entries. Decided at its first gradient and kept
      (`sends_whole`).
      "compress": always by the compressor.
  """

  # `dense_gradients="auto"` also sends whole every variable with fewer
  # entries than this, whatever the bytes (0: by bytes alone;
  # `_init_whole_below` sets it).
  whole_below: int = 0

  # Whether `reduce_as_is` sums each replica's duplicate rows of a
  # `tf.IndexedSlices` gradient before the all-gather (fewer bytes, the same
  # aggregate). `Dense` does not: it sends exactly what stock TF sends.
  dedup_rows: bool = True

  # Variable dtypes `check_variable` accepts (the ops of every path exist).
  supported_dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32",
                                       "float64")

  def __init__(self, name: str | None = None, exclude: Sequence[str] = (),
               sparse_gradients: str = "auto", dense_gradients: str = "auto"):
    super().__init__(name=name)
    self.exclude = _check_exclude(type(self).__name__, exclude)
    self._exclude = [re.compile(p) for p in self.exclude]
    if sparse_gradients not in SPARSE_GRADIENTS:
      raise ValueError(f"{type(self).__name__}: sparse_gradients must be one of "
                       f"{SPARSE_GRADIENTS}, got {sparse_gradients!r}")
    self.sparse_gradients = sparse_gradients
    if dense_gradients not in DENSE_GRADIENTS:
      raise ValueError(f"{type(self).__name__}: dense_gradients must be one of "
                       f"{DENSE_GRADIENTS}, got {dense_gradients!r}")
    self.dense_gradients = dense_gradients
    self._as_is = {}         # variable ref -> sent as it is (`sends_as_is`)
    self._whole = {}         # variable ref -> sent whole (`sends_whole`)
    self._replicator = None
    self._lock = threading.Lock()
    self._keys = {}          # variable ref -> state key, in first-seen order
    self.state = {}          # state key -> dict of PerReplicaState (tracked)
    self.accounting = accounting.Accounting()
    self._recording = threading.local()  # per replica thread: key -> Record
    # None: time selection and write summaries unless the bound replicator
    # compiles with XLA; False: never (e.g. under your own jit_compile).
    self.time_selection = None
    self.variable_summaries = True
    self.exact_sizes = None
    # Momentum correction (`momentum_correction`): 0.0 off; None until a
    # Keras adapter takes it from a momentum SGD optimizer. Only compressors
    # with an error-feedback residual offer it (`_init_momentum`).
    self.momentum = 0.0
    self.momentum_masking = False
    # Adam correction (`adam_correction`): False off; None until a Keras
    # adapter takes (beta_1, beta_2, epsilon) from an Adam optimizer.
    self.adam = False
    self.adam_second_moment = "factored"
    self.adam_select = "normalized"
    self.adam_first_moment = "replica"
    self._adam_hparams = None
    # Adagrad correction (`adagrad_correction`): False off; None until a
    # Keras adapter takes (initial_accumulator_value, epsilon) from an
    # Adagrad optimizer.
    self.adagrad = False
    self.adagrad_accumulator = "factored"
    self._adagrad_hparams = None
    # What a sparse wire's values travel as (`sparse_wire.round_values`);
    # None: the variable's dtype. Set by `_init_value_dtype`.
    self.value_dtype = None
    # The factor residuals are multiplied by after a step (`_init_residual_decay`).
    self.residual_decay = 1.0
    # The phase the step being traced runs in (`in_phase`); None: decided in
    # the graph, every step.
    self.phase = None
    self._driven = None  # whether steps are traced in their phase (`_check_driven`)

  def _init_momentum(self, momentum, momentum_masking) -> None:
    """Validates and sets the momentum-correction options (see `corrects_momentum`)."""
    owner = type(self).__name__
    momentum = validation.as_python_number(momentum)
    if momentum is not None:
      ok = (isinstance(momentum, numbers.Real) and not isinstance(momentum, bool)
            and 0 <= momentum < 1)
      if not ok:
        raise ValueError(f"{owner}: momentum must be None or a number in "
                         f"[0, 1), got {momentum!r}")
      momentum = float(momentum)
    if not isinstance(momentum_masking, bool):
      raise ValueError(f"{owner}: momentum_masking must be True or False, got "
                       f"{momentum_masking!r}")
    self.momentum = momentum
    self.momentum_masking = momentum_masking

  def _init_value_dtype(self, value_dtype, auto: str | None = None) -> None:
    """Validates and sets `value_dtype` (after `_init_momentum`).

    A compressor that accepts "auto" passes what it stands for as `auto`;
    "auto" means the variable's dtype under `momentum_masking`.
    """
    owner = type(self).__name__
    sparse_wire.check_value_dtype(owner, value_dtype, auto=auto is not None)
    if isinstance(value_dtype, str) and value_dtype == "auto":
      value_dtype = None if self.momentum_masking else auto
    if value_dtype is not None and self.momentum_masking:
      raise ValueError(f"{owner}: value_dtype must be None with "
                       "momentum_masking=True (masking finds the sent entries "
                       f"by a zero residual), got {value_dtype!r}")
    self.value_dtype = value_dtype

  def _init_whole_below(self, whole_below) -> None:
    """Validates and sets `whole_below`, an int >= 0 (see `_dense_whole`)."""
    self.whole_below = int(validation.check_number(
        type(self).__name__, "whole_below", whole_below, numbers.Integral, 0,
        False))

  def _init_residual_decay(self, residual_decay) -> None:
    """Validates and sets `residual_decay`, a number in (0, 1] (see `decay`)."""
    self.residual_decay = float(validation.check_number(
        type(self).__name__, "residual_decay", residual_decay, numbers.Real,
        0, True, 1, False))

  def decay(self, residual: tf.Tensor) -> tf.Tensor:
    """A new residual as kept for the next step: times `residual_decay`.

    Beyond the papers: below 1, what error feedback holds back fades (a
    held-back entry keeps about 1 / (1 - r) steps of it) instead of landing
    late as one jump; what fades is dropped (docs/compression.md).
    """
    if self.residual_decay == 1:
      return residual
    return residual * tf.cast(self.residual_decay, residual.dtype)

  def _init_adam(self, adam, second_moment, adam_select="normalized",
                 first_moment="replica") -> None:
    """Validates and sets the Adam-correction options (see `adam_correction`)."""
    owner = type(self).__name__
    if adam is not None and not isinstance(adam, bool):
      raise ValueError(f"{owner}: adam must be None, True or False, got {adam!r}")
    if second_moment not in adam_correction.SECOND_MOMENTS:
      raise ValueError(f"{owner}: adam_second_moment must be one of "
                       f"{adam_correction.SECOND_MOMENTS}, got {second_moment!r}")
    if adam_select not in adam_correction.SELECTIONS:
      raise ValueError(f"{owner}: adam_select must be one of "
                       f"{adam_correction.SELECTIONS}, got {adam_select!r}")
    if first_moment not in adam_correction.FIRST_MOMENTS:
      raise ValueError(f"{owner}: adam_first_moment must be one of "
                       f"{adam_correction.FIRST_MOMENTS}, got {first_moment!r}")
    self.adam = adam
    self.adam_first_moment = first_moment
    self.adam_second_moment = second_moment
    self.adam_select = adam_select

  def _init_adagrad(self, adagrad, accumulator="factored") -> None:
    """Validates and sets the Adagrad-correction options (see
    `adagrad_correction`)."""
    owner = type(self).__name__
    if adagrad is not None and not isinstance(adagrad, bool):
      raise ValueError(f"{owner}: adagrad must be None, True or False, got "
                       f"{adagrad!r}")
    if accumulator not in adagrad_correction.ACCUMULATORS:
      raise ValueError(f"{owner}: adagrad_accumulator must be one of "
                       f"{adagrad_correction.ACCUMULATORS}, got {accumulator!r}")
    self.adagrad = adagrad
    self.adagrad_accumulator = accumulator

  def set_adagrad(self, initial_accumulator_value: float,
                  epsilon: float) -> None:
    """Turns Adagrad correction on with an Adagrad optimizer's
    hyper-parameters, before any state exists (the Keras adapters call it)."""
    if self._keys:
      raise ValueError(f"{type(self).__name__}: Adagrad correction must be set "
                       "before the compressor has state")
    self._adagrad_hparams = (float(initial_accumulator_value), float(epsilon))

  @property
  def corrects_adagrad(self) -> bool:
    """Whether Adagrad correction is on (a Keras adapter called
    `set_adagrad`)."""
    return self._adagrad_hparams is not None

  def set_adam(self, beta_1: float, beta_2: float, epsilon: float) -> None:
    """Turns Adam correction on with an Adam optimizer's hyper-parameters,
    before any state exists (the Keras adapters call it)."""
    if self._keys:
      raise ValueError(f"{type(self).__name__}: Adam correction must be set "
                       "before the compressor has state")
    self._adam_hparams = (float(beta_1), float(beta_2), float(epsilon))

  @property
  def corrects_adam(self) -> bool:
    """Whether Adam correction is on (a Keras adapter called `set_adam`)."""
    return self._adam_hparams is not None

  def set_momentum(self, momentum: float) -> None:
    """Sets the momentum of the correction before any state exists (the
    Keras adapters call it with a momentum SGD optimizer's momentum)."""
    if self._keys:
      raise ValueError(f"{type(self).__name__}: momentum must be set before the "
                       "compressor creates its state (before the first step or "
                       "optimizer.build)")
    self._init_momentum(momentum, self.momentum_masking)

  def corrects_momentum(self, variable) -> bool:
    """Whether this compressor keeps the momentum of `variable`'s gradients
    itself (momentum correction), so the optimizer must apply its aggregate
    as plain SGD. False for variables sent as they are (excluded, below
    `min_size`): those keep the optimizer's own momentum."""
    if not self.momentum or self.sends_as_is(variable):
      return False
    return "velocity" in self.state_for(variable)

  def corrects_optimizer(self, variable) -> bool:
    """Whether the optimizer must apply `variable`'s aggregate as plain SGD
    because the compressor keeps its momentum (`corrects_momentum`) or runs
    its Adam or Adagrad update (`adam_correction`, `adagrad_correction`)
    itself."""
    if (not (self.momentum or self._adam_hparams or self._adagrad_hparams)
        or self.sends_as_is(variable)):
      return False
    state = self.state_for(variable)
    return any(key in state for key in ("velocity", "adam_m", "adagrad_acc"))

  # -- phases -------------------------------------------------------------------

  def phase_starts(self) -> tuple[int, ...]:
    """The steps at which this compressor's phases start: (0,), or (0, w)
    with `warmup_steps` w > 0 (phase 0 dense, phase 1 compressed)."""
    warmup = getattr(self, "warmup_steps", 0)
    return (0, warmup) if warmup else (0,)

  def phase_for(self, step: int) -> int:
    """The index of the phase that `step` (0-based, optimizer steps) is in."""
    return sum(1 for start in self.phase_starts()[1:] if step >= start)

  def phase_is_dense(self, phase: int) -> bool:
    """Whether every replica sends its whole accumulator in `phase`: the
    warm-up, the first phase when `warmup_steps` > 0."""
    return phase == 0 and bool(getattr(self, "warmup_steps", 0))

  @contextlib.contextmanager
  def in_phase(self, step: int):
    """Traces (and runs) steps as the phase of `step` within the block.

    Yields the phase's index, the key under which a driver caches the step
    function it traces for that phase. A compressor with a single phase
    yields None and changes nothing.
    """
    if len(self.phase_starts()) == 1:
      yield None
      return
    phase = self.phase_for(step)
    self.phase, before = phase, self.phase
    try:
      yield phase
    finally:
      self.phase = before

  @property
  def in_graph_warmup(self) -> bool:
    """Whether a traced step decides dense warm-up in the graph and so
    issues the dense all-reduce besides the exchange (no phase driver)."""
    return bool(getattr(self, "warmup_steps", 0)) and self.phase is None

  def _check_driven(self) -> None:
    """Raises when a step is traced with a phase driver and another without.

    With phases (a warm-up or stages), a driven run counts the compressor's
    steps per phase and an undriven one decides the phase in the graph from
    its own counter, so mixing them would, e.g., repeat the warm-up.
    """
    if len(self.phase_starts()) == 1:
      return
    driven = self.phase is not None
    if self._driven is None:
      self._driven = driven
    elif self._driven != driven:
      mode = lambda d: "with a phase driver" if d else "without one"
      raise ValueError(
          f"{type(self).__name__}: steps were traced {mode(self._driven)} and "
          f"now {mode(driven)}; with warmup_steps or a schedule, trace every "
          "step in its phase (Replicator.run with the wrapped optimizer, "
          "tf_dct.keras.phase_callback for fit) or none, on one compressor")

  def _reduce_kept(self, ctx, grads, variables, states, whole) -> list:
    """`_flush` for the variables sent `whole`, `reduce` for the others."""
    out = [None] * len(grads)
    for flag, run in ((True, self._flush), (False, self.reduce)):
      picked = [i for i, w in enumerate(whole) if w == flag]
      if picked:
        for i, r in zip(picked, run(ctx, [grads[i] for i in picked],
                                    [variables[i] for i in picked],
                                    [states[i] for i in picked])):
          out[i] = r
    return out

  def _flush(self, ctx, grads, variables, states) -> list:
    """A dense phase: each replica sends its accumulator g + E whole (one SUM
    all-reduce) and E becomes 0, so nothing held back is lost; the
    compressor's other state (thresholds, counters) does not move.

    An embedding table's rows (`tf.IndexedSlices`, outside XLA, which has no
    kernel for TF's sparse all-gather) go as TensorFlow sends them: the rows
    all-gathered at stock TF's cost instead of the whole table all-reduced.
    The table's E, zero unless state of a compressed phase was restored,
    waits for the compressed phase.
    """
    owner = type(self).__name__
    xla = _private.in_xla_context()
    rows = [isinstance(g, tf.IndexedSlices) and not xla for g in grads]
    grads = error_feedback.densify_unless(grads, rows)
    checked, values, _ = error_feedback.checked_reads(
        owner, grads, variables,
        [st if "residual" in st and not row else {}
         for st, row in zip(states, rows)], ("residual",))
    results = [None] * len(grads)
    sparse = [i for i, row in enumerate(rows) if row]
    if sparse:
      for i, out in zip(sparse, self.reduce_as_is(
          ctx, [checked[i] for i in sparse], [variables[i] for i in sparse])):
        results[i] = out
    dense = [i for i, row in enumerate(rows) if not row]
    if dense:
      accs = [tf.reshape(error_feedback.accumulate(
                  checked[i], values[i]["residual"], variables[i]),
                         variables[i].shape) if values[i] else checked[i]
              for i in dense]
      for i, out in zip(dense, sum_per_dtype(ctx, accs)):
        results[i] = out
        self.record_dense(variables[i])
    with tf.control_dependencies(error_feedback.gate(results)):
      for i in dense:
        if "residual" in states[i]:
          residual = states[i]["residual"].local()
          residual.assign(tf.zeros_like(residual))
    return results

  @property
  def replicator(self):
    return self._replicator

  def bind(self, replicator) -> None:
    """Attaches the compressor to the replicator whose replicas it serves."""
    if self._replicator is not None and self._replicator is not replicator:
      raise ValueError("this compressor is already bound to another replicator; "
                       "create one compressor per wrapped optimizer")
    self._replicator = replicator

  def config(self) -> dict:
    """The settings every worker must share: class and public scalar options."""
    out = {"compressor": type(self).__name__}
    for key, value in sorted(vars(self).items()):
      if key == "time_selection":  # a local measurement switch
        continue
      if not key.startswith("_") and isinstance(
          value, (bool, int, float, str, tuple, type(None))):
        out[key] = list(value) if isinstance(value, tuple) else value
    # Exact sizes change the collectives' shapes: every worker must agree.
    out["exact_sizes"] = self.exact_sizes
    return out

  # -- to override --------------------------------------------------------------

  def create_state(self, variable: tf.Variable) -> dict:
    """Returns the per-replica state of one variable (default: none)."""
    del variable
    return {}

  def counter_names(self, variable: tf.Variable) -> tuple[str, ...]:
    """Names of the per-step counters `reduce` may report for `variable`."""
    del variable
    return ()

  def reduce(self, ctx: tf.distribute.ReplicaContext,
             grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
             states: Sequence[dict]) -> list:
    """Returns, per variable, the cross-replica sum of what was sent.

    Runs once per replica per step, in replica context. Every replica must
    issue the same collectives in the same order, and none inside `tf.cond`
    or a loop (MirroredStrategy's merge_call forbids it): select with masks
    and static shapes instead of branching around a collective.
    """
    raise NotImplementedError

  # -- shared machinery -----------------------------------------------------------

  def _tf_variable(self, variable, arg: str = "variable") -> tf.Variable:
    """`as_tf_variable` with this compressor named in its error."""
    return as_tf_variable(variable, type(self).__name__, arg)

  def is_excluded(self, variable: tf.Variable) -> bool:
    """Whether `variable`'s name matches a pattern of `exclude` (a Keras 3
    variable: its `path`, the name of its tf.Variable)."""
    name = self._tf_variable(variable).name.split(":")[0]
    return any(p.search(name) for p in self._exclude)

  def reduce_as_is(self, ctx: tf.distribute.ReplicaContext,
                   grads: Sequence, variables: Sequence[tf.Variable]) -> list:
    """One SUM all-reduce of the gradients as they are, with accounting.

    A `tf.IndexedSlices` gradient stays sparse: TensorFlow's collectives
    all-gather its slices (row count, values and row ids). With
    `dedup_rows` (outside XLA, whose shapes are static) each replica first
    sums its duplicate rows (`sum_duplicate_rows`: one row per distinct id,
    the same aggregate) and all-gathers its row counts (`longest_rows`);
    what is recorded is what then crosses: TF's all-gather of the distinct
    rows padded to the largest count, plus that count. Otherwise the rows go
    as they are and the record is the stock baseline of `accounting`. A
    dense gradient is N entries all-reduced.
    """
    grads = list(grads)
    rows = ([i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
            if self.dedup_rows and not _private.in_xla_context() else [])
    for i in rows:
      grads[i] = sum_duplicate_rows(grads[i])
    longest = dict(zip(rows, longest_rows(ctx, [grads[i] for i in rows])
                       if rows else []))
    reduced = sum_per_dtype(ctx, grads)
    for i, (grad, var, out) in enumerate(zip(grads, variables, reduced)):
      n = var.shape.num_elements()
      if isinstance(grad, tf.IndexedSlices) and isinstance(out, tf.IndexedSlices):
        sent = tf.minimum(tf.size(grad.values, out_type=tf.int64), n)
        nnz = tf.minimum(tf.size(out.values, out_type=tf.int64), n)  # upper bound
        if i in longest:
          payload = accounting.indexed_slices_payload(
              tf.size(grad.indices), var.shape[1:].num_elements()
              * grad.values.dtype.size, grad.indices.dtype.size,
              max_rows=longest[i]) + ROW_COUNT_BYTES
          self.record(var, gather_bytes=payload, nnz=nnz, sent=sent)
        else:
          self.record(var, as_stock=True, nnz=nnz, sent=sent)
      else:  # N entries all-reduced, N non-zero
        self.record_dense(var)
    return reduced

  def record_dense(self, variable: tf.Variable) -> None:
    """Records `variable` as all-reduced as it is: N entries, N non-zero."""
    self.record(variable, reduce_bytes=(variable.shape.num_elements()
                                        * variable.dtype.size))

  @staticmethod
  def aggregate_nnz(result: tf.Tensor, warm=None) -> tf.Tensor:
    """int64 non-zero entries of an aggregate; N where `warm` (a dense step)."""
    nnz = tf.math.count_nonzero(result, dtype=tf.int64)
    if warm is None:
      return nnz
    return tf.where(warm, tf.constant(result.shape.num_elements(), tf.int64), nnz)

  @staticmethod
  def add_dense_sums(ctx, dense: Sequence, results: list) -> None:
    """All-reduces `(position, tensor)` pairs in one batch (SUM) and adds each
    sum into `results[position]` (None there: the sum itself)."""
    if not dense:
      return
    reduced = sum_per_dtype(ctx, [t for _, t in dense])
    for (i, _), t in zip(dense, reduced):
      results[i] = t if results[i] is None else results[i] + t

  @property
  def variable_summaries(self):
    """When the per-variable summaries are written (`tf_dct_variables/`).

    The compressor writes its scalars whenever a default `tf.summary` writer
    is active and records (`tf.summary.record_if`). Its per-variable ones
    (density, threshold, counters of every variable: thousands on a large
    model) are gated further: True (default) writes them with the others,
    False never, and a callable returning a boolean (tensor), such as
    `lambda: step % 1000 == 0`, is evaluated in the step like the condition
    of `tf.summary.record_if`, so they are written only when it holds too.
    """
    return self._variable_summaries

  @variable_summaries.setter
  def variable_summaries(self, value) -> None:
    if not (isinstance(value, bool) or callable(value)):
      raise TypeError(f"{type(self).__name__}: variable_summaries must be True, False "
                      "or a callable returning a boolean, got "
                      f"{type(value).__name__}")
    self._variable_summaries = value

  # Whether the compressor exchanges packed buffers through
  # `sparse_wire.exchange_many` (what `exact_sizes` acts on).
  exchanges_sparse_wire: bool = False

  @property
  def exact_sizes(self):
    """Whether each replica sends only its used wire slots (exact sizes).

    For compressors that exchange packed buffers through `sparse_wire`
    (`exchanges_sparse_wire`: DCTDP, TopK, HardThreshold). None (default):
    exact sizes where the replicas span more than one worker, outside XLA;
    the fixed capacity on one worker, where bytes are cheap and the
    exact-size exchange's extra work costs step time, and under XLA.
    True: exact sizes on one worker too (what would cross a network; an
    error under XLA). False: the fixed capacity everywhere. The sums are
    the same bits either way; the accounting reports the bytes sent
    (`sparse_wire.exchange_many`'s `exact`).
    """
    return self._exact_sizes

  @exact_sizes.setter
  def exact_sizes(self, value) -> None:
    if value is not None and not isinstance(value, bool):
      raise ValueError(f"{type(self).__name__}: exact_sizes must be None, True or "
                       f"False, got {value!r}")
    if value is not None and not self.exchanges_sparse_wire:
      raise ValueError(f"{type(self).__name__}: exact_sizes must be None (it "
                       f"exchanges no sparse_wire buffers), got {value!r}")
    self._exact_sizes = value

  def residual_norm(self) -> tf.Tensor | None:
    """The L2 norm of the calling replica's error-feedback residuals.

    Over every variable's `residual` state: what the replica holds back to
    send in later steps. None for a compressor without residuals. Call in a
    replica context (a step), where it reads the current values.
    """
    residuals = [st["residual"].local() for st in self.state.values()
                 if "residual" in st]
    if not residuals:
      return None
    return tf.sqrt(tf.add_n([
        tf.reduce_sum(tf.square(tf.cast(r.read_value(), tf.float32)))
        for r in residuals]))

  @property
  def timing_enabled(self) -> bool:
    """Whether selection time is measured (tf.timestamp has no XLA kernel)."""
    if self.time_selection is not None:
      return bool(self.time_selection)
    return not getattr(self._replicator, "jit_compile", False)

  def record(self, variable: tf.Variable, *, gather_bytes: int = 0,
             reduce_bytes: int = 0, nnz=None, sent=None, threshold=None,
             selection_seconds=None, counters=None,
             as_stock: bool = False) -> None:
    """Reports what this replica did for `variable` in the current step.

    Call from `reduce`, at most once per variable and step. Bytes per
    replica: `gather_bytes` (P) put into all-gathers (an int, or a scalar
    tensor when the payload's size is decided in the step), `reduce_bytes`
    (M, static) all-reduced; `as_stock=True` instead: the gradient went through TF's own
    collective as it is (the stock baseline's bytes). `nnz` (non-zero
    entries of the aggregated update) and `sent` (entries this replica sent)
    default to N. Outside `aggregate` it does nothing.
    """
    records = getattr(self._recording, "records", None)
    if records is None:
      return
    size = variable.shape.num_elements()
    records[self._keys[variable.ref()]] = (variable, accounting.Record(
        size=size, dtype=variable.dtype, gather_bytes=gather_bytes,
        reduce_bytes=reduce_bytes, nnz=size if nnz is None else nnz,
        sent=size if sent is None else sent, threshold=threshold,
        selection_seconds=selection_seconds, counters=dict(counters or {}),
        as_stock=as_stock))

  def communication_stats(self) -> dict:
    """Per-replica communication statistics as plain Python / numpy values.

    Keys: `num_replicas`, `replica_ids` (this worker's), `steps` (per
    replica), `last` and `total` (this step / cumulative; each maps a field
    of `accounting.FIELDS`, `density` and `local_density` to a per-replica
    list) and `variables` (per variable name: `size`, `steps`, `last` (with
    `threshold`), `total`, and `counters` when the compressor reports any).
    A compressor with phases (a warm-up, a sparsity schedule) also has
    `phases`: per phase its `start` step, whether it is `dense`, and the
    `steps` and `total` of the steps traced in that phase (by
    `Replicator.run` or `tf_dct.keras.phase_callback`; steps decided in the
    graph count only in `total`).
    """
    if self._replicator is None:
      raise RuntimeError("bind the compressor (replicator.wrap_optimizer) first")
    return self.accounting.to_python(self._replicator)

  def _account(self, ctx, records: dict, results, pairs=()) -> None:
    """Turns this step's records into statistics, after the collectives.

    `pairs`: this replica's incoming (gradient, variable) pairs; their
    gradients price the stock baseline (`accounting.with_gradient`).
    """
    incoming = {v.ref(): g for g, v in pairs}
    records = {k: (var, accounting.with_gradient(rec, incoming.get(var.ref()),
                                                 var))
               for k, (var, rec) in records.items()}
    with self._lock, tf.init_scope():
      for key, (var, rec) in records.items():
        self.accounting.ensure(self, key, var.name.split(":")[0], rec.counters)
    local0 = _private.static_replica_id(ctx)
    summaries = (self.timing_enabled and local0 is not None
                 and int(local0) == self._replicator.first_local_replica_id)
    done = [r.values if isinstance(r, tf.IndexedSlices) else r
            for r in results if r is not None]
    with tf.control_dependencies(error_feedback.gate(done)):
      has_residual = any("residual" in st for st in self.state.values())
      self.accounting.update({k: rec for k, (_, rec) in records.items()},
                             ctx.num_replicas_in_sync, summaries, self.phase,
                             variable_summaries=self.variable_summaries,
                             residual_norm=self.residual_norm if has_residual else None)

  def per_replica_state(self, initial_value, name: str):
    if self._replicator is None:
      raise RuntimeError("bind the compressor (replicator.wrap_optimizer) before "
                         "creating state")
    return self._replicator.per_replica_state(initial_value, name=name)

  def check_variable(self, variable: tf.Variable, max_size: int | None = None
                     ) -> int:
    """Returns the entry count N of a variable this compressor can handle.

    Raises:
      TypeError: its dtype is not in `supported_dtypes` (named).
      ValueError: its shape is not static, or N exceeds `max_size` (named).
    """
    owner = type(self).__name__
    variable = self._tf_variable(variable)
    if variable.dtype.name not in self.supported_dtypes:
      raise TypeError(f"{owner}: variable {variable.name!r} has dtype "
                      f"{variable.dtype.name}; supported dtypes: "
                      f"{', '.join(self.supported_dtypes)}")
    n = variable.shape.num_elements()
    if n is None:
      raise ValueError(f"{owner} needs a static shape; variable "
                       f"{variable.name!r} has shape {variable.shape}")
    if max_size is not None and n > max_size:
      raise ValueError(f"{owner}: variable {variable.name!r} has {n} entries; "
                       f"int32 positions allow at most {max_size}")
    return n

  def create_states(self, variables: Sequence[tf.Variable]) -> None:
    """Creates the state and statistics of `variables` now (eagerly).

    A wrapped optimizer's `build(variables)` calls this, so building the
    optimizer before the first step (`opt.build(model.trainable_variables)`)
    means a checkpoint restore fills the state at once and the first step
    traces once (no variables are created inside it). `variables`:
    tf.Variables or Keras 3 variables.
    """
    self._states_for([self._tf_variable(v, "variables")
                      for v in variables])

  def state_for(self, variable: tf.Variable) -> dict:
    """The per-replica state of `variable` (created on first use); a Keras 3
    variable or its backing tf.Variable."""
    return self._states_for([self._tf_variable(variable)])[0]

  def state_values(self, variable: tf.Variable) -> dict:
    """This worker's values of `variable`'s state, by name: per local
    replica, in local replica order (numpy). The packed `scalars` come back
    as the scalars they hold (`scalar_dtypes`), each of its own dtype.
    `variable`: a tf.Variable or a Keras 3 variable."""
    variable = self._tf_variable(variable)
    out = {key: s.numpy() for key, s in self.state_for(variable).items()}
    if "scalars" in out:
      rows = np.asarray(out.pop("scalars"))
      for i, (name, dtype) in enumerate(self.scalar_dtypes(variable).items()):
        out[name] = [dtype.as_numpy_dtype(x) for x in rows[:, i]]
    return out

  def scalar_dtypes(self, variable: tf.Variable) -> dict:
    """Names and dtypes of the per-variable scalars of the state (step
    counters, thresholds, last-step counts), in the order they are packed
    into its float64 `scalars` entry; {} when there are none.

    They share one variable because every variable a step touches costs
    time on each call of the step function, whatever it holds (several
    percent of a small model's step, docs/dct_dp.md). float64 holds
    each exactly: floats of at most 64 bits, integers below 2^53.
    """
    del variable
    return {}

  def scalars_state(self, variable: tf.Variable, name: str):
    """The `scalars` entry of `variable`'s state: float64 zeros, one per
    `scalar_dtypes(variable)`."""
    return self.per_replica_state(
        tf.zeros([len(self.scalar_dtypes(variable))], tf.float64), name=name)

  def residual_state(self, variable: tf.Variable, prefix: str) -> dict:
    """An error-feedback state of `variable`: its `residual` (zeros of its
    shape) and its `scalars`, named `state_name(prefix, variable, ...)`."""
    return {
        "residual": self.per_replica_state(
            tf.zeros(variable.shape, variable.dtype),
            name=state_name(prefix, variable, "residual")),
        "scalars": self.scalars_state(
            variable, state_name(prefix, variable, "scalars")),
    }

  def pack_scalars(self, variable: tf.Variable, values: dict) -> tf.Tensor:
    """float64 `scalars` of `variable` from {name: scalar}, every name of
    `scalar_dtypes(variable)` given."""
    return tf.stack([tf.cast(values[name], tf.float64)
                     for name in self.scalar_dtypes(variable)])

  def unpack_scalars(self, variable: tf.Variable, packed) -> dict:
    """{name: scalar of its dtype} from a `scalars` value of `variable`."""
    return {name: tf.cast(packed[i], dtype) for i, (name, dtype)
            in enumerate(self.scalar_dtypes(variable).items())}

  def _states_for(self, variables) -> list[dict]:
    with self._lock:
      for var in variables:
        ref = var.ref()
        if ref not in self._keys:
          key = state_key(len(self._keys))
          with tf.init_scope():  # state is created eagerly, once, for all replicas
            excluded = self.is_excluded(var)
            state = {} if excluded else self.create_state(var)
            if state and self.momentum:  # momentum correction's velocity u
              state["velocity"] = self.per_replica_state(
                  tf.zeros(var.shape, var.dtype), name=state_name(
                      self.name, var, "velocity"))
            if state and self._adam_hparams:  # Adam correction's m, v, t
              for what, shape in (("adam_m", var.shape), ("adam_v", var.shape),
                                  ("adam_t", [])):
                state[what] = self.per_replica_state(
                    tf.zeros(shape, var.dtype),
                    name=state_name(self.name, var, what))
            if state and self._adagrad_hparams:  # Adagrad correction's acc
              state["adagrad_acc"] = self.per_replica_state(
                  tf.fill(var.shape, tf.cast(self._adagrad_hparams[0],
                                             var.dtype)),
                  name=state_name(self.name, var, "adagrad_acc"))
            self.state[key] = state
            if self._replicator is not None:  # statistics too, so they restore
              self.accounting.ensure(self, key, var.name.split(":")[0],
                                     () if excluded else self.counter_names(var))
          self._keys[ref] = key  # only once its state exists
      return [self.state[self._keys[v.ref()]] for v in variables]

  def _decide(self, pairs, states) -> tuple[list[bool], list[bool]]:
    """Per (gradient, variable) pair: whether it is sent as it is
    (`sends_as_is`) and whether it is sent whole (`sends_whole`), chosen at
    a variable's first gradient and kept. `states`: the pairs' states."""
    with self._lock:
      for (g, v), st in zip(pairs, states):
        if v.ref() not in self._as_is:
          as_is = self.is_excluded(v) or self._sparse_as_is(g, v)
          self._whole[v.ref()] = not as_is and self._dense_whole(g, v, st)
          self._as_is[v.ref()] = as_is
    return ([self._as_is[v.ref()] for _, v in pairs],
            [self._whole[v.ref()] for _, v in pairs])

  def sends_as_is(self, variable) -> bool:
    """Whether `variable` is all-reduced (or all-gathered) as it is, with no
    state: excluded by name, or its sparse gradient sent as stock TF sends
    it (`sparse_gradients`, decided at its first gradient)."""
    variable = self._tf_variable(variable)
    return self._as_is.get(variable.ref(), self.is_excluded(variable))

  def sends_whole(self, variable) -> bool:
    """Whether `variable`'s accumulator is all-reduced whole on compressed
    steps (`dense_gradients`, decided at its first gradient)."""
    return self._whole.get(self._tf_variable(variable).ref(), False)

  def _sparse_as_is(self, grad, variable) -> bool:
    """The `sparse_gradients` choice for `variable`, from its first gradient."""
    if (not isinstance(grad, tf.IndexedSlices)
        or self.sparse_gradients == "compress"):
      return False
    if _private.in_xla_context():  # TF's IndexedSlices all-gather has no XLA kernel
      if self.sparse_gradients == "stock":
        logging.warning(
            "tf_dct: %s compresses %r under XLA: TensorFlow's all-gather of "
            "IndexedSlices rows has no XLA kernel, so sparse_gradients='stock' "
            "cannot send it as rows", type(self).__name__, variable.name)
      return False
    if self.sparse_gradients == "stock":
      return True
    if grad.indices.shape.num_elements() is None:
      logging.warning(
          "tf_dct: %s compresses %r: its IndexedSlices gradient has no static "
          "row count, so sparse_gradients='auto' cannot price TF's all-gather "
          "of the rows; give the dataset static batch shapes "
          "(batch(..., drop_remainder=True)) or pass sparse_gradients='stock'",
          type(self).__name__, variable.name)
      return False
    return self.stock_is_cheaper(grad, variable, _replicas_priced())

  def _dense_whole(self, grad, variable, state) -> bool:
    """The `dense_gradients` choice for `variable`, from its first gradient.
    A variable the compressor already sends dense (no `state`) stays with it."""
    if (isinstance(grad, tf.IndexedSlices) or self.dense_gradients == "compress"
        or not state):
      return False
    return (self._tf_variable(variable).shape.num_elements() < self.whole_below
            or self.dense_is_cheaper(variable, _replicas_priced()))

  def dense_is_cheaper(self, variable, num_replicas: int) -> bool:
    """Whether all-reducing `variable`'s dense gradient moves no more bytes
    per replica than this compressor's exchange would (`compressed_bytes`;
    ring model of `accounting`). Adam correction's side channel is sent
    either way and does not count. False when the compressor's bytes are
    not known statically."""
    variable = self._tf_variable(variable)
    cost = self._exchange_cost(variable, num_replicas)
    if cost is None:
      return False
    dense = accounting.all_reduce_bytes(
        variable.shape.num_elements() * variable.dtype.size, num_replicas)
    return dense <= cost

  def _exchange_cost(self, variable, num_replicas: int) -> float | None:
    """Bytes one replica moves for `variable` on a compressed step (ring
    model); None when `compressed_bytes` does not know them."""
    mine = self.compressed_bytes(variable)
    if mine is None:
      return None
    gather, reduce = mine
    return (accounting.all_gather_bytes(gather, num_replicas)
            + accounting.all_reduce_bytes(reduce, num_replicas))

  def stock_is_cheaper(self, grad: tf.IndexedSlices, variable,
                       num_replicas: int) -> bool:
    """Whether TF's all-gather of `grad`'s rows moves no more bytes per
    replica than this compressor's exchange of `variable` would
    (`compressed_bytes`, ring model of `accounting`; "auto" asks with at
    least 2 replicas, as with one nothing moves). False when either is
    unknown statically (the row count, or the compressor's bytes).

    The rows are priced as `reduce_as_is` sends them. With `dedup_rows`
    outside XLA: `accounting.distinct_rows` of the gradient's row ids in the
    table's rows (the largest replica's expected distinct rows, as TF pads
    to it) plus the row count's all-gather; otherwise every row id, the
    duplicates included."""
    variable = self._tf_variable(variable)
    rows = grad.indices.shape.num_elements()
    compressed = self._exchange_cost(variable, num_replicas)
    if rows is None or compressed is None:
      return False
    width = variable.shape[1:].num_elements()
    extra = 0
    if self.dedup_rows and not _private.in_xla_context():
      rows = accounting.distinct_rows(rows, variable.shape[0], num_replicas)
      extra = ROW_COUNT_BYTES
    stock = accounting.all_gather_bytes(accounting.indexed_slices_payload(
        rows, width * grad.values.dtype.size, grad.indices.dtype.size) + extra,
        num_replicas)
    return stock <= compressed

  def compressed_bytes(self, variable) -> tuple[int, int] | None:
    """(P, M): bytes one replica gathers and all-reduces for `variable` on a
    compressed step (`record`'s byte model); None when not known statically,
    and then `sparse_gradients` and `dense_gradients` "auto" compress the
    variable. An override takes a Keras 3 variable too (`_tf_variable`)."""
    del variable
    return None

  def _correct_momentum(self, grads, variables, states):
    """Momentum correction before `reduce`: u = m * u + g per corrected
    variable. Returns the gradients to compress and what `_mask_velocities`
    needs after the step."""
    out, pending = list(grads), []
    for i, (g, v, st) in enumerate(zip(grads, variables, states)):
      if "velocity" not in st:
        continue
      old_residual = st["residual"].local().read_value()
      u = momentum_correction.velocity(
          g, st["velocity"].local().read_value(), self.momentum, v)
      out[i] = u
      pending.append((st, u, old_residual))
    return out, pending

  def _mask_velocities(self, pending, results) -> None:
    """Writes each corrected variable's velocity after `reduce` wrote its
    residual (program order: the residual reads below see the new value),
    and only once the step's collectives (`results`) completed: a step that
    any replica rejects moves no velocity."""
    done = error_feedback.gate([r for r in results if r is not None])
    for st, u, old_residual in pending:
      if self.momentum_masking:                    # momentum factor masking
        u = momentum_correction.masked(u, old_residual,
                                       st["residual"].local().read_value())
      with tf.control_dependencies(done):
        st["velocity"].local().assign(u)

  def _side_channel(self, ctx, grads, variables, states, key: str, mode: str):
    """The replicas' second-moment estimate of every dense gradient whose
    state holds `key`, from one all-reduce of all their side channels.

    Returns (picked, pieces): the positions of those gradients and, per
    position, `adam_correction.second_moment` of the summed side channel in
    the variable's dtype. `IndexedSlices` (embedding rows) send no side
    channel and are not picked.
    """
    picked = [i for i, st in enumerate(states) if key in st
              and not isinstance(grads[i], tf.IndexedSlices)]
    if not picked:
      return [], []
    # A "sketched" channel's signs change with Adam's step count (equal on
    # every replica); Adagrad correction keeps no count and uses fixed signs.
    step = lambda st: (st["adam_t"].local().read_value()
                       if mode == "sketched" and "adam_t" in st else 0)
    parts = [adam_correction.side_channel(grads[i], variables[i], mode, step(states[i]))
             for i in picked]
    sizes = [adam_correction.side_channel_size(variables[i], mode)
             for i in picked]
    dtype = parts[0].dtype
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat(
        [tf.cast(p, dtype) for p in parts], 0))
    return picked, [
        adam_correction.second_moment(tf.cast(piece, variables[i].dtype),
                                      variables[i], mode, ctx.num_replicas_in_sync)
        for i, piece in zip(picked, tf.split(summed, sizes))]

  def _adam_before(self, ctx, grads, variables, states):
    """Adam correction before `reduce`: one all-reduce of the side channel
    of every dense corrected gradient, v and t updated, and (normalized
    selection) the gradient scaled by Adam's step scale. Returns the
    gradients to compress and {position: (v, t)} for `_adam_after`."""
    picked, seconds = self._side_channel(ctx, grads, variables, states,
                                         "adam_m", self.adam_second_moment)
    if not picked:
      return list(grads), {}
    beta_1, beta_2, epsilon = self._adam_hparams
    out, pending = list(grads), {}
    for i, second in zip(picked, seconds):
      var, st = variables[i], states[i]
      v, t = adam_correction.second_moment_step(
          st["adam_v"].local().read_value(), st["adam_t"].local().read_value(),
          second, beta_2)
      q = tf.reshape(tf.convert_to_tensor(grads[i]), var.shape)
      if self.adam_select == "normalized":
        q = q * adam_correction.scale(v, t, beta_2, epsilon)
      m = None
      if self.adam_first_moment == "replica":  # this replica's m feeds EF
        m, q = adam_correction.first_moment_step(
            st["adam_m"].local().read_value(), t, q, beta_1)
      pending[i] = (v, t, m)
      out[i] = q
    return out, pending

  def _adam_after(self, results, variables, states, pending) -> list:
    """Replaces each Adam-corrected aggregate by its Adam direction."""
    results = list(results)
    if not self._adam_hparams:
      return results
    beta_1, beta_2, epsilon = self._adam_hparams
    # No state moves before every gradient of the step passed its check.
    done = error_feedback.gate(results)
    for i, st in enumerate(states):
      if "adam_m" not in st or results[i] is None:
        continue
      var = variables[i]
      sent = tf.reshape(tf.convert_to_tensor(results[i]), var.shape)
      m = st["adam_m"].local().read_value()
      if i in pending:
        v, t, local_m = pending[i]
        if local_m is None:
          m, d = adam_correction.first_moment_step(m, t, sent, beta_1)
        else:  # the replicas' first moments were sent: apply them as they are
          m, d = local_m, sent
        if self.adam_select != "normalized":
          d = d * adam_correction.scale(v, t, beta_2, epsilon)
        self._add_reduce_bytes(var, adam_correction.side_channel_size(
            var, self.adam_second_moment) * var.dtype.size)
      else:  # sparse rows (embeddings): Adam on the aggregate, as before
        v, t = adam_correction.second_moment_step(
            st["adam_v"].local().read_value(), st["adam_t"].local().read_value(),
            tf.square(sent), beta_2)
        m, d = adam_correction.first_moment_step(m, t, sent, beta_1)
        d = d * adam_correction.scale(v, t, beta_2, epsilon)
      with tf.control_dependencies(done):
        writes = [st["adam_m"].local().assign(m),
                  st["adam_v"].local().assign(v),
                  st["adam_t"].local().assign(t)]
      with tf.control_dependencies(writes):
        results[i] = tf.identity(d)
    return results

  def _adagrad_before(self, ctx, grads, variables, states):
    """Adagrad correction before `reduce`: one all-reduce of the side
    channel of every dense corrected gradient, the accumulator updated and
    the gradient scaled by Adagrad's step. Returns the gradients to compress
    and {position: new accumulator} for `_adagrad_after`."""
    picked, seconds = self._side_channel(ctx, grads, variables, states,
                                         "adagrad_acc", self.adagrad_accumulator)
    if not picked:
      return list(grads), {}
    epsilon = self._adagrad_hparams[1]
    out, pending = list(grads), {}
    for i, second in zip(picked, seconds):
      var, st = variables[i], states[i]
      acc = adagrad_correction.accumulate(
          st["adagrad_acc"].local().read_value(), second)
      out[i] = adagrad_correction.step(
          tf.reshape(tf.convert_to_tensor(grads[i]), var.shape), acc, epsilon)
      pending[i] = acc
    return out, pending

  def _adagrad_after(self, results, variables, states, pending) -> list:
    """Writes each Adagrad-corrected variable's accumulator once the step's
    collectives completed; embedding rows (`IndexedSlices`, no side channel)
    run Adagrad on the aggregate."""
    results = list(results)
    if not self._adagrad_hparams:
      return results
    epsilon = self._adagrad_hparams[1]
    done = error_feedback.gate(results)  # no state moves on a rejected step
    for i, st in enumerate(states):
      if "adagrad_acc" not in st or results[i] is None:
        continue
      var = variables[i]
      sent = tf.reshape(tf.convert_to_tensor(results[i]), var.shape)
      if i in pending:  # the replicas' scaled gradients: applied as they are
        acc, d = pending[i], sent
        self._add_reduce_bytes(var, adam_correction.side_channel_size(
            var, self.adagrad_accumulator) * var.dtype.size)
      else:
        acc = adagrad_correction.accumulate(
            st["adagrad_acc"].local().read_value(), tf.square(sent))
        d = adagrad_correction.step(sent, acc, epsilon)
      with tf.control_dependencies(done):
        write = st["adagrad_acc"].local().assign(acc)
      with tf.control_dependencies([write]):
        results[i] = tf.identity(d)
    return results

  def _add_reduce_bytes(self, variable, extra: int) -> None:
    records = getattr(self._recording, "records", None)
    key = self._keys.get(variable.ref())
    if records is None or key not in records:
      return
    var, rec = records[key]
    records[key] = (var, dataclasses.replace(
        rec, reduce_bytes=rec.reduce_bytes + extra))

  def _check_gradients(self, grads, variables, states) -> list:
    """`error_feedback.check_gradients` on the gradients of variables with
    state, before anything reads them (momentum, Adam, `reduce`); the others
    go to a dense all-reduce and the optimizer, which check them."""
    picked = [i for i, st in enumerate(states) if st]
    out = list(grads)
    for i, g in zip(picked, error_feedback.check_gradients(
        type(self).__name__, [grads[i] for i in picked],
        [variables[i] for i in picked])):
      out[i] = g
    return out

  def _snapshot(self, grads, states):
    """Under XLA: this replica's finiteness flag and its state before the step.

    XLA compiles the gradient checks (`check_numerics`) away, so a compiled
    step cannot raise. Instead `aggregate` undoes a step in which any replica
    saw a non-finite gradient: every state variable of the step is put back,
    so nothing non-finite enters a residual and no threshold or step counter
    moves.
    """
    saved = [(s.local(), s.local().read_value())
             for st in states for s in st.values()]
    return error_feedback.all_finite(grads), saved

  def _undo_if_non_finite(self, ctx, undo, results):
    """Restores the state and poisons the results when any replica was non-finite.

    The aggregate becomes NaN on every replica, as a dense all-reduce of a
    non-finite gradient would be, so the update is visibly non-finite (and
    e.g. `tf_keras.callbacks.TerminateOnNaN` stops), while the compressor's
    state stays as it was before the step. One scalar all-reduce decides it
    for all replicas together: replicas must agree, or entries one replica
    sent would be applied and also restored into its residual.
    """
    finite, saved = undo
    bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                         1.0 - tf.cast(finite, tf.float32))
    ok = tf.equal(bad, 0.0)
    done = [r.values if isinstance(r, tf.IndexedSlices) else r
            for r in results if r is not None]
    with tf.control_dependencies(error_feedback.gate(done)):
      for var, before in saved:
        var.assign(tf.where(ok, var.read_value(), before))

    def poison(r):
      if isinstance(r, tf.IndexedSlices):
        return tf.IndexedSlices(poison(r.values), r.indices, r.dense_shape)
      return tf.where(ok, r, tf.constant(float("nan"), r.dtype))

    return [None if r is None else poison(r) for r in results]

  def aggregate(self, grads_and_vars) -> list:
    """Aggregates `(grad, var)` pairs of this replica; `None` grads pass through.

    Outside a replica context (e.g. `apply_gradients` called in cross-replica
    context) the pairs are returned unchanged, like the built-in aggregation.
    """
    grads_and_vars = list(grads_and_vars)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.distribute.in_cross_replica_context():
      return grads_and_vars
    pairs = [(g, self._tf_variable(v, "grads_and_vars"))
             for g, v in grads_and_vars if g is not None]
    if not pairs:
      return grads_and_vars
    states = self._states_for([v for _, v in pairs])  # keys in this order
    excluded, whole = self._decide(pairs, states)
    kept = [(g, v, st) for (g, v), st, ex in zip(pairs, states, excluded) if not ex]
    whole = [w for w, ex in zip(whole, excluded) if not ex]
    passed = [p for p, ex in zip(pairs, excluded) if ex]
    self._recording.records = {}
    try:
      kept_grads = [g for g, _, _ in kept]
      kept_vars = [v for _, v, _ in kept]
      kept_states = [st for _, _, st in kept]
      kept_grads = self._check_gradients(kept_grads, kept_vars, kept_states)
      undo = (_private.in_xla_context() and any(kept_states)
              and self._snapshot(kept_grads, kept_states))
      kept_grads, pending = self._correct_momentum(kept_grads, kept_vars,
                                                   kept_states)
      if any(kept_states):
        self._check_driven()
      kept_grads, adam_pending = self._adam_before(ctx, kept_grads, kept_vars,
                                                   kept_states)
      kept_grads, adagrad_pending = self._adagrad_before(
          ctx, kept_grads, kept_vars, kept_states)
      dense_phase = self.phase is not None and self.phase_is_dense(self.phase)
      out_kept = (self._reduce_kept(ctx, kept_grads, kept_vars, kept_states,
                                    [True] * len(kept) if dense_phase else whole)
                  if kept else [])
      self._mask_velocities(pending, out_kept)
      out_kept = self._adam_after(out_kept, kept_vars, kept_states, adam_pending)
      out_kept = self._adagrad_after(out_kept, kept_vars, kept_states,
                                     adagrad_pending)
      if undo:
        out_kept = self._undo_if_non_finite(ctx, undo, out_kept)
      out_kept = iter(out_kept)
      out_passed = iter(self.reduce_as_is(ctx, [g for g, _ in passed],
                                          [v for _, v in passed])
                        if passed else [])
      reduced = [next(out_passed) if ex else next(out_kept) for ex in excluded]
      records = self._recording.records
    finally:
      self._recording.records = None
    if records and self._replicator is not None:
      self._account(ctx, records, reduced, pairs)
    reduced = iter(reduced)
    return [(None, v) if g is None else (next(reduced), v)
            for g, v in grads_and_vars]
