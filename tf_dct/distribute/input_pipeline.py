"""TF-Replicator's input_fn handling (paper §3.2): PER_WORKER and PER_REPLICA.

An `input_fn` returns a `tf.data.Dataset` or a callable returning a nested
structure of tensors.

* PER_WORKER: `input_fn(input_context)` is called once per worker with a
  `tf.distribute.InputContext`; each element is one worker batch, cut into one
  piece per local replica by `input_split_fn(element, num_local_replicas)`
  (default `split_batch`: the leading dimension, evenly).
* PER_REPLICA: `input_fn(replica_id)` is called once per local replica with its
  global replica id (an int); each replica reads its own pipeline.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import tensorflow as tf


class InputReplication(enum.Enum):
  PER_WORKER = "per_worker"
  PER_REPLICA = "per_replica"


PER_WORKER = InputReplication.PER_WORKER
PER_REPLICA = InputReplication.PER_REPLICA

# Where a Dataset's iterator, and so every element read from it, lives.
INPUT_DEVICE = "/cpu:0"


def split_batch(element, num_splits: int) -> list:
  """Splits every tensor of `element` evenly along its leading dimension."""
  flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(element)]
  checks = []
  for t in flat:
    if t.shape.rank == 0:
      raise ValueError("split_batch: cannot split a scalar input across "
                       f"{num_splits} replicas; give every input a batch "
                       "dimension or pass input_split_fn")
    size = t.shape[0]
    size_text = "" if size is None else f" {size}"
    message = (f"split_batch: the worker batch size{size_text} does not "
               f"divide by the {num_splits} local replicas; use a "
               f"batch size that is a multiple of {num_splits} "
               "(drop_remainder=True) or pass input_split_fn")
    if size is None:  # only known when the step runs
      checks.append(tf.debugging.assert_equal(
          tf.shape(t)[0] % num_splits, 0, message=message))
    elif size % num_splits:
      raise ValueError(message)
  with tf.control_dependencies(checks):
    pieces = [tf.split(tf.identity(t) if checks else t, num_splits, axis=0)
              for t in flat]
  return [tf.nest.pack_sequence_as(element, [p[i] for p in pieces])
          for i in range(num_splits)]


def _as_source(obj, what: str) -> Callable[[], Any]:
  """Turns what input_fn returned into a no-arg 'next element' callable."""
  if isinstance(obj, tf.data.Dataset):
    with tf.init_scope(), tf.device(INPUT_DEVICE):
      iterator = iter(obj)
    return lambda: next(iterator)
  if callable(obj):
    return obj
  raise TypeError(f"{what} must return a tf.data.Dataset or a callable "
                  f"returning tensors, got {type(obj).__name__}")


class ReplicatedInput:
  """The per-replica input of one `input_fn`, built once and reused."""

  def __init__(self, input_fn: Callable, replication: InputReplication,
               split_fn: Callable | None, *, num_local_replicas: int,
               first_replica_id: int, input_context: tf.distribute.InputContext):
    self._replication = replication
    self._split_fn = split_fn or split_batch
    self._num_local = num_local_replicas
    if replication is PER_WORKER:
      self._sources = [_as_source(input_fn(input_context), "input_fn")]
    else:
      self._sources = [
          _as_source(input_fn(first_replica_id + i), "input_fn")
          for i in range(num_local_replicas)]
    # Reading is a function call of its own, made before the step runs: an
    # error in the step (one replica's non-finite check, say) then cannot
    # cancel another replica's read half-way, which would leave that replica
    # an element behind, or end a prefetching iterator early.
    self.read = tf.function(self.next_pieces)

  @property
  def spec(self) -> list:
    """The type specs of `read()`'s output, e.g. a step's input_signature."""
    return tf.nest.map_structure(
        tf.type_spec_from_value,
        self.read.get_concrete_function().structured_outputs)

  def next_pieces(self) -> Sequence[Any]:
    """One nested element per local replica, for the next step."""
    if self._replication is PER_REPLICA:
      return [source() for source in self._sources]
    pieces = self._split_fn(self._sources[0](), self._num_local)
    if len(pieces) != self._num_local:
      raise ValueError(f"input_split_fn returned {len(pieces)} pieces, "
                       f"expected one per local replica ({self._num_local})")
    return pieces
