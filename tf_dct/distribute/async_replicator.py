"""AsyncReplicator: asynchronous training against parameter servers (Table 1).

TF-Replicator's MultiWorkerAsyncReplicator (§3.1, §4) on TensorFlow's own
`ParameterServerStrategy` (V2): trainable variables live on the parameter
servers, one chief process (the coordinator) builds each step once and
`ClusterCoordinator` schedules it on whichever worker is free. Workers never
wait for each other: every step reads the current server values, computes
on its own data and writes its update back (hogwild-style, as in DCT §3.3).

Only gradient accumulation on the servers connects the workers, so the
primitives that need replicas to meet (all_reduce, all_sum, all_gather,
broadcast, map_reduce, map_gather), `logical_device` and per-replica state
raise `NotImplementedError` here, as the paper notes for its async replicator.
Worker-local state (e.g. error-feedback residuals) is a per-worker variable
instead; see `tf_dct.compression.async_push.AsyncPush`.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import tensorflow as tf

from tf_dct import _private
from tf_dct.distribute.multi_worker import validate_tf_config
from tf_dct.distribute.replicator import PER_WORKER, ReplicatorMixin

_NO_COLLECTIVES = (
    "AsyncReplicator: {name}() is not supported: workers of a parameter-server "
    "cluster run their steps independently and never meet in a collective, so "
    "only gradient accumulation on the parameter servers is available "
    "(TF-Replicator notes the same limit for its MultiWorkerAsyncReplicator). "
    "Use MultiWorkerReplicator for synchronous replicas.")


def validate_ps_tf_config(raw: str | None = None) -> dict:
  """Checks TF_CONFIG for a chief + worker + ps cluster seen from the chief.

  Raises:
    ValueError: naming TF_CONFIG and what is wrong.
  """
  config = validate_tf_config(raw)
  if config is None:
    raise ValueError(
        'AsyncReplicator needs TF_CONFIG (or a cluster_resolver) describing a '
        '"chief", "worker" and "ps" cluster, e.g. start it with '
        '`python -m launch.ps_cluster -- python my_chief.py`')
  cluster = config["cluster"]
  for job in ("chief", "worker", "ps"):
    if not cluster.get(job):
      raise ValueError(f'TF_CONFIG["cluster"] must list "{job}" addresses for '
                       f"AsyncReplicator, got jobs {sorted(cluster)}")
  if len(cluster["chief"]) != 1:
    raise ValueError('TF_CONFIG["cluster"]["chief"] must hold exactly one '
                     f"address, got {cluster['chief']!r}")
  if config["task"]["type"] != "chief":
    raise ValueError(
        'AsyncReplicator runs in the chief (coordinator) process only, but '
        f'TF_CONFIG["task"]["type"] is {config["task"]["type"]!r}; worker and '
        "ps tasks run a tf.distribute.Server (python -m launch.ps_cluster --serve)")
  return config


class AsyncReplicator(ReplicatorMixin,
                      tf.distribute.experimental.ParameterServerStrategy):
  """Asynchronous data parallelism on parameter servers, driven by the chief.

  Create it in the chief process (TF_CONFIG task type "chief"); the worker and
  ps processes only serve (see `launch/ps_cluster.py`). Variables created in
  `scope()` go to the parameter servers (round robin, or split by
  `variable_partitioner`).

  `run(step_fn, input_fn)` does not wait: it schedules one step on a free
  worker and returns a `RemoteValue` (call `.fetch()`, or `fetch(...)` on a
  structure; `join()` waits for every scheduled step). A step that fails
  because its worker died is re-scheduled on another worker by the
  coordinator; other errors surface from `join()` / `fetch()`.

  Args:
    cluster_resolver: optional; default validates and reads TF_CONFIG.
    variable_partitioner: passed to `ParameterServerStrategy`.
    input_replication: only `PER_WORKER` (workers are interchangeable).
    jit_compile: compile each step's replica function with XLA.
  """

  def __init__(self, cluster_resolver=None, variable_partitioner=None,
               input_replication=PER_WORKER, jit_compile: bool = False):
    if input_replication is not PER_WORKER:
      raise NotImplementedError(
          "AsyncReplicator supports input_replication=PER_WORKER only: the "
          "coordinator runs each step on whichever worker is free, so there is "
          "no fixed replica id to build a PER_REPLICA pipeline for")
    if cluster_resolver is None:
      validate_ps_tf_config()
      cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    self._init_replicator(None, input_replication, None, jit_compile)
    self._iterators = {}
    self._iter_lock = threading.Lock()
    super().__init__(cluster_resolver, variable_partitioner=variable_partitioner)
    self._coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)

  # --- topology ---------------------------------------------------------------

  @property
  def coordinator(self) -> tf.distribute.experimental.coordinator.ClusterCoordinator:
    """The `ClusterCoordinator` that schedules this replicator's steps."""
    return self._coordinator

  @property
  def num_workers(self) -> int:
    """Worker processes that run steps (each one replica per step)."""
    return _private.ps_cluster_size(self)[0]

  @property
  def num_ps(self) -> int:
    return _private.ps_cluster_size(self)[1]

  @property
  def first_local_replica_id(self) -> int:
    return 0

  # --- run --------------------------------------------------------------------

  def run(self, fn, args=(), kwargs=None, options=None, *, input_fn=None):
    """Runs `fn`: schedules a step, or the built-in replica call.

    Two forms:

    * `run(step_fn, input_fn)`: schedules one step through the coordinator and
      returns at once with a `RemoteValue` of step_fn's output (fetch it, or
      call `join()`). `input_fn(ctx)` (a `tf.distribute.InputContext`; one
      pipeline per worker, all built from the same function) returns a
      `tf.data.Dataset`, or a callable returning a nested structure of
      tensors; it is built once on every worker (cached per `input_fn`), and
      each step takes the next element of the worker it runs on. Every
      worker's pipeline is separate, so shuffle or shard inside it (a fixed
      seed makes every worker read the same order). Prefer an infinite
      dataset and a fixed number of steps: a worker whose pipeline ends
      raises `OutOfRangeError` from `join()`.
    * `run(fn, args=(), kwargs=None, options=None)`: the `tf.distribute`
      form, unchanged; like the built-in strategy it must be called inside a
      function scheduled with `coordinator.schedule` (Keras does this).
    """
    input_fn, args = self._run_form(fn, args, kwargs, options, input_fn)
    if input_fn is None:
      return tf.distribute.experimental.ParameterServerStrategy.run(
          self, fn, args=args, kwargs=kwargs, options=options)
    step = self._replicated_step(fn, input_fn)
    return self._coordinator.schedule(step, args=(self._per_worker_iterator(input_fn),))

  def _per_worker_iterator(self, input_fn):
    with self._iter_lock:
      if input_fn not in self._iterators:
        def dataset_fn(ctx):
          made = input_fn(ctx)
          if isinstance(made, tf.data.Dataset):
            return made
          if callable(made):
            return tf.data.Dataset.from_tensors(0).repeat().map(lambda _: made())
          raise TypeError("input_fn must return a tf.data.Dataset or a callable "
                          f"returning tensors, got {type(made).__name__}")
        per_worker = self._coordinator.create_per_worker_dataset(
            lambda: self.distribute_datasets_from_function(dataset_fn))
        self._iterators[input_fn] = iter(per_worker)
      return self._iterators[input_fn]

  def _replicated_step(self, step_fn, input_fn) -> Callable:
    key = (step_fn, input_fn)
    with self._cache_lock:
      if key in self._steps:
        return self._steps[key]
    base_run = tf.distribute.experimental.ParameterServerStrategy.run

    def replicated(element):
      return base_run(self, step_fn, args=(element,))
    if self._jit_compile:
      replicated = tf.function(replicated, jit_compile=True)

    @tf.function
    def one_step(iterator):
      return replicated(next(iterator))

    with self._cache_lock:
      return self._steps.setdefault(key, one_step)

  def wait_for_workers(self, timeout: float = 300.0) -> None:
    """Blocks until every worker runs functions again (e.g. after a restart).

    A worker that died is marked failed until it is back and the coordinator
    has rebuilt its per-worker resources (datasets, per-worker variables);
    until then anything addressed to that worker in particular fails. This
    runs a no-op on every worker, retrying until all succeed.

    Raises:
      TimeoutError: when a worker is not back within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    noop = tf.function(lambda: tf.constant(0))
    while True:
      try:
        _private.run_on_every_worker(self._coordinator, noop)
        return
      except Exception as e:  # pylint: disable=broad-except
        if time.monotonic() >= deadline:
          raise TimeoutError(f"AsyncReplicator: not every worker was reachable "
                             f"within {timeout:g}s: {type(e).__name__}: {e}") from e
        time.sleep(0.5)

  def join(self) -> None:
    """Waits until every scheduled step finished; raises the first error."""
    self._coordinator.join()

  def fetch(self, value):
    """The values behind a structure of `RemoteValue`s (blocks until ready)."""
    return self._coordinator.fetch(value)

  # --- what an asynchronous cluster cannot do ----------------------------------

  def all_reduce(self, x, op="sum"):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="all_reduce"))

  def all_sum(self, x):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="all_sum"))

  def all_gather(self, x, axis: int = 0):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="all_gather"))

  def broadcast(self, x, source_replica: int = 0):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="broadcast"))

  def map_reduce(self, fn, x, op="sum"):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="map_reduce"))

  def map_gather(self, fn, x):
    raise NotImplementedError(_NO_COLLECTIVES.format(name="map_gather"))

  def logical_device(self, index: int):
    raise NotImplementedError(
        "AsyncReplicator: logical_device() is not supported: each worker runs "
        "one single-device replica (num_devices_per_replica=1), as in "
        "TF-Replicator's MultiWorkerAsyncReplicator")

  def per_replica_state(self, initial_value, name: str = "per_replica_state"):
    raise NotImplementedError(
        "AsyncReplicator: per_replica_state() is not supported: steps run on "
        "whichever worker is free, so there is no fixed replica to own a value. "
        "Keep worker-local state in per-worker variables "
        "(tf.Variable(..., per_worker_variable=True) in scope(); "
        "AsyncPush does this for DCT-DP residuals)")

  def wrap_optimizer(self, optimizer, compression=None):
    """Returns `optimizer` unchanged when `compression` is None.

    Each worker's step applies its own gradients to the server variables
    (there is no cross-replica aggregation to hook). Compressed pushes go
    through `tf_dct.compression.async_push.AsyncPush` instead.
    """
    if compression is not None:
      raise NotImplementedError(
          "AsyncReplicator: wrap_optimizer(compression=...) is not supported: "
          "there is no cross-replica aggregation to compress. Push sparse "
          "updates with tf_dct.compression.async_push.AsyncPush(replicator, "
          "compressor, learning_rate) inside step_fn instead")
    return optimizer
