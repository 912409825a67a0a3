"""Fixed-size sparse wire format shared by the sparsifying compressors.

A replica that keeps only some entries of a flat vector of length `n` packs
them into two buffers of a static length `capacity`: `idx` (int32, the flat
positions in increasing order; unused slots hold `n`) and `val` (their
values; unused slots hold 0), plus an int32 `count`. Every shape is static,
so the same code runs under XLA. Packing is a prefix sum over the mask;
entries that do not fit are reported (`compact`) so the caller keeps them in
its residual. The exchange all-gathers every replica's buffers and
scatter-adds them into a dense vector of length `n + 1`, whose last slot
takes the padding and is cut off.

Positions travel as int32 words, either one per slot ("int32"), as offsets
inside chunks of 65536 / 256 entries packed four bytes to a word, with
per-chunk counts ahead ("chunk16" / "chunk8"), or Elias-Fano coded ("ef":
low bits at fixed width plus a bitmap of the high parts, about
log2(n / capacity) + 2 bits per slot; with exact sizes laid out for the
used slots instead, `_EliasFanoExact`); "auto" takes the fewest words.
`exchange_many` sends a step's buffers in one all-gather and handles
the short ones (at most `BATCH_CAPACITY` slots) with one set of ops.
Values travel in their dtype, or as bfloat16 two to an int32 word
(`round_values`, which keeps the rounding error in the residual).
docs/compression.md ("The sparse wire format") describes the layouts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import tensorflow as tf

from tf_dct import _private
from tf_dct.compression import native

# Positions travel as int32, so a vector must have fewer entries than this.
MAX_SIZE = 2**31 - 1

ENCODINGS = ("int32", "chunk16", "chunk8", "ef")
_CHUNK = {"chunk16": (2**16, 2), "chunk8": (2**8, 1)}  # chunk length, offset bytes


@dataclasses.dataclass(frozen=True)
class Encoding:
  """The static layout of one vector's index words on the wire.

  Attributes:
    name: one of `ENCODINGS`.
    n: length of the dense vector.
    capacity: slots per replica.
    chunk: chunk length (0 for "int32" and "ef").
    offset_bytes: bytes per slot offset (4 for "int32", 0 for "ef").
    count_bytes: bytes per chunk count (0 for "int32" and "ef").
    low_bits: for "ef", the low bits of each position sent at fixed width
      (`ef_low_bits`); 0 otherwise.
  """
  name: str
  n: int
  capacity: int
  chunk: int
  offset_bytes: int
  count_bytes: int
  low_bits: int = 0

  @property
  def high_bits(self) -> int:
    """"ef": length of the upper-bits bitmap ((n - 1) >> low_bits) + capacity."""
    return ((self.n - 1) >> self.low_bits) + self.capacity

  @property
  def bits(self) -> int:
    """Bits of index data per replica before filling to whole words."""
    if self.name == "ef":
      return self.capacity * self.low_bits + self.high_bits
    return 8 * (self.num_chunks * self.count_bytes
                + self.capacity * self.offset_bytes)

  @property
  def num_chunks(self) -> int:
    return math.ceil(self.n / self.chunk) if self.chunk else 0

  @property
  def count_words(self) -> int:
    return math.ceil(self.num_chunks * self.count_bytes / 4)

  @property
  def offset_words(self) -> int:
    return math.ceil(self.capacity * self.offset_bytes / 4)

  @property
  def words(self) -> int:
    """int32 words of index data per replica (counts + offsets, or the
    Elias-Fano bit stream)."""
    if self.name == "ef":
      return -(-self.bits // 32)
    return self.count_words + self.offset_words

  @property
  def index_bytes(self) -> int:
    return 4 * self.words


def _narrowest(max_value: int) -> int:
  return 1 if max_value < 2**8 else 2 if max_value < 2**16 else 4


def ef_low_bits(n: int, capacity: int) -> int:
  """Low bits per position of the "ef" layout: max(0, floor(log2(n / capacity))).

  With b low bits a position costs b bits plus about 1 + n / (capacity 2^b)
  bits of the upper-bits bitmap; this b minimises that sum.
  """
  return max(0, (n // capacity).bit_length() - 1)


def ef_exact_tables(n: int, capacity: int):
  """The "ef" layout of c used slots laid out for (n, c), c = 0 .. capacity.

  With exact sizes a replica that uses c of a vector's slots sends the
  "ef" stream of (n, c): b_c = ef_low_bits(n, c) low bits per slot, then a
  bitmap of ((n - 1) >> b_c) + c bits, about log2(n / c) + 2 bits per
  position instead of log2(n / capacity) + 2. Its bit count c (b_c + 1) +
  ((n - 1) >> b_c) does not decrease with c (where b_c drops by one, the
  bitmap grows by at least c - b_c bits and the lows shrink by c), so
  every stream fits in the `Encoding.words` of (n, capacity), zero-filled.

  Returns:
    `(low_bits, words)`: int64[capacity + 1] each; c = 0 sends no word
    (its low bits are those of c = capacity, as a placeholder).
  """
  c = np.arange(1, capacity + 1, dtype=np.int64)
  # floor(log2(n // c)) from the binary exponent (exact for integers).
  b = np.maximum(0, np.frexp((n // c).astype(np.float64))[1] - 1)
  b = np.where(n // c >= 1, b, 0)
  bits = c * (b + 1) + ((n - 1) >> b)
  low_bits = np.concatenate([[ef_low_bits(n, capacity)], b]).astype(np.int64)
  words = np.concatenate([[0], -(-bits // 32)]).astype(np.int64)
  return low_bits, words


def make_encoding(name: str, n: int, capacity: int) -> Encoding:
  """The layout `name` ("int32", "chunk16", "chunk8", "ef" or "auto") for
  (n, capacity)."""
  for arg, value in (("n", n), ("capacity", capacity)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{arg} must be an int, got {value!r}")
  if not 0 < n < MAX_SIZE:
    raise ValueError(f"n must be in [1, {MAX_SIZE - 1}], got {n}")
  if capacity < 1:
    raise ValueError(f"capacity must be >= 1, got {capacity}")
  if name == "auto":
    return choose_encoding(n, capacity)
  if name == "int32":
    return Encoding("int32", n, capacity, 0, 4, 0)
  if name == "ef":
    return Encoding("ef", n, capacity, 0, 0, 0, ef_low_bits(n, capacity))
  if name not in _CHUNK:
    raise ValueError(f"index encoding must be 'auto' or one of {ENCODINGS}, "
                     f"got {name!r}")
  chunk, offset_bytes = _CHUNK[name]
  return Encoding(name, n, capacity, chunk, offset_bytes,
                  _narrowest(min(chunk, capacity, n)))


def choose_encoding(n: int, capacity: int) -> Encoding:
  """The layout with the fewest index words for (n, capacity)."""
  candidates = [make_encoding(name, n, capacity) for name in ENCODINGS]
  return min(candidates, key=lambda e: e.words)  # min keeps the first on ties


# What the values of a float32 vector travel as (`round_values`): None, the
# vector's own dtype; "bfloat16", two to an int32 word.
VALUE_DTYPES = (None, "bfloat16")


# Below this magnitude a bfloat16 rounding error of a float32 value may be
# subnormal (it is a multiple of 2^(e - 23) for a value of exponent e), so
# `round_values` sends 0 and keeps the value instead.
TINY = 2.0**-103


def check_value_dtype(owner: str, value_dtype, auto: bool = False) -> str | None:
  """`value_dtype` if it is one of `VALUE_DTYPES` (or "auto" where `auto`
  allows it), else a ValueError naming it."""
  allowed = VALUE_DTYPES + (("auto",) if auto else ())
  if not any(value_dtype is d or (isinstance(value_dtype, str) and value_dtype == d)
             for d in allowed):
    raise ValueError(f"{owner}: value_dtype must be "
                     + ("'auto', " if auto else "")
                     + f"None (the variable's dtype) or 'bfloat16', got "
                     f"{value_dtype!r}")
  return value_dtype


def wire_dtype(dtype, value_dtype: str | None) -> tf.DType:
  """The dtype a vector of `dtype` sends its values in: bfloat16 for a
  float32 vector with `value_dtype="bfloat16"`, else `dtype` itself."""
  dtype = tf.as_dtype(dtype)
  return (tf.bfloat16 if value_dtype == "bfloat16" and dtype == tf.float32
          else dtype)


def value_bytes(capacity: int, dtype) -> int:
  """Bytes of `capacity` value slots of `dtype` on the wire: bfloat16 values
  go two to an int32 word (an odd count fills its last word with a zero)."""
  dtype = tf.as_dtype(dtype)
  if dtype == tf.bfloat16:
    return 4 * -(-capacity // 2)
  return capacity * dtype.size


def round_values(idx: tf.Tensor, val: tf.Tensor, residual: tf.Tensor,
                 value_dtype: str | None):
  """The values to send in `value_dtype`, and the residual that keeps the
  rounding error (error feedback for the value word).

  With "bfloat16" a float32 value v travels as b = bfloat16(v), rounded to
  nearest even, and the replica keeps v - float32(b) in its residual at v's
  position. That difference is exact in float32 (v and b share the
  exponent, b drops the low 16 bits of v's significand), so what is applied
  plus what is held back is v to the bit; the rest reaches the model one
  step later. A value below `TINY` in magnitude travels as 0 and stays whole
  in the residual: its rounding error could be subnormal, and TensorFlow's
  CPU kernels flush subnormal results of arithmetic to zero. Other
  dtypes, and `value_dtype` None, pass through unchanged.

  Args:
    idx: int32[capacity] positions, padding (>= n) with value 0.
    val: [capacity] the values at `idx`.
    residual: flat [n] residual after the selection, 0 at every position
      of `idx` (the error is written there).
    value_dtype: one of `VALUE_DTYPES`.

  Returns:
    `(val, residual)`: the wire values (bfloat16 or `val`) and the residual.
  """
  if wire_dtype(val.dtype, value_dtype) == val.dtype:
    return val, residual
  tiny = tf.abs(val) < TINY
  word = tf.cast(tf.where(tiny, tf.zeros_like(val), val), tf.bfloat16)
  error = tf.where(tiny, val, val - tf.cast(word, val.dtype))
  n = residual.shape[0]
  # The residual is 0 where a value was sent: the error is written, not
  # added (no arithmetic that could flush it). Padding writes slot n, cut off.
  at = tf.minimum(idx, n)[:, None]
  held = tf.concat([residual, tf.zeros([1], residual.dtype)], 0)
  return word, tf.tensor_scatter_nd_update(held, at, error)[:n]


def _pack_halves(val: tf.Tensor) -> tf.Tensor:
  """int32[ceil(c / 2)] words of bfloat16[c], slot 2j in the low 16 bits of
  word j and slot 2j + 1 in the high ones (a zero fills an odd count)."""
  if val.shape[0] % 2:
    val = tf.concat([val, tf.zeros([1], val.dtype)], 0)
  halves = tf.bitcast(tf.reshape(val, [-1, 2]), tf.uint16)
  low, high = tf.unstack(tf.cast(halves, tf.int32), axis=1)
  return tf.bitwise.bitwise_or(low, tf.bitwise.left_shift(high, 16))


def _unpack_halves(words: tf.Tensor, capacities: Sequence[int]) -> tf.Tensor:
  """float32[r, sum(capacities)] from int32[r, words] holding one
  `_pack_halves` block per capacity, one after another."""
  r = words.shape[0]
  low = tf.bitwise.bitwise_and(words, 0xFFFF)
  high = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, 16), 0xFFFF)
  halves = tf.reshape(tf.stack([low, high], axis=2), [r, -1])
  # A bfloat16 is the upper half of the float32 of the same value.
  floats = tf.bitcast(tf.bitwise.left_shift(halves, 16), tf.float32)
  starts = np.cumsum([0] + [2 * -(-c // 2) for c in capacities])[:-1]
  keep = np.concatenate([s + np.arange(c) for s, c in zip(starts, capacities)])
  if keep.size == floats.shape[1]:
    return floats
  return tf.gather(floats, keep.astype(np.int32), axis=1)


def wire_bytes(n: int, capacity: int, dtype, encoding: str = "auto") -> int:
  """Bytes one replica contributes to the all-gather for one vector.

  Index words (counts, offsets, padding) plus `capacity` value slots
  (`value_bytes`: bfloat16 two to a word).

  Example:
    10 float32 slots for a vector of 1000 entries: "auto" picks "ef" (6 low
    bits per slot and a bitmap of (999 >> 6) + 10 = 25 bits: 85 bits, 3
    words), "chunk8" needs 4 (4 one-byte chunk counts and 10 one-byte
    offsets), "int32" one word per slot.

    >>> wire_bytes(1000, 10, tf.float32)
    52
    >>> wire_bytes(1000, 10, tf.float32, encoding="chunk8")
    56
    >>> wire_bytes(1000, 10, tf.float32, encoding="int32")
    80
  """
  return (make_encoding(encoding, n, capacity).index_bytes
          + value_bytes(capacity, dtype))


class _Layout:
  """Static layout of several vectors' index words, one after another.

  Each vector contributes its `Encoding.words` words: for the chunked
  layouts its chunk counts (`count_bytes` each, filled to whole words), then
  its slot offsets (`offset_bytes` each, filled to whole words); for "int32"
  its positions. Encoding and decoding handle all vectors at once: the field
  values of every vector sit in one int32 vector F (all chunk counts first,
  then all slots); fields of one byte width are gathered into one array and
  packed 4 / width to a word with shifts, and a last gather puts the words
  in vector order. The number of ops does not grow with the number of
  vectors (a step exchanges one buffer per variable).
  """

  def __init__(self, encodings: Sequence[Encoding]):
    encodings = list(encodings)
    if any(e.name == "ef" for e in encodings):
      raise ValueError("_Layout takes no 'ef' encodings (see _EliasFano)")
    caps = [e.capacity for e in encodings]
    chunks = [e.num_chunks for e in encodings]
    self.num_slots = sum(caps)
    self.num_chunks = sum(chunks)
    self.words = sum(e.words for e in encodings)
    self.chunked = self.num_chunks > 0
    slot_at = np.cumsum([0] + caps)[:-1]
    chunk_at = np.cumsum([0] + chunks)[:-1]
    # Per slot: vector length n, chunk length (1 for "int32"), whether it is
    # chunked, its index in its vector, and the first / last chunk of its
    # vector among all chunk counts (num_chunks for "int32": a zero column).
    rep = lambda xs, dtype=np.int32: np.repeat(np.asarray(xs, np.int64),
                                              caps).astype(dtype)
    self.slot_n = rep([e.n for e in encodings])
    self.slot_chunk = rep([max(e.chunk, 1) for e in encodings])
    self.slot_is_chunked = rep([e.chunk > 0 for e in encodings], bool)
    self.slot_local = (np.arange(self.num_slots) - rep(slot_at)).astype(np.int32)
    self.slot_first_chunk = rep([a if e.chunk else self.num_chunks
                                 for a, e in zip(chunk_at, encodings)])
    self.slot_last_chunk = rep([a + c - 1 if e.chunk else self.num_chunks
                                for a, c, e in zip(chunk_at, chunks,
                                                   encodings)])
    # Per chunk count: its vector's first chunk and capacity, and where its
    # vector's region of capacity + 1 entries starts in `decode`'s
    # histogram of chunk ends (one region per vector, in order).
    region_at = np.cumsum([0] + [c + 1 for c in caps])[:-1]
    self.histogram = sum(c + 1 for c in caps)
    self.chunk_first = np.repeat(chunk_at, chunks).astype(np.int32)
    self.chunk_cap = np.repeat(caps, chunks).astype(np.int32)
    self.chunk_region = np.repeat(region_at, chunks).astype(np.int32)
    self.slot_region = rep(region_at)
    # Fields (start in F, length, byte width, words), in wire order.
    fields = []
    for v, e in enumerate(encodings):
      if e.chunk:
        fields.append((chunk_at[v], e.num_chunks, e.count_bytes, e.count_words))
      fields.append((self.num_chunks + slot_at[v], e.capacity, e.offset_bytes,
                     e.offset_words))
    # Per byte width: `take` gathers F (index len(F): a zero) into the
    # group's packing order, `4 // width` values per word; `put` gathers the
    # unpacked group values back into F. `order` puts the groups' words in
    # wire order (None when they are in it already).
    size = self.num_chunks + self.num_slots
    self.groups = []     # (width, take, word positions on the wire)
    put = np.zeros(size, np.int64)
    wire_at = np.cumsum([0] + [f[3] for f in fields])[:-1]
    unpacked = 0         # values of the groups before, unpacked
    for width in (1, 2, 4):
      mine = [(f, at) for f, at in zip(fields, wire_at) if f[2] == width]
      if not mine:
        continue
      per = 4 // width
      take, words = [], []
      for (start, length, _, nwords), at in mine:
        src = np.full(nwords * per, size, np.int64)
        src[:length] = start + np.arange(length)
        put[start:start + length] = unpacked + np.arange(length)
        unpacked += src.size
        take.append(src)
        words.append(at + np.arange(nwords))
      take = np.concatenate(take).astype(np.int32)
      self.groups.append((width, take, np.concatenate(words).astype(np.int32)))
    self.put = put.astype(np.int32)
    grouped = np.concatenate([w for _, _, w in self.groups])
    self.order = (None if np.array_equal(grouped, np.arange(self.words))
                  else np.argsort(grouped).astype(np.int32))

  def encode(self, idx: tf.Tensor) -> tf.Tensor:
    """int32[words] for the concatenated positions `idx` (int32[num_slots])."""
    if not self.chunked:  # every vector "int32": the words are the positions
      return idx
    valid = idx < self.slot_n
    offsets = tf.where(valid, idx % self.slot_chunk, 0)
    chunk_id = tf.where(tf.logical_and(valid, self.slot_is_chunked),
                        self.slot_first_chunk + idx // self.slot_chunk,
                        self.num_chunks)
    counts = tf.math.unsorted_segment_sum(
        tf.ones([self.num_slots], tf.int32), chunk_id,
        self.num_chunks + 1)[:self.num_chunks]
    values = tf.concat(
        [counts, tf.where(self.slot_is_chunked, offsets, idx), [0]], 0)
    words = []
    for width, take, _ in self.groups:
      group = tf.gather(values, take)
      if width < 4:  # value k of a word goes to bits [8 width k, 8 width (k+1))
        parts = tf.reshape(tf.bitcast(group, tf.uint32), [-1, 4 // width])
        shifts = tf.constant([8 * width * k for k in range(4 // width)],
                             tf.uint32)
        group = tf.bitcast(tf.reduce_sum(
            tf.bitwise.left_shift(parts, shifts), axis=1), tf.int32)
      words.append(group)
    words = words[0] if len(words) == 1 else tf.concat(words, 0)
    return words if self.order is None else tf.gather(words, self.order)

  def decode(self, words: tf.Tensor) -> tf.Tensor:
    """int32[r, num_slots] positions (padding = n) from int32[r, words]."""
    if not self.chunked:  # every vector "int32": the words are the positions
      return words
    r = words.shape[0]
    unpacked = []
    for width, _, at in self.groups:
      group = (words if self.order is None and len(self.groups) == 1
               else tf.gather(words, at, axis=1))
      if width < 4:
        shifts = tf.constant([8 * width * k for k in range(4 // width)],
                             tf.uint32)
        parts = tf.bitwise.bitwise_and(
            tf.bitwise.right_shift(tf.bitcast(group, tf.uint32)[:, :, None],
                                   shifts), (1 << (8 * width)) - 1)
        group = tf.reshape(tf.bitcast(parts, tf.int32), [r, -1])
      unpacked.append(group)
    unpacked = unpacked[0] if len(unpacked) == 1 else tf.concat(unpacked, 1)
    fields = tf.gather(unpacked, self.put, axis=1)
    counts, raw = fields[:, :self.num_chunks], fields[:, self.num_chunks:]
    # ends[c]: slots of its vector up to and including chunk c.
    cum = tf.cumsum(counts, axis=1)
    ends = cum - tf.gather(cum - counts, self.chunk_first, axis=1)
    # Slot j of a vector lies in chunk "number of its chunks ending at or
    # before j": a histogram of the ends per vector region (capacity + 1
    # entries, the last one catching full chunks), counted up by a cumsum.
    at = (tf.minimum(ends, self.chunk_cap) + self.chunk_region
          + tf.range(r, dtype=tf.int32)[:, None] * self.histogram)
    ended = tf.reshape(tf.math.unsorted_segment_sum(
        tf.ones([r * self.num_chunks], tf.int32), tf.reshape(at, [-1]),
        r * self.histogram), [r, self.histogram])
    upto = tf.cumsum(ended, axis=1)
    chunk_id = (tf.gather(upto, self.slot_region + self.slot_local, axis=1)
                - tf.gather(upto - ended, self.slot_region, axis=1))
    used = tf.gather(tf.concat([ends, tf.zeros([r, 1], tf.int32)], 1),
                     self.slot_last_chunk, axis=1)
    idx = tf.where(self.slot_local < used,
                   chunk_id * self.slot_chunk + raw, self.slot_n)
    return tf.where(self.slot_is_chunked, idx, raw)


def _ef_high_parts(bit: tf.Tensor, bit_cap, bit_first, bit_slot_at, bit_q,
                   num_slots: int) -> tuple[tf.Tensor, tf.Tensor]:
  """Each slot's high part from the bitmap bits of "ef" vectors.

  Args:
    bit: int32[r, bits], each candidate bitmap bit as 0 or 1.
    bit_cap, bit_first, bit_slot_at, bit_q: per bit, its vector's slots in
      use, first bit, first slot, and the bit's value q within its bitmap.
    num_slots: slots per row.

  Returns:
    (int32[r, num_slots] high parts, int32[r, bits] the count of set bits up
    to each bit within its vector): the i-th set bit at q gives q - i.
  """
  r = bit.shape[0] if bit.shape[0] is not None else tf.shape(bit)[0]
  cum = tf.cumsum(bit, axis=1)
  upto = cum - tf.gather(cum - bit, bit_first, axis=1)  # within its vector
  slot = upto - 1
  fits = tf.logical_and(bit > 0, slot < bit_cap)
  rows = tf.range(r, dtype=tf.int32)[:, None] * num_slots
  segment = tf.where(fits, rows + bit_slot_at + slot, r * num_slots)
  upper = tf.math.unsorted_segment_sum(
      tf.reshape(bit_q - slot, [-1]), tf.reshape(segment, [-1]),
      r * num_slots + 1)[:-1]
  return tf.reshape(upper, [r, num_slots]), upto


class _EfVectors:
  """Where the slots, words and bitmap bits of several "ef" vectors sit when
  their words follow each other: the offsets both Elias-Fano coders build
  their per-slot and per-bit tables from."""

  def __init__(self, encodings: Sequence[Encoding], owner: str):
    self.encodings = list(encodings)
    if any(e.name != "ef" for e in self.encodings):
      raise ValueError(f"{owner} takes 'ef' encodings only")
    self.caps = [e.capacity for e in self.encodings]
    self.highs = [e.high_bits for e in self.encodings]
    self.num_slots = sum(self.caps)
    self.num_bits = sum(self.highs)
    self.words = sum(e.words for e in self.encodings)
    self.word_at = np.cumsum([0] + [e.words for e in self.encodings])[:-1]
    self.slot_at = np.cumsum([0] + self.caps)[:-1]
    self.bit_at = np.cumsum([0] + self.highs)[:-1]
    self.slot_n = self.per_slot([e.n for e in self.encodings]).astype(np.int32)
    # Each slot's place among its own vector's slots.
    self.slot_local = (np.arange(self.num_slots)
                       - self.per_slot(self.slot_at)).astype(np.int32)

  def per_slot(self, xs) -> np.ndarray:
    """int64 per slot: its vector's entry of `xs` (one per vector)."""
    return np.repeat(np.asarray(xs, np.int64), self.caps)

  def per_bit(self, xs) -> np.ndarray:
    """int64 per bitmap bit: its vector's entry of `xs` (one per vector)."""
    return np.repeat(np.asarray(xs, np.int64), self.highs)


class _EliasFano:
  """Encoder and decoder of several "ef" vectors' index words at once.

  One vector's words are a little-endian bit stream (bit k is bit k % 32 of
  word k // 32) of `Encoding.bits` bits, filled to whole words: first the
  low `b = low_bits` bits of each slot's position at fixed width (slot j at
  bits [j b, (j + 1) b); 0 for a padding slot), then the upper-bits bitmap
  of `high_bits` bits, where the i-th position p_i sets bit
  (p_i >> b) + i. The positions must be increasing with the padding (n)
  last; their count is the number of set bits. Decoding is parallel: the
  i-th set bit, at q, gives p_i = ((q - i) << b) | low_i.

  The vectors' words follow each other; every op works on all of them, so
  the number of ops does not grow with the number of vectors. Contributions
  to a word are disjoint bits, so an int32 segment sum is their bitwise or.
  """

  def __init__(self, encodings: Sequence[Encoding]):
    v = _EfVectors(encodings, "_EliasFano")
    encodings, caps, highs = v.encodings, v.caps, v.highs
    word_at, slot_at, bit_at = v.word_at, v.slot_at, v.bit_at
    rep, rep_bits = v.per_slot, v.per_bit
    self.num_slots, self.num_bits, self.words = v.num_slots, v.num_bits, v.words
    self.slot_n, self.slot_local = v.slot_n, v.slot_local
    b = rep([e.low_bits for e in encodings])
    self.slot_b = b.astype(np.int32)
    # Low bits of slot j: bits [j b, j b + b) of its vector's stream.
    low_at = 32 * rep(word_at) + self.slot_local * b
    self.low_word = (low_at >> 5).astype(np.int32)
    self.low_shift = (low_at & 31).astype(np.uint32)
    self.has_low = b > 0
    self.spill = (low_at & 31) + b > 32  # the bits run on into the next word
    self.spill_shift = np.where(self.spill, 32 - (low_at & 31), 0).astype(np.uint32)
    self.low_mask = ((np.uint64(1) << b.astype(np.uint64)) - 1).astype(np.uint32)
    # First bit of each slot's vector's bitmap (on the whole stream).
    self.slot_high_at = (32 * rep(word_at) + rep([e.capacity * e.low_bits
                                                   for e in encodings]))
    # Per bitmap bit: its word and shift, its value q in its vector's
    # bitmap, its vector's first slot and first bit among all bitmap bits.
    q = np.arange(self.num_bits) - rep_bits(bit_at)
    stream_bit = (32 * rep_bits(word_at)
                  + rep_bits([e.capacity * e.low_bits for e in encodings]) + q)
    self.bit_word = (stream_bit >> 5).astype(np.int32)
    self.bit_shift = (stream_bit & 31).astype(np.uint32)
    self.bit_q = q.astype(np.int32)
    self.bit_slot_at = rep_bits(slot_at).astype(np.int32)
    self.bit_first = rep_bits(bit_at).astype(np.int32)
    self.bit_cap = rep_bits(caps).astype(np.int32)
    # Per slot: the last bitmap bit of its vector.
    self.slot_last_bit = rep(bit_at + np.asarray(highs) - 1).astype(np.int32)

  def encode(self, idx: tf.Tensor) -> tf.Tensor:
    """int32[words] for the concatenated positions `idx` (int32[num_slots])."""
    idx = tf.cast(idx, tf.int32)
    valid = idx < self.slot_n
    dump = self.words
    low = tf.where(valid, tf.bitwise.bitwise_and(
        tf.bitcast(idx, tf.uint32), self.low_mask), tf.zeros([], tf.uint32))
    low_here = tf.bitwise.left_shift(low, self.low_shift)
    low_next = tf.bitwise.right_shift(low, self.spill_shift)
    high_bit = (self.slot_high_at
                + tf.cast(tf.bitwise.right_shift(idx, self.slot_b)
                          + self.slot_local, tf.int64))
    high = tf.bitwise.left_shift(
        tf.ones([self.num_slots], tf.uint32),
        tf.cast(tf.bitwise.bitwise_and(high_bit, 31), tf.uint32))
    segments = tf.concat([
        tf.where(tf.logical_and(valid, self.has_low), self.low_word, dump),
        tf.where(tf.logical_and(valid, self.spill), self.low_word + 1, dump),
        tf.where(valid, tf.cast(tf.bitwise.right_shift(high_bit, 5), tf.int32),
                 dump)], 0)
    values = tf.bitcast(tf.concat([low_here, low_next, high], 0), tf.int32)
    return tf.math.unsorted_segment_sum(values, segments, dump + 1)[:dump]

  def decode(self, words: tf.Tensor) -> tf.Tensor:
    """int32[r, num_slots] positions (padding = n) from int32[r, words]."""
    bits = tf.bitcast(words, tf.uint32)
    low = tf.bitwise.right_shift(tf.gather(bits, self.low_word, axis=1),
                                 self.low_shift)
    spill = tf.bitwise.left_shift(
        tf.gather(bits, np.minimum(self.low_word + 1, self.words - 1), axis=1),
        self.spill_shift)
    low = tf.bitwise.bitwise_and(
        tf.where(self.spill, tf.bitwise.bitwise_or(low, spill), low),
        self.low_mask)
    # The bitmap, one entry per bit; the i-th set bit of a vector (i from
    # 0) at q gives slot i the upper bits q - i.
    bit = tf.bitcast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.gather(bits, self.bit_word, axis=1), self.bit_shift), 1), tf.int32)
    upper, upto = _ef_high_parts(bit, self.bit_cap, self.bit_first,
                                 self.bit_slot_at, self.bit_q, self.num_slots)
    used = tf.gather(upto, self.slot_last_bit, axis=1)
    idx = tf.bitwise.bitwise_or(tf.bitwise.left_shift(upper, self.slot_b),
                                tf.bitcast(low, tf.int32))
    return tf.where(self.slot_local < used, idx, self.slot_n)


