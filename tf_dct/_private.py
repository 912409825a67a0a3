"""The only module that touches private TensorFlow / Keras APIs.

Each accessor below names the private symbol it relies on. `check()` verifies
that every one of them still exists with the shape we expect, and
`tests/test_private.py` calls it, so an upgrade that moves one fails loudly in
one place instead of silently changing behaviour elsewhere.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.ops import resource_variable_ops

# Collective group keys of built-in strategies start at 1 + `_collective_key_base`
# (class attribute, read from the container strategy by `MirroredExtended` and
# `CollectiveAllReduceExtended` in their __init__). Every built-in instance uses
# base 0, so two strategies over the same devices in one process would share
# group keys. Ours take bases far above 0; the sequence is deterministic so that
# every worker of a multi-worker job derives the same keys.
_KEY_BASE_START = 1_000_000
_KEY_BASE_STRIDE = 100_000
_key_bases = itertools.count()


def next_collective_key_base() -> int:
  """Returns a fresh collective key base for one strategy instance."""
  return _KEY_BASE_START + _KEY_BASE_STRIDE * next(_key_bases)


def set_collective_key_base(strategy: tf.distribute.Strategy, base: int) -> None:
  """Sets the per-instance key base; call before the built-in __init__ runs."""
  strategy._collective_key_base = base  # pylint: disable=protected-access


def first_local_replica_id(strategy: tf.distribute.Strategy) -> int:
  """Global id of this worker's first replica (0 on a single worker)."""
  # `CollectiveAllReduceExtended._id_in_cluster` (chief-aware worker rank).
  rank = getattr(strategy.extended, "_id_in_cluster", 0)
  return int(rank) * len(strategy.extended.worker_devices)


def num_workers(strategy: tf.distribute.Strategy) -> int:
  """Worker processes the replicas of `strategy` span (1 on a single worker).

  Reads `CollectiveAllReduceExtended._num_workers` (MultiWorkerMirrored);
  strategies without it (Mirrored, one process) count as one worker.
  """
  return int(getattr(strategy.extended, "_num_workers", 1))


def input_context(strategy: tf.distribute.Strategy) -> tf.distribute.InputContext:
  """The `InputContext` of this worker's input pipeline."""
  rank = int(getattr(strategy.extended, "_id_in_cluster", 0))
  return tf.distribute.InputContext(
      num_input_pipelines=num_workers(strategy), input_pipeline_id=rank,
      num_replicas_in_sync=strategy.num_replicas_in_sync)


def unmirrored_variable(initial_value, name: str, device: str) -> tf.Variable:
  """Creates a plain resource variable that no strategy creator intercepts.

  Inside `strategy.scope()` every `tf.Variable(...)` call is routed through the
  strategy's variable creator and becomes a Mirrored/SyncOnRead variable whose
  checkpoint holds one value for all replicas. Calling the `ResourceVariable`
  class directly skips the creator stack (`VariableMetaclass` only applies
  creators for `tf.Variable` itself), so each replica gets a variable of its own
  that round-trips through `tf.train.Checkpoint` exactly.
  """
  with tf.init_scope(), tf.device(device):
    return resource_variable_ops.ResourceVariable(
        initial_value, trainable=False, name=name)


def per_worker_variable(initial_value, name: str) -> tf.Variable:
  """A variable with one independent copy on every worker of a PS strategy.

  Call in `ParameterServerStrategy.scope()`. `per_worker_variable=True` is
  popped by `ParameterServerStrategyV2Extended._create_variable`, which
  builds a `ps_values.PerWorkerVariable`: inside a function scheduled by the
  `ClusterCoordinator` it resolves to the copy of the worker running it;
  `read_all()` reads every copy. On worker recovery the coordinator re-creates
  the copy from `initial_value`.
  """
  with tf.init_scope():
    return tf.Variable(initial_value, name=name, trainable=False,
                       per_worker_variable=True)


