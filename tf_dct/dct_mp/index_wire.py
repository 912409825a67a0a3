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

Both encodings have static shapes ([N, k] or [N, W], N the rows): packing
shifts each index to its offset in int64 and sums, per word, the parts that
land in it (a gather with a static table); unpacking gathers each index's
word (and the next, if it spills over) and shifts back. Only elementwise ops,
gathers and sums, O(N * k), so they compile with XLA (`jit_compile=True`).
Packing works on one row at a time, so the size per row does not depend on N
and N may be dynamic.
"""

from __future__ import annotations

import numbers

import numpy as np
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


def _layout(d: int, k: int):
  """Static per-index word w, bit offset o and whether it spills into w + 1."""
  b = index_bits(d)
  start = np.arange(k, dtype=np.int64) * b
  word, offset = start // WORD_BITS, start % WORD_BITS
  return b, word, offset, offset + b > WORD_BITS


def _word_table(d: int, k: int) -> np.ndarray:
  """[W, P] positions in concat([low parts, high parts]) ([N, 2k]) per word.

  Word q sums the low parts (bits below 32 after the shift) of the indices
  starting in it and the high part of the index spilling into it. Unused
  slots point at position k, the high part of index 0, which is always 0
  (index 0 starts at bit 0 and b <= 31).
  """
  _, word, _, spills = _layout(d, k)
  owner = np.concatenate([word, word[spills] + 1])
  position = np.concatenate([np.arange(k), k + np.arange(k)[spills]])
  order = np.argsort(owner, kind="stable")
  owner, position = owner[order], position[order]
  counts = np.bincount(owner, minlength=words_per_row(d, k))
  slot = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
  table = np.full((len(counts), counts.max()), k, np.int32)
  table[owner, slot] = position
  return table


def pack_indices(indices, d: int) -> tf.Tensor:
  """Bit-packs int32 indices [N, k] in [0, d) into int32 words [N, W].

  Entries must lie in [0, d) (as top-k column indices do); others are not
  detected and corrupt their neighbours' bits.
  """
  d = _check_d(d, "pack_indices")
  indices = tf.convert_to_tensor(indices)
  if indices.dtype != tf.int32:
    raise TypeError(f"pack_indices: indices must be int32, got {indices.dtype.name}")
  _check_rank_2(indices, "indices", "pack_indices")
  k = indices.shape[1]
  if words_per_row(d, k) == 0:  # d = 1 or k = 0: nothing to send
    return tf.zeros(tf.stack([_rows(indices), 0]), tf.int32)
  _, _, offset, _ = _layout(d, k)
  # Index j shifted to its bit offset in word w_j: bits [0, 32) stay in w_j,
  # bits [32, 64) spill into w_j + 1. In int64 no bit is lost.
  shifted = tf.bitwise.left_shift(tf.cast(indices, tf.int64), offset)
  parts = tf.concat([tf.bitwise.bitwise_and(shifted, 0xFFFFFFFF),
                     tf.bitwise.right_shift(shifted, WORD_BITS)], axis=1)
  # The parts summed into a word have disjoint bits: the sum is their OR,
  # in [0, 2**32); the int32 word has the same bits.
  words = tf.reduce_sum(tf.gather(parts, _word_table(d, k), axis=1), axis=-1)
  return tf.bitcast(tf.cast(words, tf.uint32), tf.int32)


def unpack_indices(words, d: int, k: int) -> tf.Tensor:
  """The int32 indices [N, k] that `pack_indices(indices, d)` packed to `words`."""
  d, k = _check_d(d, "unpack_indices"), _check_k(k, "unpack_indices")
  words = tf.convert_to_tensor(words)
  if words.dtype != tf.int32:
    raise TypeError(f"unpack_indices: words must be int32, got {words.dtype.name}")
  _check_rank_2(words, "words", "unpack_indices")
  w = words_per_row(d, k)
  if words.shape[1] != w:
    raise ValueError(f"unpack_indices: words must have W = ceil(k * b / 32) = "
                     f"{w} columns for d = {d}, k = {k}, got shape {words.shape}")
  if w == 0:
    return tf.zeros(tf.stack([_rows(words), k]), tf.int32)
  b, word, offset, spills = _layout(d, k)
  unsigned = tf.bitwise.bitwise_and(tf.cast(words, tf.int64), 0xFFFFFFFF)
  low = tf.bitwise.right_shift(tf.gather(unsigned, word, axis=1), offset)
  # The bits of index j in word w_j + 1 (none unless it spills), moved up.
  high_bits = np.where(spills, offset + b - WORD_BITS, 0)
  high = tf.gather(unsigned, np.where(spills, word + 1, word), axis=1)
  high = tf.bitwise.left_shift(
      tf.bitwise.bitwise_and(high, (1 << high_bits) - 1), WORD_BITS - offset)
  joined = tf.bitwise.bitwise_or(low, high)
  return tf.cast(tf.bitwise.bitwise_and(joined, (1 << b) - 1), tf.int32)


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
