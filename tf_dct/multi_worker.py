"""MultiWorkerReplicator: synchronous replicas on many machines (Table 1)."""

from __future__ import annotations

import json
import os

import tensorflow as tf

from tf_dct import _private
from tf_dct.replicator import PER_WORKER, ReplicatorMixin, check_positive_int


def validate_tf_config(raw: str | None = None) -> dict | None:
  """Parses TF_CONFIG and checks its shape; returns None when it is unset.

  Raises:
    ValueError: naming TF_CONFIG and what is wrong with it.
  """
  raw = os.environ.get("TF_CONFIG") if raw is None else raw
  if not raw:
    return None
  try:
    config = json.loads(raw)
  except json.JSONDecodeError as e:
    raise ValueError(f"TF_CONFIG is not valid JSON ({e.msg} at char {e.pos})") from None
  if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
    raise ValueError('TF_CONFIG must be a JSON object with a "cluster" object, '
                     'e.g. {"cluster": {"worker": ["host:port", ...]}, '
                     '"task": {"type": "worker", "index": 0}}')
  cluster = config["cluster"]
  if not cluster.get("worker") and not cluster.get("chief"):
    raise ValueError('TF_CONFIG["cluster"] must list "worker" (or "chief") addresses')
  for job, addresses in cluster.items():
    if (not isinstance(addresses, list) or
        not all(isinstance(a, str) and ":" in a for a in addresses)):
      raise ValueError(f'TF_CONFIG["cluster"]["{job}"] must be a list of '
                       f'"host:port" strings, got {addresses!r}')
  task = config.get("task")
  if not isinstance(task, dict):
    raise ValueError('TF_CONFIG must have a "task" object with "type" and "index"')
  task_type, index = task.get("type"), task.get("index")
  # A side-car evaluator may be absent from the cluster (as TF allows).
  if task_type not in cluster and task_type != "evaluator":
    raise ValueError(f'TF_CONFIG["task"]["type"] must be one of {sorted(cluster)}, '
                     f"got {task_type!r}")
  num_tasks = len(cluster[task_type]) if task_type in cluster else 1
  if (isinstance(index, bool) or not isinstance(index, int) or
      not 0 <= index < num_tasks):
    raise ValueError(f'TF_CONFIG["task"]["index"] must be an int in '
                     f"[0, {num_tasks}), got {index!r}")
  return config


class MultiWorkerReplicator(ReplicatorMixin,
                            tf.distribute.MultiWorkerMirroredStrategy):
  """One replica per local device on every worker; collectives over gRPC.

  The cluster comes from TF_CONFIG (validated first, with a clear error) or a
  `cluster_resolver`. Every worker runs the same program, and must create its
  replicators in the same order: collective keys are derived from that order.

  Args:
    cluster_resolver: optional; default reads TF_CONFIG.
    communication_options: `tf.distribute.experimental.CommunicationOptions`
      (e.g. a collective `timeout_seconds`).
    num_devices_per_replica: only 1 is supported on this kind.
    input_replication, input_split_fn, jit_compile: as for `Replicator`.
  """

  def __init__(self, cluster_resolver=None, communication_options=None,
               num_devices_per_replica: int = 1, input_replication=PER_WORKER,
               input_split_fn=None, jit_compile: bool = False):
    check_positive_int("num_devices_per_replica", num_devices_per_replica)
    if num_devices_per_replica != 1:
      raise NotImplementedError(
          "MultiWorkerReplicator supports num_devices_per_replica=1 only "
          f"(got {num_devices_per_replica}); use Replicator for model-parallel "
          "replicas on one machine")
    if cluster_resolver is None:
      validate_tf_config()
    self._init_replicator(None, input_replication, input_split_fn, jit_compile)
    _private.set_collective_key_base(self, _private.next_collective_key_base())
    super().__init__(cluster_resolver=cluster_resolver,
                     communication_options=communication_options)

  @property
  def worker_index(self) -> int:
    return self.first_local_replica_id // len(self.replica_devices)

  @property
  def is_chief(self) -> bool:
    return self.extended.should_checkpoint
