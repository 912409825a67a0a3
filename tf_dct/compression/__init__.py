"""Gradient compressors that plug into `wrap_optimizer(..., compression=...)`."""

from tf_dct.compression.base import Compressor
from tf_dct.compression.dense import Dense

__all__ = ["Compressor", "Dense"]
