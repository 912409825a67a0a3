"""tf-dct: communication-efficient distributed training for TensorFlow 2.

Three rooms: `tf_dct.distribute` (the replicators: TensorFlow's own strategies
with the TF-Replicator API), `tf_dct.compression` (the gradient compressors
that plug into `wrap_optimizer`) and `tf_dct.dct_mp` (activation compression
at model-parallel splits); `tf_dct.keras` adapts Keras optimizers to them.
docs/architecture.md says what each may import.
"""

from tf_dct import compression
from tf_dct import dct_mp
from tf_dct import distribute
from tf_dct.distribute.async_replicator import AsyncReplicator
from tf_dct.distribute.factory import create_replicator, split_cpu
from tf_dct.distribute.input_pipeline import PER_REPLICA, PER_WORKER, split_batch
from tf_dct.distribute.multi_worker import MultiWorkerReplicator, PeerFailureError
from tf_dct.distribute.per_replica_state import PerReplicaState
from tf_dct.distribute.replicator import Replicator
from tf_dct.distribute.tpu import TpuReplicator
from tf_dct.keras import wrap_optimizer

__version__ = "0.1.0"

__all__ = [
    "AsyncReplicator", "PER_REPLICA", "PER_WORKER", "MultiWorkerReplicator",
    "PeerFailureError", "PerReplicaState",
    "Replicator", "TpuReplicator", "compression", "create_replicator", "dct_mp",
    "distribute", "split_batch", "split_cpu", "wrap_optimizer",
]
