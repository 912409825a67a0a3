"""TF-Replicator's communication primitives (paper §3.4), for use inside step_fn.

Every primitive is called by every replica with that replica's value and
returns the same result on every replica. Inputs may be nested structures of
tensors; the result has the same structure. All of them are differentiable
where the underlying collective is (sum, mean, gather), so they can sit inside
a loss, e.g. cross-replica batch norm through `all_sum`.

Semantics, for replicas r = 0..n-1 holding values x_r:

* `all_reduce(x, op)`: op over r of x_r, op in sum | mean | max | min.
* `all_sum(x)`: sum over r of x_r.
* `all_gather(x, axis)`: concat([x_0, ..., x_{n-1}], axis); the sizes along
  `axis` may differ between replicas (not on TPU).
* `broadcast(x, source_replica)`: x_source on every replica; gradients flow
  back to the source replica.
* `map_reduce(fn, x, op)`: all_reduce(fn(x_r), op).
* `map_gather(fn, x)`: stack([fn(x_0), ..., fn(x_{n-1})], axis=0).

Every replica must pass the same structure, dtypes and shapes; the replicas
of one process are compared while the step is traced, before any collective
runs (docs/errors.md, "Communication primitives").
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tf_dct import _private

_OPS = {
    "sum": tf.distribute.ReduceOp.SUM,
    "mean": tf.distribute.ReduceOp.MEAN,
    "max": "max",
    "min": "min",
}


def replica_context(caller: str,
                    strategy: tf.distribute.Strategy | None = None
                   ) -> tf.distribute.ReplicaContext:
  """Returns the current replica context or raises a clear error."""
  ctx = tf.distribute.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"{caller}() must be called inside step_fn (a replica context, e.g. "
        "within replicator.run(step_fn, ...)), not in cross-replica context.")
  if strategy is not None and ctx.strategy is not strategy:
    raise RuntimeError(
        f"{caller}() was called outside a replica of this replicator; call it "
        "inside a step_fn run by the same replicator.")
  return ctx


def _normalize_op(op) -> Any:
  if isinstance(op, tf.distribute.ReduceOp):
    return op
  if isinstance(op, str) and op.lower() in _OPS:
    return _OPS[op.lower()]
  raise ValueError(
      f"op must be one of {sorted(_OPS)} or a tf.distribute.ReduceOp, got {op!r}")


class _Leaf:
  """One value's static dtype and shape, printed as e.g. float32[2, 3]."""

  def __init__(self, value):
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
      value = tf.convert_to_tensor(value)
    self.dtype = tf.as_dtype(value.dtype)
    self.shape = tf.TensorShape(value.shape)

  def __repr__(self):
    shape = "[unknown rank]" if self.shape.rank is None else self.shape.as_list()
    return f"{self.dtype.name}{shape}"


class _Signature:
  """One replica's input to a primitive, as a structure of `_Leaf`s.

  merge_call hands it over whole (it regroups lists, tuples and dicts).
  """

  def __init__(self, x):
    self.structure = tf.nest.map_structure(_Leaf, x)


def _leaves_agree(leaves, gather_axis) -> bool:
  """Same dtype, and compatible shapes apart from `gather_axis`."""
  if len({leaf.dtype for leaf in leaves}) > 1:
    return False
  merged = tf.TensorShape(None)
  for leaf in leaves:
    shape = leaf.shape
    if gather_axis is not None and shape.rank:
      a = gather_axis % shape.rank
      shape = shape[:a].concatenate([None]).concatenate(shape[a + 1:])
    if not merged.is_compatible_with(shape):
      return False
    merged = merged.merge_with(shape)
  return True


def _check_replicas_agree(ctx, caller: str, arg: str, x, gather_axis=None):
  """Raises ValueError unless `x` has the same structure, dtypes and static
  shapes on every replica of this process (sizes along `gather_axis` aside).

  Only Mirrored strategies trace one copy of the step per local replica;
  there one merge_call compares them while tracing (their collectives merge
  too, so this adds no new constraint). Elsewhere it does nothing.
  """
  strategy = ctx.strategy
  if (not isinstance(strategy, (tf.distribute.MirroredStrategy,
                                tf.distribute.MultiWorkerMirroredStrategy))
      or len(strategy.extended.worker_devices) < 2
      or _private.in_xla_context()):
    return

  @tf.autograph.experimental.do_not_convert  # plain Python, run while tracing
  def compare(strategy, signature):
    structures = [s.structure
                  for s in strategy.experimental_local_results(signature)]
    first = _private.first_local_replica_id(strategy)

    def fail(what, name, values):
      got = ", ".join(f"replica {first + i}: {v!r}" for i, v in enumerate(values))
      raise ValueError(f"{caller}(): {name} must have the same {what} on every "
                       f"replica; got {got}")

    paths = [_private.flat_paths(s) for s in structures]
    if any(p != paths[0] for p in paths):
      fail("nested structure", arg, structures)
    what = "dtype and shape" + (
        "" if gather_axis is None else f" (except along axis {gather_axis})")
    for path, leaves in zip(paths[0], zip(*map(tf.nest.flatten, structures))):
      if not _leaves_agree(leaves, gather_axis):
        fail(what, arg + "".join(f"[{k!r}]" for k in path), leaves)

  ctx.merge_call(compare, args=(_Signature(x),))


