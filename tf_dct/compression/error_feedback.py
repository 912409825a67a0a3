"""The error-feedback steps every sparsifying compressor shares.

DCT Algorithm 1 line 2 and DEFT Algorithm 1 line 5 add the replica's residual
E to its gradient before selecting: acc = g + E. This module does that add
and the checks before it, for dense gradients and for `tf.IndexedSlices`
(embedding tables), without building a table-sized dense gradient.

For IndexedSlices, duplicate row ids are combined first (a static-shape sort
and segment sum that sums in the order `tf.convert_to_tensor` would, so the
result is bit-identical to densifying), then the combined rows are
scatter-added into a copy of the residual. The residual itself is
table-shaped, so the accumulator still covers every entry: an untouched row
may hold residual mass that must be able to leave.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


def non_finite_message(owner: str, variable) -> str:
  """The error text when `variable`'s gradient has a NaN or Inf entry."""
  return f"{owner}: non-finite gradient for variable {variable.name}"


def check_finite(owner: str, grads: Sequence, variables: Sequence) -> list:
  """`tf.debugging.check_numerics` on every gradient (IndexedSlices: values).

  The caller reads no state before these checks ran (control dependencies),
  so a non-finite gradient never reaches a residual. XLA compiles the checks
  away (nothing can raise in compiled code); there `Compressor.aggregate`
  undoes a non-finite step instead, using `all_finite`.
  """
  checked = []
  for g, v in zip(grads, variables):
    message = non_finite_message(owner, v)
    if isinstance(g, tf.IndexedSlices):
      checked.append(tf.IndexedSlices(
          tf.debugging.check_numerics(g.values, message), g.indices,
          g.dense_shape))
    else:
      checked.append(tf.debugging.check_numerics(g, message))
  return checked


def _shape_text(shape) -> str:
  return str(tf.TensorShape(shape).as_list()).replace("None", "?")


def check_gradients(owner: str, grads: Sequence, variables: Sequence) -> list:
  """Checks each gradient's dtype, shape and row ids against its variable.

  What is known statically raises now, at trace: a dtype other than the
  variable's (TypeError), a dense gradient whose shape differs from the
  variable's (same entry count or not; ValueError), an `IndexedSlices` whose
  `dense_shape` or row width differs. What is not is checked in the graph:
  the shape of a dense gradient of unknown shape, and every row id of an
  `IndexedSlices` in [0, rows). The returned gradients pass through an
  identity that waits for those asserts, so every state write computed from
  them waits too (`checked_reads`); each message names `owner`, the variable
  and both shapes (or the row count). XLA compiles the asserts away.
  """
  out = []
  for g, v in zip(grads, variables):
    name = v.name.split(":")[0]
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    if values.dtype != v.dtype:
      raise TypeError(
          f"{owner}: the gradient of variable {name!r} has dtype "
          f"{values.dtype.name}, the variable {v.dtype.name}; gradients must "
          "have their variable's dtype")
    shape = v.shape
    if not isinstance(g, tf.IndexedSlices):
      if not g.shape.is_compatible_with(shape):
        raise ValueError(
            f"{owner}: the gradient of variable {name!r} has shape "
            f"{_shape_text(g.shape)}, the variable {_shape_text(shape)}")
      if g.shape.is_fully_defined():
        out.append(g)
        continue
      assertion = tf.debugging.assert_equal(
          tf.shape(g, out_type=tf.int64), tf.constant(shape.as_list(), tf.int64),
          message=f"{owner}: the gradient of variable {name} must have the "
          f"shape of the variable, {_shape_text(shape)} (x: the shape of the "
          "gradient)")
      with tf.control_dependencies([assertion]):
        out.append(tf.identity(g))
      continue
    static_dense = tf.get_static_value(g.dense_shape)
    if (static_dense is not None
        and list(static_dense) != shape.as_list()) or not (
            g.values.shape[1:].is_compatible_with(shape[1:])):
      got = (f"dense_shape {_shape_text(static_dense)}"
             if static_dense is not None and list(static_dense) != shape.as_list()
             else f"rows of shape {_shape_text(g.values.shape[1:])}")
      raise ValueError(
          f"{owner}: the IndexedSlices gradient of variable {name!r} has "
          f"{got}, the variable {_shape_text(shape)}")
    rows = shape[0]
    ids = g.indices
    checks = [tf.debugging.assert_non_negative(
                  ids, message=f"{owner}: IndexedSlices gradient of variable "
                  f"{name}: row ids must be in [0, {rows}) (its row count)"),
              tf.debugging.assert_less(
                  ids, tf.cast(rows, ids.dtype),
                  message=f"{owner}: IndexedSlices gradient of variable "
                  f"{name}: row ids must be in [0, {rows}) (its row count)")]
    if not g.values.shape[1:].is_fully_defined():
      checks.append(tf.debugging.assert_equal(
          tf.shape(g.values, out_type=tf.int64)[1:],
          tf.constant(shape[1:].as_list(), tf.int64),
          message=f"{owner}: the IndexedSlices gradient of variable {name} "
          f"must have rows of shape {_shape_text(shape[1:])}"))
    with tf.control_dependencies(checks):
      out.append(tf.IndexedSlices(tf.identity(g.values), tf.identity(ids),
                                  g.dense_shape))
  return out


