"""Communication accounting: bytes moved, density, thresholds, selection time.

Byte model (ring collectives, what each replica moves per step):

* all-gather of P bytes per replica over n replicas: every replica sends and
  receives (n - 1) * P bytes.
* all-reduce of M bytes: every replica sends and receives 2 (n - 1) / n * M
  bytes (reduce-scatter then all-gather).
* dense baseline: the ring all-reduce of the gradient as it is (4 bytes per
  entry for float32), 2 (n - 1) / n * 4N each way.

P counts everything a replica puts into the gather: index words (positions, or
per-chunk counts and offsets), values, and the padding of unused slots. A
compressor declares, per variable and step, the bytes it gathers (P) and
all-reduces (M); the sent / received bytes follow from the model above. With
one replica nothing moves (0 bytes each way).

Payload bytes are P + M: what this replica contributes, as a worker would
upload it to a parameter server (DCT's production setting); the dense payload
is the gradient itself (4N for float32). Both ratios, ring and payload, can be
read from the statistics.

Density of a variable is nnz(aggregated update) / N, where nnz counts the
non-zero entries of the cross-replica sum (N for dense steps by definition);
the global density is sum nnz / sum N over the variables of the step. The
local density is the entries this replica sent / N.

Selection time is measured with `tf.timestamp()` around a compressor's
selection ops: one span per replica and step around the selection of all its
variables, recorded with the step's first compressed variable (read it from
the totals, not per variable). Inside a `tf.function` TensorFlow runs
stateful ops without resource inputs, such as `Timestamp`, in program order.
Per-variable timers made each variable's selection wait for the previous
one's (measured on bench/compression.py's model: 2.97x Dense step time with
per-variable timers, 2.41x without timers). Across replicas, which share one
graph under MirroredStrategy, one replica's span started only after the
previous replica's had ended, so the replicas' selections ran one after
another. The timestamps are therefore taken outside that order
(`_private.run_independently`): each waits only for the tensors it times.
DCT-DP's native kernel times itself, and a step whose selection is all
native has no timestamps. `tf.timestamp` has no XLA kernel, so when the
replicator compiles steps with XLA (`jit_compile=True`) the time is recorded
as 0 and no summaries are written (the summary ops have no XLA kernels
either). The detection only sees the replicator's own flag: set
`compressor.time_selection = False` when calling it from a function of your
own compiled with `jit_compile=True`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
import tensorflow as tf

from tf_dct import _private

# Additive per-step fields, in the order of the stored vectors.
FIELDS = ("payload_bytes", "bytes_sent", "bytes_received", "dense_bytes",
          "dense_payload_bytes", "nnz", "size", "sent", "selection_seconds")
_SCALARS = ("bytes_sent", "bytes_received", "payload_bytes", "dense_bytes",
            "dense_payload_bytes", "selection_seconds")


def all_gather_bytes(payload: float, n: int) -> float:
  """Bytes one replica sends (= receives) in a ring all-gather of `payload`."""
  return (n - 1) * payload


def all_reduce_bytes(size: float, n: int) -> float:
  """Bytes one replica sends (= receives) in a ring all-reduce of `size`."""
  return 2 * (n - 1) / n * size


@dataclasses.dataclass
class Record:
  """What one replica did for one variable in one step.

  Attributes:
    size: N, entries of the variable.
    dtype: the gradient's dtype (its size prices the dense baseline).
    gather_bytes: P, bytes this replica put into all-gathers (static int).
    reduce_bytes: M, bytes this replica all-reduced (static int).
    nnz: non-zero entries of the aggregated update (int or tensor).
    sent: entries this replica sent (int or tensor).
    threshold: the threshold used, or None.
    selection_seconds: selection time of this replica, or None.
    counters: name -> per-step amount (int or tensor), accumulated over steps,
      e.g. {"early_refreshes": 1}.
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

  def static_vector(self, num_replicas: int) -> np.ndarray:
    """float64[len(FIELDS)] of the static fields under the byte model.

    The fields that may be tensors (nnz, sent, selection_seconds) are 0 here;
    `dynamic_fields` names them.
    """
    n = num_replicas
    moved = (all_gather_bytes(self.gather_bytes, n)
             + all_reduce_bytes(self.reduce_bytes, n))
    dense = self.size * tf.as_dtype(self.dtype).size
    return np.asarray([self.gather_bytes + self.reduce_bytes, moved, moved,
                       all_reduce_bytes(dense, n), dense, 0, self.size, 0, 0],
                      np.float64)

  def dynamic_fields(self) -> dict:
    """{field: value} of the fields that may be tensors (None counts as 0)."""
    seconds = 0.0 if self.selection_seconds is None else self.selection_seconds
    return {"nnz": self.nnz, "sent": self.sent, "selection_seconds": seconds}


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
  """A TensorBoard scalar under exactly `tag` (no name-scope prefix)."""
  tf.summary.write(tag, tf.cast(value, tf.float32), step=step,
                   metadata=_scalar_metadata())


