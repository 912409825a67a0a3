"""Communication accounting: bytes moved, density, thresholds, selection time.

A compressor declares, per variable and step, the bytes it all-gathers (P)
and all-reduces (M). With ring collectives over n replicas each replica then
sends and receives (n - 1) * P bytes for the all-gather and 2 (n - 1) / n * M
for the all-reduce; its payload is P + M. Two baselines are priced beside
them: what stock TensorFlow's `MultiWorkerMirroredStrategy` moves for the
same gradients (`stock_*`: dense gradients all-reduced, `IndexedSlices`
all-gathered row by row) and the DCT paper's all-reduce of every gradient
densified (`dense_*`).

`Accounting` keeps each variable's records in one small float64 matrix per
replica, since every variable a step touches costs time on each call.
Density is nnz(aggregate) / N. Selection time is one `tf.timestamp` span per
replica and step, taken outside TensorFlow's program order so that replicas
do not wait for each other (0 under XLA). docs/compression.md
("Accounting") has the byte model and the baselines in full.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping

import numpy as np
import tensorflow as tf

from tf_dct import _private
from tf_dct import validation

# Additive per-step fields, in the order of the stored vectors.
FIELDS = ("payload_bytes", "bytes_sent", "bytes_received", "dense_bytes",
          "dense_payload_bytes", "nnz", "size", "sent", "selection_seconds",
          "stock_bytes", "stock_payload_bytes")
# Rows of the stats matrices: this step, and summed over steps.
LAST, TOTAL = 0, 1
_SCALARS = ("bytes_sent", "bytes_received", "payload_bytes", "stock_bytes",
            "stock_payload_bytes", "dense_bytes", "dense_payload_bytes",
            "selection_seconds")
# The TensorBoard group of the per-variable scalars, apart from the
# compressor's own `tf_dct/` scalars so that they stay readable.
VARIABLE_GROUP = "tf_dct_variables"
# The row count TF all-gathers before an IndexedSlices (one int32).
LENGTH_BYTES = 4


def all_gather_bytes(payload: float, n: int) -> float:
  """Bytes one replica sends (= receives) in a ring all-gather of `payload`.

  Example:
    >>> all_gather_bytes(100, 4)  # 3 other replicas' 100 bytes each
    300
    >>> all_gather_bytes(100, 1)
    0
  """
  return (n - 1) * payload


def all_reduce_bytes(size: float, n: int) -> float:
  """Bytes one replica sends (= receives) in a ring all-reduce of `size`.

  Example:
    >>> all_reduce_bytes(1000, 4)  # reduce-scatter, then all-gather
    1500.0
    >>> all_reduce_bytes(1000, 1)
    0.0
  """
  return 2 * (n - 1) / n * size


def indexed_slices_payload(rows, row_bytes: int, index_bytes: int,
                           max_rows=None):
  """P of stock TF's all-gather of an IndexedSlices gradient (module doc).

  Args:
    rows: this replica's row count (int, or an integer tensor).
    row_bytes: bytes of one row of values.
    index_bytes: bytes of one row id.
    max_rows: the largest row count over the replicas (default `rows`); TF
      pads values and row ids to it.

  Returns:
    LENGTH_BYTES + max_rows * (row_bytes + index_bytes): an int, or a
    float64 tensor when a count is a tensor.

  Example:
    10 rows of 64 float32 values with int32 row ids, and the same padded to
    another replica's 12 rows:

    >>> indexed_slices_payload(10, row_bytes=64 * 4, index_bytes=4)
    2604
    >>> indexed_slices_payload(10, row_bytes=64 * 4, index_bytes=4, max_rows=12)
    3124
  """
  rows = rows if max_rows is None else max_rows
  if tf.is_tensor(rows):
    rows = tf.cast(rows, tf.float64)
  return LENGTH_BYTES + rows * (row_bytes + index_bytes)


def distinct_rows(lookups: int, rows: int, replicas: int = 1) -> float:
  """Rows an all-gather of IndexedSlices carries per replica once each
  replica's duplicate rows are summed, estimated before any step runs.

  Each replica's `lookups` row ids are taken as independent uniform draws
  from a table of `rows` rows. Its distinct count D then has mean
  mu = rows (1 - (1 - 1/rows)^lookups) and the variance of the classical
  occupancy problem (empty rows E = rows - D, P(a row empty) =
  (1 - 1/rows)^lookups, P(two given rows empty) = (1 - 2/rows)^lookups).
  TensorFlow pads every replica's rows to the largest count, so for
  `replicas` > 1 this is the Hartley-David-Gumbel bound on the expected
  largest of `replicas` independent counts, mu + sigma (R - 1) / sqrt(2R - 1),
  which holds for any distribution of D. Never more than `lookups` or `rows`.

  Uniform draws give the most distinct rows in expectation: with row
  probabilities p_i the mean is sum_i 1 - (1 - p_i)^lookups, a sum of
  concave terms, largest at p_i = 1/rows. Skewed ids (a few frequent rows)
  only add duplicates. Ids drawn without replacement (each at most once per
  batch) are not covered: they give up to `lookups` distinct rows.

  Args:
    lookups: row ids of one replica's gradient (int >= 0).
    rows: rows of the table (int >= 1).
    replicas: replicas padded to the largest count (int >= 1).

  Returns:
    The estimate, a float in [0, min(lookups, rows)].

  Example:
    >>> distinct_rows(2, 2)  # ids (0, 0), (0, 1), (1, 0), (1, 1)
    1.5
    >>> round(distinct_rows(3328, 26000), 1)  # 128 examples x 26 features
    3123.9
    >>> round(distinct_rows(3328, 26000, replicas=2), 1)
    3131.4
  """
  n = validation.check_number("distinct_rows", "lookups", lookups,
                              numbers.Integral, 0, False)
  v = validation.check_number("distinct_rows", "rows", rows, numbers.Integral,
                              1, False)
  r = validation.check_number("distinct_rows", "replicas", replicas,
                              numbers.Integral, 1, False)
  if n == 0 or v == 1:
    return float(min(n, v))
  empty = math.exp(n * math.log1p(-1 / v))  # P(a given row is not drawn)
  mean = -v * math.expm1(n * math.log1p(-1 / v))
  if v == 2:  # both rows empty: impossible
    variance = v * empty - v * v * empty * empty
  else:  # v e + v (v - 1) e2 - (v e)^2 with e2 = P(two given rows empty),
    # as v (e - e2) + v^2 (e2 - e^2) in ratios of e that keep their digits
    variance = (-v * empty * math.expm1(n * math.log1p(-1 / (v - 1)))
                + v * v * empty * empty
                * math.expm1(n * math.log1p(-1 / (v - 1) ** 2)))
  spread = math.sqrt(max(variance, 0.0)) * (r - 1) / math.sqrt(2 * r - 1)
  return min(mean + spread, float(min(n, v)))


@dataclasses.dataclass
class Record:
  """What one replica did for one variable in one step.

  Attributes:
    size: N, entries of the variable.
    dtype: the gradient's dtype (its size prices the dense baseline).
    gather_bytes: P, bytes this replica put into all-gathers: a static int,
      or a tensor where the payload's size is known only in the step
      (`sparse_wire.exchange_many` with exact sizes).
    reduce_bytes: M, bytes this replica all-reduced (static int).
    nnz: non-zero entries of the aggregated update (int or tensor).
    sent: entries this replica sent (int or tensor).
    threshold: the threshold used, or None.
    selection_seconds: selection time of this replica, or None.
    counters: name -> per-step amount (int or tensor), accumulated over steps,
      e.g. {"early_refreshes": 1}.
    sparse_rows: rows of this replica's incoming `tf.IndexedSlices` gradient
      (int or tensor), or None for a dense gradient; prices the stock
      baseline (`with_gradient`).
    row_bytes: bytes of one row of that gradient's values.
    index_bytes: bytes of one of its row ids.
    as_stock: the variable was sent as stock TF sends it: the bytes moved
      are the stock baseline's, and gather / reduce bytes are ignored.
  """
  size: int
  dtype: tf.DType
  gather_bytes: int = 0
  reduce_bytes: int = 0
  nnz: object = 0
  sent: object = 0
  threshold: object = None
  selection_seconds: object = None
  counters: Mapping[str, object] = dataclasses.field(default_factory=dict)
  sparse_rows: object = None
  row_bytes: int = 0
  index_bytes: int = 0
  as_stock: bool = False

  def static_vector(self, num_replicas: int) -> np.ndarray:
    """float64[len(FIELDS)] of the static fields under the byte model.

    The fields that may be tensors (nnz, sent, selection_seconds and the
    stock baseline; `dynamic_fields`) are 0 here.
    """
    n = num_replicas
    gather = 0 if tf.is_tensor(self.gather_bytes) else self.gather_bytes
    moved = (all_gather_bytes(gather, n)
             + all_reduce_bytes(self.reduce_bytes, n))
    dense = self.size * tf.as_dtype(self.dtype).size
    return np.asarray([gather + self.reduce_bytes, moved, moved,
                       all_reduce_bytes(dense, n), dense, 0, self.size, 0, 0,
                       0, 0], np.float64)

  def stock(self, num_replicas: int) -> tuple:
    """(payload, ring bytes each way) of the stock baseline (module doc)."""
    if self.sparse_rows is None:
      dense = self.size * tf.as_dtype(self.dtype).size
      return dense, all_reduce_bytes(dense, num_replicas)
    payload = indexed_slices_payload(self.sparse_rows, self.row_bytes,
                                     self.index_bytes)
    return payload, all_gather_bytes(payload, num_replicas)

  def dynamic_fields(self, num_replicas: int) -> dict:
    """{field: value} of the fields that may be tensors (None counts as 0)."""
    seconds = 0.0 if self.selection_seconds is None else self.selection_seconds
    payload, moved = self.stock(num_replicas)
    out = {"nnz": self.nnz, "sent": self.sent, "selection_seconds": seconds,
           "stock_bytes": moved, "stock_payload_bytes": payload}
    if self.as_stock:
      out.update(payload_bytes=payload, bytes_sent=moved, bytes_received=moved)
    elif tf.is_tensor(self.gather_bytes):  # exact sizes, known in the step
      gather = tf.cast(self.gather_bytes, tf.float64)
      moved = (all_gather_bytes(gather, num_replicas)
               + all_reduce_bytes(self.reduce_bytes, num_replicas))
      out.update(payload_bytes=gather + self.reduce_bytes, bytes_sent=moved,
                 bytes_received=moved)
    else:  # the same keys for every record (one column each in `update`)
      static = self.static_vector(num_replicas)
      out.update({f: static[FIELDS.index(f)] for f in
                  ("payload_bytes", "bytes_sent", "bytes_received")})
    return out


def with_gradient(record: Record, grad, variable) -> Record:
  """`record` priced against `grad`, the gradient as it reached the compressor.

  A `tf.IndexedSlices` gradient prices the stock baseline as TF's all-gather
  of its rows; anything else as the dense all-reduce.
  """
  if not isinstance(grad, tf.IndexedSlices):
    return record
  rows = grad.indices.shape.num_elements()
  if rows is None:
    rows = tf.size(grad.indices, out_type=tf.int64)
  width = variable.shape[1:].num_elements()
  return dataclasses.replace(
      record, sparse_rows=rows, row_bytes=width * grad.values.dtype.size,
      index_bytes=grad.indices.dtype.size)


def _as_float64_vector(values) -> tf.Tensor:
  """float64[len(values)] of Python numbers and scalar tensors, in few ops.

  Scalars of one dtype are stacked before a single cast, so the ops do not
  grow with the number of values.
  """
  if all(not tf.is_tensor(v) for v in values):
    return tf.constant(np.asarray(values, np.float64))
  tensors = [v if tf.is_tensor(v) else None for v in values]
  dtypes = {t.dtype for t in tensors if t is not None}
  if len(dtypes) == 1:
    dtype = dtypes.pop()
    if all(t is not None or float(v) == float(np.asarray(v).astype(
        dtype.as_numpy_dtype)) for t, v in zip(tensors, values)):
      return tf.cast(tf.stack([t if t is not None else tf.constant(v, dtype)
                               for t, v in zip(tensors, values)]), tf.float64)
  return tf.stack([tf.cast(v, tf.float64) for v in values])


def _timestamp(after) -> tf.Tensor:
  """`tf.timestamp()` once `after` exist, outside the program order of
  stateful ops (`_private.run_independently`)."""
  with tf.control_dependencies(tf.nest.flatten(after)):
    stamp = tf.timestamp()
  if not tf.executing_eagerly():
    _private.run_independently(stamp.op)
  return stamp


def start_timer(inputs, enabled: bool):
  """A timestamp taken after `inputs` exist (0 when not `enabled`)."""
  if not enabled:
    return tf.zeros([], tf.float64)
  return _timestamp(inputs)


def stop_timer(start: tf.Tensor, outputs, enabled: bool):
  """Seconds from `start` until `outputs` exist (0 when not `enabled`)."""
  if not enabled:
    return tf.zeros([], tf.float64)
  return _timestamp(outputs) - start


def _scalar_metadata():
  return tf.compat.v1.SummaryMetadata(
      plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"),
      data_class=1)  # DATA_CLASS_SCALAR


def write_scalar(tag: str, value, step) -> None:
  """A TensorBoard scalar under exactly `tag` (no name-scope prefix).

  `value` may be a callable, called only when the summary is recorded. Needs
  no TensorBoard installation (`tf.summary.scalar` does).
  """
  if callable(value):
    tf.summary.write(tag, lambda: tf.cast(value(), tf.float32), step=step,
                     metadata=_scalar_metadata())
    return
  tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                   metadata=_scalar_metadata())


class Accounting(tf.Module):
  """Per-replica statistics of one compressor, kept in `PerReplicaState`.

  One float64 matrix of two rows per variable (`stats`): row `LAST` holds
  this step's FIELDS, then tau, then the step's counter amounts; row `TOTAL`
  the FIELDS summed over steps, then the number of steps, then the
  cumulative counters (the variable's own counters, in sorted order). For
  the compressor as a whole one [2, len(FIELDS) + 1] matrix: the step's
  FIELDS summed over variables and the totals, the last column 0 and the
  number of aggregation steps. One variable each rather than one per row
  and counter: every variable a step touches costs a few microseconds per
  call of the step function (docs/compression.md). Everything is created the
  first time a compressor reports, so compressors that never report add
  nothing to checkpoints.
  """

  def __init__(self, name: str = "accounting"):
    super().__init__(name=name)
    self.per_variable = {}   # state key -> {"stats": PerReplicaState}
    self.overall = {}     # "stats"
    self.phases = {}      # "stats": [phases, len(FIELDS) + 1] totals per phase
    self._phase_info = ()  # (start, dense) per phase of the compressor
    self._names = {}      # state key -> display name
    self._counter_names = {}

  def ensure(self, compressor, key: str, name: str, counters) -> dict:
    """Creates the state of one variable (and the overall state) if missing."""
    if not self.overall:
      # Filled in place: re-assigning a tracked attribute skips the deferred
      # restore of a checkpoint read before this state existed.
      self.overall["stats"] = compressor.per_replica_state(
          tf.zeros([2, len(FIELDS) + 1], tf.float64), name="tf_dct_stats/all")
      starts = compressor.phase_starts()
      if len(starts) > 1:  # the totals of each phase, like the TOTAL row
        self._phase_info = tuple((start, compressor.phase_is_dense(i))
                                 for i, start in enumerate(starts))
        self.phases["stats"] = compressor.per_replica_state(
            tf.zeros([len(starts), len(FIELDS) + 1], tf.float64),
            name="tf_dct_stats/phases")
    if key not in self.per_variable:
      taken = set(self._names.values())
      self._names[key] = name if name not in taken else key
      self._counter_names[key] = tuple(sorted(counters))
      width = len(FIELDS) + 1 + len(counters)
      self.per_variable[key] = {"stats": compressor.per_replica_state(
          tf.zeros([2, width], tf.float64), name=f"tf_dct_stats/{key}")}
    elif not set(counters) <= set(self._counter_names[key]):
      raise ValueError(f"variable {self._names[key]!r} reported counters "
                       f"{sorted(counters)}; declared: "
                       f"{list(self._counter_names[key])}")
    return self.per_variable[key]

  def update(self, records: Mapping[str, Record], num_replicas: int,
             summaries: bool, phase: int | None = None,
             variable_summaries=True, residual_norm=None) -> None:
    """Writes this step's records of the calling replica (in replica context).

    `phase`: the compressor's phase this step was traced in (None without a
    phase driver); its totals get this step too. With `summaries`, the
    step's scalars are written; `variable_summaries` (a bool or a callable
    giving a boolean) gates the per-variable ones on top of that, and
    `residual_norm` (None or a callable giving the norm) adds
    `tf_dct/residual_norm`.

    All records go into one [V, len(FIELDS) + 1] matrix (fields, then tau)
    built with a few ops whatever V is, the counter amounts into one [V, C]
    matrix (C the most counters of a variable, zero-padded); the variables
    of one width are then updated together.
    """
    keys = list(records)
    recs = [records[k] for k in keys]
    fields = len(FIELDS)
    static = np.stack([r.static_vector(num_replicas) for r in recs])
    columns = [tf.constant(static[:, i]) for i in range(fields)]
    dynamic = [r.dynamic_fields(num_replicas) for r in recs]
    for name in dynamic[0]:
      columns[FIELDS.index(name)] = _as_float64_vector([d[name] for d in dynamic])
    columns.append(_as_float64_vector(
        [0.0 if r.threshold is None else r.threshold for r in recs]))
    last = tf.stack(columns, axis=1)
    # What the total row adds: the fields and a step count of 1 where `last`
    # holds tau.
    added = tf.concat([last[:, :fields], tf.ones([len(recs), 1], tf.float64)],
                      axis=1)
    widest = max(len(self._counter_names[k]) for k in keys)
    if widest:  # zero-padded past a variable's own counters
      amounts = tf.reshape(_as_float64_vector(
          [a for k in keys for a in
           [records[k].counters.get(c, 0) for c in self._counter_names[k]]
           + [0] * (widest - len(self._counter_names[k]))]), [len(keys), widest])
      last = tf.concat([last, amounts], axis=1)
      added = tf.concat([added, amounts], axis=1)
    rows = {}  # key -> its new [2, width] matrix
    by_width = {}
    for i, key in enumerate(keys):
      by_width.setdefault(len(self._counter_names[key]), []).append(i)
    for count, members in by_width.items():
      width = fields + 1 + count
      pick = ((lambda t: t[:, :width]) if len(members) == len(keys)
              else (lambda t: tf.gather(t[:, :width], members)))
      old = tf.stack([self.per_variable[keys[i]]["stats"].local().read_value()
                      for i in members])
      new = tf.stack([pick(last), old[:, TOTAL] + pick(added)], axis=1)
      for i, value in zip(members, tf.unstack(new)):
        self.per_variable[keys[i]]["stats"].local().assign(value)
        rows[keys[i]] = value
    overall = self.overall["stats"].local()
    step_vec = tf.reduce_sum(last[:, :fields], axis=0)
    # As for a variable: this step (steps column 0), and the totals plus
    # this step with a step count of 1.
    zero, one = (tf.constant([x], tf.float64) for x in (0.0, 1.0))
    new = tf.stack([tf.concat([step_vec, zero], 0),
                    overall.read_value()[TOTAL] + tf.concat([step_vec, one], 0)])
    overall.assign(new)
    if phase is not None and self.phases:
      totals = self.phases["stats"].local()
      totals.assign(tf.tensor_scatter_nd_add(
          totals.read_value(), [[phase]],
          tf.concat([step_vec, one], 0)[None]))
    if summaries:
      self._summarize(records, rows, step_vec, new[TOTAL], variable_summaries,
                      residual_norm)

  def _summarize(self, records, rows, step_vec, total, variable_summaries,
                 residual_norm) -> None:
    field = {f: i for i, f in enumerate(FIELDS)}
    step = tf.summary.experimental.get_step()
    if step is None:
      step = tf.cast(total[len(FIELDS)], tf.int64)
    for name in _SCALARS:
      write_scalar(f"tf_dct/{name}", step_vec[field[name]], step)
    for name, baseline, moved in (
        ("stock_ratio", "stock_bytes", "bytes_sent"),
        ("stock_payload_ratio", "stock_payload_bytes", "payload_bytes")):
      write_scalar(f"tf_dct/{name}", tf.math.divide_no_nan(
          step_vec[field[baseline]], step_vec[field[moved]]), step)
    write_scalar("tf_dct/compression_ratio", tf.math.divide_no_nan(
        total[field["stock_bytes"]], total[field["bytes_sent"]]), step)
    write_scalar("tf_dct/total_bytes_sent", total[field["bytes_sent"]], step)
    write_scalar("tf_dct/density",
                 step_vec[field["nnz"]] / step_vec[field["size"]], step)
    if residual_norm is not None:
      write_scalar("tf_dct/residual_norm", residual_norm, step)
    if variable_summaries is False:
      return
    if variable_summaries is True:
      self._summarize_variables(records, rows, step)
      return
    # One branch around them all: a step that writes none of them runs one
    # conditional, not one per scalar (thousands on a large model).
    def write():
      self._summarize_variables(records, rows, step)
      return tf.constant(True)

    tf.cond(tf.logical_and(tf.summary.should_record_summaries(),
                           tf.cast(variable_summaries(), tf.bool)),
            write, lambda: tf.constant(False))

  def _summarize_variables(self, records, rows, step) -> None:
    field = {f: i for i, f in enumerate(FIELDS)}
    for key, rec in records.items():
      name, row = self._names[key], rows[key]
      write_scalar(f"{VARIABLE_GROUP}/density/{name}",
                   row[LAST, field["nnz"]] / row[LAST, field["size"]], step)
      if rec.threshold is not None:
        write_scalar(f"{VARIABLE_GROUP}/threshold/{name}", rec.threshold, step)
      for i, c in enumerate(self._counter_names[key]):
        write_scalar(f"{VARIABLE_GROUP}/{c}/{name}",
                     row[TOTAL, len(FIELDS) + 1 + i], step)

  def to_python(self, replicator) -> dict:
    """The statistics as plain Python / numpy values, per local replica."""
    local = len(replicator.replica_devices)
    out = {"num_replicas": replicator.num_replicas,
           "replica_ids": [replicator.first_local_replica_id + i
                           for i in range(local)],
           "steps": [0] * local, "last": _fields(None, local),
           "total": _fields(None, local), "variables": {}}
    if not self.overall:
      return out
    fields = len(FIELDS)
    overall = self.overall["stats"].numpy()
    out["steps"] = [int(m[TOTAL, fields]) for m in overall]
    out["last"] = _fields([m[LAST] for m in overall], local)
    out["total"] = _fields([m[TOTAL] for m in overall], local)
    if self.phases:
      totals = self.phases["stats"].numpy()  # [local, phases, fields + 1]
      out["phases"] = [
          {"start": start, "dense": dense,
           "steps": [int(m[i, fields]) for m in totals],
           "total": _fields([m[i] for m in totals], local)}
          for i, (start, dense) in enumerate(self._phase_info)]
    for key, st in self.per_variable.items():
      stats = st["stats"].numpy()
      last, total = [m[LAST] for m in stats], [m[TOTAL] for m in stats]
      var = {"size": (int(last[0][FIELDS.index("size")]) if total[0][fields]
                      else None),
             "steps": [int(t[fields]) for t in total],
             "last": _fields(last, local), "total": _fields(total, local)}
      var["last"]["threshold"] = [float(v[fields]) for v in last]
      if self._counter_names[key]:
        var["counters"] = {c: [int(v[fields + 1 + i]) for v in total]
                           for i, c in enumerate(self._counter_names[key])}
      out["variables"][self._names[key]] = var
    return out


def _fields(vectors, local: int) -> dict:
  """{field: [per replica]} plus density and local_density."""
  if vectors is None:
    vectors = np.zeros([local, len(FIELDS)])
  out = {}
  for i, f in enumerate(FIELDS):
    col = [float(v[i]) for v in vectors]
    out[f] = [int(c) for c in col] if f in ("nnz", "size", "sent") else col
  size = out["size"]
  out["density"] = [a / s if s else 0.0 for a, s in zip(out["nnz"], size)]
  out["local_density"] = [a / s if s else 0.0 for a, s in zip(out["sent"], size)]
  return out
