"""Tests for models/data/text.py: plain and parallel text readers, vocabulary, synthetic text."""

import os

import numpy as np
import tensorflow as tf

from models.data import text
from tests import util


def setUpModule():
  util.setup_cpus()


def _write(directory: str, name: str, content: str | bytes) -> str:
  path = os.path.join(directory, name)
  with open(path, "wb") as f:
    f.write(content.encode("utf-8") if isinstance(content, str) else content)
  return path


class ReadLinesTest(tf.test.TestCase):

  def test_reads_lines_exactly(self):
    path = _write(self.get_temp_dir(), "a.txt", " = Title = \n\nthe cat sat\r\nÜber alles\n")
    self.assertEqual(text.read_lines(path), [" = Title = ", "", "the cat sat", "Über alles"])

  def test_missing_path(self):
    missing = os.path.join(self.get_temp_dir(), "nope.txt")
    with self.assertRaisesRegex(FileNotFoundError, "nope.txt"):
      text.read_lines(missing)

  def test_malformed_line_numbered(self):
    path = _write(self.get_temp_dir(), "bad.txt", b"fine\nalso fine\nbroken \xff byte\n")
    with self.assertRaisesRegex(ValueError, r"bad.txt:3: not valid UTF-8"):
      text.read_lines(path)
    path = _write(self.get_temp_dir(), "nul.txt", b"fine\nnul\x00here\n")
    with self.assertRaisesRegex(ValueError, r"nul.txt:2: NUL byte"):
      text.read_lines(path)


class ReadParallelTest(tf.test.TestCase):

  def test_pairs(self):
    d = self.get_temp_dir()
    src = _write(d, "train.de", "hallo welt\n\nguten tag\n")
    tgt = _write(d, "train.en", "hello world\n\ngood day\n")
    self.assertEqual(text.read_parallel(src, tgt),
                     [("hallo welt", "hello world"), ("guten tag", "good day")])

  def test_line_count_mismatch_names_both(self):
    d = self.get_temp_dir()
    src = _write(d, "x.de", "a\nb\nc\n")
    tgt = _write(d, "x.en", "a\nb\n")
    with self.assertRaisesRegex(ValueError, r"x\.de has 3 lines, .*x\.en has 2"):
      text.read_parallel(src, tgt)

  def test_one_sided_blank_line_numbered(self):
    d = self.get_temp_dir()
    src = _write(d, "y.de", "a\nb\n")
    tgt = _write(d, "y.en", "a\n  \n")
    with self.assertRaisesRegex(ValueError, r"y\.en:2: blank sentence"):
      text.read_parallel(src, tgt)

  def test_missing(self):
    d = self.get_temp_dir()
    src = _write(d, "z.de", "a\n")
    with self.assertRaisesRegex(FileNotFoundError, "z.en"):
      text.read_parallel(src, os.path.join(d, "z.en"))


class VocabularyTest(tf.test.TestCase):

  def test_cutoff_order_and_encoding(self):
    lines = ["b a a", "", "c a b <unk>", "d"]
    vocab = text.Vocabulary.build(lines, min_count=2)
    self.assertEqual(vocab.words, ("<unk>", "<eos>", "a", "b"))
    # Blank lines add nothing; every other line ends in <eos>; c, d and <unk> -> 0.
    self.assertAllEqual(vocab.encode(lines), [3, 2, 2, 1, 0, 2, 3, 0, 1, 0, 1])
    self.assertEqual(vocab.decode([2, 3, 1]), ["a", "b", "<eos>"])
    self.assertLen(text.Vocabulary.build(lines), 6)  # min_count=1 keeps c and d

  def test_lm_windows(self):
    inputs, targets = text.lm_windows(np.arange(10), 3)
    self.assertAllEqual(inputs, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    self.assertAllEqual(targets, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    with self.assertRaisesRegex(ValueError, "too few"):
      text.lm_windows(np.arange(3), 3)


class SyntheticTextTest(tf.test.TestCase):

  def test_markov_text_is_deterministic_and_sparse(self):
    lines = text.markov_text(200, seed=3, vocab_size=50, branching=2)
    self.assertEqual(lines, text.markov_text(200, seed=3, vocab_size=50, branching=2))
    self.assertNotEqual(lines, text.markov_text(200, seed=4, vocab_size=50, branching=2))
    successors = {}
    for line in lines:
      words = line.split()
      for a, b in zip(words, words[1:]):
        successors.setdefault(a, set()).add(b)
    self.assertLessEqual(max(len(s) for s in successors.values()), 2)

  def test_translation_is_reversed_word_map(self):
    pairs = text.synthetic_translation(300, seed=1, vocab_size=20)
    lexicon = {}
    for source, target in pairs:
      s, t = source.split(), target.split()
      self.assertLen(t, len(s))
      for a, b in zip(s, reversed(t)):
        self.assertEqual(lexicon.setdefault(a, b), b)  # one consistent translation
    self.assertLen(lexicon, 20)
    test = text.synthetic_translation(50, seed=1, vocab_size=20, stream=1)
    self.assertNotEqual(test, pairs[:50])
    for source, target in test:
      self.assertEqual([lexicon[w] for w in reversed(source.split())], target.split())


if __name__ == "__main__":
  tf.test.main()
