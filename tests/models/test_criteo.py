"""Tests for models/data/criteo.py: the TSV reader and the synthetic generator."""

import os
from unittest import mock

import numpy as np
import tensorflow as tf

from models.data import criteo
from models.data import errors
from tests import util


def setUpModule():
  util.setup_cpus()


def _row(label="1", ints=None, cats=None) -> str:
  ints = [str(i) for i in range(criteo.NUM_DENSE)] if ints is None else ints
  cats = [f"{j:08x}" for j in range(criteo.NUM_SPARSE)] if cats is None else cats
  return "\t".join([label, *ints, *cats]) + "\n"


class ReaderTest(tf.test.TestCase):

  def _write(self, text: str) -> str:
    path = os.path.join(self.get_temp_dir(), "day.tsv")
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    return path

  def test_parses_exact_values(self):
    ints = ["5", "", "-3", "0"] + ["1"] * 9
    cats = ["", "68fd1e64"] + ["0"] * 24
    path = self._write(_row() + _row("0", ints, cats))
    (dense, sparse), label = next(iter(criteo.read_tsv(path, batch_size=2, vocab_sizes=7)))
    self.assertAllEqual(label, [[1.0], [0.0]])
    self.assertAllClose(dense[0], np.log1p(np.arange(13)))
    self.assertAllClose(dense[1, :4], [np.log(6.0), 0.0, 0.0, 0.0])  # empty, negative -> 0
    self.assertEqual(sparse.dtype, tf.int32)
    want = tf.strings.to_hash_bucket_fast(["68fd1e64", "0"], 6).numpy() + 1
    self.assertEqual(sparse[1, 0], 0)  # empty -> the missing id
    self.assertAllEqual(sparse[1, 1:3], want)
    self.assertAllInRange(sparse, 0, 6)

  def test_per_feature_vocab_and_batches_across_files(self):
    a, b = self._write(_row() * 3), os.path.join(self.get_temp_dir(), "b.tsv")
    with open(b, "w", encoding="utf-8") as f:
      f.write(_row("0") * 3)
    sizes = [2] * 13 + [1000] * 13
    batches = list(criteo.read_tsv([a, b], 4, sizes, drop_remainder=True))
    self.assertLen(batches, 1)
    (_, sparse), label = batches[0]
    self.assertAllEqual(label[:, 0], [1, 1, 1, 0])
    self.assertAllEqual(sparse[:, :13], np.ones((4, 13)))  # vocab 2: one non-missing bucket

  def test_malformed_rows_name_file_and_line(self):
    cases = {
        _row()[:-1] + "\textra\n": r"day.tsv:2: expected 40 tab-separated fields, got 41",
        _row(label="2"): r"day.tsv:2: label must be 0 or 1, got `2`",
        _row(ints=["1"] * 4 + ["1.5"] + ["1"] * 8): r"day.tsv:2: integer feature I5 is not "
                                                   r"an integer: `1.5`",
    }
    for bad, message in cases.items():
      path = self._write(_row() + bad + _row())
      with self.assertRaisesRegex(ValueError, message):  # eager check, small file
        criteo.read_tsv(path, 2)
      lines = tf.constant([r.rstrip("\n") for r in (_row(), bad, _row())])
      with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):  # in-graph check
        criteo._parse_lines(lines, tf.constant([1, 2, 3], tf.int64), path, [10] * 26)  # pylint: disable=protected-access
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):  # big-file path
      list(criteo.read_tsv(path, 2, eager_check_bytes=0))

  def test_crlf_quotes_and_a_lone_minus(self):
    # decode_csv is told not to treat `"` specially; a Windows line end is
    # dropped; `-` alone is no integer (it used to fail in a cast).
    cats = ['"a', 'b"'] + ["0"] * 24
    path = self._write((_row() + _row("0", cats=cats)).replace("\n", "\r\n"))
    (_, sparse), label = next(iter(criteo.read_tsv(path, 2, vocab_sizes=7)))
    self.assertAllEqual(label, [[1.0], [0.0]])
    want = tf.strings.to_hash_bucket_fast(['"a', 'b"'], 6).numpy() + 1
    self.assertAllEqual(sparse[1, :2], want)
    bad = self._write(_row() + _row(ints=["-"] + ["1"] * 12))
    with self.assertRaisesRegex(errors.DataError, r"day.tsv:2: integer feature I1 is not "
                                r"an integer: `-`"):
      criteo.read_tsv(bad, 2)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"day.tsv:2: integer "
                                r"feature I1"):
      list(criteo.read_tsv(bad, 2, eager_check_bytes=0))

  def test_a_bad_row_in_a_later_batch_of_the_check(self):
    path = self._write(_row() * 5 + _row(label="") + _row())
    with mock.patch.object(criteo, "_CHECK_BATCH", 2):
      with self.assertRaisesRegex(errors.DataError, r"day.tsv:6: label must be 0 or 1"):
        criteo.read_tsv(path, 2)

  def test_big_file_reports_a_bad_label_by_its_line(self):
    # The in-graph check runs before any field is converted, so a label
    # that is not a number is reported as path:line, not as a failed cast.
    path = self._write(_row() + _row() + _row(label="x"))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                r"malformed data: .*day.tsv:3: label must be 0 "
                                r"or 1, got `x`"):
      list(criteo.read_tsv(path, 2, eager_check_bytes=0))

  def test_a_header_line_is_named(self):
    header = "\t".join(["label"] + [f"I{i}" for i in range(1, 14)]
                       + [f"C{i}" for i in range(1, 27)]) + "\n"
    with self.assertRaisesRegex(errors.DataError,
                                r"day.tsv:1: label must be 0 or 1, got `label` "
                                r"\(a header line\? Criteo TSV files have none"):
      criteo.read_tsv(self._write(header + _row()), 2)

  def test_missing_paths(self):
    missing = os.path.join(self.get_temp_dir(), "nope.tsv")
    with self.assertRaisesRegex(FileNotFoundError, "nope.tsv"):
      criteo.read_tsv(missing, 2)
    with self.assertRaisesRegex(FileNotFoundError, "no_dir"):
      criteo.find_files(os.path.join(self.get_temp_dir(), "no_dir"))

  def test_synthetic_file_round_trips_through_reader(self):
    path = os.path.join(self.get_temp_dir(), "train.txt")
    criteo.write_tsv(path, 64, seed=3)
    self.assertEqual(criteo.find_files(self.get_temp_dir()), [path])
    (dense, _), label = next(iter(criteo.read_tsv(path, 64, 1000)))
    (want_dense, _), want_label = next(iter(criteo.synthetic_dataset(64, seed=3)))
    self.assertAllEqual(label, want_label)
    self.assertAllClose(dense, want_dense, atol=1e-5)


