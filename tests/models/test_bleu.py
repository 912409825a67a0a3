"""Tests for models/transformer/bleu.py against hand-computed values."""

import math

import tensorflow as tf

from models.transformer import bleu
from tests import util


def setUpModule():
  util.setup_cpus()


def _bleu(hyps, refs, **kwargs):
  return bleu.corpus_bleu([h.split() for h in hyps], [r.split() for r in refs], **kwargs)


class BleuTest(tf.test.TestCase):

  def test_perfect_match_is_one(self):
    self.assertAlmostEqual(_bleu(["a b c d e", "x y z w"], ["a b c d e", "x y z w"]), 1.0)

  def test_partial_match(self):
    # a b c d e f vs a b c d x f: p1 = 5/6, p2 = 3/5, p3 = 2/4, p4 = 1/3, BP = 1.
    expected = (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25  # = (1/12)^(1/4) ≈ 0.537285
    self.assertAlmostEqual(_bleu(["a b c d e f"], ["a b c d x f"]), expected)
    self.assertAlmostEqual(expected, 0.5372849659, places=9)

  def test_brevity_penalty(self):
    # All precisions 1; c = 4, r = 6: BP = exp(1 - 6/4).
    self.assertAlmostEqual(_bleu(["a b c d"], ["a b c d e f"]), math.exp(-0.5))
    # Longer than the reference: no penalty (p_n = 4/5, 3/4, 2/3, 1/2).
    self.assertAlmostEqual(_bleu(["a b c d q"], ["a b c d"]),
                           (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)

  def test_clipping_and_zero_order(self):
    # "the" 4 times, twice in the reference: p1 = 2/4, BP = 1 (c=4 > r=3).
    self.assertAlmostEqual(_bleu(["the the the the"], ["the cat the"], max_order=1), 0.5)
    # No 4-gram match -> 0 without smoothing.
    self.assertEqual(_bleu(["the cat sat on the mat"], ["the cat is on the mat"]), 0.0)
    self.assertEqual(_bleu([""], ["a b"]), 0.0)

  def test_corpus_level_sums_counts(self):
    hyps, refs = ["a b c d e f", "a b c d"], ["a b c d x f", "a b c d"]
    m, t, c, r = bleu.corpus_stats([h.split() for h in hyps], [x.split() for x in refs])
    self.assertEqual((m, t, c, r), ([9, 6, 4, 2], [10, 8, 6, 4], 10, 10))
    self.assertAlmostEqual(_bleu(hyps, refs), (9 / 10 * 6 / 8 * 4 / 6 * 2 / 4) ** 0.25)
    self.assertAlmostEqual(bleu.corpus_bleu_text(hyps, refs), _bleu(hyps, refs))
    with self.assertRaisesRegex(ValueError, "2 hypotheses but 1 references"):
      _bleu(hyps, refs[:1])


if __name__ == "__main__":
  tf.test.main()
