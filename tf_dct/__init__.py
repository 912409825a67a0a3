"""tf-dct: communication-efficient distributed training for TensorFlow 2.

Three rooms: `tf_dct.distribute` (the replicators: TensorFlow's own strategies
with the TF-Replicator API), `tf_dct.compression` (the gradient compressors
that plug into `wrap_optimizer`) and `tf_dct.dct_mp` (activation compression
at model-parallel splits); `tf_dct.keras` adapts Keras optimizers to them.
docs/architecture.md says what each may import.
"""

from tf_dct import _lazy
from tf_dct import distribute  # light: its names load on first use too

# Imported on first use (`_lazy`): `import tf_dct` alone loads no TensorFlow.
# The replicators are `tf_dct.distribute`'s (all but its mixin).
_EXPORTS = {name: module for name, module in distribute._EXPORTS.items()  # pylint: disable=protected-access
            if name != "ReplicatorMixin"}
_EXPORTS.update({
    "compression": "tf_dct.compression",
    "dct_mp": "tf_dct.dct_mp",
    "distribute": "tf_dct.distribute",
    "keras": "tf_dct.keras",
    "wrap_optimizer": "tf_dct.keras",
})
__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "AsyncReplicator", "PER_REPLICA", "PER_WORKER", "MultiWorkerReplicator",
    "PeerFailureError", "PerReplicaState",
    "Replicator", "TpuReplicator", "compression", "create_replicator", "dct_mp",
    "distribute", "split_batch", "split_cpu", "wrap_optimizer",
]