class ResumeTest(tf.test.TestCase):
  """A stream started at a batch: the uninterrupted stream's batches from
  there on, with no row before it parsed."""

  def _files(self):
    """11 + 6 rows, each its own (row r has count r in I1 and label r % 2)."""
    paths = [os.path.join(self.get_temp_dir(), name) for name in ("train.txt", "train.tsv")]
    for path, rows in zip(paths, (range(11), range(11, 17))):
      with open(path, "w", encoding="utf-8") as f:
        f.writelines(_row(str(r % 2), [str(r)] + ["1"] * 12) for r in rows)
    return paths

  def _assert_batches_equal(self, got, want):
    self.assertEqual(len(got), len(want))
    for g, w in zip(got, want):
      tf.nest.map_structure(self.assertAllEqual, g, w)

  def test_stream_from_a_batch_is_the_uninterrupted_stream(self):
    # 11 + 6 rows in batches of 4: 4 batches a pass (a row dropped each
    # pass). Batch 3 starts a row into the second file (the first is passed
    # over whole); batch 4 is the second pass's first (row 16 of the first
    # pass is the dropped one); batch 6 the second pass's batch 2.
    paths = self._files()
    full = list(criteo.tsv_stream(paths, 4, 50, eager_check_bytes=0).take(10))
    for start in (3, 4, 6):
      self._assert_batches_equal(
          list(criteo.tsv_stream(paths, 4, 50, start=start, eager_check_bytes=0).take(10 - start)),
          full[start:])
    # One pass from a row: the rows from there, batched afresh.
    (dense, _), label = next(iter(criteo.read_tsv(paths, 8, 50, skip_rows=9,
                                                  eager_check_bytes=0)))
    self.assertAllClose(dense[:, 0], np.log1p(np.arange(9, 17)))
    self.assertAllEqual(label[:, 0], np.arange(9, 17) % 2)
    self.assertEmpty(list(criteo.read_tsv(paths, 4, 50, skip_rows=17)))

  def test_rows_before_the_start_are_not_parsed(self):
    # A row that only parsing rejects (the files are too big for the eager
    # check here) sits in batch 1 of each pass; a stream from batch 2 reads
    # to the end of the first pass without it.
    paths = self._files()
    with open(paths[0], encoding="utf-8") as f:
      lines = f.readlines()
    lines[5] = _row(label="x")
    with open(paths[0], "w", encoding="utf-8") as f:
      f.writelines(lines)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"train.txt:6: label"):
      list(criteo.tsv_stream(paths, 4, 50, eager_check_bytes=0).take(2))
    resumed = criteo.tsv_stream(paths, 4, 50, start=2, eager_check_bytes=0)
    self.assertLen(list(resumed.take(2)), 2)  # batches 2, 3 of the first pass
    # The next pass reads the bad row again and names its line.
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"train.txt:6: label"):
      list(resumed.take(4))
    # Batch 6 (the second pass's batch 2) starts past the bad row as well.
    self.assertLen(list(criteo.tsv_stream(paths, 4, 50, start=6,
                                          eager_check_bytes=0).take(2)), 2)

  def test_restored_iterator_seeks_to_its_byte_offset(self):
    # A checkpointed iterator resumes at its saved byte offset in the file:
    # the 8 rows it consumed, overwritten by as many bytes without a
    # newline, are neither read as lines nor parsed.
    paths = self._files()
    full = list(criteo.tsv_stream(paths, 4, 50, eager_check_bytes=0).take(3))
    iterator = iter(criteo.tsv_stream(paths, 4, 50, eager_check_bytes=0))
    next(iterator), next(iterator)
    saved = tf.train.Checkpoint(input=iterator).write(
        os.path.join(self.get_temp_dir(), "input"))
    with open(paths[0], "rb") as f:
      data = f.read()
    consumed = sum(len(line) for line in data.splitlines(keepends=True)[:8])
    with open(paths[0], "wb") as f:
      f.write(b"x" * consumed + data[consumed:])
    restored = iter(criteo.tsv_stream(paths, 4, 50, eager_check_bytes=0))
    tf.train.Checkpoint(input=restored).read(saved).assert_consumed()
    self._assert_batches_equal([next(restored)], full[2:])

  def test_count_rows_counts_what_the_reader_reads(self):
    d = self.get_temp_dir()
    for name, text in {"plain": _row() * 3, "no_last_newline": _row() * 2 + _row()[:-1],
                       "crlf": (_row() * 2).replace("\n", "\r\n"), "empty": ""}.items():
      path = os.path.join(d, name)
      with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
      self.assertEqual(criteo.count_rows(path),
                       len(list(tf.data.TextLineDataset(path))), name)
    # Reading a row at a time, a count of at least 2 stops after 2 of 3 rows.
    path = os.path.join(d, "plain")
    with mock.patch.object(criteo, "_COUNT_CHUNK", len(_row())):
      self.assertEqual(criteo.count_rows(path, at_least=2), 2)
      self.assertEqual(criteo.count_rows(path), 3)

  def test_bad_start_and_skip(self):
    paths = self._files()
    with self.assertRaisesRegex(ValueError, r"skip_rows must be an int >= 0, got -1"):
      criteo.read_tsv(paths, 4, skip_rows=-1)
    with self.assertRaisesRegex(ValueError, r"at_least must be an int >= 0, got -1"):
      criteo.count_rows(paths[0], at_least=-1)
    with self.assertRaisesRegex(ValueError, r"start \(the index of the first batch\) must "
                                r"be an int >= 0, got 1.5"):
      criteo.tsv_stream(paths, 4, start=1.5)
    with self.assertRaisesRegex(ValueError, r"the files hold 17 rows, fewer than one batch "
                                r"of 32: no batch 1 to start at"):
      criteo.tsv_stream(paths, 32, start=1)


class SyntheticTest(tf.test.TestCase):

  def test_deterministic_per_seed(self):
    take = lambda seed: list(criteo.synthetic_dataset(16, seed, vocab_sizes=50).take(2))
    first, again, other = take(1), take(1), take(2)
    tf.nest.map_structure(self.assertAllEqual, first, again)
    self.assertNotAllEqual(first[0][1], other[0][1])
    (dense, sparse), label = first[0]
    self.assertEqual((dense.shape, sparse.shape, label.shape), ((16, 13), (16, 26), (16, 1)))
    self.assertEqual(sparse.dtype, tf.int32)
    self.assertAllInRange(sparse, 0, 49)

  def test_teacher_beats_chance(self):
    (dense, sparse), label = next(iter(criteo.synthetic_dataset(2048, seed=0, split="eval")))
    logits = criteo.Teacher(0).logits(dense, sparse)
    accuracy = np.mean((logits.numpy() > 0) == (label.numpy() > 0.5))
    self.assertBetween(float(np.mean(label)), 0.35, 0.65)  # balanced classes
    self.assertGreater(accuracy, 0.75)


if __name__ == "__main__":
  tf.test.main()
