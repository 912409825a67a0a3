"""Tests for models/data/tokenizer.py: learned WordPiece and byte tokenizers."""

import tensorflow as tf

from models.data import tokenizer
from tests import util


def setUpModule():
  util.setup_cpus()


CORPUS = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog",
          "walking talking walked talked"] * 10


class WordPieceTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.vocab = tokenizer.learn_wordpiece_vocab(CORPUS, vocab_size=200)
    cls.tok = tokenizer.WordPieceTokenizer(cls.vocab)

  def test_vocab_learned_offline(self):
    self.assertEqual(tuple(self.vocab[:4]), tokenizer.RESERVED_TOKENS)
    for word in ("the", "cat", "sat", "dog"):
      self.assertIn(word, self.vocab)
    self.assertTrue(any(t.startswith("##") for t in self.vocab))

  def test_round_trips_known_words(self):
    sentences = ["the cat sat on the log", "a dog talked"]
    ids = self.tok.encode(sentences)
    self.assertEqual(ids[0], [self.vocab.index(w) for w in sentences[0].split()])
    self.assertEqual(self.tok.decode(ids), sentences)
    # Lower-cased like BERT; unseen characters become [UNK].
    self.assertEqual(self.tok.decode(self.tok.encode(["The CAT zzz"])), ["the cat [UNK]"])
    # Special ids are dropped on decode.
    start, end = tokenizer.START_ID, tokenizer.END_ID
    self.assertEqual(self.tok.decode([[start] + ids[1] + [end, 0, 0]]), ["a dog talked"])

  def test_rejects_vocab_without_reserved_tokens(self):
    with self.assertRaisesRegex(ValueError, "must start with"):
      tokenizer.WordPieceTokenizer(["the", "cat"])


class ByteTest(tf.test.TestCase):

  def test_round_trips_unicode(self):
    tok = tokenizer.ByteTokenizer()
    texts = ["Grüße, 世界! 🙂", "", "plain"]
    ids = tok.encode(texts)
    self.assertEqual(ids[2], [b + 4 for b in b"plain"])
    self.assertLen(ids[0], len(texts[0].encode("utf-8")))
    self.assertEqual(tok.decode(ids), texts)
    self.assertEqual(tok.vocab_size, 260)
    self.assertEqual(tok.decode([[tokenizer.START_ID] + ids[2] + [tokenizer.END_ID, 0]]),
                     ["plain"])

  def test_make_tokenizer(self):
    self.assertIsInstance(tokenizer.make_tokenizer("bytes"), tokenizer.ByteTokenizer)
    with self.assertRaisesRegex(ValueError, "unknown tokenizer 'bpe'"):
      tokenizer.make_tokenizer("bpe")


if __name__ == "__main__":
  tf.test.main()
