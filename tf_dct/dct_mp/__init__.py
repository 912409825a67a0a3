"""DCT-MP: activation compression at model-parallel splits (DCT Algorithm 2).

`op` (the per-row top-k mask, optionally `rescale`d), `transfer` (the compact form sent across
devices, its indices encoded by `index_wire`) and the Appendix-A baselines
(`gaussian_sketch`, `xgrad_topk`) know nothing of Keras; `split.SplitCore`
holds the split point's logic and `DCTSplit` (tf-keras) / `Keras3DCTSplit`
(Keras 3) are its thin layers.
"""

from tf_dct.dct_mp.transfer import compact
from tf_dct.dct_mp.transfer import compact_bytes
from tf_dct.dct_mp.transfer import dct_mp_transfer
from tf_dct.dct_mp.transfer import dense_bytes
from tf_dct.dct_mp.transfer import densify
from tf_dct.dct_mp.op import WARMUPS
from tf_dct.dct_mp.rescale import RESCALES
from tf_dct.dct_mp.rescale import row_scale
from tf_dct.dct_mp.op import dct_mp
from tf_dct.dct_mp.op import dct_mp_kept
from tf_dct.dct_mp.op import dct_mp_mask
from tf_dct.dct_mp.op import kept_at
from tf_dct.dct_mp.op import num_dropped
from tf_dct.dct_mp.op import num_kept
from tf_dct.dct_mp.gaussian_sketch import gaussian_sketch
from tf_dct.dct_mp.gaussian_sketch import sketch_matrix
from tf_dct.dct_mp.index_wire import decode_indices
from tf_dct.dct_mp.index_wire import encode_indices
from tf_dct.dct_mp.index_wire import index_bits
from tf_dct.dct_mp.index_wire import index_bytes_per_row
from tf_dct.dct_mp.index_wire import index_dtype_for
from tf_dct.dct_mp.index_wire import pack_indices
from tf_dct.dct_mp.index_wire import unpack_indices
from tf_dct.dct_mp.index_wire import words_per_row
from tf_dct.dct_mp.xgrad_topk import xgrad_topk
from tf_dct.dct_mp.split import MODES
from tf_dct.dct_mp.split import SplitCore
from tf_dct.dct_mp.keras3_split import DCTSplit as Keras3DCTSplit
from tf_dct.dct_mp.tf_keras_split import DCTSplit

__all__ = [
    "DCTSplit", "Keras3DCTSplit", "MODES", "RESCALES", "SplitCore", "WARMUPS", "compact", "compact_bytes", "dct_mp", "dct_mp_kept", "dct_mp_mask", "dct_mp_transfer",
    "decode_indices", "dense_bytes", "densify", "encode_indices",
    "gaussian_sketch", "index_bits", "index_bytes_per_row", "index_dtype_for",
    "kept_at", "num_dropped", "num_kept", "pack_indices", "row_scale", "sketch_matrix",
    "unpack_indices", "words_per_row", "xgrad_topk",
]
