"""Criteo click logs: a TSV reader and a synthetic generator of the same shape.

A Criteo row is `label \\t I1..I13 \\t C1..C26`: a 0/1 click label, 13 integer
counts and 26 categorical values (8-digit hex strings); any feature may be
empty. Both sources yield batches `((dense, sparse), label)` with

* `dense`: float32 [B, 13], `log(1 + max(x, 0))` of the counts (empty -> 0);
* `sparse`: int32 [B, 26], column j hashed into `[0, vocab_sizes[j])`, where 0
  is kept for an empty value and other values land in `[1, vocab_sizes[j])`;
* `label`: float32 [B, 1].

Malformed rows (wrong column count, a non-integer count, a label other than 0
or 1) are reported as `path:line`. Files up to `eager_check_bytes` are checked
when the dataset is built (`DataError`, a ValueError); every file is also
checked inside the pipeline, so a bad row in a big file fails when it is read
(`tf.errors.InvalidArgumentError` with the same `path:line: reason` text).
Both checks match whole lines against one regular expression in TensorFlow and
look for the line and the reason only once a batch fails; rows are then parsed
by `tf.io.decode_csv`.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
import re

import numpy as np
import tensorflow as tf

from models.data import order
from models.data.errors import DataError
from models.data.errors import MALFORMED

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_COLUMNS = 1 + NUM_DENSE + NUM_SPARSE
SYNTHETIC_VOCAB_SIZE = 1000  # per categorical feature, synthetic data
CRITEO_VOCAB_SIZE = 100_000  # per categorical feature, hashed real data
EAGER_CHECK_BYTES = 64 << 20

# An integer count (optionally negative) or an empty field.
_INT_PATTERN = r"(?:-?[0-9]+)?"
_INT_RE = re.compile(_INT_PATTERN)
# A whole well-formed row (non-capturing, so RE2 checks it with its fast DFA).
_ROW_PATTERN = (rf"[01](?:\t{_INT_PATTERN}){{{NUM_DENSE}}}"
                rf"(?:\t[^\t]*){{{NUM_SPARSE}}}")
# Lines per batch of the eager check.
_CHECK_BATCH = 1 << 16
# Bytes per read of `count_rows`.
_COUNT_CHUNK = 1 << 24


def vocab_list(vocab_sizes: int | Sequence[int]) -> list[int]:
  """One vocabulary size per categorical feature (an int is used for all 26)."""
  sizes = [vocab_sizes] * NUM_SPARSE if isinstance(vocab_sizes, int) else list(vocab_sizes)
  if len(sizes) != NUM_SPARSE or any(int(v) < 2 for v in sizes):
    raise ValueError(f"vocab_sizes must be {NUM_SPARSE} ints >= 2 (or one int), "
                     f"got {vocab_sizes!r}")
  return [int(v) for v in sizes]


def check_row(line: str) -> str | None:
  """Why a raw TSV line is malformed, or None if it is a valid row."""
  fields = line.rstrip("\r\n").split("\t")
  if len(fields) != NUM_COLUMNS:
    return f"expected {NUM_COLUMNS} tab-separated fields, got {len(fields)}"
  if fields[0] not in ("0", "1"):
    return f"label must be 0 or 1, got `{fields[0]}`"
  for j, value in enumerate(fields[1:1 + NUM_DENSE]):
    if not _INT_RE.fullmatch(value):
      return f"integer feature I{j + 1} is not an integer: `{value}`"
  return None


def check_file(path: str) -> None:
  """Raises DataError naming `path:line` at the first malformed row.

  The rows are matched in TensorFlow, a batch at a time; only a file with a
  bad row is read again line by line, to name it.
  """
  valid = tf.data.TextLineDataset(path).batch(_CHECK_BATCH).map(
      lambda lines: tf.reduce_all(tf.strings.regex_full_match(lines, _ROW_PATTERN)))
  if all(bool(ok) for ok in valid):
    return
  with open(path, encoding="utf-8", newline="") as f:
    for number, line in enumerate(f, start=1):
      reason = check_row(line)
      if reason:
        if number == 1 and not line.split("\t")[0].strip().isdigit():
          reason += (" (a header line? Criteo TSV files have none: remove "
                     "the first line)")
        raise DataError(f"{path}:{number}: {reason}")


def _reason(line: tf.Tensor) -> tf.Tensor:
  """`check_row` in graph ops, for one line known to be malformed."""
  fields = tf.strings.split(line, "\t")
  count = tf.size(fields, out_type=tf.int64)
  num = tf.strings.as_string

  def bad_int():
    ints = fields[1:1 + NUM_DENSE]
    col = tf.argmin(tf.cast(tf.strings.regex_full_match(ints, _INT_PATTERN), tf.int32))
    return tf.strings.join(["integer feature I", num(col + 1), " is not an integer: `",
                            ints[col], "`"])

  return tf.case([
      (tf.not_equal(count, NUM_COLUMNS), lambda: tf.strings.join([
          f"expected {NUM_COLUMNS} tab-separated fields, got ", num(count)])),
      (tf.logical_not(tf.strings.regex_full_match(fields[0], "[01]")),
       lambda: tf.strings.join(["label must be 0 or 1, got `", fields[0], "`"])),
  ], default=bad_int)


def _parse_lines(lines: tf.Tensor, numbers: tf.Tensor, path: tf.Tensor,
                 vocab_sizes: Sequence[int]):
  """Parses a batch of raw lines with `tf.io.decode_csv`; asserts they are
  well formed first (naming `path:line` of the first bad one)."""
  ok = tf.strings.regex_full_match(lines, _ROW_PATTERN)

  def report():
    i = tf.argmin(tf.cast(ok, tf.int32))
    message = tf.strings.join([MALFORMED, path, ":", tf.strings.as_string(numbers[i]),
                               ": ", _reason(lines[i])])
    return tf.debugging.Assert(False, [message])

  check = tf.cond(tf.reduce_all(ok), tf.no_op, report)
  with tf.control_dependencies([check]):  # no conversion runs before the check
    lines = tf.identity(lines)
  columns = tf.io.decode_csv(
      lines, [[0.0]] * (1 + NUM_DENSE) + [[""]] * NUM_SPARSE, field_delim="\t",
      use_quote_delim=False)
  dense = tf.math.log1p(tf.maximum(tf.stack(columns[1:1 + NUM_DENSE], axis=1), 0.0))
  sparse = tf.stack([hash_column(columns[1 + NUM_DENSE + j], vocab_sizes[j])
                     for j in range(NUM_SPARSE)], axis=1)
  return (dense, sparse), columns[0][:, None]


def hash_column(values: tf.Tensor, vocab_size: int) -> tf.Tensor:
  """Hashes strings into [1, vocab_size); the empty string becomes 0."""
  hashed = tf.strings.to_hash_bucket_fast(values, vocab_size - 1) + 1
  return tf.cast(tf.where(tf.equal(values, ""), tf.zeros_like(hashed), hashed), tf.int32)


def count_rows(path: str, at_least: int | None = None) -> int:
  """The rows `tf.data.TextLineDataset(path)` yields: the newlines in the
  file, plus one for a last line without one. Counts bytes; parses nothing.

  With `at_least`, reading stops once that many rows are counted: the result
  is then a count >= `at_least`, not necessarily the file's total.
  """
  if at_least is not None:
    order.check_count("at_least", at_least)
  rows, last = 0, b"\n"
  with open(path, "rb") as f:
    while chunk := f.read(_COUNT_CHUNK):
      rows += chunk.count(b"\n")
      last = chunk[-1:]
      if at_least is not None and rows >= at_least:
        return rows
  return rows + (last != b"\n")


def _checked_paths(paths, eager_check_bytes: int) -> list[str]:
  """The paths as a list; each exists, and those up to `eager_check_bytes`
  hold only well-formed rows (`check_file`)."""
  paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not paths:
    raise ValueError("read_tsv: no files given")
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"Criteo file not found: {path}")
    if os.path.getsize(path) <= eager_check_bytes:
      check_file(path)
  return [os.fspath(p) for p in paths]


def _one_pass(paths: list[str], batch_size: int, sizes: list[int], drop_remainder: bool,
              skip_rows: int = 0, rows: list[int] | None = None) -> tf.data.Dataset:
  """One pass over the files' rows, in order, from row `skip_rows` (counting
  across files) on. Files before that row are not opened; in the file that
  holds it, the lines before it are read and dropped unparsed. `rows`: the
  files' row counts (`count_rows`) as far as known (for the file that holds
  the row, any count above it will do)."""
  skips = [0] * len(paths)
  first = 0
  while skip_rows and first < len(paths):
    n = rows[first] if rows is not None else count_rows(paths[first])
    if skip_rows < n:
      skips[first] = skip_rows
      break
    skip_rows -= n
    first += 1
  empty = first == len(paths)  # every row skipped
  paths, skips = (paths[-1:], [0]) if empty else (paths[first:], skips[first:])

  def one_file(path, skip):
    # Numbered before the skip, so a bad row is named by its line in the file.
    lines = tf.data.TextLineDataset(path).enumerate(start=1).skip(skip)
    return lines.batch(batch_size).map(
        lambda numbers, batch: _parse_lines(batch, numbers, path, sizes))

  files = tf.data.Dataset.from_tensor_slices((paths, tf.constant(skips, tf.int64)))
  data = files.flat_map(one_file)
  if drop_remainder or len(paths) > 1:  # batches restart per file: rebatch
    data = data.rebatch(batch_size, drop_remainder=drop_remainder)
  return data.take(0) if empty else data


def read_tsv(paths: str | Sequence[str], batch_size: int,
             vocab_sizes: int | Sequence[int] = CRITEO_VOCAB_SIZE, *,
             drop_remainder: bool = False,
             eager_check_bytes: int = EAGER_CHECK_BYTES,
             skip_rows: int = 0) -> tf.data.Dataset:
  """Batches of parsed Criteo rows from TSV files, in file order.

  Args:
    paths: one file or several, read one after another.
    batch_size: rows per batch.
    vocab_sizes: hash buckets per categorical feature (one int for all).
    drop_remainder: drop a last batch smaller than `batch_size`.
    eager_check_bytes: files up to this size are fully checked now
      (DataError naming `path:line`); bigger ones only as they are read.
    skip_rows: rows (counting across the files) to leave out before the
      first batch. They are never parsed: whole files are passed over by
      their line counts (`count_rows`), the rest dropped as raw lines.

  Returns:
    A dataset of `((dense [B,13] float32, sparse [B,26] int32), label [B,1])`.

  Raises:
    FileNotFoundError: a path does not exist.
    DataError: a checked file has a malformed row (a bigger file fails
      in the graph as it is read, with the same message after `MALFORMED`).
  """
  order.check_count("skip_rows", skip_rows)
  sizes = vocab_list(vocab_sizes)
  paths = _checked_paths(paths, eager_check_bytes)
  return _one_pass(paths, batch_size, sizes, drop_remainder, skip_rows)


def tsv_stream(paths: str | Sequence[str], batch_size: int,
               vocab_sizes: int | Sequence[int] = CRITEO_VOCAB_SIZE, *,
               start: int = 0, eager_check_bytes: int = EAGER_CHECK_BYTES) -> tf.data.Dataset:
  """Endless batches of parsed Criteo rows: the files read in order, pass
  after pass, each pass dropping its last partial batch; from batch `start`
  of that stream on.

  The batches before `start` are not made: the stream opens at the row of
  batch `start` (`read_tsv`'s `skip_rows`), so no row is parsed twice. The
  files' lines are counted (`count_rows`) up to the end of that batch; only
  when the files end before it are all counted, and with `P` whole batches
  per pass the stream opens pass `start // P` at row
  `(start % P) * batch_size`. Arguments and errors as in `read_tsv`; a
  ValueError if the files hold fewer rows than one batch (`start > 0`).
  """
  order.check_start(start)
  sizes = vocab_list(vocab_sizes)
  paths = _checked_paths(paths, eager_check_bytes)
  full = _one_pass(paths, batch_size, sizes, drop_remainder=True).repeat()
  if not start:
    return full
  skip, rows = start * batch_size, []
  for path in paths:
    rows.append(count_rows(path, at_least=skip + batch_size - sum(rows)))
    if sum(rows) >= skip + batch_size:  # batch `start` is whole in the first pass
      return _one_pass(paths, batch_size, sizes, True, skip, rows).concatenate(full)
  per_pass = sum(rows) // batch_size
  if not per_pass:
    raise ValueError(f"tsv_stream: the files hold {sum(rows)} rows, fewer than one "
                     f"batch of {batch_size}: no batch {start} to start at")
  skip = (start % per_pass) * batch_size
  return _one_pass(paths, batch_size, sizes, True, skip, rows).concatenate(full)


def find_files(data_dir: str, split: str = "train") -> list[str]:
  """The TSV files of `split` in `data_dir`: `{split}.txt` / `{split}.tsv`.

  `train.txt` is the name of the Criteo Kaggle training file; an `eval` split
  is whatever the user holds out into `eval.txt` or `eval.tsv`.
  """
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"Criteo data directory not found: {data_dir}")
  names = [f"{split}.txt", f"{split}.tsv"]
  found = [os.path.join(data_dir, n) for n in names
           if os.path.isfile(os.path.join(data_dir, n))]
  if not found:
    raise FileNotFoundError(
        f"no Criteo {split} file in {data_dir} (expected one of {', '.join(names)})")
  return found


# --- synthetic data ------------------------------------------------------------


class Teacher:
  """A fixed random DLRM-like scorer that labels synthetic rows.

  logit = w · dense + Σ_j b_j[id_j] + Σ_{i<j} <v_i, v_j> (scaled), where v_0 is
  a projection of the dense features and v_j an embedding of feature j.
  """

  def __init__(self, seed: int, vocab_sizes: int | Sequence[int] = SYNTHETIC_VOCAB_SIZE,
               dim: int = 4):
    rng = np.random.default_rng([seed, 7])
    self.vocab_sizes = vocab_list(vocab_sizes)
    self.w = tf.constant(rng.normal(size=(NUM_DENSE, 1)) / 2, tf.float32)
    self.proj = tf.constant(rng.normal(size=(NUM_DENSE, dim)) / 4, tf.float32)
    total = sum(self.vocab_sizes)  # all features' tables stacked row-wise
    self.rows = tf.constant(np.cumsum([0] + self.vocab_sizes[:-1]), tf.int32)
    self.bias = tf.constant(rng.normal(size=(total,)) * 0.6, tf.float32)
    self.emb = tf.constant(rng.normal(size=(total, dim)) * 0.5, tf.float32)
    self.offset = 0.0
    dense, sparse = _synthetic_features(tf.constant([seed, 1 << 20], tf.int64), 4096,
                                        self.vocab_sizes)
    self.offset = float(np.median(self.logits(dense, sparse).numpy()))

  def logits(self, dense: tf.Tensor, sparse: tf.Tensor) -> tf.Tensor:
    """Teacher logits [B, 1] for features shaped like the reader's output."""
    centered = dense - 1.5
    rows = sparse + self.rows
    linear = (tf.matmul(centered, self.w) +
              tf.reduce_sum(tf.gather(self.bias, rows), axis=1, keepdims=True))
    v = tf.concat([tf.matmul(centered, self.proj)[:, None], tf.gather(self.emb, rows)],
                  axis=1)  # [B, 27, dim]
    gram = tf.matmul(v, v, transpose_b=True)
    pairs = (tf.reduce_sum(gram, axis=[1, 2]) - tf.linalg.trace(gram)) / 2
    return linear + 0.2 * pairs[:, None] - self.offset


def _synthetic_features(seed: tf.Tensor, batch_size: int, vocab_sizes: Sequence[int]):
  """Criteo-shaped features: log-normal counts, Zipf-like categorical ids."""
  s1, s2, s3 = tf.unstack(tf.random.experimental.stateless_split(seed, 3))
  counts = tf.floor(tf.exp(tf.random.stateless_normal([batch_size, NUM_DENSE], s1) * 1.5))
  empty = tf.random.stateless_uniform([batch_size, NUM_DENSE], s2) < 0.1
  dense = tf.math.log1p(tf.where(empty, 0.0, counts))
  u = tf.random.stateless_uniform([batch_size, NUM_SPARSE], s3)
  vocab = tf.constant(vocab_sizes, tf.float32)
  # ids ~ vocab ** u - 1: small ids are far more frequent, like real categories
  sparse = tf.cast(tf.minimum(tf.pow(vocab, u) - 1.0, vocab - 1.0), tf.int32)
  return dense, sparse


def synthetic_dataset(batch_size: int, seed: int = 0,
                      vocab_sizes: int | Sequence[int] = SYNTHETIC_VOCAB_SIZE,
                      split: str = "train", start: int = 0) -> tf.data.Dataset:
  """Endless teacher-labelled Criteo-shaped batches, deterministic per seed.

  The labels are Bernoulli draws from the sigmoid of a fixed `Teacher(seed)`;
  `split="eval"` draws other rows from the same teacher. Batch `i` depends
  on `i` alone; the stream begins at batch `start`.
  """
  order.check_start(start)
  sizes = vocab_list(vocab_sizes)
  teacher = Teacher(seed, sizes)
  stream = {"train": 0, "eval": 1}[split]

  def batch(i):
    key = tf.stack([tf.constant(seed, tf.int64) * 4 + stream, i])
    dense, sparse = _synthetic_features(key, batch_size, sizes)
    u = tf.random.stateless_uniform([batch_size, 1], key + [0, 1 << 40])
    label = tf.cast(u < tf.sigmoid(teacher.logits(dense, sparse)), tf.float32)
    return (dense, sparse), label

  return tf.data.Dataset.range(start, order.ENDLESS).map(batch).prefetch(2)


def write_tsv(path: str, num_rows: int, seed: int = 0,
              vocab_sizes: int | Sequence[int] = SYNTHETIC_VOCAB_SIZE,
              split: str = "train") -> None:
  """Writes synthetic rows in the raw Criteo format (for smoke runs of --data_dir).

  Counts are written as integers, ids as 8-digit hex, so reading the file
  back hashes ids again (a different but fixed id mapping, same signal).
  """
  data = synthetic_dataset(num_rows, seed, vocab_sizes, split)
  (dense, sparse), label = next(iter(data))
  counts = np.rint(np.expm1(dense.numpy())).astype(np.int64)
  with open(path, "w", encoding="utf-8") as f:
    for y, c, s in zip(label.numpy()[:, 0], counts, sparse.numpy()):
      cells = [str(int(y))] + [str(x) for x in c] + [
          "" if x == 0 else f"{int(x) * 2654435761 % (1 << 32):08x}" for x in s]
      f.write("\t".join(cells) + "\n")
