"""DEFT: whole-model top-k split across replicas (DEFT Algorithms 1-5).

Every step, each replica adds its held-back error to its gradient. The flat
vector of all compressed variables is cut into partitions (whole variables,
or n pieces of a variable larger than n_g / n). Each partition gets a share
k_x of the budget k_total = n_g * density, in proportion to its norm
(`budget="norm"`, DEFT Algorithm 3) or to its size (`budget="size"`, the
default), and the partitions are packed onto replicas so that the selection
work is balanced.
Each replica runs top-k only on the partitions it owns, on its own
accumulator. The chosen positions do not overlap across replicas; their union
is shared, every replica contributes its accumulator there, the sum is the
update, and every replica clears its error at the union.

All-reduces carry the partition norms (under "norm" only), the union of
positions (Elias-Fano coded, `sparse_wire`'s "ef" layout, in position order)
and the values there. Every choice (partition, budget, packing, rotation,
ties) is a deterministic function of all-reduced numbers, so the replicas
agree without a leader. docs/sparsifiers.md fixes each convention; the numpy
reference tests/compression/reference_deft.py follows it exactly.
"""

from __future__ import annotations

import functools
import dataclasses
import numbers
from typing import Sequence

import tensorflow as tf

from tf_dct import _private
from tf_dct import validation
from tf_dct.compression import accounting
from tf_dct.compression import error_feedback
from tf_dct.compression import sparse_wire
from tf_dct.compression.base import WHOLE_BELOW, Compressor

_check = functools.partial(validation.check_number, "DEFT")

# How k_total is split over the partitions: "norm" (DEFT Algorithm 3) or
# "size" (the same density everywhere, `size_k`).
BUDGETS = ("norm", "size")

# Mitchell log2 in fixed point: float32 bits minus the exponent bias.
LOG2_ONE = 1 << 23
_FLOAT32_BIAS = 127 << 23


@dataclasses.dataclass(frozen=True)
class Partition:
  """A run of consecutive entries of one variable in the flat group vector."""
  variable: int  # index of the variable in the group
  start: int     # first flat position in the group vector
  size: int


def partition(sizes: Sequence[int], num_replicas: int) -> list[Partition]:
  """Two-stage partition of variables of `sizes` entries over n replicas."""
  total = sum(sizes)
  parts = []
  start = 0
  for v, size in enumerate(sizes):
    if size * num_replicas > total:  # DEFT Algorithm 2 line 6
      q, rem = divmod(size, num_replicas)  # DEFT Algorithm 2 lines 7-8
      # DEFT Algorithm 2 lines 9-13: the first `rem` pieces take one more.
      pieces = [q + (i < rem) for i in range(num_replicas)]
    else:
      pieces = [size]                            # DEFT Algorithm 2 lines 19-24
    for piece in pieces:
      if piece:  # a variable smaller than n leaves empty pieces: dropped
        parts.append(Partition(v, start, piece))  # DEFT Alg. 2 lines 14-18
      start += piece
  return parts


def total_k(num_entries: int, density: float) -> int:
  """k_total = max(1, floor(n_g * density)) on the decimal value of density."""
  return max(1, validation.floor_fraction(num_entries, density))


def union_capacity(num_entries: int, k_total: int, num_partitions: int,
                   min_count: int = 1, sizes: Sequence[int] = ()) -> int:
  """Slots of the union buffer: an upper bound of sum_x k_x.

  With a floor f_x = min(size_x, min_count) > 1 per partition (`local_k`),
  each partition can take at most f_x beyond its share of the budget, so
  sum_x k_x <= k_total + sum_x f_x; with f_x = 1 the first partition never
  exceeds its share, hence k_total + P - 1.
  """
  if min_count <= 1:
    return min(num_entries, k_total + num_partitions - 1)
  return min(num_entries, k_total + sum(min(s, min_count) for s in sizes))


