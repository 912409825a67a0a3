"""TpuReplicator: synchronous replicas on TPU cores, compiled by XLA (Table 1)."""

from __future__ import annotations

import tensorflow as tf

from tf_dct.distribute.replicator import PER_WORKER, ReplicatorMixin, check_positive_int


def resolve_tpu(tpu: str | None):
  """Finds, connects to and initializes a TPU; raises a clear error if none."""
  try:
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
  except (ValueError, RuntimeError, tf.errors.OpError) as e:
    raise RuntimeError(
        f"TpuReplicator: no TPU could be used for tpu={tpu!r} ({e}). Run on a "
        "TPU VM (tpu='local') or pass a TPU name/grpc address; on CPU or GPU "
        "use kind='cpu' or kind='gpu'.") from e
  return resolver


class TpuReplicator(ReplicatorMixin, tf.distribute.TPUStrategy):
  """One replica per TPU core.

  Per-replica state and `logical_device` need a static replica id, which TPU
  replicas (one XLA program for all cores) do not have: both raise a clear
  NotImplementedError on this kind.

  Args:
    tpu: "local" on a TPU VM, or a TPU name / grpc address.
    num_devices_per_replica: only 1 is supported on this kind.
    input_replication, input_split_fn: as for `Replicator`.
  """

  def __init__(self, tpu: str = "local", num_devices_per_replica: int = 1,
               input_replication=PER_WORKER, input_split_fn=None):
    check_positive_int("num_devices_per_replica", num_devices_per_replica)
    if num_devices_per_replica != 1:
      raise NotImplementedError("TpuReplicator supports num_devices_per_replica=1 "
                                f"only, got {num_devices_per_replica}")
    self._init_replicator(None, input_replication, input_split_fn,
                          jit_compile=False)  # TPUStrategy.run compiles anyway
    super().__init__(resolve_tpu(tpu))
