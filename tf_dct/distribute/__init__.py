"""Replicators: TensorFlow's strategies with the TF-Replicator API.

Each replicator is a thin subclass of a built-in strategy (`Replicator` of
MirroredStrategy, `MultiWorkerReplicator`, `TpuReplicator`, `AsyncReplicator`
of ParameterServerStrategyV2) sharing `ReplicatorMixin`: `run(step_fn,
input_fn)`, the primitives, `logical_device` and per-replica state. Nothing
here knows of compression or Keras.
"""

from tf_dct.distribute.async_replicator import AsyncReplicator
from tf_dct.distribute.factory import create_replicator, split_cpu
from tf_dct.distribute.input_pipeline import PER_REPLICA, PER_WORKER, split_batch
from tf_dct.distribute.multi_worker import MultiWorkerReplicator, PeerFailureError
from tf_dct.distribute.per_replica_state import PerReplicaState
from tf_dct.distribute.replicator import Replicator, ReplicatorMixin
from tf_dct.distribute.tpu import TpuReplicator

__all__ = [
    "AsyncReplicator", "MultiWorkerReplicator", "PER_REPLICA", "PER_WORKER",
    "PeerFailureError", "PerReplicaState", "Replicator", "ReplicatorMixin",
    "TpuReplicator", "create_replicator", "split_batch", "split_cpu",
]
