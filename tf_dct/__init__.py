"""tf-dct: communication-efficient distributed training for TensorFlow 2.

The replicators extend TensorFlow's own strategies with the TF-Replicator API;
`tf_dct.compression` holds the gradient compressors that plug into
`wrap_optimizer`.
"""

from tf_dct import compression
from tf_dct.async_replicator import AsyncReplicator
from tf_dct import layers
from tf_dct import ops
from tf_dct.factory import create_replicator, split_cpu
from tf_dct.input_pipeline import PER_REPLICA, PER_WORKER, split_batch
from tf_dct.multi_worker import MultiWorkerReplicator, PeerFailureError
from tf_dct.per_replica_state import PerReplicaState
from tf_dct.replicator import Replicator
from tf_dct.tpu import TpuReplicator

__version__ = "0.1.0"

__all__ = [
    "AsyncReplicator", "PER_REPLICA", "PER_WORKER", "MultiWorkerReplicator",
    "PeerFailureError", "PerReplicaState",
    "Replicator", "TpuReplicator", "compression", "create_replicator", "layers",
    "ops",
    "split_batch", "split_cpu",
]
