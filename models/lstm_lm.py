"""Word-level LSTM language model (DEFT Table 2: LSTM on WikiText-2) and its data.

Embedding -> stacked LSTMs -> dropout -> softmax over the word vocabulary,
trained on fixed-length windows to predict the next word; reported as
perplexity (exp of the mean per-token cross-entropy). Windows are independent
(no hidden state carried across batches), so batches split freely across
replicas.

Data: WikiText-style plain text in `data_dir` (`wiki.{train,valid,test}.tokens`
or `{train,valid,test}.txt`), or Markov-chain text when `data_dir` is empty.
The vocabulary comes from the training split only.

Entry points: `build_model`, `make_dataset`, `loss`, `evaluate`, `METRIC`.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import tensorflow as tf
from models.flavour import keras

from models.data import order
from models.data import text

METRIC = "perplexity"
# The medium configuration of PyTorch's word_language_model example.
DEFAULT_CONFIG = {"embedding_dim": 650, "hidden_dim": 650, "num_layers": 2, "dropout": 0.5}
TINY_CONFIG = {"embedding_dim": 16, "hidden_dim": 32, "num_layers": 1, "dropout": 0.0}
SEQ_LEN = 35
SPLITS = ("train", "valid", "test")
SYNTHETIC_LINES = {"train": 2000, "valid": 200, "test": 200}


@dataclasses.dataclass(frozen=True)
class LmData:
  """Token streams of each split and the training vocabulary."""

  vocab: text.Vocabulary
  ids: dict[str, np.ndarray]


def split_path(data_dir: str, split: str) -> str:
  """The file of `split` in `data_dir` (WikiText or plain naming)."""
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"text data directory not found: {data_dir}")
  for name in (f"wiki.{split}.tokens", f"{split}.txt"):
    path = os.path.join(data_dir, name)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f"no {split} text in {data_dir}: expected "
                          f"{os.path.join(data_dir, f'wiki.{split}.tokens')} or {split}.txt")


@functools.lru_cache(maxsize=4)
def load_data(data_dir: str | None = None, seed: int = 0, min_count: int = 1) -> LmData:
  """Reads (or generates) all splits and builds the vocabulary (cached).

  Args:
    data_dir: WikiText-style directory; None or "" for synthetic text.
    seed: Fixes the synthetic Markov chain (unused for real data).
    min_count: Training words seen fewer times become `<unk>`.
  """
  if data_dir:
    lines = {s: text.read_lines(split_path(data_dir, s)) for s in SPLITS}
  else:
    everything = text.markov_text(sum(SYNTHETIC_LINES.values()), seed)
    lines, start = {}, 0
    for s in SPLITS:
      lines[s], start = everything[start:start + SYNTHETIC_LINES[s]], start + SYNTHETIC_LINES[s]
  vocab = text.Vocabulary.build(lines["train"], min_count)
  return LmData(vocab, {s: vocab.encode(lines[s]) for s in SPLITS})


def lstm_lm(vocab_size: int, embedding_dim: int = 650, hidden_dim: int = 650,
            num_layers: int = 2, dropout: float = 0.5, seq_len: int | None = None,
            name: str = "lstm_lm") -> keras.Model:
  """Token ids [batch, time] -> next-word logits [batch, time, vocab_size]."""
  ids = keras.Input((seq_len,), dtype=tf.int32, name="tokens")
  x = keras.layers.Embedding(vocab_size, embedding_dim, name="embedding")(ids)
  x = keras.layers.Dropout(dropout)(x)
  for i in range(num_layers):
    x = keras.layers.LSTM(hidden_dim, return_sequences=True, name=f"lstm_{i}")(x)
    x = keras.layers.Dropout(dropout)(x)
  logits = keras.layers.Dense(vocab_size, name="logits")(x)
  return keras.Model(ids, logits, name=name)


def build_model(seed: int = 0, data_dir: str | None = None, min_count: int = 1,
                **config) -> keras.Model:
  """The LM sized to the vocabulary of `data_dir` (or the synthetic text).

  `config` overrides `lstm_lm` arguments (`DEFAULT_CONFIG` otherwise).
  """
  vocab_size = len(load_data(data_dir or None, seed, min_count).vocab)
  keras.utils.set_random_seed(seed)
  return lstm_lm(vocab_size, **{**DEFAULT_CONFIG, **config})


def make_dataset(batch_size: int, seed: int = 0, data_dir: str | None = None,
                 split: str = "train", seq_len: int = SEQ_LEN,
                 min_count: int = 1, start: int = 0) -> tf.data.Dataset:
  """(inputs int32 [b, seq_len], targets int32 [b, seq_len]) batches.

  Train: endless, whole batches of windows, every epoch in its own seeded
  order, from batch `start` on (made directly, for a resume;
  `models.data.order`). valid/test: one pass in order, last batch may be
  short.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  inputs, targets = text.lm_windows(load_data(data_dir or None, seed, min_count).ids[split],
                                    seq_len)
  if split != "train":
    if start:
      raise ValueError(f"start is for the endless train split, not {split!r}")
    return tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(batch_size)
  return order.shuffled_batches((inputs, targets), batch_size, seed, start)


def loss(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
  """Per-example mean token cross-entropy, [batch]."""
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      tf.cast(targets, tf.int32), logits), axis=-1)


def evaluate(model: keras.Model, batch_size: int = 64, seed: int = 0,
             data_dir: str | None = None, split: str = "test",
             seq_len: int = SEQ_LEN, min_count: int = 1) -> dict[str, float]:
  """Perplexity and mean token cross-entropy on `split`."""
  predict = tf.function(lambda x: model(x, training=False))
  total = tokens = 0.0
  for x, y in make_dataset(batch_size, seed, data_dir, split, seq_len, min_count):
    total += float(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
        y, predict(x))))
    tokens += float(tf.size(y))
  return {"perplexity": float(np.exp(total / tokens)), "loss": total / tokens}