def _batched_all_reduce(ctx, op, x):
  """`ctx.all_reduce` of a nest, one batch for int32 and one for the rest.

  Mirrored strategies keep int32 tensors in host memory and refuse a batched
  reduction that mixes host and device tensors.
  """
  # identity() puts each value on this replica's device: a function argument
  # has none under XLA, and the strategy reduces towards the value's device.
  flat = [tf.identity(t) for t in tf.nest.flatten(x)]
  groups = {}
  for i, t in enumerate(flat):
    groups.setdefault(t.dtype == tf.int32, []).append(i)
  out = [None] * len(flat)
  for indices in groups.values():
    for i, r in zip(indices, ctx.all_reduce(op, [flat[i] for i in indices])):
      out[i] = r
  return tf.nest.pack_sequence_as(x, out)


def _gather_reduce(ctx, x, reduce_fn):
  def one(t):
    t = tf.convert_to_tensor(t)
    stacked = ctx.all_gather(tf.expand_dims(t, 0), axis=0)
    return reduce_fn(stacked, axis=0)
  return tf.nest.map_structure(one, x)


def all_reduce(x, op="sum", *, strategy=None):
  """Reduces `x` across replicas with `op` (sum | mean | max | min)."""
  op = _normalize_op(op)
  ctx = replica_context("all_reduce", strategy)
  _check_replicas_agree(ctx, "all_reduce", "x", x)
  return _reduce(ctx, x, op)


def _reduce(ctx, x, op):
  if op == "max":
    return _gather_reduce(ctx, x, tf.reduce_max)
  if op == "min":
    return _gather_reduce(ctx, x, tf.reduce_min)
  return _batched_all_reduce(ctx, op, x)


def all_sum(x, *, strategy=None):
  """Sums `x` across replicas."""
  ctx = replica_context("all_sum", strategy)
  _check_replicas_agree(ctx, "all_sum", "x", x)
  return _batched_all_reduce(ctx, tf.distribute.ReduceOp.SUM, x)


def all_gather(x, axis: int = 0, *, strategy=None):
  """Concatenates every replica's `x` along `axis`, in replica order."""
  if not isinstance(axis, int) or isinstance(axis, bool):
    raise TypeError(f"axis must be an int, got {axis!r}")
  ctx = replica_context("all_gather", strategy)

  def one(t):
    t = tf.convert_to_tensor(t)
    rank = t.shape.rank
    if rank is None or not -rank <= axis < max(rank, 1):
      raise ValueError(f"axis must be in [{-(rank or 0)}, {rank}) for a "
                       f"rank-{rank} value, got {axis}")
    if not tf.executing_eagerly() and not t.device:
      # TF's gather places its result where the value is; a tensor made
      # outside the replica's device scope (the step's input under
      # MultiWorkerReplicator) has no device, so take a copy made in it.
      t = tf.identity(t)
    return t, axis % max(rank, 1)

  checked = [one(t) for t in tf.nest.flatten(x)]
  _check_replicas_agree(ctx, "all_gather", "x", x, gather_axis=axis)
  if axis >= 0:  # one batched collective for the whole structure
    # The converted tensors: eagerly, TF returns a Keras 3 variable as it is.
    return ctx.all_gather(
        tf.nest.pack_sequence_as(x, [t for t, _ in checked]), axis=axis)
  # TF's collective gather takes only non-negative axes.
  return tf.nest.pack_sequence_as(
      x, [ctx.all_gather(t, axis=a) for t, a in checked])


def broadcast(x, source_replica: int = 0, *, strategy=None):
  """Returns the value of `x` held by replica `source_replica`, everywhere."""
  ctx = replica_context("broadcast", strategy)
  n = ctx.num_replicas_in_sync
  if (not isinstance(source_replica, int) or isinstance(source_replica, bool)
      or not 0 <= source_replica < n):
    raise ValueError(
        f"source_replica must be an int in [0, {n}), got {source_replica!r}")
  _check_replicas_agree(ctx, "broadcast", "x", x)
  is_source = tf.equal(ctx.replica_id_in_sync_group, source_replica)

  def mask(t):
    t = tf.convert_to_tensor(t)
    if t.dtype == tf.bool:
      t = tf.cast(t, tf.int32)
    return tf.where(is_source, t, tf.zeros_like(t))

  summed = _batched_all_reduce(ctx, tf.distribute.ReduceOp.SUM,
                               tf.nest.map_structure(mask, x))
  return tf.nest.map_structure(
      lambda s, t: tf.cast(s, tf.bool) if tf.convert_to_tensor(t).dtype == tf.bool else s,
      summed, x)


def map_reduce(fn: Callable, x, op="sum", *, strategy=None):
  """Applies `fn` to each replica's `x`, then reduces the results with `op`."""
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  op = _normalize_op(op)
  ctx = replica_context("map_reduce", strategy)
  y = fn(x)
  _check_replicas_agree(ctx, "map_reduce", "fn(x)", y)
  return _reduce(ctx, y, op)


def map_gather(fn: Callable, x, *, strategy=None):
  """Applies `fn` to each replica's `x`, then stacks the results in replica order."""
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r}")
  ctx = replica_context("map_gather", strategy)
  y = fn(x)
  _check_replicas_agree(ctx, "map_gather", "fn(x)", y)
  return ctx.all_gather(
      tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), y), axis=0)