class _EliasFanoExact:
  """Encoder and decoder of "ef" vectors laid out for the slots in use.

  Each vector's words hold the "ef" stream of (n, c) for its c used slots
  (`ef_exact_tables`), zero-filled to the `Encoding.words` of (n,
  capacity); `_index_map` sends only the words of the stream. The sender
  takes c from its positions, the receiver per replica from the counts
  exchanged ahead of the payload (`_gather_exact`). The layout depends on
  c, so the bit positions are computed per step (`_EliasFano` keeps them
  static); decoding is as parallel, row by row.
  """

  def __init__(self, encodings: Sequence[Encoding]):
    v = _EfVectors(encodings, "_EliasFanoExact")
    encodings, caps, word_at, bit_at = v.encodings, v.caps, v.word_at, v.bit_at
    rep, rep_bits = v.per_slot, v.per_bit
    self.num_vectors = len(encodings)
    self.num_slots, self.num_bits, self.words = v.num_slots, v.num_bits, v.words
    self.slot_n, self.slot_local = v.slot_n, v.slot_local
    tables = [ef_exact_tables(e.n, e.capacity) for e in encodings]
    # b of vector v at count c: low_bits[table_at[v] + c].
    self.table_at = np.cumsum([0] + [c + 1 for c in caps])[:-1].astype(np.int32)
    self.low_bits = np.concatenate([t[0] for t in tables]).astype(np.int32)
    self.slot_vector = rep(np.arange(len(caps))).astype(np.int32)
    self.slot_bit_at = 32 * rep(word_at)  # first bit of its vector's stream
    self.slot_last_word = rep(word_at + np.asarray([e.words for e in encodings])
                              - 1).astype(np.int32)
    # Candidate bitmap bits: the longest bitmap, that of c = capacity.
    self.bit_vector = rep_bits(np.arange(len(caps))).astype(np.int32)
    self.bit_q = (np.arange(self.num_bits) - rep_bits(bit_at)).astype(np.int32)
    self.bit_n = rep_bits([e.n for e in encodings]).astype(np.int32)
    self.bit_stream_at = 32 * rep_bits(word_at)
    self.bit_first = rep_bits(bit_at).astype(np.int32)
    self.bit_slot_at = rep_bits(v.slot_at).astype(np.int32)

  def _low_bits(self, counts: tf.Tensor) -> tf.Tensor:
    """int32[..., vectors] b per vector from its count."""
    return tf.gather(self.low_bits, counts + self.table_at)

  def encode(self, idx: tf.Tensor, used: tf.Tensor) -> tf.Tensor:
    """int32[words] for the concatenated positions `idx` (int32[num_slots],
    increasing, padding last) with `used` (int32[vectors]) slots in use."""
    idx = tf.cast(idx, tf.int32)
    valid = self.slot_local < tf.gather(used, self.slot_vector)
    b = tf.gather(self._low_bits(used), self.slot_vector)
    c = tf.cast(tf.gather(used, self.slot_vector), tf.int64)
    b64 = tf.cast(b, tf.int64)
    dump = self.words
    low_at = self.slot_bit_at + tf.cast(self.slot_local, tf.int64) * b64
    shift = tf.cast(tf.bitwise.bitwise_and(low_at, 31), tf.int32)
    word = tf.cast(tf.bitwise.right_shift(low_at, 5), tf.int32)
    spill = shift + b > 32  # the bits run on into the next word
    mask = tf.bitwise.left_shift(tf.ones_like(b), b) - 1
    low = tf.bitcast(tf.where(valid, tf.bitwise.bitwise_and(idx, mask), 0),
                     tf.uint32)
    low_here = tf.bitwise.left_shift(low, tf.cast(shift, tf.uint32))
    low_next = tf.bitwise.right_shift(
        low, tf.cast(tf.where(spill, 32 - shift, 0), tf.uint32))
    high_bit = (self.slot_bit_at + c * b64
                + tf.cast(tf.bitwise.right_shift(idx, b) + self.slot_local,
                          tf.int64))
    high = tf.bitwise.left_shift(
        tf.ones([self.num_slots], tf.uint32),
        tf.cast(tf.bitwise.bitwise_and(high_bit, 31), tf.uint32))
    segments = tf.concat([
        tf.where(tf.logical_and(valid, b > 0), word, dump),
        tf.where(tf.logical_and(valid, spill), word + 1, dump),
        tf.where(valid, tf.cast(tf.bitwise.right_shift(high_bit, 5), tf.int32),
                 dump)], 0)
    values = tf.bitcast(tf.concat([low_here, low_next, high], 0), tf.int32)
    return tf.math.unsorted_segment_sum(values, segments, dump + 1)[:dump]

  def decode(self, words: tf.Tensor, counts: tf.Tensor) -> tf.Tensor:
    """int32[r, num_slots] positions (padding = n) from int32[r, words] and
    each row's counts (int32[r, vectors])."""
    bits = tf.bitcast(words, tf.uint32)
    b_rv = self._low_bits(counts)                              # [r, vectors]
    b = tf.gather(b_rv, self.slot_vector, axis=1)              # [r, slots]
    c = tf.gather(counts, self.slot_vector, axis=1)
    b64 = tf.cast(b, tf.int64)
    valid = self.slot_local < c
    low_at = self.slot_bit_at + tf.cast(self.slot_local, tf.int64) * b64
    word = tf.minimum(tf.cast(tf.bitwise.right_shift(low_at, 5), tf.int32),
                      self.slot_last_word)
    shift = tf.cast(tf.bitwise.bitwise_and(low_at, 31), tf.int32)
    spill = shift + b > 32
    low = tf.bitwise.right_shift(tf.gather(bits, word, axis=1, batch_dims=1),
                                 tf.cast(shift, tf.uint32))
    after = tf.gather(bits, tf.minimum(word + 1, self.slot_last_word), axis=1,
                      batch_dims=1)
    low = tf.where(spill, tf.bitwise.bitwise_or(low, tf.bitwise.left_shift(
        after, tf.cast(tf.where(spill, 32 - shift, 0), tf.uint32))), low)
    mask = tf.bitcast(tf.bitwise.left_shift(tf.ones_like(b), b) - 1, tf.uint32)
    low = tf.bitcast(tf.bitwise.bitwise_and(low, mask), tf.int32)
    # Bitmap bit q of vector v (q < ((n - 1) >> b) + c) sits at stream bit
    # c b + q; the i-th set one gives slot i the upper bits q - i.
    bb = tf.gather(b_rv, self.bit_vector, axis=1)              # [r, bits]
    bc = tf.gather(counts, self.bit_vector, axis=1)
    in_map = self.bit_q < tf.bitwise.right_shift(self.bit_n - 1, bb) + bc
    at = (self.bit_stream_at + tf.cast(bc, tf.int64) * tf.cast(bb, tf.int64)
          + self.bit_q)
    bit_word = tf.where(in_map, tf.cast(tf.bitwise.right_shift(at, 5),
                                        tf.int32), 0)
    bit = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
        tf.gather(bits, bit_word, axis=1, batch_dims=1),
        tf.cast(tf.bitwise.bitwise_and(at, 31), tf.uint32)), 1)
    bit = tf.where(in_map, tf.bitcast(bit, tf.int32), 0)
    upper, _ = _ef_high_parts(bit, bc, self.bit_first, self.bit_slot_at,
                              self.bit_q, self.num_slots)
    idx = tf.bitwise.bitwise_or(tf.bitwise.left_shift(upper, b), low)
    return tf.where(valid, idx, self.slot_n)