def ps_cluster_size(strategy) -> tuple[int, int]:
  """(workers, parameter servers) of a `ParameterServerStrategy`.

  Reads `_num_workers` / `_num_ps`, set by `ParameterServerStrategyV2.
  _connect_to_cluster`.
  """
  return int(strategy._num_workers), int(strategy._num_ps)  # pylint: disable=protected-access


def run_on_every_worker(coordinator, fn) -> list:
  """Runs the tf.function `fn` once on every worker; returns each result.

  Uses `ClusterCoordinator._create_per_worker_resources` (one closure tagged
  per worker, run by that worker's thread). The returned RemoteValues are
  dropped after fetching, so the coordinator does not re-run `fn` when a
  worker recovers later.
  """
  per_worker = coordinator._create_per_worker_resources(fn)  # pylint: disable=protected-access
  values = list(per_worker._values)  # pylint: disable=protected-access
  results = [v.fetch() for v in values]
  del per_worker, values
  return results


KERAS3_AGGREGATION_METHOD = "_all_reduce_sum_gradients"


def keras3_optimizer_base():
  """Keras 3's TF-backend optimizer class that owns gradient aggregation."""
  from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer  # pylint: disable=g-import-not-at-top
  return keras_tf_optimizer.TFOptimizer


def coordination_key_value_store():
  """`(set(key, value), get(key, timeout_in_ms))` of the coordination service.

  Multi-worker strategies start TensorFlow's coordination service; its
  key-value store is reachable through the private eager context. Returns
  None when no service runs (one process).
  """
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  if not coordination_service_configured():
    return None
  ctx = context.context()
  return ctx.set_config_key_value, ctx.get_config_key_value


def coordination_service_configured() -> bool:
  """Whether this process has configured TF's coordination service.

  A multi-worker strategy configures it (once per process) right before it
  starts this task's gRPC server, through the eager context's
  `coordination_service` config.
  """
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  return context.context().coordination_service is not None


def configure_bounded_coordination_service(cluster_spec, task_type: str,
                                           register_timeout_seconds: float
                                          ) -> str | None:
  """Configures the coordination service with a bounded registration.

  `CollectiveAllReduceExtended._initialize_multi_worker` configures the
  service itself (its leader, the "chief" and "worker" jobs) only when none
  is configured yet; this configures it the same way first, adding
  `cluster_register_timeout_in_ms` and `cluster_register_with_barrier`:
  every task's registration (and so the strategy's start-up) then waits
  for all tasks at most `register_timeout_seconds`, and fails with a
  `DeadlineExceededError` instead of waiting for ever. Returns the service
  leader's task name (e.g. "/job:worker/replica:0/task:0"), or None (and
  configures nothing) when TF would not configure the service here.
  """
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import multi_worker_util  # pylint: disable=g-import-not-at-top
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  coordinated_jobs = ("chief", "worker")
  cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
  if coordination_service_configured() or task_type not in coordinated_jobs:
    return None
  leader = multi_worker_util.coordination_leader(cluster_spec)
  ctx = context.context()
  ctx.configure_coordination_service(
      service_type="standalone", service_leader=leader,
      coordinated_jobs=[
          coordination_config_pb2.CoordinatedJob(
              name=job, num_tasks=cluster_spec.num_tasks(job))
          for job in coordinated_jobs if job in cluster_spec.jobs],
      cluster_register_timeout_in_ms=max(1, int(register_timeout_seconds * 1000)))
  ctx.coordination_service.cluster_register_with_barrier = True
  return leader


def in_xla_context() -> bool:
  """Whether ops built now will be compiled by XLA.

  True inside `tf.function(jit_compile=True)` and TPU replication (their
  graphs carry an XLA control-flow context, possibly on an outer graph);
  uses `control_flow_util.GraphOrParentsInXlaContext`.
  """
  from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top
  assert flat_paths({"b": (1, 2), "a": [3]}) == [("a", 0), ("b", 0), ("b", 1)], (
      "tf.__internal__.nest.yield_flat_paths no longer follows tf.nest.flatten")
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  return control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph())


