"""Sparse asynchronous pushes to parameter servers (DCT §3.3, Remark 2).

With `tf_dct.AsyncReplicator`, every worker step calls an `AsyncPush` with its
gradients. Per variable, the worker adds the residual it held back, selects
entries with DCT-DP's threshold (DCT Algorithm 1, the same order statistic,
life-span and capacity as `DCTDP`), and sends only the selected entries to
the parameter server, where they are applied as a scatter update:

    w[positions] -= learning_rate * values          (plain SGD on the server)

Everything else stays in the worker's residual, a per-worker variable (never
on the servers). No gradient mass is lost: the server's change plus every
worker's residual equals the pushed gradients. `save()` drains every
residual into the model first, so a checkpoint holds all of it; a restarted
worker starts from a zero residual. An optional stochastic drain
(`drain_every`) pushes a worker's whole accumulator now and then.
docs/replicators.md ("What `AsyncPush` does exactly") has the conventions.
"""

from __future__ import annotations

import threading
import weakref
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_dct import _private
from tf_dct.compression import base
from tf_dct.compression import dct_dp
from tf_dct.compression import error_feedback
from tf_dct.compression.dense import Dense

STAT_FIELDS = ("steps", "entries_pushed", "bytes_pushed", "dense_bytes",
               "drains", "refreshes", "early_refreshes")


