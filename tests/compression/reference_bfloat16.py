"""numpy reference of the bfloat16 value words (`sparse_wire.round_values`),
and float32 values that exercise their rounding."""

import numpy as np

from tf_dct.compression import sparse_wire


def np_bfloat16_bits(x, tiny=True):
  """uint16 bits of float32 `x` rounded to bfloat16, nearest even: the upper
  16 bits of x plus one where the lower 16 exceed half, or equal it and the
  upper half is odd (finite values only); with `tiny`, 0 below
  `sparse_wire.TINY` (`round_values`)."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  upper, lower = bits >> 16, bits & 0xFFFF
  up = (lower > 0x8000) | ((lower == 0x8000) & (upper & 1 == 1))
  out = (upper + up).astype(np.uint16)
  if not tiny:
    return out
  return np.where(np.abs(np.asarray(x, np.float32)) < sparse_wire.TINY, 0, out
                  ).astype(np.uint16)


def np_bfloat16_value(bits):
  """float32 of uint16 bfloat16 bits."""
  return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def tricky_floats(size, seed):
  """float32 values that exercise the rounding: exact ties (even and odd
  upper halves), just above / below a tie, values that carry into the
  exponent, tiny normals and subnormals, negatives and zero."""
  rng = np.random.default_rng(seed)
  upper = rng.integers(0x0001, 0x7F00, size).astype(np.uint32)
  lower = rng.choice([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], size).astype(np.uint32)
  sign = rng.choice([0, 1], size).astype(np.uint32) << 31
  x = (sign | (upper << 16) | lower).view(np.float32)
  # Zero, a subnormal, a normal whose error would be subnormal, either side
  # of TINY, and a tie that carries into the exponent.
  x[:6] = [0.0, 1e-40, -3e-37, np.float32(2.0**-103), -np.float32(2.0**-103)
           * np.float32(1 - 2.0**-20), np.float32(2.0 - 2.0**-8)]
  return x