def static_replica_id(ctx: tf.distribute.ReplicaContext) -> int | None:
  """The replica id of `ctx` as a Python int; None when it is not static.

  The public `ReplicaContext.replica_id_in_sync_group` builds a new constant
  op on every call. Per-replica state calls it for every read and write, so a
  step of V variables got thousands of constants, each with the control
  inputs of the block it was built in. This reads the value the property
  wraps, `ReplicaContext._replica_id_in_sync_group`: a Python int under
  Mirrored strategies, a tensor under TPU replication (shared program).
  """
  value = ctx._replica_id_in_sync_group  # pylint: disable=protected-access
  if tf.is_tensor(value):
    value = tf.get_static_value(value)
    return None if value is None else int(value)
  return int(value)


def flat_paths(structure) -> list[tuple]:
  """The path (keys and indices) of each leaf of `structure`, in the order
  of `tf.nest.flatten`; uses `tf.__internal__.nest.yield_flat_paths`."""
  return list(tf.__internal__.nest.yield_flat_paths(structure))


def run_independently(op: tf.Operation) -> None:
  """Exempts the stateful `op` from the program order of a `tf.function`.

  Automatic control dependencies run stateful ops without resource inputs
  (e.g. `Timestamp`) one after another in the order they were built. Under
  MirroredStrategy all replicas build into one graph, so a replica's
  timestamps waited for the previous replica's, and with them the work
  they time. This marks `op` through the graph's
  `experimental_acd_manager.run_independently` (the mechanism TF uses for
  TPU infeed ops): it keeps its own control inputs and must still run, but
  joins no chain. Does nothing when eager or outside automatic control
  dependencies.
  """
  manager = getattr(op.graph, "experimental_acd_manager", None)
  if manager is not None:
    manager.run_independently(op)


def tf_keras_var_key(optimizer, variable):
  """tf-keras `Optimizer._var_key`: one key for a distributed variable and
  each of its per-device components (what `update_step` receives)."""
  return optimizer._var_key(variable)  # pylint: disable=protected-access


def keras3_var_key(optimizer, variable):
  """Keras 3 (TF backend) `TFOptimizer._var_key`: one key for a Keras
  variable, its backing tf.Variable, a distributed variable and each of its
  per-device components (what `update_step` receives)."""
  return optimizer._var_key(variable)  # pylint: disable=protected-access


def inbound_layers(layer) -> list:
  """The layers feeding `layer` in the functional models it was called in:
  `layer._inbound_nodes`, each node's `inbound_layers` (tf-keras) or its
  `parent_nodes`' operations (Keras 3)."""
  out = []
  for node in layer._inbound_nodes:  # pylint: disable=protected-access
    if not hasattr(node, "inbound_layers"):  # Keras 3
      out += [parent.operation for parent in node.parent_nodes]
      continue
    inbound = node.inbound_layers
    out += inbound if isinstance(inbound, (list, tuple)) else [inbound]
  return out


def per_device_iterators_without_autotune() -> None:
  """Makes the per-device side of every `MultiDeviceIterator` skip autotune.

  `multi_device_iterator_ops._create_device_dataset` builds each device's
  side (a fixed-size prefetch of what the host iterator hands out) as a new
  dataset with default options, whatever the input's options say, so each
  per-device iterator starts a tf.data autotune thread. Destroying the
  iterator (when `fit` returns, or when its owner is collected) waits for
  those threads, which sleep up to a minute between optimizations. With
  fixed buffer sizes there is nothing for them to tune. Idempotent;
  process-wide (the tests and their worker scripts call it at start).
  """
  from tensorflow.python.data.ops import multi_device_iterator_ops as mdi  # pylint: disable=g-import-not-at-top
  create = mdi._create_device_dataset  # pylint: disable=protected-access
  if getattr(create, "_tf_dct_without_autotune", False):
    return

  @functools.wraps(create)
  def create_without_autotune(*args, **kwargs):
    options = tf.data.Options()
    options.autotune.enabled = False
    return create(*args, **kwargs).with_options(options)

  create_without_autotune._tf_dct_without_autotune = True  # pylint: disable=protected-access
  mdi._create_device_dataset = create_without_autotune  # pylint: disable=protected-access