def _descending_order(values: tf.Tensor, sentinel) -> tf.Tensor:
  """Positions of rank-1 `values` (all > sentinel) by decreasing value.

  Equal values keep increasing position. A scan of arg-max picks, so it does
  not depend on the stability of a sort kernel.
  """
  p = values.shape[0]
  positions = tf.range(p)

  def pick(carry, _):
    taken, _ = carry
    masked = tf.where(taken, tf.cast(sentinel, values.dtype), values)
    best = tf.reduce_max(masked)
    hit = tf.logical_and(tf.equal(masked, best), tf.logical_not(taken))
    index = tf.reduce_min(tf.where(hit, positions, p))
    return tf.logical_or(taken, tf.equal(positions, index)), index

  _, order = tf.scan(pick, positions,
                     initializer=(tf.zeros([p], tf.bool), tf.constant(0)))
  return order


def local_k(norms: tf.Tensor, sizes: Sequence[int], k_total: int,
            min_count: int = 1) -> tf.Tensor:
  """k_x per partition from float32 `norms` (DEFT Algorithm 3), int32[P].

  Each partition takes at least min(size, max(1, min_count)) (the paper: 1).
  """
  floor = max(1, min_count)
  p = len(sizes)
  order = _descending_order(norms, -1.0)                 # highest norm first
  s_norm = tf.gather(norms, order)
  s_size = tf.gather(tf.constant(sizes, tf.int32), order)
  # norm_remain per visit: sum of the norms not visited yet (lines 2-4, 15).
  rest = tf.scan(lambda a, x: a + x, s_norm,
                 initializer=tf.zeros([], tf.float32), reverse=True)

  def assign(carry, elems):
    k_remain, _ = carry
    norm, remain, size = elems
    ratio = tf.math.divide_no_nan(norm, remain)  # DEFT Algorithm 3 lines 6-9
    k_temp = tf.cast(k_remain, tf.float32) * ratio  # DEFT Algorithm 3 line 7
    # DEFT Algorithm 3 lines 10-13: min(size, max(1, floor(k_temp))), with
    # the floor raised to `min_count`.
    k = tf.minimum(size, tf.maximum(floor, tf.cast(tf.floor(k_temp), tf.int32)))
    return k_remain - k, k  # DEFT Algorithm 3 line 14

  _, s_k = tf.scan(assign, (s_norm, rest, s_size),
                   initializer=(tf.constant(k_total, tf.int32), tf.constant(0)))
  return tf.scatter_nd(order[:, None], s_k, [p])