def _unravel(positions: tf.Tensor, shape: tf.TensorShape) -> tf.Tensor:
  """[k, rank] row-major coordinates of flat `positions` (also for k = 0,
  which `tf.unravel_index` rejects)."""
  dims = shape.as_list()
  strides = [int(np.prod(dims[i + 1:], dtype=np.int64)) for i in range(len(dims))]
  return tf.stack([(positions // s) % d for s, d in zip(strides, dims)], axis=1)


class AsyncPush:
  """Worker-side DCT-DP selection with scatter pushes to the servers.

  Args:
    replicator: the `tf_dct.AsyncReplicator` whose workers push.
    compressor: a `DCTDP` (its sparsity, threshold_life, capacity_factor,
      min_size, min_count and warmup_steps are used; momentum, Adam and
      Adagrad correction are not offered), or None / `Dense()` for dense
      pushes of the raw gradient.
    learning_rate: the server-side SGD step (a float > 0).
    drain_every: None (off) or D > 1: drain probability 1/D per step, see the
      module docstring.
    variables: the variables to create the worker state for (or call
      `build(variables)` before the first step).
    seed: optional seed of the drain draws.
    name: accepted for symmetry with the compressors; unused.

  Not a trackable: its state is per-worker and is drained, not checkpointed
  (see `save`).
  """

  def __init__(self, replicator, compressor=None, learning_rate: float = 0.01,
               drain_every: float | None = None, variables=None,
               seed: int | None = None, name: str | None = None):
    del name
    if compressor is not None and not isinstance(compressor, (dct_dp.DCTDP, Dense)):
      raise TypeError("AsyncPush: compressor must be None, Dense() or a DCTDP, "
                      f"got {type(compressor).__name__}")
    if isinstance(compressor, dct_dp.DCTDP) and compressor.momentum:
      raise ValueError("AsyncPush: the servers apply plain SGD pushes; "
                       f"momentum correction (momentum={compressor.momentum}) "
                       "is not available here, pass DCTDP(momentum=0)")
    if isinstance(compressor, dct_dp.DCTDP) and compressor.sparsity_schedule:
      raise ValueError("AsyncPush: workers push on their own clocks, so a "
                       "sparsity_schedule has no common step; pass a DCTDP "
                       "without one")
    if isinstance(compressor, dct_dp.DCTDP) and compressor.adam:
      raise ValueError("AsyncPush: the servers apply plain SGD pushes; Adam "
                       "correction (adam=True) is not available here, pass "
                       "DCTDP(adam=False)")
    if isinstance(compressor, dct_dp.DCTDP) and compressor.adagrad:
      raise ValueError("AsyncPush: the servers apply plain SGD pushes; "
                       "Adagrad correction (adagrad=True) is not available "
                       "here, pass DCTDP(adagrad=False)")
    from tf_dct.distribute.async_replicator import AsyncReplicator  # pylint: disable=g-import-not-at-top
    if not isinstance(replicator, AsyncReplicator):
      raise TypeError("AsyncPush needs a tf_dct.AsyncReplicator, got "
                      f"{type(replicator).__name__}")
    if (isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float))
        or not learning_rate > 0):
      raise ValueError(f"AsyncPush: learning_rate must be a number > 0, got "
                       f"{learning_rate!r}")
    if drain_every is not None and (
        isinstance(drain_every, bool) or not isinstance(drain_every, (int, float))
        or not drain_every > 1):
      raise ValueError("AsyncPush: drain_every must be None or a number > 1 "
                       f"(drain probability 1/drain_every), got {drain_every!r}")
    self._replicator = replicator
    self.compressor = compressor if isinstance(compressor, dct_dp.DCTDP) else None
    self.learning_rate = float(learning_rate)
    self.drain_every = drain_every
    self._seed = seed
    self._lock = threading.Lock()
    self._keys = {}
    self.state = {}
    self._pushed_graphs = weakref.WeakSet()  # graphs that traced a push
    with replicator.scope():
      self.counters = {f: _private.per_worker_variable(
          tf.zeros([], tf.int64), f"async_push/{f}") for f in STAT_FIELDS}
    if variables is not None:
      self._states_for(list(variables))

  # -- state ------------------------------------------------------------------------

  def _sparse(self, variable) -> bool:
    n = variable.shape.num_elements()
    return (self.compressor is not None and variable.shape.rank >= 1 and
            n >= max(self.compressor.min_size, 2))

  def _states_for(self, variables) -> list[dict]:
    if tf.inside_function() and any(v.ref() not in self._keys for v in variables):
      raise ValueError("AsyncPush: create the state from the chief, outside "
                       "any tf.function (variables=... or build())")
    with self._lock, tf.init_scope():
      for var in variables:
        if var.ref() in self._keys:
          continue
        if not var.dtype.is_floating:
          raise TypeError(f"AsyncPush pushes floating-point variables only; "
                          f"{var.name!r} has dtype {var.dtype.name}")
        if var.shape.num_elements() is None:
          raise ValueError(f"AsyncPush needs static shapes; {var.name!r} has "
                           f"shape {var.shape}")
        key = base.state_key(len(self._keys))
        self._keys[var.ref()] = key
        state = {}
        if self._sparse(var):
          with self._replicator.scope():
            state = {
                "residual": _private.per_worker_variable(
                    tf.zeros(var.shape, var.dtype), f"async_push/{key}/residual"),
                "threshold": _private.per_worker_variable(
                    tf.zeros([], var.dtype), f"async_push/{key}/threshold"),
                "step": _private.per_worker_variable(
                    tf.zeros([], tf.int64), f"async_push/{key}/step"),
            }
        self.state[key] = state
      return [self.state[self._keys[v.ref()]] for v in variables]

  # -- the push (inside step_fn, on a worker) ----------------------------------------

  def __call__(self, grads: Sequence, variables: Sequence[tf.Variable]) -> dict:
    """Pushes this step's update of every variable; call inside step_fn.

    Args:
      grads: gradients (tensors, `tf.IndexedSlices` or None) of `variables`.
      variables: the server variables (created in the replicator's scope).

    Returns:
      This push's statistics as int64 scalars (`entries_pushed`,
      `bytes_pushed`, `dense_bytes`, `drains`, `refreshes`,
      `early_refreshes`), computed after every write of the push.

    Raises:
      ValueError: for variables without state (see `build`), or when called
        twice while tracing one step.
    """
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if not pairs:
      return {}
    missing = [v.name for _, v in pairs if v.ref() not in self._keys]
    if missing:
      raise ValueError(
          f"AsyncPush has no state for {missing}: pass variables=[...] to "
          "AsyncPush(...) or call build(variables) before scheduling steps "
          "(per-worker state cannot be created inside a step)")
    states = self._states_for([v for _, v in pairs])
    # One push per traced function: reads and writes of a per-worker variable
    # are ordered only by data dependencies (see the error below).
    graph = tf.compat.v1.get_default_graph()
    if graph in self._pushed_graphs:
      raise ValueError(
          "AsyncPush was called twice in one traced step: push each variable "
          "once per scheduled function. (TensorFlow does not order several "
          "reads and writes of a per-worker variable inside one function, not "
          "even with explicit control dependencies, so a second push could "
          "read a stale residual.)")
    self._pushed_graphs.add(graph)
    return self._push(pairs, states)

  def build(self, variables: Sequence[tf.Variable]) -> None:
    """Creates the per-worker state of `variables` (from the chief)."""
    self._states_for(list(variables))

  def _push(self, pairs, states) -> dict:
    lr = self.learning_rate
    drain = tf.constant(False)
    if self.drain_every is not None:
      drain = tf.random.uniform([], seed=self._seed) < 1.0 / self.drain_every
    writes, entries, nbytes, dense, refreshes, early = [], [], [], [], [], []
    # IndexedSlices are densified on the worker. Every gradient is checked
    # before anything is pushed: one non-finite variable stops the whole step.
    grads = error_feedback.check_finite(
        "AsyncPush", [tf.convert_to_tensor(g) for g, _ in pairs],
        [v for _, v in pairs])
    with tf.control_dependencies(error_feedback.dependencies(grads)):
      for grad, (_, var), st in zip(grads, pairs, states):
        n = var.shape.num_elements()
        size = var.dtype.size
        dense.append(tf.constant(n * size, tf.int64))
        if not st:
          writes.append(var.assign_sub(lr * tf.cast(grad, var.dtype)))
          entries.append(tf.constant(n, tf.int64))
          nbytes.append(tf.constant(n * size, tf.int64))
          continue
        out = self._sparse_push(grad, var, st, drain)
        writes.extend(out["writes"])
        entries.append(out["entries"])
        nbytes.append(out["bytes"])
        refreshes.append(out["refresh"])
        early.append(out["early"])
    with tf.control_dependencies(writes):
      stats = {
          "entries_pushed": tf.add_n(entries),
          "bytes_pushed": tf.add_n(nbytes),
          "dense_bytes": tf.add_n(dense),
          "drains": tf.cast(drain, tf.int64),
          "refreshes": (tf.add_n(refreshes) if refreshes
                        else tf.constant(0, tf.int64)),
          "early_refreshes": (tf.add_n(early) if early
                              else tf.constant(0, tf.int64)),
      }
      counted = [self.counters["steps"].assign_add(1)]
      counted += [self.counters[f].assign_add(v) for f, v in stats.items()]
    with tf.control_dependencies(counted):
      return {f: tf.identity(v) for f, v in stats.items()}

  def _sparse_push(self, grad, var, st, drain) -> dict:
    """DCT Algorithm 1 lines 2-12 for one variable on this worker."""
    c = self.compressor
    n = var.shape.num_elements()
    m = dct_dp.num_below(n, c.sparsity, c.min_count)
    cap = dct_dp.capacity(n, c.sparsity, c.capacity_factor, c.min_count)
    residual, threshold, step = st["residual"], st["threshold"], st["step"]
    # Per-worker variables cannot be read inside tf.cond branches.
    k = step.read_value()
    acc = tf.reshape(tf.cast(grad, var.dtype), [-1]) + tf.reshape(
        residual.read_value(), [-1])                                   # line 2
    warm, due = dct_dp.schedule(k, c.threshold_life, c.warmup_steps)   # line 3
    picked = dct_dp.select(acc, threshold.read_value(), due, m, cap,   # 3-11
                           c.density_band, warm)
    tau, refresh = picked.tau, picked.refresh
    early = picked.early if picked.early is not None else tf.constant(False)
    count = tf.minimum(picked.selected, cap)
    dense_step = drain if warm is None else tf.logical_or(drain, warm)
    lr = tf.constant(self.learning_rate, var.dtype)
    # Only `count` entries leave the worker: the buffers are cut to it here.
    positions, values = picked.idx[:count], lr * picked.val[:count]

    def sparse_push():
      with tf.device(var.device):   # positions are unravelled on the server
        if var.shape.rank == 1:
          return var.scatter_sub(tf.IndexedSlices(values, positions, [n])).op
        return var.scatter_nd_sub(_unravel(positions, var.shape), values).op

    def dense_push():
      return var.assign_sub(lr * tf.reshape(acc, var.shape)).op

    pushed = tf.cond(dense_step, dense_push, sparse_push)              # line 12
    zero = tf.zeros_like(acc)
    new_residual = tf.where(dense_step, zero, picked.residual)        # 10-11
    # Every write consumes the value it replaces: with per-worker variables
    # only data dependencies order a read before a write (see __call__).
    with tf.control_dependencies([pushed]):
      writes = [residual.assign(tf.reshape(new_residual, var.shape)),
                threshold.assign(tau), step.assign(k + 1)]
    entries = tf.where(dense_step, tf.constant(n, tf.int64),
                       tf.cast(tf.size(positions), tf.int64))
    pushed_bytes = tf.where(
        dense_step, tf.constant(n * var.dtype.size, tf.int64),
        tf.cast(tf.size(values), tf.int64) * var.dtype.size +
        tf.cast(tf.size(positions), tf.int64) * positions.dtype.size)
    return {"writes": [pushed] + writes, "entries": entries,
            "bytes": pushed_bytes, "refresh": tf.cast(refresh, tf.int64),
            "early": tf.cast(early, tf.int64)}

  # -- from the chief ---------------------------------------------------------------

  def stats(self) -> dict:
    """Cumulative counters summed over workers, plus `per_worker` lists.

    Waits for a restarting worker to be back first; a restarted worker's
    counters start again from 0.
    """
    self._replicator.wait_for_workers()
    per_worker = {f: [int(x) for x in v.read_all()] for f, v in self.counters.items()}
    out = {f: sum(v) for f, v in per_worker.items()}
    out["per_worker"] = per_worker
    return out

  def residuals(self, variable) -> list[np.ndarray]:
    """Every worker's residual of `variable` (zeros for dense variables)."""
    st = self._states_for([variable])[0]
    self._replicator.wait_for_workers()
    if not st:
      return [np.zeros(variable.shape, variable.dtype.as_numpy_dtype)
              for _ in range(self._replicator.num_workers)]
    return [x.numpy() for x in st["residual"].read_all()]

  def drain(self) -> None:
    """Waits for all steps, then pushes every residual densely and zeroes it."""
    self._replicator.join()
    self._replicator.wait_for_workers()
    items = [(self._var_of(key), st) for key, st in self.state.items() if st]
    if not items:
      return
    lr = self.learning_rate

    @tf.function
    def drain_worker():
      done = []
      for var, st in items:
        r = st["residual"].read_value()
        push = var.assign_sub(tf.constant(lr, var.dtype) * r)
        with tf.control_dependencies([push]):
          done.append(st["residual"].assign(r - r))  # data-ordered after the read
      with tf.control_dependencies(done):
        return self.counters["drains"].assign_add(1)

    _private.run_on_every_worker(self._replicator.coordinator, drain_worker)

  def reset(self) -> None:
    """Zeroes every worker's residual, threshold and step counter (no push).

    Use it only right after restoring a checkpoint written by `save()`
    (whose residuals were drained), never to discard live residuals.
    """
    self._replicator.join()
    self._replicator.wait_for_workers()
    items = [st for st in self.state.values() if st]
    if not items:
      return

    @tf.function
    def reset_worker():
      done = []
      for st in items:
        for v in st.values():
          value = v.read_value()
          done.append(v.assign(value - value))  # data-ordered after the read
      with tf.control_dependencies(done):
        return tf.constant(0)

    _private.run_on_every_worker(self._replicator.coordinator, reset_worker)

  def save(self, checkpoint: tf.train.Checkpoint, file_prefix: str) -> str:
    """Drains every residual into the model, then saves `checkpoint`."""
    self.drain()
    return checkpoint.save(file_prefix)

  def restore(self, checkpoint: tf.train.Checkpoint, path: str):
    """Restores a checkpoint written by `save()` and zeroes worker state."""
    status = checkpoint.restore(path)
    self.reset()
    return status

  def _var_of(self, key):
    for ref, k in self._keys.items():
      if k == key:
        return ref.deref()
    raise KeyError(key)
