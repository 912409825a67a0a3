"""DCT-MP activation compression ops (DCT Algorithm 2) and Appendix-A baselines.

Core ops know nothing of Keras; `tf_dct.layers` wraps them as layers.
"""

from tf_dct.ops.compact_transfer import compact
from tf_dct.ops.compact_transfer import compact_bytes
from tf_dct.ops.compact_transfer import dct_mp_transfer
from tf_dct.ops.compact_transfer import dense_bytes
from tf_dct.ops.compact_transfer import densify
from tf_dct.ops.dct_mp import dct_mp
from tf_dct.ops.dct_mp import dct_mp_kept
from tf_dct.ops.dct_mp import dct_mp_mask
from tf_dct.ops.dct_mp import kept_at
from tf_dct.ops.dct_mp import WARMUPS
from tf_dct.ops.dct_mp import num_dropped
from tf_dct.ops.dct_mp import num_kept
from tf_dct.ops.gaussian_sketch import gaussian_sketch
from tf_dct.ops.gaussian_sketch import sketch_matrix
from tf_dct.ops.index_wire import decode_indices
from tf_dct.ops.index_wire import encode_indices
from tf_dct.ops.index_wire import index_bits
from tf_dct.ops.index_wire import index_bytes_per_row
from tf_dct.ops.index_wire import index_dtype_for
from tf_dct.ops.index_wire import pack_indices
from tf_dct.ops.index_wire import unpack_indices
from tf_dct.ops.index_wire import words_per_row
from tf_dct.ops.xgrad_topk import xgrad_topk

__all__ = [
    "compact", "compact_bytes", "dct_mp", "dct_mp_kept", "dct_mp_mask", "dct_mp_transfer",
    "decode_indices", "dense_bytes", "densify", "encode_indices",
    "gaussian_sketch", "index_bits", "index_bytes_per_row", "index_dtype_for",
    "kept_at", "num_dropped", "num_kept", "pack_indices", "sketch_matrix",
    "unpack_indices", "WARMUPS", "words_per_row", "xgrad_topk",
]
