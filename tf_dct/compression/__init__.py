"""Gradient compressors that plug into `wrap_optimizer(..., compression=...)`."""

from tf_dct.compression.base import Compressor
from tf_dct.compression.cltk import CLTK
from tf_dct.compression.dct_dp import DCTDP
from tf_dct.compression.deft import DEFT
from tf_dct.compression.dense import Dense
from tf_dct.compression.hard_threshold import HardThreshold
from tf_dct.compression.topk import TopK

__all__ = ["CLTK", "Compressor", "DCTDP", "DEFT", "Dense", "HardThreshold",
           "TopK"]
