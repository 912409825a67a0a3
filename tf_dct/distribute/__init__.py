"""Replicators: TensorFlow's strategies with the TF-Replicator API.

Each replicator is a thin subclass of a built-in strategy (`Replicator` of
MirroredStrategy, `MultiWorkerReplicator`, `TpuReplicator`, `AsyncReplicator`
of ParameterServerStrategyV2) sharing `ReplicatorMixin`: `run(step_fn,
input_fn)`, the primitives, `logical_device` and per-replica state. Nothing
here knows of compression or Keras.
"""

from tf_dct import _lazy

# Imported on first use (`_lazy`): `tf_dct.distribute.ports` alone loads no
# TensorFlow.
_EXPORTS = {
    "AsyncReplicator": "tf_dct.distribute.async_replicator",
    "MultiWorkerReplicator": "tf_dct.distribute.multi_worker",
    "PER_REPLICA": "tf_dct.distribute.input_pipeline",
    "PER_WORKER": "tf_dct.distribute.input_pipeline",
    "PeerFailureError": "tf_dct.distribute.multi_worker",
    "PerReplicaState": "tf_dct.distribute.per_replica_state",
    "Replicator": "tf_dct.distribute.replicator",
    "ReplicatorMixin": "tf_dct.distribute.replicator",
    "TpuReplicator": "tf_dct.distribute.tpu",
    "create_replicator": "tf_dct.distribute.factory",
    "split_batch": "tf_dct.distribute.input_pipeline",
    "split_cpu": "tf_dct.distribute.factory",
}
__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS)

__all__ = [
    "AsyncReplicator", "MultiWorkerReplicator", "PER_REPLICA", "PER_WORKER",
    "PeerFailureError", "PerReplicaState", "Replicator", "ReplicatorMixin",
    "TpuReplicator", "create_replicator", "split_batch", "split_cpu",
]