def _pack(values: tf.Tensor, nbytes: int, words: int) -> tf.Tensor:
  """Packs int32 `values` (each < 256**nbytes) into `words` int32 words."""
  if nbytes == 4:
    raw = tf.bitcast(values, tf.uint8)
  elif nbytes == 2:
    raw = tf.bitcast(tf.cast(values, tf.uint16), tf.uint8)
  else:
    raw = tf.cast(values, tf.uint8)
  raw = tf.reshape(raw, [-1])
  raw = tf.pad(raw, [[0, 4 * words - raw.shape[0]]])
  return tf.bitcast(tf.reshape(raw, [words, 4]), tf.int32)


def _unpack(words: tf.Tensor, nbytes: int, length: int) -> tf.Tensor:
  """Inverse of `_pack` along the last axis: the first `length` values, int32."""
  batch = words.shape[:-1].as_list()
  raw = tf.reshape(tf.bitcast(words, tf.uint8), batch + [-1])
  raw = raw[..., :length * nbytes]
  if nbytes == 1:
    return tf.cast(raw, tf.int32)
  raw = tf.reshape(raw, batch + [length, nbytes])
  if nbytes == 2:
    return tf.cast(tf.bitcast(raw, tf.uint16), tf.int32)
  return tf.bitcast(raw, tf.int32)


