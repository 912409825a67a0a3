"""Transformer translation (DCT §3.2: IWSLT'14 De-En, BLEU) and its data.

Data: parallel text in `data_dir` named `{split}.{lang}` (fairseq's
prepare-iwslt14 layout: train.de/train.en, valid.*, test.*), or a synthetic
task (target = source reversed and word-by-word translated) when `data_dir` is
empty. Text is tokenized with a WordPiece vocabulary learned offline from the
training text of both languages (`tokenizer="wordpiece"`) or as UTF-8 bytes
(`tokenizer="bytes"`). Examples are ((source, target_in), target_out) with
target_in = [START] + target and target_out = target + [END], all padded or
truncated to `max_len`. The metric is corpus BLEU (0-100) of greedy decodes on
the test split.

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
from models.data import tokenizer as tokenizers
from models.transformer import bleu
from models.transformer.model import greedy_decoder
from models.transformer.model import split_points
from models.transformer.model import SplitFn
from models.transformer.model import strip_output
from models.transformer.model import transformer

__all__ = ["METRIC", "DEFAULT_CONFIG", "TINY_CONFIG", "TranslationData", "load_data",
           "build_model", "make_dataset", "loss", "evaluate", "transformer", "split_points",
           "greedy_decoder", "bleu"]

METRIC = "bleu"
# fairseq's transformer_iwslt_de_en, as in DCT §3.2: 512 wide, FFN 1024, 6+6 layers.
DEFAULT_CONFIG = {"d_model": 512, "ffn_dim": 1024, "num_heads": 4, "num_encoder_layers": 6,
                  "num_decoder_layers": 6, "dropout": 0.1}
TINY_CONFIG = {"d_model": 32, "ffn_dim": 64, "num_heads": 2, "num_encoder_layers": 1,
               "num_decoder_layers": 1, "dropout": 0.0}
SYNTHETIC_PAIRS = {"train": 4000, "valid": 200, "test": 200}


@dataclasses.dataclass(frozen=True)
class TranslationData:
  """Sentence pairs and their padded id arrays per split, plus the tokenizer."""

  tokenizer: tokenizers.Tokenizer
  pairs: dict[str, list[tuple[str, str]]]
  arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # source, target_in, target_out
  max_len: int


def _pad(rows: list[list[int]], max_len: int) -> np.ndarray:
  out = np.full((len(rows), max_len), tokenizers.PAD_ID, np.int32)
  for i, row in enumerate(rows):
    row = row[:max_len]
    out[i, :len(row)] = row
  return out


def encode_pairs(tok: tokenizers.Tokenizer, pairs: list[tuple[str, str]], max_len: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Padded int32 [n, max_len] source, target_in and target_out ids."""
  source = tok.encode([s for s, _ in pairs])
  target = tok.encode([t for _, t in pairs])
  return (_pad(source, max_len), _pad([[tokenizers.START_ID] + t for t in target], max_len),
          _pad([t + [tokenizers.END_ID] for t in target], max_len))


