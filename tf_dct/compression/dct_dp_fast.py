"""Fast paths of DCT-DP's selection, bit-identical to `dct_dp.select`.

`dct_dp.select` runs Algorithm 1 lines 3-11 for one variable with about a
dozen stock ops per variable and a `tf.cond` for the schedule. Models with many
small variables (biases, small kernels) pay that per variable on every step and
in the trace. Two paths do the same work for several variables at once and give
the same bits (tested against `select` and the numpy reference):

* `select_fused`, stock ops: variables of at most `FUSE_SIZE` entries and one
  dtype are laid end to end and share one mask, one prefix count and one
  compaction, each with its own threshold, schedule, capacity and residual.
* `select_native`: on CPU outside XLA, all of a replica's variables of one
  dtype go through lines 2-11 in one C++ op (`tf_dct.compression.native.select`),
  which also checks the gradients and adds the residual.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

# dct_dp imports this module too; only its attributes at call time are used.
from tf_dct.compression import dct_dp
from tf_dct.compression import error_feedback
from tf_dct.compression import sparse_wire
from tf_dct.compression import native as native_ops

# With stock ops, variables of at most this many entries are selected
# together (`select_fused`); larger ones one by one. Grouping saves ops per
# variable (faster steps and a much faster trace for models with many small
# variables) but costs per entry: an entry finds its variable's tau through
# a gather, and a step on which any member refreshes computes every member's
# order statistic. docs/dct_dp.md ("What a step costs") has the measurements.
FUSE_SIZE = 8192


def native_positions(compressor, grads, variables, states) -> set[int]:
  """Positions of the variables whose lines 2-11 run in the native kernel:
  with state, float32/float64, on a CPU, outside XLA, when the kernel is
  available and `compressor.native` is not False."""
  if compressor.native is False:
    return set()
  return {i for i, (g, v, st) in enumerate(zip(grads, variables, states))
          if st and native_ops.usable(g.dtype, v.device)}


def groups(grads, variables, states, native,
           fuse_size: int | None = None) -> list[tuple[bool, list[int]]]:
  """Positions of the variables selected together, in variable order.

  Each group is `(native, positions)`. The variables of `native` of one
  dtype form one group for the native kernel. Of the others, those of at
  most `fuse_size` (None: `FUSE_SIZE`) entries and one dtype form one
  group; every larger one is a group of its own.
  """
  if fuse_size is None:
    fuse_size = FUSE_SIZE
  fused, out = {}, []
  for i, (g, v, st) in enumerate(zip(grads, variables, states)):
    if not st:
      continue
    key = (i in native, g.dtype)
    if i in native or v.shape.num_elements() <= fuse_size:
      if key not in fused:
        fused[key] = []
        out.append((i in native, fused[key]))
      fused[key].append(i)
    else:
      out.append((False, [i]))
  return out


def _band_counts(group, band):
  """The guard's band on each variable's selected count, as float64 [V]
  bounds (low * K, high * K) with K = n - m."""
  expected = np.asarray([n - m for n, m in zip(group.sizes, group.below)],
                        np.float64)
  return band[0] * expected, band[1] * expected


def select_native(group, band, value_dtype=None):
  """Lines 2-11 of a group in one native op; a `dct_dp.Picked`.

  With `value_dtype` "bfloat16" a float32 group's packed values come out
  rounded to bfloat16, the rounding error in the residuals (the kernel does
  `sparse_wire.round_values`).

  `group.accs` holds `(g, E)` flat pairs (E may be a scalar 0); the kernel
  checks g, adds E and takes each variable's branch (refresh, guard, reuse)
  itself, so no `tf.cond` is built. `seconds` is the kernel's own run time.
  """
  dtype = group.accs[0][0].dtype
  if band is None:
    reuse = native_ops.FIXED
    lowest = highest = [0] * len(group.sizes)
  else:  # the band on the count, as integers: c < x iff c < ceil(x)
    reuse = native_ops.GUARDED
    low, high = _band_counts(group, band)
    lowest = [int(math.ceil(x)) for x in low]
    highest = [int(math.floor(x)) for x in high]
  modes = tf.where(group.due, native_ops.REFRESH, reuse)
  taus = group.tau
  if group.warm is not None:  # a warm variable selects nothing: tau = inf
    modes = tf.where(group.warm, native_ops.FIXED, modes)
    taus = tf.where(group.warm, tf.constant(np.inf, dtype), group.tau)
  idxs, vals, residuals, tau, selected, early, seconds = native_ops.select(
      [g for g, _ in group.accs], [e for _, e in group.accs], taus, modes,
      group.caps, group.below, lowest, highest,
      [error_feedback.non_finite_message("DCTDP", v) for v in group.variables],
      sparse_wire.wire_dtype(dtype, value_dtype))
  return dct_dp.Picked(tau, tf.logical_or(group.due, early),
                       early if band is not None else None, selected, idxs,
                       vals, residuals, seconds)


def select_fused(group, band):
  """Lines 3-11 of a group of small variables with one set of stock ops.

  The variables are laid end to end in one flat vector; per-variable
  scalars (tau, k, due) are vectors and an entry meets its variable's tau
  through a gather by segment. Returns a `dct_dp.Picked`.
  """
  sizes, old_tau, warm = group.sizes, group.tau, group.warm
  seg = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
  per_entry = lambda t: tf.gather(t, seg)
  flat = tf.concat(group.accs, 0)
  magnitude = tf.abs(flat)
  eligible = magnitude > 0  # zeros carry nothing (as in `dct_dp.select`)
  if warm is not None:
    eligible = tf.logical_and(eligible, tf.logical_not(per_entry(warm)))

  def masked(tau):  # the mask, its prefix count, selected per variable
    mask = tf.logical_and(magnitude >= per_entry(tau), eligible)
    ends = sparse_wire.prefix_count(mask)
    through = tf.gather(ends, np.cumsum(sizes).astype(np.int32) - 1)
    return mask, ends, through - tf.concat([[0], through[:-1]], 0)

  refresh, early, kept = group.due, None, None
  if band is not None:  # the density guard, per variable
    low, high = _band_counts(group, band)
    kept = masked(old_tau)
    count = tf.cast(kept[-1], tf.float64)
    early = tf.logical_and(tf.logical_not(refresh),
                           tf.logical_or(count < low, count > high))
    if warm is not None:
      early = tf.logical_and(early, tf.logical_not(warm))
    refresh = tf.logical_or(refresh, early)

  def fresh():  # a new tau for the variables due, the old one for the rest
    tau = tf.stack([dct_dp.order_statistic_threshold(p, m)
                    for p, m in zip(tf.split(magnitude, sizes), group.below)])
    tau = tf.where(refresh, tau, old_tau)
    return (tau,) + masked(tau)

  def reuse():
    return (old_tau,) + (kept if kept is not None else masked(old_tau))

  # One branch for the group: a step that keeps every tau builds no order
  # statistic.
  tau, mask, ends, selected = tf.cond(tf.reduce_any(refresh), fresh, reuse)
  idx, val, _, fitted = sparse_wire.compact_segments(flat, mask, ends, sizes,
                                                     group.caps)
  residual = tf.where(fitted, tf.zeros_like(flat), flat)
  return dct_dp.Picked(tau, refresh, early, selected, tf.split(idx, group.caps),
                       tf.split(val, group.caps), tf.split(residual, sizes))