def size_k(sizes: Sequence[int], k_total: int, min_count: int = 1) -> list[int]:
  """k_x per partition in proportion to its size (beyond the paper).

  k_x = min(size_x, max(1, min_count, floor(k_total * size_x / n_g))): every
  partition at the budget's density, whatever its norm. Static, so no norm
  is exchanged. Fits `union_capacity` as `local_k` does.
  """
  n_g = sum(sizes)
  floor = max(1, min_count)
  return [min(size, max(floor, k_total * size // n_g)) for size in sizes]


def selection_cost(k: tf.Tensor, sizes: Sequence[int]) -> tf.Tensor:
  """int64 cost size_x * max(1, log2 k_x), log2 in Mitchell fixed point."""
  log2 = tf.bitcast(tf.cast(k, tf.float32), tf.int32) - _FLOAT32_BIAS
  log2 = tf.maximum(log2, LOG2_ONE)
  return tf.constant(sizes, tf.int64) * tf.cast(log2, tf.int64)


def pack(k: tf.Tensor, sizes: Sequence[int], num_replicas: int) -> tf.Tensor:
  """Bin of every partition, greedy by cost (DEFT Algorithm 4), int32[P]."""
  p = len(sizes)
  cost = selection_cost(k, sizes)  # DEFT Algorithm 4 lines 6-8
  order = _descending_order(cost, -1)        # DEFT Algorithm 4 lines 10-11, 15
  bins = tf.range(num_replicas)

  def place(carry, x):
    loads, _ = carry
    least = tf.reduce_min(loads)
    # DEFT Algorithm 4 line 12: the least loaded bin, lowest index on ties.
    b = tf.reduce_min(tf.where(tf.equal(loads, least), bins, num_replicas))
    loads = loads + tf.where(tf.equal(bins, b), cost[x],
                             tf.zeros([], tf.int64))  # DEFT Alg. 4 lines 13-14
    return loads, b

  _, placed = tf.scan(place, order, initializer=(
      tf.zeros([num_replicas], tf.int64), tf.constant(0)))
  return tf.scatter_nd(order[:, None], placed, [p])


def top_k_sizes(bound: int, smallest: int = 64) -> list[int]:
  """Static top-k sizes for a partition: 64, 128, ... below `bound`, then it."""
  sizes, size = [], smallest
  while size < bound:
    sizes.append(size)
    size *= 2
  return sizes + [bound]


def owned_top_k(magnitude: tf.Tensor, k: tf.Tensor, bound: int,
                owned: tf.Tensor) -> tf.Tensor:
  """Positions of the `k` largest of rank-1 `magnitude`, int32[bound].

  The first `k` entries are the positions by decreasing magnitude (lower
  position first on ties), exactly those of `top_k(magnitude, bound)`; the
  rest are unspecified. Nothing runs when not `owned` (zeros). Needs
  1 <= k <= bound. Outside XLA the top-k size is `k` itself (TensorFlow's
  kernels take it at run time); under XLA, which needs static sizes,
  `ladder_top_k`.
  """
  if _private.in_xla_context():
    return ladder_top_k(magnitude, k, bound, owned)

  def exact():
    top = tf.math.top_k(magnitude, k, sorted=True).indices
    return tf.ensure_shape(tf.pad(top, [[0, bound - k]]), [bound])
  return tf.cond(owned, exact, lambda: tf.zeros([bound], tf.int32))


def ladder_top_k(magnitude: tf.Tensor, k: tf.Tensor, bound: int,
                 owned: tf.Tensor) -> tf.Tensor:
  """`owned_top_k` with static shapes only (for XLA).

  Runs a top-k of the smallest ladder size >= k (`top_k_sizes`), picked by a
  `tf.switch_case`, or nothing when not `owned` (zeros).
  """
  sizes = top_k_sizes(bound)

  def top(size):
    def branch():
      positions = tf.math.top_k(magnitude, size, sorted=True).indices
      return tf.pad(positions, [[0, bound - size]])
    return branch

  rung = tf.reduce_sum(tf.cast(k > tf.constant(sizes[:-1], k.dtype), tf.int32))
  branch_index = tf.where(owned, rung + 1, 0)
  return tf.switch_case(branch_index, [lambda: tf.zeros([bound], tf.int32)] +
                        [top(size) for size in sizes])


def owners(bins: tf.Tensor, step: tf.Tensor, num_replicas: int) -> tf.Tensor:
  """Replica owning each partition: replica r takes bin (step % n + r) % n."""
  cycle = tf.cast(step % num_replicas, tf.int32)  # DEFT Algorithm 4 line 1
  return tf.math.floormod(bins - cycle, num_replicas)  # DEFT Alg. 4 lines 2, 17


class DEFT(Compressor):
  """DEFT gradient compressor: partitioned whole-model top-k, error feedback.

  Args:
    density: fraction of the compressed entries selected per step, in (0, 1].
    min_size: variables with fewer entries are always all-reduced densely and
      keep no state, an int >= 0.
    warmup_steps: steps during which every variable goes dense, an int >= 0.
    name: module name.
    exclude: regular expressions searched in variable names; matching
      variables are all-reduced as they are and keep no state (see
      `Compressor.reduce_as_is`).
    min_count: every partition takes at least min(size, min_count) of the
      budget, an int >= 0 (the paper: 1; values below 1 mean 1).
    budget: how the budget k_total is split over the partitions: "size"
      (default; in proportion to their sizes, so every partition is sent at
      `density` and no norms are exchanged) or "norm" (DEFT Algorithm 3: in
      proportion to their norms summed over replicas). Under momentum and
      Adam the norm split starved layers whose gradients are small and
      trained further behind dense (docs/quality.md).
    sparse_gradients: "stock" (default), "auto" or "compress": how
      `tf.IndexedSlices` gradients (embedding rows) are sent (`Compressor`).
      "stock" sends the touched rows as TF does: a table partition is
      selected from its owner's accumulator, which holds only the rows its
      own batches looked up, so compressed tables trained behind dense
      (docs/quality.md).
    dense_gradients: "auto" (default) or "compress": "auto" sends a
      variable with a dense gradient whole (one all-reduce of its
      accumulator, keeping momentum or Adam correction) where that moves no
      more bytes than compressing it, and every variable with fewer than
      `whole_below` entries (`Compressor`).
    whole_below: an int >= 0 (default `base.WHOLE_BELOW`; 0: by bytes
      alone).
      DEFT's union gives a small variable its floor of `min_count` entries
      a step in all, where TopK's gives it up to n * min_count: a bias then
      trails far behind, most under Adam (docs/quality.md).
    momentum, momentum_masking: momentum correction, as in `DCTDP`. Every
      replica sends at the union, so masking zeroes the same entries of
      every replica's velocity; it helps DEFT on some models and hurts it
      on others (docs/quality.md), so it is off by default.
    adam, adam_second_moment, adam_select, adam_first_moment: Adam
      correction, as in `DCTDP` (None, the default: on with an Adam or AdamW
      optimizer without amsgrad; False: off). Its side channel costs bytes
      (docs/quality.md).
    adagrad, adagrad_accumulator: Adagrad correction, as in `DCTDP`.
    residual_decay: the factor residuals are multiplied by after a step, in
      (0, 1], as in `DCTDP` (default 1: Algorithm 1's error feedback).

  See the module docstring for the exact conventions.
  """

  def __init__(self, density: float = 0.01, min_size: int = 0,
               warmup_steps: int = 0, name: str | None = None,
               exclude: Sequence[str] = (), min_count: int = 8,
               momentum: float | None = None, momentum_masking: bool = False,
               adam: bool | None = None, adam_second_moment: str = "factored",
               adam_select: str = "normalized",
               adam_first_moment: str = "replica",
               adagrad: bool | None = False,
               adagrad_accumulator: str = "factored",
               sparse_gradients: str = "stock",
               dense_gradients: str = "auto", budget: str = "size",
               whole_below: int = WHOLE_BELOW, residual_decay: float = 1.0):
    super().__init__(name=name, exclude=exclude,
                     sparse_gradients=sparse_gradients,
                     dense_gradients=dense_gradients)
    self._init_whole_below(whole_below)
    self.min_count = int(_check("min_count", min_count, numbers.Integral, 0,
                                False))
    if budget not in BUDGETS:
      raise ValueError(f"DEFT: budget must be one of {BUDGETS}, got {budget!r}")
    self.budget = budget
    self._init_momentum(momentum, momentum_masking)
    self._init_adam(adam, adam_second_moment, adam_select,
                    adam_first_moment)
    self._init_adagrad(adagrad, adagrad_accumulator)
    self._init_residual_decay(residual_decay)
    self.density = float(_check("density", density, numbers.Real, 0, True, 1))
    self.min_size = int(_check("min_size", min_size, numbers.Integral, 0, False))
    self.warmup_steps = int(_check("warmup_steps", warmup_steps,
                                   numbers.Integral, 0, False))

  def compressed_bytes(self, variable):
    """DEFT's budget is shared by the whole model, so a variable's share of
    the union slots is known only in the step; its own budget k_total at
    `density` (positions and values all-reduced) stands for it."""
    variable = self._tf_variable(variable)
    n = variable.shape.num_elements()
    if self._is_dense(variable):
      return 0, n * variable.dtype.size
    k = total_k(n, self.density)
    return 0, (sparse_wire.make_encoding("ef", n, k).index_bytes
               + k * variable.dtype.size)

  def _is_dense(self, variable) -> bool:
    """Always all-reduced densely, with no state: empty or below `min_size`."""
    n = variable.shape.num_elements()
    return n == 0 or n < self.min_size

  def create_state(self, variable):
    self.check_variable(variable)
    if self._is_dense(variable):
      return {}
    return self.residual_state(variable, "deft")

  def scalar_dtypes(self, variable):
    return {"step": tf.int64, "sent": tf.int32, "selected": tf.int32}

  def reduce(self, ctx, grads, variables, states):
    grads = error_feedback.densify_unless(grads, [bool(st) for st in states])
    # No state is read before every gradient of this replica passed the check
    # (see `error_feedback.checked_reads`); variables without state (below
    # min_size, or empty) go to a plain dense SUM.
    checked, values, dense_items = error_feedback.checked_reads(
        "DEFT", grads, variables, states, ("residual", "scalars"))
    for i, _ in dense_items:  # all-reduced as they are: N entries each
      self.record_dense(variables[i])
    results = [None] * len(grads)
    groups = {}       # dtype -> positions of its compressed variables
    writes = []
    for i, (g, st) in enumerate(zip(checked, states)):
      if st:
        groups.setdefault(g.dtype, []).append(i)
    for members in groups.values():
      sparse, dense, write = self._group(
          ctx, [checked[i] for i in members], [variables[i] for i in members],
          [states[i] for i in members], [values[i] for i in members])
      writes.append(write)
      for i, s in zip(members, sparse):
        results[i] = s
      if dense is not None:
        dense_items.extend(zip(members, dense))
    self.add_dense_sums(ctx, dense_items, results)
    # The collectives depend on every replica's checks: if one replica meets a
    # non-finite gradient, they never complete and no replica writes state.
    with tf.control_dependencies(error_feedback.gate(results)):
      for write in writes:
        write()
    return results

  def _record_group(self, variables, parts, cap, dtype, sparse, selected,
                    seconds):
    """Reports one group's collectives to the accounting, per variable.

    The group all-reduces P float32 norms (budget "norm"), the "ef" words
    of the U union positions and U values (plus every entry densely while
    warmup is configured). Norms are charged to the variable owning the
    partition; the union's words and values are split in proportion to
    variable size (remainder to the last variable), so the per-variable
    bytes add up to exactly what was all-reduced.
    """
    sizes = [v.shape.num_elements() for v in variables]
    n_g = sum(sizes)
    union_bytes = (sparse_wire.make_encoding("ef", n_g, cap).index_bytes
                   + cap * dtype.size)
    shares = [union_bytes * size // n_g for size in sizes]
    shares[-1] += union_bytes - sum(shares)
    for i, var in enumerate(variables):
      norms = (4 * sum(1 for p in parts if p.variable == i)
               if self.budget == "norm" else 0)
      union = shares[i]
      warm = sizes[i] * dtype.size if self.in_graph_warmup else 0
      self.record(var, reduce_bytes=norms + union + warm,
                  nnz=tf.math.count_nonzero(sparse[i], dtype=tf.int32),
                  sent=selected[i],
                  selection_seconds=seconds if i == 0 else None)

  def _group(self, ctx, grads, variables, states, values):
    """DEFT Algorithms 1-5 for one group on this replica.

    `values` holds each state's residual and step as read after the checks.

    Returns the per-variable sparse sums, the per-variable dense parts (warmup
    only, else None) and a closure writing the new state.
    """
    n = ctx.num_replicas_in_sync
    sizes = [v.shape.num_elements() for v in variables]
    n_g = sum(sizes)
    if n_g >= sparse_wire.MAX_SIZE:
      raise ValueError(f"DEFT: {n_g} compressed entries of one dtype; int32 "
                       f"positions allow at most {sparse_wire.MAX_SIZE - 1}")
    parts = partition(sizes, n)
    p_sizes = [p.size for p in parts]
    k_total = total_k(n_g, self.density)
    cap = union_capacity(n_g, k_total, len(parts), self.min_count, p_sizes)
    residuals = [st["residual"].local() for st in states]
    steps = [self.unpack_scalars(v, value["scalars"])["step"]
             for v, value in zip(variables, values)]
    step = steps[0]

    # DEFT Algorithm 1 line 5: acc = g + E, all variables in one flat vector.
    acc = tf.concat([error_feedback.accumulate(g, value["residual"], v)
                     for g, value, v in zip(grads, values, variables)], axis=0)
    pieces = [acc[p.start:p.start + p.size] for p in parts]
    if self.budget == "norm":
      norms = tf.stack([
          tf.sqrt(tf.reduce_sum(tf.square(tf.cast(x, tf.float32))))
          for x in pieces])
      # Beyond the paper: every replica gets the same norms, hence the same
      # plan.
      norms = ctx.all_reduce(tf.distribute.ReduceOp.SUM, norms)
      k = local_k(norms, p_sizes, k_total, self.min_count)  # DEFT Algorithm 3
    else:
      k = tf.constant(size_k(p_sizes, k_total, self.min_count), tf.int32)
    owner = owners(pack(k, p_sizes, n), step, n)         # DEFT Algorithm 4
    owned = tf.equal(owner, tf.cast(ctx.replica_id_in_sync_group, tf.int32))
    warm = None
    if self.in_graph_warmup:
      warm = step < self.warmup_steps
      owned = tf.logical_and(owned, tf.logical_not(warm))

    offsets = tf.cumsum(k, exclusive=True)
    timing = self.timing_enabled
    start = accounting.start_timer(acc, timing)
    slots, positions = [], []
    # DEFT Algorithm 5 line 3 (loop over the owned partitions; static here).
    for x, (part, piece) in enumerate(zip(parts, pieces)):
      bound = min(part.size, max(k_total, self.min_count))
      # The selection starts after the start stamp, so the span contains it.
      with tf.control_dependencies([start] if timing else []):
        top = owned_top_k(tf.abs(piece), k[x], bound, owned[x])  # Alg. 5 l. 4
      rank = tf.range(bound)
      keep = tf.logical_and(owned[x], rank < k[x])
      # In position order: the partitions follow each other, so the union's
      # slots hold increasing positions, as the "ef" layout needs.
      top = tf.sort(tf.where(rank < k[x], top, part.size))
      slots.append(tf.where(keep, offsets[x] + rank, cap))
      positions.append(top + part.start)  # DEFT Algorithm 5 line 5
    # This replica's positions in its slots, the padding n_g elsewhere.
    mine = tf.math.unsorted_segment_sum(
        tf.concat(positions, 0) - n_g, tf.concat(slots, 0), cap + 1)[:cap] + n_g
    # DEFT Algorithm 1 line 7: the union of every replica's positions, "ef"
    # coded. Each slot's low bits and bitmap bit come from its one owner, so
    # the replicas' words share no set bit and their int32 sum is the
    # union's words.
    enc = sparse_wire.make_encoding("ef", n_g, cap)
    union = sparse_wire.decode_indices(ctx.all_reduce(
        tf.distribute.ReduceOp.SUM, sparse_wire.encode_indices(mine, enc)), enc)
    padded = tf.concat([acc, tf.zeros([1], acc.dtype)], 0)  # padding reads 0
    values = tf.gather(padded, union)  # DEFT Algorithm 1 line 8
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, values)  # Alg. 1 line 9
    update = sparse_wire.scatter_sum(union, summed, n_g)
    in_union = sparse_wire.scatter_sum(union, tf.ones_like(union), n_g) > 0
    # DEFT Algorithm 1 lines 11-12: every replica clears E at the union.
    new_residual = tf.where(in_union, tf.zeros_like(acc), acc)

    var_of = tf.constant([p.variable for p in parts], tf.int32)
    sent = tf.math.unsorted_segment_sum(k, var_of, len(sizes))
    selected = tf.math.unsorted_segment_sum(
        tf.where(owned, k, 0), var_of, len(sizes))
    dense = None
    if warm is not None:
      dense = [tf.reshape(tf.where(warm, a, tf.zeros_like(a)), v.shape)
               for a, v in zip(tf.split(acc, sizes), variables)]
      new_residual = tf.where(warm, tf.zeros_like(acc), new_residual)
      sent = tf.where(warm, tf.constant(sizes, tf.int32), sent)
    sparse = [tf.reshape(u, v.shape)
              for u, v in zip(tf.split(update, sizes), variables)]
    kept = tf.split(new_residual, sizes)
    seconds = accounting.stop_timer(start, positions, timing)
    self._record_group(variables, parts, cap, acc.dtype, sparse, selected,
                       seconds)

    def write():
      for i, (r, st) in enumerate(zip(residuals, states)):
        r.assign(self.decay(tf.reshape(kept[i], variables[i].shape)))
        st["scalars"].local().assign(self.pack_scalars(variables[i], {
            "step": steps[i] + 1, "sent": sent[i], "selected": selected[i]}))

    return sparse, dense, write
