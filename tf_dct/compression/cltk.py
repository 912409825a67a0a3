"""Cyclic local top-k (CLT-k, Chen et al.; DEFT §1, §3.1, Table 1).

Per variable, one replica leads each step, in turn: at its step t the leader is
replica t mod n. The leader picks the top-k positions of its own g + E; those
positions go to every replica, each replica contributes its own g + E at them,
the values are summed, and every replica clears its residual there (DEFT
Algorithm 1 lines 5-12 with idx_t chosen by the leader alone). All replicas
share one support, so the aggregate holds exactly k entries: no build-up.

Conventions (tests/compression/reference_baselines.py follows them exactly):

* k = n - floor(n * (1 - density)) = ceil(n * density), as in TopK.
* The leader's selection is `tf.math.top_k` of the magnitudes: among equal
  magnitudes the lower position wins. It runs under `tf.cond` on the leader
  only; the other replicas contribute zeros.
* The positions, sorted ascending, are broadcast Elias-Fano coded
  (`sparse_wire`'s "ef" layout of (n, k), about log2(n / k) + 2 bits each)
  by an int32 SUM all-reduce of the words that only the leader fills
  (static shape; no collective inside `tf.cond`; the others' zeros leave
  the words bit for bit). Then one SUM all-reduce of every replica's k
  values.
* The step counter t is per variable and per replica (scalar `step`); all
  replicas advance it together, so they always agree on the leader.
* Dense variables (`min_size`), warmup, non-finite gradients and state as in
  TopK / DCTDP (see tf_dct/compression/error_feedback_compressor.py). State
  per compressed variable and replica: `residual`, and `scalars` packing
  `step`, `sent` (k, or n on a warmup step) and `overflow` (always 0).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import tensorflow as tf

from tf_dct.distribute import primitives
from tf_dct.compression import accounting
from tf_dct.compression import error_feedback_compressor
from tf_dct.compression import sparse_wire
from tf_dct.compression import topk


class CLTK(error_feedback_compressor.ErrorFeedbackCompressor):
  """Cyclic local top-k: the step's leader selects, everyone sends there.

  Args:
    density: fraction of each variable's entries selected, in (0, 1].
    min_size, warmup_steps, name, exclude, sparse_gradients,
      dense_gradients: as in
      `ErrorFeedbackCompressor`.
  """

  # The leader's positions and the values go through all-reduces instead.
  exchanges_sparse_wire = False

  def __init__(self, density: float = 0.01, min_size: int = 0,
               warmup_steps: int = 0, name: str | None = None,
               exclude: Sequence[str] = (), sparse_gradients: str = "auto",
               dense_gradients: str = "auto"):
    super().__init__(min_size=min_size, warmup_steps=warmup_steps, name=name,
                     exclude=exclude, sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients)
    self.density = float(self._check("density", density, numbers.Real, 0, True,
                                     1, False))

  def _encoding(self, n: int) -> sparse_wire.Encoding:
    """The "ef" layout of the k positions the leader broadcasts."""
    return sparse_wire.make_encoding("ef", n, topk.selected_count(n, self.density))

  def _exchange_bytes(self, n, dtype):
    enc = self._encoding(n)
    return 0, enc.index_bytes + enc.capacity * dtype.size  # all-reduced

  def _exchange(self, ctx, items):
    replicas = ctx.num_replicas_in_sync
    me = tf.cast(ctx.replica_id_in_sync_group, tf.int64)
    timing = self.timing_enabled
    proposals = []
    # One selection-time span for all variables (see `accounting`).
    start = accounting.start_timer([it.acc for it in items], timing)
    encs = [self._encoding(it.n) for it in items]
    for it, enc in zip(items, encs):
      is_leader = tf.equal(it.step % replicas, me)

      def lead(acc=it.acc, enc=enc):  # the leader's local top-k (DEFT §1)
        idx = tf.sort(tf.math.top_k(tf.abs(acc), k=enc.capacity,
                                    sorted=True).indices)
        return sparse_wire.encode_indices(idx, enc)

      with tf.control_dependencies([start] if timing else []):
        proposals.append(tf.cond(is_leader, lead,
                                 lambda enc=enc: tf.zeros([enc.words], tf.int32)))
    seconds = [accounting.stop_timer(start, proposals, timing)]
    seconds += [None] * (len(items) - 1)
    # Broadcast from the leader: the others contribute zeros. One int32
    # buffer for all variables (int32 tensors may sit in host memory, and a
    # batch must not mix host and device tensors).
    words = tf.split(primitives.all_sum(tf.concat(proposals, axis=0)),
                     [p.shape[0] for p in proposals])
    positions = [sparse_wire.decode_indices(w, enc)
                 for w, enc in zip(words, encs)]
    values = []
    for it, idx in zip(items, positions):
      val = tf.gather(it.acc, idx)                 # DEFT Algorithm 1 line 8
      if it.warm is not None:  # a warmup step goes dense instead
        val = tf.where(it.warm, tf.zeros_like(val), val)
      values.append(val)
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, values)  # line 9
    out = []
    for it, idx, val, secs, enc in zip(items, positions, summed, seconds, encs):
      k = idx.shape[0]
      hit = sparse_wire.scatter_sum(idx, tf.ones([k], tf.int32), it.n) > 0
      residual = tf.where(hit, tf.zeros_like(it.acc), it.acc)  # lines 11-12
      # Two all-reduces: the positions' "ef" words and the k values.
      report = dict(reduce_bytes=enc.index_bytes + k * it.acc.dtype.size,
                    selection_seconds=secs)
      out.append(error_feedback_compressor.Outcome(
          sparse_wire.scatter_sum(idx, val, it.n), residual,
          tf.constant(k, tf.int32), tf.constant(0, tf.int32), {}, report))
    return out