def check() -> None:
  """Raises AssertionError if a private API we rely on has drifted."""
  from tensorflow.python.framework import auto_control_deps as acd  # pylint: disable=g-import-not-at-top
  assert callable(getattr(acd.AutomaticControlDependencies,
                          "run_independently", None)), (
      "AutomaticControlDependencies.run_independently is gone")
  assert "experimental_acd_manager = self" in inspect.getsource(
      acd.AutomaticControlDependencies.__enter__), (
          "AutomaticControlDependencies no longer sets "
          "graph.experimental_acd_manager")
  assert isinstance(mirrored_strategy.MirroredStrategy._collective_key_base, int), (
      "MirroredStrategy._collective_key_base is gone")
  src = inspect.getsource(mirrored_strategy.MirroredExtended.__init__)
  assert "container_strategy._collective_key_base" in src, (
      "MirroredExtended no longer reads the key base from the container")
  from tensorflow.python.distribute import collective_all_reduce_strategy as cars  # pylint: disable=g-import-not-at-top
  src = inspect.getsource(cars.CollectiveAllReduceExtended)
  assert "container_strategy._collective_key_base" in src, (
      "CollectiveAllReduceExtended no longer reads the key base")
  assert "_id_in_cluster" in src, "CollectiveAllReduceExtended._id_in_cluster is gone"
  assert "self._num_workers" in src, "CollectiveAllReduceExtended._num_workers is gone"
  assert hasattr(resource_variable_ops, "ResourceVariable")
  from tensorflow.python.distribute import parameter_server_strategy_v2 as pss  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute import ps_values  # pylint: disable=g-import-not-at-top
  from tensorflow.python.distribute.coordinator import cluster_coordinator as cc  # pylint: disable=g-import-not-at-top
  src = inspect.getsource(pss.ParameterServerStrategyV2Extended._create_variable)
  assert 'kwargs.pop("per_worker_variable"' in src, (
      "ParameterServerStrategy no longer accepts per_worker_variable=True")
  assert callable(getattr(ps_values.PerWorkerVariable, "read_all", None)), (
      "PerWorkerVariable.read_all is gone")
  assert callable(getattr(cc.ClusterCoordinator, "_create_per_worker_resources",
                          None)), "ClusterCoordinator._create_per_worker_resources is gone"
  assert "_values" in inspect.getsource(cc.PerWorkerValues.__init__), (
      "PerWorkerValues no longer keeps its RemoteValues in _values")
  assert "_num_workers" in inspect.getsource(pss.ParameterServerStrategyV2._connect_to_cluster), (
      "ParameterServerStrategyV2._num_workers is gone")
  from tensorflow.python.eager import context  # pylint: disable=g-import-not-at-top
  for name, params in (("set_config_key_value", ["self", "key", "value"]),
                       ("get_config_key_value", ["self", "key", "timeout_in_ms"])):
    fn = getattr(context.Context, name, None)
    assert callable(fn), f"eager Context.{name} is gone"
    assert list(inspect.signature(fn).parameters) == params, (
        f"eager Context.{name} signature changed")
  assert hasattr(context.Context, "coordination_service"), (
      "eager Context.coordination_service is gone")
  params = inspect.signature(context.Context.configure_coordination_service).parameters
  assert {"service_type", "service_leader", "coordinated_jobs",
          "cluster_register_timeout_in_ms"} <= set(params), (
              "eager Context.configure_coordination_service signature changed")
  src = inspect.getsource(cars.CollectiveAllReduceExtended._initialize_multi_worker)
  assert ("if context.context().coordination_service is None:" in src
          and 'coordinated_jobs = ["chief", "worker"]' in src
          and "multi_worker_util.coordination_leader(" in src), (
              "MultiWorkerMirroredStrategy no longer configures the coordination "
              "service only when none is configured, for chief and worker")
  from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2  # pylint: disable=g-import-not-at-top
  fields = coordination_config_pb2.CoordinationServiceConfig.DESCRIPTOR.fields_by_name
  assert {"cluster_register_timeout_in_ms", "cluster_register_with_barrier"} <= set(fields), (
      "CoordinationServiceConfig lost its cluster registration fields")
  from tensorflow.python.distribute import distribute_lib  # pylint: disable=g-import-not-at-top
  src = inspect.getsource(distribute_lib.ReplicaContext.replica_id_in_sync_group.fget)
  assert "self._replica_id_in_sync_group" in src, (
      "ReplicaContext.replica_id_in_sync_group no longer wraps "
      "_replica_id_in_sync_group")
  from tensorflow.python.data.ops import multi_device_iterator_ops as mdi  # pylint: disable=g-import-not-at-top
  create = mdi._create_device_dataset  # pylint: disable=protected-access
  create = getattr(create, "__wrapped__", create)  # the original, if wrapped
  assert list(inspect.signature(create).parameters) == [
      "prototype_ds", "incarnation_id", "prefetch_buffer_size",
      "experimental_slack"], "_create_device_dataset signature changed"
  for cls in (mdi.MultiDeviceIterator, mdi.OwnedMultiDeviceIterator):
    assert "_create_device_dataset(" in inspect.getsource(cls), (
        f"{cls.__name__} no longer builds its per-device datasets with "
        "multi_device_iterator_ops._create_device_dataset")
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  assert callable(getattr(control_flow_util, "GraphOrParentsInXlaContext", None)), (
      "control_flow_util.GraphOrParentsInXlaContext is gone")
  import tf_keras  # pylint: disable=g-import-not-at-top
  import keras  # pylint: disable=g-import-not-at-top
  for flavour in (tf_keras, keras):
    x = flavour.Input((2,))
    first = flavour.layers.Dense(2)
    second = flavour.layers.Dense(1)
    second(first(x))
    assert inbound_layers(second) == [first], (
        f"{flavour.__name__}: a layer's _inbound_nodes no longer name the "
        "layers feeding it (inbound_layers)")
  src = inspect.getsource(tf_keras.optimizers.Optimizer._var_key)
  assert "_distributed_container" in src, (
      "tf-keras Optimizer._var_key no longer maps components to their container")
  src = inspect.getsource(tf_keras.optimizers.SGD.update_step)
  assert "self.momentum" in src and "self.nesterov" in src, (
      "tf-keras SGD.update_step no longer reads momentum / nesterov")
  base = keras3_optimizer_base()
  method = getattr(base, KERAS3_AGGREGATION_METHOD, None)
  assert callable(method), f"Keras 3 TFOptimizer.{KERAS3_AGGREGATION_METHOD} is gone"
  params = list(inspect.signature(method).parameters)
  assert params == ["self", "grads_and_vars"], (
      f"Keras 3 {KERAS3_AGGREGATION_METHOD} signature changed: {params}")
  update_src = inspect.getsource(base._backend_update_step)
  assert KERAS3_AGGREGATION_METHOD in update_src, (
      "Keras 3 _backend_update_step no longer calls the aggregation method")
  assert "_distributed_container" in inspect.getsource(base._var_key), (
      "Keras 3 TFOptimizer._var_key no longer maps components to their container")
  assert "self.update_step(grad, var, learning_rate)" in inspect.getsource(
      base._distributed_tf_update_step), (
          "Keras 3 no longer applies each variable through update_step")
  # `tf_dct.keras.updates_wait_for_aggregation`: Keras 3's public `apply`
  # aggregates (in `_backend_apply_gradients`) before it counts the step.
  apply_src = inspect.getsource(base.apply)
  assert ("_backend_apply_gradients" in apply_src
          and "_iterations.assign_add(1)" in apply_src
          and apply_src.index("_backend_apply_gradients")
          < apply_src.index("_iterations.assign_add(1)")), (
              "Keras 3 apply no longer counts the step after aggregating")
  assert update_src.index(KERAS3_AGGREGATION_METHOD) < update_src.index(
      "maybe_merge_call"), (
          "Keras 3 no longer aggregates in replica context, before its merge")