def _read_vocab(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [line.rstrip("\n") for line in f]


@functools.lru_cache(maxsize=4)
def load_data(data_dir: str | None = None, seed: int = 0, tokenizer: str = "wordpiece",
              vocab_size: int = 8000, max_len: int = 64, source_lang: str = "de",
              target_lang: str = "en", vocab_file: str | None = None) -> TranslationData:
  """Reads (or generates) the splits, learns/loads the tokenizer, encodes (cached).

  Args:
    data_dir: Directory with `{split}.{lang}` files; None or "" for synthetic.
    seed: Fixes the synthetic task (unused for real data).
    tokenizer: "wordpiece" or "bytes".
    vocab_size: WordPiece vocabulary bound.
    max_len: Tokens per sequence after padding/truncation.
    source_lang: Source file suffix.
    target_lang: Target file suffix.
    vocab_file: WordPiece vocabulary, one token a line: read if it exists,
      else learned and written there. None: learned every time.
  """
  if tokenizer not in tokenizers.KINDS:
    raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {tokenizers.KINDS}")
  if data_dir:
    if not os.path.isdir(data_dir):
      raise FileNotFoundError(f"translation data directory not found: {data_dir}")
    pairs = {}
    for split in ("train", "valid", "test"):
      paths = [os.path.join(data_dir, f"{split}.{lang}") for lang in (source_lang, target_lang)]
      if split == "valid" and not any(os.path.exists(p) for p in paths):
        continue
      pairs[split] = text.read_parallel(*paths)
  else:
    pairs = {split: text.synthetic_translation(n, seed, stream=i)
             for i, (split, n) in enumerate(SYNTHETIC_PAIRS.items())}
  if tokenizer == "bytes":
    tok = tokenizers.ByteTokenizer()
  elif vocab_file and os.path.exists(vocab_file):
    tok = tokenizers.WordPieceTokenizer(_read_vocab(vocab_file))
  else:
    vocab = tokenizers.learn_wordpiece_vocab(
        [s for pair in pairs["train"] for s in pair], vocab_size)
    if vocab_file:
      with open(vocab_file, "w", encoding="utf-8") as f:
        f.write("".join(token + "\n" for token in vocab))
    tok = tokenizers.WordPieceTokenizer(vocab)
  arrays = {split: encode_pairs(tok, p, max_len) for split, p in pairs.items()}
  return TranslationData(tok, pairs, arrays, max_len)


def _data(data_dir, seed, tokenizer, max_len, vocab_size=8000) -> TranslationData:
  # One call form, so the lru_cache key is the same from every entry point.
  return load_data(data_dir or None, seed, tokenizer, vocab_size, max_len)


def build_model(seed: int = 0, data_dir: str | None = None, split_fn: SplitFn | None = None,
                tokenizer: str = "wordpiece", max_len: int = 64, **config) -> keras.Model:
  """The Transformer sized to the tokenizer of `data_dir` (or the synthetic task).

  `config` overrides `transformer` arguments (`DEFAULT_CONFIG` otherwise).
  """
  vocab_size = _data(data_dir, seed, tokenizer, max_len).tokenizer.vocab_size
  keras.utils.set_random_seed(seed)
  return transformer(vocab_size, split_fn=split_fn, **{**DEFAULT_CONFIG, **config})


def make_dataset(batch_size: int, seed: int = 0, data_dir: str | None = None,
                 split: str = "train", tokenizer: str = "wordpiece",
                 max_len: int = 64, start: int = 0) -> tf.data.Dataset:
  """((source, target_in), target_out) int32 [b, max_len] batches.

  Train: endless, every epoch in its own seeded order, whole batches, from
  batch `start` on (made directly, for a resume; `models.data.order`).
  valid/test: one pass, in order, last batch may be short.
  """
  arrays = _data(data_dir, seed, tokenizer, max_len).arrays
  if split not in arrays:
    raise ValueError(f"split must be one of {sorted(arrays)}, got {split!r}")
  source, target_in, target_out = arrays[split]
  if split != "train":
    if start:
      raise ValueError(f"start is for the endless train split, not {split!r}")
    return tf.data.Dataset.from_tensor_slices(((source, target_in), target_out)).batch(
        batch_size)
  return order.shuffled_batches(((source, target_in), target_out), batch_size, seed, start)


def loss(targets: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
  """Per-example cross-entropy averaged over non-PAD target tokens, [batch]."""
  targets = tf.cast(targets, tf.int32)
  mask = tf.cast(tf.not_equal(targets, tokenizers.PAD_ID), logits.dtype)
  token_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)
  return tf.reduce_sum(token_loss * mask, -1) / tf.maximum(tf.reduce_sum(mask, -1), 1.0)


def evaluate(model: keras.Model, batch_size: int = 64, seed: int = 0,
             data_dir: str | None = None, split: str = "test", tokenizer: str = "wordpiece",
             max_len: int = 64, max_examples: int | None = None) -> dict[str, float]:
  """Corpus BLEU (0-100) of greedy decodes, and teacher-forced loss, on `split`.

  Hypotheses and references are compared as whitespace-separated words after
  the same tokenizer round trip (so WordPiece's lower-casing and punctuation
  splitting apply to both).
  """
  data = _data(data_dir, seed, tokenizer, max_len)
  tok = data.tokenizer
  decode = greedy_decoder(model, max_len)
  predict = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
  hypotheses, references, loss_sum, count = [], [], 0.0, 0
  pairs = data.pairs[split][:max_examples]
  for (source, target_in), target_out in make_dataset(batch_size, seed, data_dir, split,
                                                      tokenizer, max_len):
    if count >= len(pairs):
      break
    loss_sum += float(tf.reduce_sum(loss(target_out, predict((source, target_in)))))
    hypotheses += tok.decode(strip_output(decode(source).numpy()))
    references += tok.decode(tok.encode([t for _, t in pairs[count:count + len(source)]]))
    count += len(source)
  n = min(count, len(pairs))
  return {"bleu": 100.0 * bleu.corpus_bleu_text(hypotheses[:n], references[:n]),
          "loss": loss_sum / count}