class Accounting(tf.Module):
  """Per-replica statistics of one compressor, kept in `PerReplicaState`.

  Per variable: `last` (FIELDS + threshold, float64), `total` (FIELDS summed
  over steps, plus the number of steps) and, if the compressor reports any,
  `counters` (cumulative). For the compressor as a whole: `last` and `total`
  (FIELDS), and `steps` (aggregation steps seen). Everything is created the
  first time a compressor reports, so compressors that never report add
  nothing to checkpoints.
  """

  def __init__(self, name: str = "accounting"):
    super().__init__(name=name)
    self.per_variable = {}   # state key -> dict of PerReplicaState
    self.overall = {}     # "last", "total", "steps"
    self._names = {}      # state key -> display name
    self._counter_names = {}

  def ensure(self, compressor, key: str, name: str, counters) -> dict:
    """Creates the state of one variable (and the overall state) if missing."""
    if not self.overall:
      zeros = tf.zeros([len(FIELDS)], tf.float64)
      # Filled in place: re-assigning a tracked attribute skips the deferred
      # restore of a checkpoint read before this state existed.
      self.overall.update({
          "last": compressor.per_replica_state(zeros, name="tf_dct_stats/last"),
          "total": compressor.per_replica_state(zeros, name="tf_dct_stats/total"),
          "steps": compressor.per_replica_state(tf.zeros([], tf.int64),
                                                name="tf_dct_stats/steps")})
    if key not in self.per_variable:
      taken = set(self._names.values())
      self._names[key] = name if name not in taken else key
      self._counter_names[key] = tuple(sorted(counters))
      base = f"tf_dct_stats/{key}"
      st = {"last": compressor.per_replica_state(
                tf.zeros([len(FIELDS) + 1], tf.float64), name=f"{base}/last"),
            "total": compressor.per_replica_state(
                tf.zeros([len(FIELDS) + 1], tf.float64), name=f"{base}/total")}
      if counters:
        st["counters"] = compressor.per_replica_state(
            tf.zeros([len(counters)], tf.float64), name=f"{base}/counters")
      self.per_variable[key] = st
    elif not set(counters) <= set(self._counter_names[key]):
      raise ValueError(f"variable {self._names[key]!r} reported counters "
                       f"{sorted(counters)}; declared: "
                       f"{list(self._counter_names[key])}")
    return self.per_variable[key]

  def update(self, records: Mapping[str, Record], num_replicas: int,
             summaries: bool) -> None:
    """Writes this step's records of the calling replica (in replica context).

    All records go into one [V, len(FIELDS) + 1] matrix (fields, then tau)
    built with a few ops whatever V is; each variable then takes its row.
    """
    keys = list(records)
    recs = [records[k] for k in keys]
    static = np.stack([r.static_vector(num_replicas) for r in recs])
    columns = [tf.constant(static[:, i]) for i in range(len(FIELDS))]
    dynamic = [r.dynamic_fields() for r in recs]
    for name in dynamic[0]:
      columns[FIELDS.index(name)] = _as_float64_vector([d[name] for d in dynamic])
    columns.append(_as_float64_vector(
        [0.0 if r.threshold is None else r.threshold for r in recs]))
    last = tf.stack(columns, axis=1)
    # total: the fields and a step count of 1 where `last` holds tau.
    total = tf.concat([last[:, :len(FIELDS)], tf.ones([len(recs), 1], tf.float64)],
                      axis=1)
    counted = [k for k in keys if "counters" in self.per_variable[k]]
    if counted:
      amounts = _as_float64_vector([records[k].counters.get(c, 0) for k in counted
                                    for c in self._counter_names[k]])
      amounts = tf.split(amounts, [len(self._counter_names[k]) for k in counted])
      for key, amount in zip(counted, amounts):
        self.per_variable[key]["counters"].local().assign_add(amount)
    for key, row, add in zip(keys, tf.unstack(last), tf.unstack(total)):
      self.per_variable[key]["last"].local().assign(row)
      self.per_variable[key]["total"].local().assign_add(add)
    step_vec = tf.reduce_sum(last[:, :len(FIELDS)], axis=0)
    self.overall["last"].local().assign(step_vec)
    self.overall["total"].local().assign_add(step_vec)
    steps = self.overall["steps"].local().assign_add(1)
    if summaries:
      vectors = dict(zip(keys, tf.unstack(last[:, :len(FIELDS)])))
      self._summarize(records, vectors, step_vec, steps)

  def _summarize(self, records, vectors, step_vec, steps) -> None:
    step = tf.summary.experimental.get_step()
    if step is None:
      step = steps
    field = {f: i for i, f in enumerate(FIELDS)}
    for name in _SCALARS:
      write_scalar(f"tf_dct/{name}", step_vec[field[name]], step)
    write_scalar("tf_dct/density",
                 step_vec[field["nnz"]] / step_vec[field["size"]], step)
    for key, rec in records.items():
      name, vec = self._names[key], vectors[key]
      write_scalar(f"tf_dct/density/{name}",
                   vec[field["nnz"]] / vec[field["size"]], step)
      if rec.threshold is not None:
        write_scalar(f"tf_dct/threshold/{name}", rec.threshold, step)
      if "counters" in self.per_variable[key]:
        counts = self.per_variable[key]["counters"].local()
        for i, c in enumerate(self._counter_names[key]):
          write_scalar(f"tf_dct/{c}/{name}", counts[i], step)

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
    out["steps"] = [int(s) for s in self.overall["steps"].numpy()]
    out["last"] = _fields(self.overall["last"].numpy(), local)
    out["total"] = _fields(self.overall["total"].numpy(), local)
    for key, st in self.per_variable.items():
      last, total = st["last"].numpy(), st["total"].numpy()
      var = {"size": int(last[0][FIELDS.index("size")]) if total[0][-1] else None,
             "steps": [int(t[-1]) for t in total],
             "last": _fields(last, local), "total": _fields(total, local)}
      var["last"]["threshold"] = [float(v[len(FIELDS)]) for v in last]
      if "counters" in st:
        counts = st["counters"].numpy()
        var["counters"] = {c: [int(v[i]) for v in counts]
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
