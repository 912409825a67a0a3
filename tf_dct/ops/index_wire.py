"""Column indices of the DCT-MP compact form on the wire: bytes or bit-packed.

Each row sends k column indices in [0, d). Two encodings; the smaller per row
is used (`packs(d, k)`), ties go to the byte-aligned one:

* Byte-aligned: the narrowest integer type holding d - 1 (`index_dtype_for`):
  uint8 for d <= 256, int16 for d <= 32768, int32 above; k * size bytes.
* Bit-packed: b = ceil(log2 d) bits per index (`index_bits`, 0 for d = 1),
  the row's k indices concatenated into W = ceil(k * b / 32) int32 words
  (`words_per_row`); 4 * W bytes. Layout: index j of a row holds bits
  [j * b, (j + 1) * b) of the row's bit stream, least significant bit first,
  and stream bit t is bit t % 32 of word t // 32 (two's complement: bit 31 is
  the sign). The unused tail bits of the last word are 0.

Example: d = 512, k = 26 (sparsity 0.95): 9 bits per index, 234 bits in 8
words, 32 bytes per row instead of 52 as int16.

Both encodings have static shapes ([N, k] or [N, W], N the rows) and use
only elementwise ops, reshapes and sums, so they compile with XLA
(`jit_compile=True`). Packing works on one row at a time, so the size per row
does not depend on N and N may be dynamic.
"""

from __future__ import annotations

import numbers

import tensorflow as tf

WORD_BITS = 32


def _check_d(d, caller: str) -> int:
  if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not (
      1 <= d <= 2**31):
    raise ValueError(f"{caller}: d must be an int in [1, 2**31], got {d!r}")
  return int(d)


def _check_k(k, caller: str) -> int:
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
    raise ValueError(f"{caller}: k must be an int >= 0, got {k!r}")
  return int(k)


def index_dtype_for(d: int) -> tf.DType:
  """The narrowest byte-aligned index type for a last axis of size d."""
  d = _check_d(d, "index_dtype_for")
  if d <= 256:
    return tf.uint8
  if d <= 32768:
    return tf.int16
  return tf.int32


def index_bits(d: int) -> int:
  """b = ceil(log2 d): bits per bit-packed index (0 for d = 1)."""
  return (_check_d(d, "index_bits") - 1).bit_length()


def words_per_row(d: int, k: int) -> int:
  """W = ceil(k * b / 32): int32 words per row of k bit-packed indices."""
  k = _check_k(k, "words_per_row")
  return -(-k * index_bits(d) // WORD_BITS)


def packs(d: int, k: int) -> bool:
  """True if bit-packing k indices of [0, d) is smaller than bytes per index."""
  aligned = _check_k(k, "packs") * index_dtype_for(d).size
  return 4 * words_per_row(d, k) < aligned


def index_bytes_per_row(d: int, k: int) -> int:
  """Bytes per row of the indices on the wire (the smaller encoding)."""
  if packs(d, k):
    return 4 * words_per_row(d, k)
  return k * index_dtype_for(d).size


def _rows(t: tf.Tensor):
  return t.shape[0] if t.shape[0] is not None else tf.shape(t)[0]


def _check_rank_2(t: tf.Tensor, what: str, caller: str) -> None:
  if t.shape.rank != 2 or t.shape[1] is None:
    raise ValueError(f"{caller}: {what} must have rank 2 with a static last "
                     f"axis, got shape {t.shape}")


def pack_indices(indices, d: int) -> tf.Tensor:
  """Bit-packs int32 indices [N, k] in [0, d) into int32 words [N, W].

  Entries outside [0, d) are not detected: only their low b bits are kept.
  """
  d = _check_d(d, "pack_indices")
  indices = tf.convert_to_tensor(indices)
  if indices.dtype != tf.int32:
    raise TypeError(f"pack_indices: indices must be int32, got {indices.dtype.name}")
  _check_rank_2(indices, "indices", "pack_indices")
  k, b = indices.shape[1], index_bits(d)
  w = words_per_row(d, k)
  n = _rows(indices)
  # Bit i of index j -> stream bit j * b + i -> bit t % 32 of word t // 32.
  bits = tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(indices[:, :, None], tf.range(b, dtype=tf.int32)), 1)
  bits = tf.pad(tf.reshape(bits, [n, k * b]), [[0, 0], [0, WORD_BITS * w - k * b]])
  # Distinct powers of two, bit 31 as -2**31: every partial sum fits in int32.
  weights = tf.constant([1 << i for i in range(WORD_BITS - 1)] + [-(1 << 31)],
                        tf.int32)
  return tf.reduce_sum(tf.reshape(bits, [n, w, WORD_BITS]) * weights, axis=-1)


def unpack_indices(words, d: int, k: int) -> tf.Tensor:
  """The int32 indices [N, k] that `pack_indices(indices, d)` packed to `words`."""
  d, k = _check_d(d, "unpack_indices"), _check_k(k, "unpack_indices")
  words = tf.convert_to_tensor(words)
  if words.dtype != tf.int32:
    raise TypeError(f"unpack_indices: words must be int32, got {words.dtype.name}")
  _check_rank_2(words, "words", "unpack_indices")
  b, w = index_bits(d), words_per_row(d, k)
  if words.shape[1] != w:
    raise ValueError(f"unpack_indices: words must have W = ceil(k * b / 32) = "
                     f"{w} columns for d = {d}, k = {k}, got shape {words.shape}")
  n = _rows(words)
  bits = tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(words[:, :, None], tf.range(WORD_BITS, dtype=tf.int32)),
      1)
  bits = tf.reshape(tf.reshape(bits, [n, w * WORD_BITS])[:, :k * b], [n, k, b])
  weights = tf.constant([1 << i for i in range(b)], tf.int32, shape=[b])
  return tf.reduce_sum(bits * weights, axis=-1)


def encode_indices(indices: tf.Tensor, d: int) -> tf.Tensor:
  """int32 indices [N, k] -> what crosses: packed words or a narrow type."""
  if packs(d, indices.shape[-1]):
    return pack_indices(indices, d)
  return tf.cast(indices, index_dtype_for(d))


def decode_indices(wire: tf.Tensor, d: int, k: int) -> tf.Tensor:
  """The inverse of `encode_indices`: int32 indices [N, k]."""
  if packs(d, k):
    return unpack_indices(wire, d, k)
  return tf.cast(wire, tf.int32)
