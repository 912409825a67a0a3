"""Subword tokenizers for the translation model: learned WordPiece or raw bytes.

Both share the special ids PAD=0, UNK=1, START=2, END=3 and one interface:
`encode(texts) -> list[list[int]]`, `decode(ids) -> list[str]`, `vocab_size`.
The WordPiece vocabulary is learned offline from the training text with
tensorflow-text's own learner (`bert_vocab_from_dataset`); the byte tokenizer
needs no vocabulary at all (UTF-8 bytes shifted past the special ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import tensorflow as tf
import tensorflow_text as tf_text
from tensorflow_text.tools.wordpiece_vocab import bert_vocab_from_dataset

PAD_ID, UNK_ID, START_ID, END_ID = 0, 1, 2, 3
RESERVED_TOKENS = ("[PAD]", "[UNK]", "[START]", "[END]")
KINDS = ("wordpiece", "bytes")


def learn_wordpiece_vocab(lines: Iterable[str], vocab_size: int = 8000,
                          lower_case: bool = True) -> list[str]:
  """Learns a WordPiece vocabulary from training text, offline.

  Args:
    lines: Training sentences.
    vocab_size: Upper bound on the vocabulary size (reserved tokens included).
    lower_case: Lower-case and strip accents before learning (BERT's rule).

  Returns:
    The vocabulary; `RESERVED_TOKENS` come first, so their ids are fixed.
  """
  dataset = tf.data.Dataset.from_tensor_slices(tf.constant(list(lines), tf.string))
  return bert_vocab_from_dataset.bert_vocab_from_dataset(
      dataset.batch(1024), vocab_size=vocab_size,
      reserved_tokens=list(RESERVED_TOKENS),
      bert_tokenizer_params={"lower_case": lower_case}, learn_params={})


class WordPieceTokenizer:
  """`tf_text.BertTokenizer` over a given WordPiece vocabulary."""

  def __init__(self, vocab: Sequence[str], lower_case: bool = True):
    if tuple(vocab[:len(RESERVED_TOKENS)]) != RESERVED_TOKENS:
      raise ValueError(f"vocabulary must start with {RESERVED_TOKENS}, got {list(vocab[:4])}")
    self.vocab = list(vocab)
    table = tf.lookup.StaticVocabularyTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(self.vocab), tf.range(len(self.vocab), dtype=tf.int64)),
        num_oov_buckets=1)
    self._tokenizer = tf_text.BertTokenizer(
        table, lower_case=lower_case, token_out_type=tf.int64, unknown_token="[UNK]")

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (no START/END)."""
    if not texts:
      return []
    ragged = self._tokenizer.tokenize(tf.constant(list(texts), tf.string))
    return ragged.merge_dims(-2, -1).to_list()

  def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
    """Texts of id rows: word pieces joined into words, words by spaces.

    Special ids (PAD, START, END) are dropped; UNK stays as "[UNK]".
    """
    rows = [[i for i in row if i not in (PAD_ID, START_ID, END_ID)] for row in ids]
    if not rows:
      return []
    words = self._tokenizer.detokenize(tf.ragged.constant(rows, dtype=tf.int64,
                                                          ragged_rank=1))
    return [" ".join(w.decode("utf-8") for w in row) for row in words.to_list()]


class ByteTokenizer:
  """UTF-8 bytes as tokens: id = byte + 4. Lossless, no vocabulary."""

  OFFSET = len(RESERVED_TOKENS)
  vocab_size = 256 + OFFSET

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (no START/END)."""
    return [[b + self.OFFSET for b in text.encode("utf-8")] for text in texts]

  def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
    """Texts of id rows; special ids are dropped, broken UTF-8 is replaced."""
    return [bytes(i - self.OFFSET for i in row if i >= self.OFFSET).decode(
        "utf-8", errors="replace") for row in ids]


Tokenizer = WordPieceTokenizer | ByteTokenizer


def make_tokenizer(kind: str, train_lines: Iterable[str] = (), vocab_size: int = 8000,
                   lower_case: bool = True) -> Tokenizer:
  """A tokenizer by name: "wordpiece" (learned from `train_lines`) or "bytes"."""
  if kind == "bytes":
    return ByteTokenizer()
  if kind == "wordpiece":
    return WordPieceTokenizer(learn_wordpiece_vocab(train_lines, vocab_size, lower_case),
                              lower_case=lower_case)
  raise ValueError(f"unknown tokenizer {kind!r}; expected one of {KINDS}")