def encode_indices(idx: tf.Tensor, encoding: Encoding) -> tf.Tensor:
  """int32[encoding.words] wire words for positions `idx` (padding = n).

  For the chunked and "ef" layouts `idx` must be increasing with the padding last
  (as `compact` returns it).
  """
  if encoding.name == "int32":
    return tf.cast(idx, tf.int32)
  if encoding.name == "ef":
    return _EliasFano([encoding]).encode(idx)
  n, chunk, nc = encoding.n, encoding.chunk, encoding.num_chunks
  idx = tf.cast(idx, tf.int32)
  valid = idx < n
  offsets = tf.where(valid, idx % chunk, 0)
  chunk_id = tf.where(valid, idx // chunk, nc)  # padding -> dump segment nc
  counts = tf.math.unsorted_segment_sum(tf.cast(valid, tf.int32), chunk_id,
                                        nc + 1)[:nc]
  return tf.concat([_pack(counts, encoding.count_bytes, encoding.count_words),
                    _pack(offsets, encoding.offset_bytes, encoding.offset_words)],
                   axis=0)


def decode_indices(words: tf.Tensor, encoding: Encoding) -> tf.Tensor:
  """Inverse of `encode_indices`: int32[..., capacity] positions, padding = n.

  `words` is int32[encoding.words], or int32[r, encoding.words] to decode r
  replicas' words in one go (one set of ops instead of r).
  """
  if encoding.name == "int32":
    return words
  if words.shape.rank not in (1, 2):
    raise ValueError(f"decode_indices: words must be rank 1 or 2, got shape "
                     f"{words.shape}")
  rows = words if words.shape.rank == 2 else words[None]
  if encoding.name == "ef":
    idx = _EliasFano([encoding]).decode(rows)
    return idx if words.shape.rank == 2 else idx[0]
  n, cap, nc = encoding.n, encoding.capacity, encoding.num_chunks
  r = rows.shape[0]
  counts = _unpack(rows[:, :encoding.count_words], encoding.count_bytes, nc)
  offsets = _unpack(rows[:, encoding.count_words:], encoding.offset_bytes, cap)
  ends = tf.cumsum(counts, axis=1)  # slot j is in chunk c iff ends[c-1] <= j < ends[c]
  # chunk of slot j = number of chunks ending at or before j (O(nc + capacity)),
  # counted per row: row i's chunk ends land in segments [i (cap + 1), ...).
  row_base = tf.range(r, dtype=tf.int32)[:, None] * (cap + 1)
  ended = tf.math.unsorted_segment_sum(
      tf.ones([r * nc], tf.int32),
      tf.reshape(tf.minimum(ends, cap) + row_base, [-1]), r * (cap + 1))
  chunk_id = tf.cumsum(tf.reshape(ended, [r, cap + 1])[:, :cap], axis=1)
  slot = tf.range(cap, dtype=tf.int32)
  idx = tf.where(slot < ends[:, -1:], chunk_id * encoding.chunk + offsets, n)
  return idx if words.shape.rank == 2 else idx[0]


_BLOCK = 64  # entries per block of `prefix_count`'s matrix product


def prefix_count(mask: tf.Tensor) -> tf.Tensor:
  """int32 inclusive prefix count of a rank-1 bool `mask` of static length.

  Equal to `tf.cumsum(tf.cast(mask, tf.int32))`, computed in blocks: a matrix
  product with an upper-triangular matrix of ones counts within each block of
  64 entries, a short cumsum over the block totals adds what came before.
  On CPU that is about twice as fast as TensorFlow's one-dimensional scan,
  and on accelerators it runs on the matrix units. Exact: the inputs are 0
  or 1 (exact in bfloat16 and TF32 too) and every partial sum is an integer
  of at most 64, which the float32 accumulator holds exactly.
  """
  if mask.dtype != tf.bool or mask.shape.rank != 1 or mask.shape[0] is None:
    raise ValueError(f"prefix_count: mask must be a rank-1 bool tensor of static "
                     f"length, got {mask.dtype.name} {mask.shape}")
  n = mask.shape[0]
  if n <= _BLOCK:
    return tf.cumsum(tf.cast(mask, tf.int32))
  blocks = -(-n // _BLOCK)
  ones = tf.cast(mask, tf.float32)
  if blocks * _BLOCK != n:
    ones = tf.pad(ones, [[0, blocks * _BLOCK - n]])
  upper = tf.linalg.band_part(tf.ones([_BLOCK, _BLOCK]), 0, -1)
  within = tf.cast(tf.matmul(tf.reshape(ones, [blocks, _BLOCK]), upper), tf.int32)
  before = tf.cumsum(within[:, -1], exclusive=True)
  ends = tf.reshape(within + before[:, None], [-1])
  return ends if blocks * _BLOCK == n else ends[:n]


def compact(acc_flat: tf.Tensor, mask: tf.Tensor, capacity: int,
            ends: tf.Tensor | None = None):
  """Packs the entries of `acc_flat` selected by `mask` into fixed buffers.

  Args:
    acc_flat: rank-1 tensor of static length n.
    mask: bool tensor of the same shape; True marks entries to send.
    capacity: Python int >= 1, the buffer length.
    ends: `prefix_count(mask)` when the caller has it already (it saves a
      pass over the n entries); computed here when None.

  Returns:
    `(idx, val, count, fitted)`: int32[capacity] positions (padding = n),
    values[capacity] (padding = 0), the int32 number of used slots
    (min(selected, capacity)), and a bool[n] mask of the entries that were
    packed: the first `capacity` selected entries in position order. Selected
    entries outside `fitted` were not packed.

  Example:
    >>> x = tf.constant([0.5, -2.0, 0.0, 1.5, 3.0])
    >>> idx, val, count, fitted = compact(x, tf.abs(x) >= 1.0, capacity=4)
    >>> idx.numpy().tolist(), val.numpy().tolist(), int(count)
    ([1, 3, 4, 5], [-2.0, 1.5, 3.0, 0.0], 3)

    With 2 slots the third selected entry does not fit:

    >>> idx, val, count, fitted = compact(x, tf.abs(x) >= 1.0, capacity=2)
    >>> idx.numpy().tolist(), fitted.numpy().tolist()
    ([1, 3], [False, True, False, True, False])
  """
  n = acc_flat.shape[0]
  if n is None or acc_flat.shape.rank != 1:
    raise ValueError(f"acc_flat must be rank 1 with a static length, got shape "
                     f"{acc_flat.shape}")
  if not 0 < n < MAX_SIZE:
    raise ValueError(f"acc_flat must have between 1 and {MAX_SIZE - 1} entries, "
                     f"got {n}")
  if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
    raise ValueError(f"capacity must be a Python int >= 1, got {capacity!r}")
  # ends[i]: selected entries up to and including position i (prefix sum).
  if ends is None:
    ends = prefix_count(mask)
  elif ends.shape != mask.shape or ends.dtype != tf.int32:
    raise ValueError(f"ends must be int32 of the mask's shape {mask.shape}, "
                     f"got {ends.dtype.name} {ends.shape}")
  # An entry fits when fewer than `capacity` selected entries precede it.
  fitted = tf.logical_and(mask, ends <= capacity)
  if _private.in_xla_context():
    # XLA lowers a binary search to all-pairs comparisons (O(capacity * n)),
    # but its scatter is one pass: each fitted entry goes to slot ends - 1,
    # the rest to a dump segment `capacity` that is cut off. Each used slot
    # receives exactly one entry; unused slots sum nothing, so shifting the
    # positions by -n and back leaves `n` in them.
    segment = tf.where(fitted, ends - 1, capacity)
    positions = tf.range(n, dtype=tf.int32) - n
    idx = tf.math.unsorted_segment_sum(positions, segment,
                                       capacity + 1)[:capacity] + n
    val = tf.math.unsorted_segment_sum(acc_flat, segment,
                                       capacity + 1)[:capacity]
  else:
    # Slot j holds the (j + 1)-th selected entry: the first position whose
    # prefix count reaches j + 1, found by binary search (O(capacity log n);
    # TensorFlow's CPU scatter over all n entries costs several times more).
    # Slots past the last selected entry get n, the padding position.
    slots = tf.range(1, capacity + 1, dtype=tf.int32)
    idx = tf.searchsorted(ends, slots, side="left", out_type=tf.int32)
    val = tf.where(idx < n, tf.gather(acc_flat, tf.minimum(idx, n - 1)),
                   tf.zeros([], acc_flat.dtype))
  count = tf.minimum(ends[-1], capacity)
  return idx, val, count, fitted


def compact_segments(flat: tf.Tensor, mask: tf.Tensor, ends: tf.Tensor,
                     sizes: Sequence[int], capacities: Sequence[int]):
  """`compact` of consecutive segments of one flat vector, with one set of ops.

  A compressor that lays its variables end to end (segment v holds
  `sizes[v]` entries) packs each segment into its own `capacities[v]` slots,
  exactly as `compact` would pack that segment alone, but with a number of
  ops that does not grow with the number of segments.

  Args:
    flat: rank-1 tensor of static length N = sum(sizes).
    mask: bool[N]; True marks entries to send.
    ends: `prefix_count(mask)` over the whole vector (int32[N]).
    sizes: Python ints >= 1, the segment lengths.
    capacities: Python ints, 1 <= capacities[v] <= sizes[v].

  Returns:
    `(idx, val, selected, fitted)`: int32[sum(capacities)] positions inside
    each segment (padding = that segment's size), values[sum(capacities)]
    (padding = 0), int32[V] selected entries per segment (before capacity),
    and bool[N] the entries packed.
  """
  sizes = [int(s) for s in sizes]
  caps = [int(c) for c in capacities]
  n = flat.shape[0]
  if (flat.shape.rank != 1 or n != sum(sizes) or not sizes
      or mask.shape != flat.shape or ends.shape != flat.shape
      or ends.dtype != tf.int32):
    raise ValueError(f"compact_segments: flat, mask and ends (int32) must be "
                     f"rank 1 of length sum(sizes) = {sum(sizes)}, got "
                     f"{flat.shape}, {mask.shape}, {ends.dtype.name} {ends.shape}")
  if len(caps) != len(sizes) or not all(1 <= c <= s for c, s in zip(caps, sizes)):
    raise ValueError(f"compact_segments: capacities must hold one int in "
                     f"[1, size] per segment; sizes {sizes}, capacities {caps}")
  num = len(sizes)
  if num == 1:  # no segment ids to look up
    idx, val, _, fitted = compact(flat, mask, caps[0], ends=ends)
    return idx, val, ends[-1:], fitted
  starts = np.cumsum([0] + sizes)[:-1]
  slot_starts = np.cumsum([0] + caps)[:-1]
  slots = sum(caps)
  seg = np.repeat(np.arange(num, dtype=np.int32), sizes)          # per entry
  slot_seg = np.repeat(np.arange(num, dtype=np.int32), caps)      # per slot
  slot_local = (np.arange(slots) - np.repeat(slot_starts, caps)).astype(np.int32)
  slot_size = np.repeat(sizes, caps).astype(np.int32)
  caps_t = tf.constant(caps, tf.int32)
  # Selected entries up to each segment's end, and before its start.
  through = tf.gather(ends, (starts + np.asarray(sizes) - 1).astype(np.int32))
  before = tf.concat([tf.zeros([1], tf.int32), through[:-1]], 0)
  selected = through - before
  # Entry e of segment v fits when fewer than caps[v] selected entries of v
  # precede it: ends[e] - before[v] <= caps[v].
  fitted = tf.logical_and(mask, ends <= tf.gather(before + caps_t, seg))
  if _private.in_xla_context():  # one scatter pass, as in `compact`
    segment = tf.where(fitted, ends - 1 + tf.gather(
        tf.constant(slot_starts, tf.int32) - before, seg), slots)
    shifted = (np.arange(n) - np.repeat(starts, sizes)
               - np.repeat(sizes, sizes)).astype(np.int32)  # position - size
    idx = tf.math.unsorted_segment_sum(tf.constant(shifted), segment,
                                       slots + 1)[:slots] + slot_size
    val = tf.math.unsorted_segment_sum(flat, segment, slots + 1)[:slots]
  else:  # slot j of v: the (j + 1)-th selected entry of v, by binary search
    pos = tf.searchsorted(ends, tf.gather(before, slot_seg) + slot_local + 1,
                          side="left", out_type=tf.int32)
    valid = slot_local < tf.gather(tf.minimum(selected, caps_t), slot_seg)
    idx = tf.where(valid, pos - np.repeat(starts, caps).astype(np.int32),
                   slot_size)
    val = tf.where(valid, tf.gather(flat, tf.minimum(pos, n - 1)),
                   tf.zeros([], flat.dtype))
  return idx, val, selected, fitted


def scatter_sum(idx: tf.Tensor, val: tf.Tensor, n: int) -> tf.Tensor:
  """Dense vector of length n: sum of `val` at `idx`; indices >= n are dropped.

  Example:
    >>> idx = tf.constant([1, 3, 1, 5])  # 5 = n: padding
    >>> val = tf.constant([1.0, 2.0, 0.5, 9.0])
    >>> scatter_sum(idx, val, 5).numpy().tolist()
    [0.0, 1.5, 0.0, 2.0, 0.0]
  """
  # unsorted_segment_sum drops a negative segment id, so the padding (n)
  # needs no extra segment, and the result no copy of its first n entries.
  return tf.math.unsorted_segment_sum(val, tf.where(idx < n, idx, -1), n)


# Buffers of at most this many slots are encoded, decoded and scatter-added
# together (`_Layout`); longer ones one by one. `bench/wire_batching.py`
# (4 CPU replicas, the exchange alone, "auto" encoding): batched is 2.0x
# faster for 200 buffers of 40 slots, 1.4x for 100 of 100 and 1.3x for 50 of
# 128; about even for 40 of 200, and 0.63x for 16 of 600, where its gathers
# cost more per slot than one buffer's elementwise ops.
BATCH_CAPACITY = 128


def exchange_many(ctx: tf.distribute.ReplicaContext,
                  buffers: Sequence[tuple[tf.Tensor, tf.Tensor, int]],
                  encoding: str = "auto", presorted: bool = False,
                  nnz: bool = False, use_native: bool = True,
                  batch_capacity: int | None = None,
                  payload: bool = False, exact: bool | None = None):
  """`exchange` for several vectors with one batched all-gather.

  Args:
    ctx: the replica context of the calling replica.
    buffers: `(idx, val, n)` per vector: positions (padding = n) and values of
      one static length, e.g. as produced by `compact`. bfloat16 values
      (`round_values`) travel two to an int32 word and are summed in
      float32: their sums are float32.
    encoding: index layout for every vector, "auto" (per vector, see
      `choose_encoding`) or one of `ENCODINGS`.
    presorted: True promises increasing positions with the padding last (the
      layout of `compact`); otherwise a chunked layout sorts them first.
    nnz: also count the non-zero entries of each sum.
    use_native: False keeps to stock ops even where the native kernel could
      run (`TF_DCT_NATIVE=0` turns it off everywhere).
    batch_capacity: on the stock-op path, buffers of at most this many
      slots share one set of ops (0: every buffer on its own); an int >= 0,
      None: `BATCH_CAPACITY`. The sums are the same either way.
    payload: also return the bytes this replica put on the wire per vector.
    exact: send each replica's used slots only (`_gather_exact`) instead of
      every buffer's full capacity. None (default): exact sizes where the
      replicas span more than one worker and the exchange runs outside XLA;
      the fixed capacity on one worker (bytes between devices of one
      machine are cheap, and the exact-size exchange costs step time: a
      header of counts, TensorFlow's padded gather of differing lengths,
      and a decode) and under XLA (and so on TPU), where shapes must be
      static (True there is an error). The sums are the same bits either
      way.

  Returns:
    Per vector, the dense length-n sum over replicas (same on every replica);
    with `nnz` also counts[v] = int64 non-zero entries of sums[v]; with
    `payload` also bytes[v], what this replica contributed for vector v:
    `wire_bytes` (a Python int) at fixed capacity; with `exact` a float64
    scalar, the vector's used slots and index words, the first vector also
    carrying the step's overhead (the counts header, TensorFlow's length
    word per gathered tensor, and the padding to the longest replica's
    payload). Results come as `sums`, `(sums, counts)`, `(sums, bytes)` or
    `(sums, counts, bytes)`. On CPU (outside XLA; float32, float64 or
    bfloat16 values) two native
    kernels do the work of the stock ops, bit for bit: one lays this
    replica's vectors into one int32 payload per value dtype
    (`tf_dct.compression.native.encode`), and after the all-gather one decodes,
    sums and counts (`tf_dct.compression.native.gather_sum`).

  Raises:
    ValueError: an argument outside its allowed values, before any op is built.
  """
  if batch_capacity is None:
    batch_capacity = BATCH_CAPACITY
  if (isinstance(batch_capacity, bool) or not isinstance(batch_capacity, int)
      or batch_capacity < 0):
    raise ValueError(f"exchange_many: batch_capacity must be an int >= 0 (or None), "
                     f"got {batch_capacity!r}")
  if encoding != "auto" and encoding not in ENCODINGS:
    raise ValueError(f"exchange_many: encoding must be 'auto' or one of {ENCODINGS}, "
                     f"got {encoding!r}")
  for name, flag in (("presorted", presorted), ("nnz", nnz),
                     ("use_native", use_native), ("payload", payload)):
    if not isinstance(flag, bool):
      raise ValueError(f"exchange_many: {name} must be True or False, got {flag!r}")
  if exact is not None and not isinstance(exact, bool):
    raise ValueError(f"exchange_many: exact must be None, True or False, got {exact!r}")
  in_xla = _private.in_xla_context()
  if exact and in_xla:
    raise ValueError("exchange_many: exact must be None or False under XLA, got True "
                     "(exact sizes vary per step; XLA needs static shapes)")
  buffers = list(buffers)

  def result(sums, counts, sent):
    return ((sums,) + ((counts,) if nnz else ()) + ((sent,) if payload else ())
            if nnz or payload else sums)

  if not buffers:
    return result([], [], [])
  if exact is None:
    exact = not in_xla and _private.num_workers(ctx.strategy) > 1
  encs, idxs, vals = [], [], []
  for idx, val, n in buffers:
    enc = make_encoding(encoding, n, idx.shape[0])
    # Exact sizes send a prefix of the slots: the used ones must come first.
    if (enc.name != "int32" or exact) and not presorted:
      order = tf.argsort(idx, stable=True)
      idx, val = tf.gather(idx, order), tf.gather(val, order)
    encs.append(enc)
    idxs.append(tf.cast(idx, tf.int32))
    vals.append(val)
  fixed = [enc.index_bytes + value_bytes(enc.capacity, val.dtype)
           for enc, val in zip(encs, vals)]
  used = _used_slots(encs, idxs) if exact else None
  if use_native and all(native.usable(v.dtype, v.device) for v in vals):
    summed, counts, sent = _exchange_native(ctx, encs, idxs, vals, used)
    return result(summed, counts, sent or fixed)
  # Short buffers share one set of ops (an op per buffer costs a dispatch
  # each); long ones go one by one (see BATCH_CAPACITY).
  short = [v for v, e in enumerate(encs) if e.capacity <= batch_capacity]
  long = [v for v, e in enumerate(encs) if e.capacity > batch_capacity]
  # Short "ef" vectors have their own batched coder; the others share
  # `_Layout`. With exact sizes every "ef" vector is laid out for its used
  # slots (`_EliasFanoExact`), the long ones each with a coder of its own.
  short_ef = [v for v in short if encs[v].name == "ef"]
  short_other = [v for v in short if encs[v].name != "ef"]
  ef_coder = _EliasFanoExact if exact else _EliasFano
  coders = [(members, coder([encs[v] for v in members]))
            for members, coder in ((short_other, _Layout), (short_ef, ef_coder))
            if members]
  long_coders = {v: _EliasFanoExact([encs[v]]) for v in long
                 if exact and encs[v].name == "ef"}

  def encode(members, coder):  # int32[coder.words] for `members`' positions
    idx = tf.concat([idxs[v] for v in members], 0)
    if isinstance(coder, _EliasFanoExact):
      return coder.encode(idx, tf.gather(used, members))
    return coder.encode(idx)

  def decode(members, coder, words):  # int32[r, slots] of `members`
    if isinstance(coder, _EliasFanoExact):
      return coder.decode(words, tf.gather(counts, members, axis=1))
    return coder.decode(words)
  # One all-gather for everything: index words and 4-byte values travel in
  # one int32 stream (values bitcast), other value dtypes in one stream each.
  # One collective per vector and tensor would cost a rendezvous each.
  wire = lambda dtype: tf.int32 if dtype.size == 4 else dtype
  streams = {tf.int32: []}   # dtype on the wire -> pieces, in order
  maps = {tf.int32: []}      # dtype on the wire -> `_WordMap` per piece
  sizes = {}                 # dtype on the wire -> length so far

  def put(piece, word_map):  # -> (wire dtype, start of `piece` in its stream)
    w = wire(piece.dtype)
    at = sizes.get(w, 0)
    sizes[w] = at + piece.shape[0]
    streams.setdefault(w, []).append(
        piece if w == piece.dtype else tf.bitcast(piece, w))
    maps.setdefault(w, []).append(word_map)
    return w, at

  def put_values(members):  # bfloat16 values: two to an int32 word each
    if vals[members[0]].dtype == tf.bfloat16:
      return put(tf.concat([_pack_halves(vals[v]) for v in members], 0),
                 _WordMap.join([_value_map(v, encs[v].capacity, 1, 2)
                                for v in members]))
    return put(tf.concat([vals[v] for v in members], 0),
               _WordMap.join([_value_map(v, encs[v].capacity, 1)
                              for v in members]))

  coder_at = [put(encode(members, coder),
                  _WordMap.join([_index_map(v, encs[v]) for v in members]))[1]
              for members, coder in coders]
  words_at = [put(encode([v], long_coders[v]) if v in long_coders
                  else encode_indices(idxs[v], encs[v]), _index_map(v, encs[v]))[1]
              for v in long]
  short_by_dtype = {}        # value dtype -> short vectors
  for v in short:
    short_by_dtype.setdefault(vals[v].dtype, []).append(v)
  short_vals = {d: put_values(m) for d, m in short_by_dtype.items()}
  long_vals = [put_values([v]) for v in long]
  names = list(streams)
  r = ctx.num_replicas_in_sync
  sent, counts = None, None
  if exact:
    gathered, sent, counts = _gather_exact(
        ctx, [(tf.concat(streams[w], 0), _WordMap.join(maps[w])) for w in names],
        used)
    rows = dict(zip(names, gathered))
  else:
    gathered = ctx.all_gather([tf.concat(streams[w], 0) for w in names], axis=0)
    # One row per replica; the count is static even where the gathered shape
    # is not (MultiWorkerMirrored leaves the leading dimension unknown).
    rows = {w: tf.reshape(g, [r, sizes[w]]) for w, g in zip(names, gathered)}

  def take(where, length, dtype):  # [r, length] of one piece, in `dtype`
    w, at = where
    piece = rows[w][:, at:at + length]
    return piece if w == dtype else tf.bitcast(piece, dtype)

  def take_values(where, members):  # [r, slots] of `members`, summable
    if vals[members[0]].dtype != tf.bfloat16:
      return take(where, sum(encs[v].capacity for v in members),
                  vals[members[0]].dtype)
    caps = [encs[v].capacity for v in members]
    return _unpack_halves(take(where, sum(-(-c // 2) for c in caps), tf.int32),
                          caps)  # summed in float32

  out = [None] * len(buffers)
  if short:
    decoded = [decode(members, coder, rows[tf.int32][:, at:at + coder.words])
               for (members, coder), at in zip(coders, coder_at)]
    idx = decoded[0] if len(decoded) == 1 else tf.concat(decoded, 1)
    order = [v for members, _ in coders for v in members]  # columns of idx
    slot_at = np.cumsum([0] + [encs[v].capacity for v in order])
    column = {v: np.arange(slot_at[i], slot_at[i + 1]) for i, v in enumerate(order)}
    slot_n = np.repeat([encs[v].n for v in order],
                       [encs[v].capacity for v in order]).astype(np.int32)
    for dtype, members in short_by_dtype.items():
      # The group's vectors laid end to end: one scatter-add, one split. Per
      # position, replicas are added in replica order, as in `scatter_sum`.
      cols = np.concatenate([column[v] for v in members])
      ns = [encs[v].n for v in members]
      start = np.repeat(np.cumsum([0] + ns)[:-1],
                        [encs[v].capacity for v in members]).astype(np.int32)
      mine = (idx if np.array_equal(cols, np.arange(slot_n.size))
              else tf.gather(idx, cols, axis=1))
      pos = tf.where(mine < slot_n[cols], mine + start, -1)
      total = tf.math.unsorted_segment_sum(
          tf.reshape(take_values(short_vals[dtype], members), [-1]),
          tf.reshape(pos, [-1]), sum(ns))
      for v, part in zip(members, tf.split(total, ns)):
        out[v] = part
  for i, v in enumerate(long):
    enc = encs[v]
    w_at = words_at[i]
    words = rows[tf.int32][:, w_at:w_at + enc.words]
    val = take_values(long_vals[i], [v])
    idx = (decode([v], long_coders[v], words) if v in long_coders
           else decode_indices(words, enc))  # every replica at once
    out[v] = scatter_sum(tf.reshape(idx, [-1]), tf.reshape(val, [-1]), enc.n)
  nonzero = ([tf.math.count_nonzero(o, dtype=tf.int64) for o in out] if nnz
             else None)
  return result(out, nonzero, sent or fixed)


def _exchange_native(ctx, encs, idxs, vals, used=None):
  """`exchange_many` with the native kernels: per value dtype one payload
  (index words, then values), all of them in one all-gather (with `used`,
  each replica's used slots only, `_gather_exact`); returns the sums, their
  int64 non-zero counts and the exact bytes per vector (None at fixed
  capacity)."""
  groups = {}  # value dtype -> vectors
  for v, val in enumerate(vals):
    groups.setdefault(val.dtype, []).append(v)
  payloads, payload_maps = [], []
  for dtype, members in groups.items():
    mine = [encs[v] for v in members]
    payload = native.encode([idxs[v] for v in members],
                            [vals[v] for v in members], mine,
                            exact=used is not None)
    payload.set_shape([sum(e.words + value_bytes(e.capacity, dtype) // 4
                           for e in mine)])
    payloads.append(payload)
    payload_maps.append(_WordMap.join(
        [_index_map(v, encs[v]) for v in members]
        + [_value_map(v, encs[v].capacity, 1, 2) if dtype == tf.bfloat16
           else _value_map(v, encs[v].capacity, dtype.size // 4)
           for v in members]))
  r = ctx.num_replicas_in_sync
  sent, used_by_row = None, None
  if used is not None:
    gathered, sent, used_by_row = _gather_exact(
        ctx, list(zip(payloads, payload_maps)), used)
  else:
    gathered = [tf.reshape(rows, [r, payload.shape[0]]) for payload, rows in
                zip(payloads, ctx.all_gather(payloads, axis=0))]
  sums, counts = [None] * len(vals), [None] * len(vals)
  for (dtype, members), rows in zip(groups.items(), gathered):
    summed, nnz = native.gather_sum(
        rows, [encs[v] for v in members], dtype,
        None if used is None else tf.gather(used_by_row, members, axis=1))
    for v, total, count in zip(members, summed, tf.unstack(nnz)):
      sums[v], counts[v] = total, count
  return sums, counts, sent


@dataclasses.dataclass(frozen=True)
class _WordMap:
  """Per element of a wire stream: its vector, the first slot of that vector
  it carries (0 for chunk counts) and its value in an unused slot.

  An element whose first slot is at or past its vector's used slots holds
  nothing but padding, so exact sizes leave it out and the receiver puts
  `pad` back, restoring the stream bit for bit (for "ef" the stream laid
  out for the used slots, `_EliasFanoExact`).
  """
  vector: np.ndarray
  first: np.ndarray
  pad: np.ndarray

  @staticmethod
  def join(maps):
    return _WordMap(*(np.concatenate([getattr(m, f) for m in maps])
                      for f in ("vector", "first", "pad")))


def _index_map(v: int, enc: Encoding) -> _WordMap:
  """The `_WordMap` of vector v's index words (`encode_indices`)."""
  if enc.name == "int32":  # one position per word, padding n
    first = np.arange(enc.capacity)
    pad = np.full(enc.capacity, enc.n)
  elif enc.name == "ef":
    # The stream of c used slots is laid out for (n, c) and takes words[c]
    # words (`ef_exact_tables`), a count that grows with c: word w is sent
    # from the smallest c with words[c] > w on, i.e. when slot c - 1 is used.
    words = ef_exact_tables(enc.n, enc.capacity)[1]
    first = np.searchsorted(words, np.arange(enc.words), side="right") - 1
    pad = np.zeros(enc.words, np.int64)
  else:  # chunk counts (always sent), then offsets packed 4 // width a word
    first = np.concatenate([np.zeros(enc.count_words, np.int64),
                            np.arange(enc.offset_words) * (4 // enc.offset_bytes)])
    pad = np.zeros(enc.words, np.int64)
  return _WordMap(np.full(first.size, v), first, pad)


def sent_index_words(encoding: Encoding, used: int) -> int:
  """Index words a replica sends with exact sizes when `used` slots hold a
  position: the words of `encode_indices` that carry more than padding
  ("ef": the words of the stream laid out for (n, used))."""
  return int(np.sum(_index_map(0, encoding).first < used))


def _value_map(v: int, capacity: int, per_slot: int,
               per_element: int = 1) -> _WordMap:
  """The `_WordMap` of vector v's values, `per_slot` elements a slot or
  `per_element` slots an element (bfloat16 in int32 words: 2)."""
  elements = -(-capacity * per_slot // per_element)
  first = np.arange(elements) * per_element // per_slot
  return _WordMap(np.full(first.size, v), first, np.zeros(first.size, np.int64))


def _used_slots(encs, idxs) -> tf.Tensor:
  """int32[vectors]: slots holding a position (< n) per vector."""
  slot_n = np.concatenate([np.full(e.capacity, e.n) for e in encs])
  slot_vector = np.repeat(np.arange(len(encs)), [e.capacity for e in encs])
  return tf.math.unsorted_segment_sum(
      tf.cast(tf.concat(idxs, 0) < slot_n.astype(np.int32), tf.int32),
      slot_vector.astype(np.int32), len(encs))


def _gather_exact(ctx, streams, used):
  """All-gathers streams of fixed-capacity words, sending only what is used.

  Each replica drops the elements of its streams that carry only padding
  (an element whose first slot is at or past its vector's `used` count,
  `_WordMap`) and sends the rest, the first stream headed by its length and
  the `used` counts. TensorFlow's all-gather takes tensors whose lengths
  differ between replicas: it gathers the lengths (one int32 each) and pads
  every replica's tensor to the longest. The receiver walks the rows of the
  first stream by their lengths, reads every replica's counts and puts the
  dropped padding back, so the rows are exactly those of a fixed-capacity
  all-gather.

  Args:
    ctx: the replica context.
    streams: `(tensor, _WordMap)` per stream, rank-1 tensors of static
      length; the first int32.
    used: int32[vectors], used slots per vector of this replica.

  Returns:
    `(rows, sent, counts)`: per stream the [replicas, length] rows with the
    padding restored; per vector the float64 bytes this replica sent for
    it, the first vector also carrying the step's overhead (header,
    lengths, padding to the longest replica); int32[replicas, vectors] the
    used slots of every replica.
  """
  r = ctx.num_replicas_in_sync
  vectors = used.shape[0]
  parts, sizes = [], []
  own = tf.zeros([vectors], tf.float64)
  for tensor, word_map in streams:
    keep = tf.constant(word_map.first, tf.int32) < tf.gather(
        used, word_map.vector.astype(np.int32))
    parts.append(tf.boolean_mask(tensor, keep))
    sizes.append(tensor.dtype.size)
    own += tf.math.unsorted_segment_sum(
        tf.cast(keep, tf.float64) * tensor.dtype.size,
        word_map.vector.astype(np.int32), vectors)
  header = 1 + vectors
  parts[0] = tf.concat([[tf.size(parts[0], tf.int32) + header], used,
                        parts[0]], 0)
  gathered = ctx.all_gather(parts, axis=0)
  # Row i of the first stream starts where row i - 1 ends.
  start, counts, data = tf.constant(0, tf.int32), [], []
  for _ in range(r):
    length = gathered[0][start]
    counts.append(tf.slice(gathered[0], [start + 1], [vectors]))
    data.append(tf.slice(gathered[0], [start + header], [length - header]))
    start += length
  counts = tf.stack(counts)  # [r, vectors]
  data = [tf.concat(data, 0)] + list(gathered[1:])
  rows, longest = [], []
  for (tensor, word_map), values in zip(streams, data):
    keep = tf.constant(word_map.first[None], tf.int32) < tf.gather(
        counts, word_map.vector.astype(np.int32), axis=1)
    template = tf.tile(tf.constant(word_map.pad[None], tensor.dtype), [r, 1])
    rows.append(tf.tensor_scatter_nd_update(template, tf.where(keep), values))
    longest.append(tf.reduce_max(tf.reduce_sum(tf.cast(keep, tf.float64), 1)))
  # What crosses per replica: every stream padded to its longest row (the
  # first with its header), plus the int32 length TensorFlow gathers first.
  total = tf.add_n([size * (n + (header if i == 0 else 0)) + 4
                    for i, (size, n) in enumerate(zip(sizes, longest))])
  sent = tf.unstack(own)
  sent[0] += total - tf.reduce_sum(own)
  return rows, sent, counts


def exchange(ctx: tf.distribute.ReplicaContext, idx: tf.Tensor, val: tf.Tensor,
             n: int, encoding: str = "auto", presorted: bool = False) -> tf.Tensor:
  """Sums every replica's packed entries into a dense vector of length n.

  Every replica calls it with its own buffers; all replicas get the same
  result. Positions sent by several replicas are added up; padding slots
  (index n) contribute nothing.
  """
  return exchange_many(ctx, [(idx, val, n)], encoding, presorted)[0]
