"""Fixed-size sparse wire format shared by the sparsifying compressors.

A replica that keeps only some entries of a flat vector of length `n` packs
them into two buffers of a static length `capacity`:

* `idx` (int32[capacity]): the flat positions of the packed entries, in
  increasing order; unused slots hold `n`, one past the last valid position.
* `val` (float[capacity]): their values; unused slots hold 0.

plus an int32 `count` of the used slots. Every shape is known when the graph is
built, so the same code runs under XLA (`jit_compile=True`, TPU): no
single-argument `tf.where`, no `tf.boolean_mask`, no sort.

Packing is a prefix sum over the mask (O(n)): a selected entry goes to slot
"number of selected entries before it". Selected entries whose slot would be
`>= capacity` do not fit; `compact` reports which entries fitted so the caller
can keep the rest (e.g. in an error-feedback residual) instead of losing them.

Exchange all-gathers every replica's buffers and scatter-adds them into a dense
vector of length `n + 1`; slot `n` collects the padding and is cut off, so
padding never contributes, and positions chosen by several replicas are summed.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

# Positions travel as int32, so a vector must have fewer entries than this.
MAX_SIZE = 2**31 - 1


def compact(acc_flat: tf.Tensor, mask: tf.Tensor, capacity: int):
  """Packs the entries of `acc_flat` selected by `mask` into fixed buffers.

  Args:
    acc_flat: rank-1 tensor of static length n.
    mask: bool tensor of the same shape; True marks entries to send.
    capacity: Python int >= 1, the buffer length.

  Returns:
    `(idx, val, count, fitted)`: int32[capacity] positions (padding = n),
    values[capacity] (padding = 0), the int32 number of used slots
    (min(selected, capacity)), and a bool[n] mask of the entries that were
    packed: the first `capacity` selected entries in position order. Selected
    entries outside `fitted` were not packed.
  """
  n = acc_flat.shape[0]
  if n is None or acc_flat.shape.rank != 1:
    raise ValueError(f"acc_flat must be rank 1 with a static length, got shape "
                     f"{acc_flat.shape}")
  if not 0 < n < MAX_SIZE:
    raise ValueError(f"acc_flat must have between 1 and {MAX_SIZE - 1} entries, "
                     f"got {n}")
  if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"capacity must be a Python int >= 1, got {capacity!r}")
  selected = tf.cast(mask, tf.int32)
  slot = tf.cumsum(selected, exclusive=True)  # selected entries before each one
  fitted = tf.logical_and(mask, slot < capacity)
  # Entries that are not packed go to a dump segment `capacity`, cut off below.
  segment = tf.where(fitted, slot, capacity)
  # Each used slot receives exactly one entry; unused slots sum nothing, so
  # shifting positions by -n and back leaves `n` in them.
  positions = tf.range(n, dtype=tf.int32) - n
  idx = tf.math.unsorted_segment_sum(positions, segment, capacity + 1)[:capacity] + n
  val = tf.math.unsorted_segment_sum(acc_flat, segment, capacity + 1)[:capacity]
  count = tf.minimum(tf.reduce_sum(selected), capacity)
  return idx, val, count, fitted


def scatter_sum(idx: tf.Tensor, val: tf.Tensor, n: int) -> tf.Tensor:
  """Dense vector of length n: sum of `val` at `idx`; index n is dropped."""
  return tf.math.unsorted_segment_sum(val, idx, n + 1)[:n]


def exchange_many(ctx: tf.distribute.ReplicaContext,
                  buffers: Sequence[tuple[tf.Tensor, tf.Tensor, int]]) -> list:
  """`exchange` for several vectors with one batched all-gather.

  Args:
    ctx: the replica context of the calling replica.
    buffers: `(idx, val, n)` per vector, as produced by `compact`.

  Returns:
    Per vector, the dense length-n sum over replicas (same on every replica).
  """
  buffers = list(buffers)
  if not buffers:
    return []
  gathered = ctx.all_gather([[idx, val] for idx, val, _ in buffers], axis=0)
  return [scatter_sum(idx, val, n)
          for (idx, val), (_, _, n) in zip(gathered, buffers)]


def exchange(ctx: tf.distribute.ReplicaContext, idx: tf.Tensor, val: tf.Tensor,
             n: int) -> tf.Tensor:
  """Sums every replica's packed entries into a dense vector of length n.

  Every replica calls it with its own buffers; all replicas get the same
  result. Positions sent by several replicas are added up; padding slots
  (index n) contribute nothing.
  """
  return exchange_many(ctx, [(idx, val, n)])[0]
