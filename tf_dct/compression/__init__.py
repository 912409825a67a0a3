"""Gradient compressors that plug into `wrap_optimizer(..., compression=...)`."""

from tf_dct.compression.base import Compressor
from tf_dct.compression.dct_dp import DCTDP
from tf_dct.compression.dense import Dense

__all__ = ["Compressor", "DCTDP", "Dense"]