def all_finite(grads: Sequence) -> tf.Tensor:
  """bool scalar: every entry of every gradient (IndexedSlices: values) is finite."""
  flags = [tf.reduce_all(tf.math.is_finite(
      g.values if isinstance(g, tf.IndexedSlices) else g)) for g in grads]
  return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def dependencies(grads: Sequence) -> list:
  """What to wait on (`tf.control_dependencies`) so every gradient check has run.

  One gate op that waits for all the checks, not the checks themselves: every
  op created under `tf.control_dependencies(xs)` gets each x as a control
  input, so a list of V checks around a step of O(V) ops is O(V^2) edges.
  On the launcher's full-size Transformer (4 replicas) that made DCT-DP's
  step a 567 MB GraphDef (one scalar constant had 36 KB of control inputs),
  and building the function ran out of 24 GB.
  """
  return gate([g.values if isinstance(g, tf.IndexedSlices) else g for g in grads])


def read_checked(deps: Sequence, states: Sequence[dict],
                 keys: Sequence[str]) -> list[dict]:
  """This replica's values of `keys` of each state, read after `deps` ran.

  Only the reads wait for the gradient checks: every op computed from the
  state waits through its data, so the step's other ops need no control edge
  of their own. An edge on every op costs grappler's dependency optimizer
  time that grows with edges times nodes (on the launcher's full-size
  Transformer it spent 20 s of a 250 s start in its transitive reduction).
  Empty states (variables without state) give empty dicts.
  """
  with tf.control_dependencies(deps):
    return [{key: st[key].local().read_value() for key in keys} if st else {}
            for st in states]


def checked_reads(owner: str, grads: Sequence, variables: Sequence,
                  states: Sequence[dict], keys: Sequence[str],
                  checked_by_caller: Sequence[bool] | None = None):
  """One replica's gradient checks and what has to wait for them.

  Returns `(checked, values, dense)`: the checked gradients
  (`check_finite`); per state the values of `keys` read after every check
  (`read_checked`, {} for variables without state); and `(position,
  gradient)` of each variable without state, through an identity that also
  waits for the checks, for the dense all-reduce. So everything the replica
  contributes to a collective depends on all of its checks, while the other
  ops of the step wait through their data only.

  `checked_by_caller[i]` True skips the check of gradient i: the caller
  checks it in the op that first reads it (a native kernel that raises on a
  non-finite entry, `tf_dct.compression.native`), and everything it contributes
  depends on that op.
  """
  if checked_by_caller is None:
    checked_by_caller = [False] * len(grads)
  own = [i for i, done in enumerate(checked_by_caller) if not done]
  checked = list(grads)
  for i, g in zip(own, check_finite(owner, [grads[i] for i in own],
                                    [variables[i] for i in own])):
    checked[i] = g
  deps = dependencies([checked[i] for i in own])
  values = read_checked(deps, states, keys)
  with tf.control_dependencies(deps):
    dense = [(i, tf.identity(g)) for i, (g, st)
             in enumerate(zip(checked, states)) if not st]
  return checked, values, dense


def gate(tensors: Sequence) -> list:
  """`tensors` as at most one op to pass to `tf.control_dependencies`.

  Ops created under `tf.control_dependencies(xs)` get every x as a control
  input; one `tf.group` of the xs keeps that to one edge per op.
  """
  tensors = [t.values if isinstance(t, tf.IndexedSlices) else t
             for t in tensors if t is not None]
  if len(tensors) <= 1 or tf.executing_eagerly():
    return tensors
  return [tf.group(*tensors)]


def densify_unless(grads: Sequence, keep_sparse: Sequence[bool]) -> list:
  """Converts IndexedSlices to dense tensors where `keep_sparse` is False."""
  return [g if keep and isinstance(g, tf.IndexedSlices)
          else tf.convert_to_tensor(g)
          for g, keep in zip(grads, keep_sparse)]


def combine_rows(slices: tf.IndexedSlices, width: int):
  """Sums duplicate rows of `slices` with static shapes.

  Returns `(row_ids, values)`: int32[k] distinct row ids (unused entries: 0)
  and [k, width] their summed values (unused: 0), k = number of slices.
  Duplicates are summed in their original order, as
  `tf.convert_to_tensor(slices)` does.
  """
  ids = tf.cast(slices.indices, tf.int32)
  values = tf.reshape(slices.values, [-1, width])
  k = tf.shape(ids)[0]
  order = tf.argsort(ids, stable=True)
  sorted_ids = tf.gather(ids, order)
  first = tf.concat([tf.ones([1], tf.bool), sorted_ids[1:] != sorted_ids[:-1]], 0)
  seg_sorted = tf.cumsum(tf.cast(first, tf.int32)) - 1
  seg = tf.scatter_nd(order[:, None], seg_sorted, [k])  # segment of each slice
  summed = tf.math.unsorted_segment_sum(values, seg, k)
  row_ids = tf.scatter_nd(seg_sorted[:, None],
                          tf.where(first, sorted_ids, 0), [k])
  return row_ids, summed


def accumulate(grad, residual: tf.Tensor, variable: tf.Variable) -> tf.Tensor:
  """acc = g + E as a flat vector (DCT Alg. 1 line 2, DEFT Alg. 1 line 5).

  Args:
    grad: this replica's gradient, dense or `tf.IndexedSlices` over rows.
    residual: E, the residual's current value (variable shape).
    variable: the variable (for its static shape).
  """
  n = variable.shape.num_elements()
  if isinstance(grad, tf.IndexedSlices):  # row-wise, no dense gradient
    rows = variable.shape[0]
    row_ids, summed = combine_rows(grad, n // rows)
    return tf.reshape(tf.tensor_scatter_nd_add(
        tf.reshape(residual, [rows, n // rows]), row_ids[:, None], summed), [-1])
  return tf.reshape(grad, [-1]) + tf.reshape(residual, [-1])
