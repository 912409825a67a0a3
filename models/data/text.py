"""Text data: plain-text and parallel-text readers, word vocabulary, synthetic text.

* Language modelling (WikiText style): `read_lines` a split, build a `Vocabulary`
  from the training split (words below `min_count` become `<unk>`), `encode` each
  non-blank line as its words plus `<eos>`, and cut the id stream into
  fixed-length (input, next-word target) windows with `lm_windows`.
* Translation: `read_parallel` two files of equal line count.
* Synthetic stand-ins with a learnable signal: `markov_text` (a sparse random
  Markov chain over generated words) and `synthetic_translation` (target =
  source reversed, each word mapped through a fixed random dictionary).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
import dataclasses
import os

import numpy as np

from models.data.errors import DataError

UNK, EOS = "<unk>", "<eos>"


def read_lines(path: str) -> list[str]:
  """Lines of a UTF-8 text file, without line endings.

  Raises:
    FileNotFoundError: `path` does not exist (the message names it).
    DataError: a line is not valid UTF-8 or contains a NUL byte
      ("path:line: ...").
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"text file not found: {path}")
  lines = []
  with open(path, "rb") as f:
    for number, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{number}: not valid UTF-8 ({e.reason})") from None
      if "\0" in line:
        raise DataError(f"{path}:{number}: NUL byte in text")
      lines.append(line.rstrip("\r\n"))
  return lines


def read_parallel(source_path: str, target_path: str) -> list[tuple[str, str]]:
  """Sentence pairs from two files with one sentence per line.

  Lines blank on both sides are skipped.

  Raises:
    FileNotFoundError: a file does not exist.
    DataError: the line counts differ (both files and counts are named), or a
      line is blank on one side only ("path:line: ...").
  """
  source, target = read_lines(source_path), read_lines(target_path)
  if len(source) != len(target):
    raise DataError(f"parallel files differ in length: {source_path} has {len(source)} "
                    f"lines, {target_path} has {len(target)}")
  pairs = []
  for number, (s, t) in enumerate(zip(source, target), start=1):
    s, t = s.strip(), t.strip()
    if not s and not t:
      continue
    if not s or not t:
      blank = source_path if not s else target_path
      raise DataError(f"{blank}:{number}: blank sentence whose translation is not blank")
    pairs.append((s, t))
  return pairs


@dataclasses.dataclass
class Vocabulary:
  """Word <-> id mapping; id 0 is `<unk>`, id 1 is `<eos>`."""

  words: tuple[str, ...]
  index: dict[str, int] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    self.words = tuple(self.words)
    self.index = {w: i for i, w in enumerate(self.words)}

  @classmethod
  def build(cls, lines: Iterable[str], min_count: int = 1) -> Vocabulary:
    """Words seen at least `min_count` times, most frequent first (ties: a-z)."""
    counts = collections.Counter(w for line in lines for w in line.split())
    for special in (UNK, EOS):
      counts.pop(special, None)
    kept = sorted((w for w, c in counts.items() if c >= min_count),
                  key=lambda w: (-counts[w], w))
    return cls((UNK, EOS, *kept))

  def __len__(self) -> int:
    return len(self.words)

  def encode(self, lines: Iterable[str]) -> np.ndarray:
    """One id stream: each non-blank line's words, then `<eos>`."""
    index, ids = self.index, []
    for line in lines:
      words = line.split()
      if words:
        ids.extend(index.get(w, 0) for w in words)
        ids.append(1)
    return np.asarray(ids, np.int32)

  def decode(self, ids: Iterable[int]) -> list[str]:
    return [self.words[i] for i in ids]


def lm_windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping windows: inputs ids[k:k+L], targets ids[k+1:k+L+1].

  Returns:
    (inputs, targets), each int32 [num_windows, seq_len]; the tail that does not
    fill a window is dropped.
  """
  n = (len(ids) - 1) // seq_len
  if n < 1:
    raise ValueError(f"{len(ids)} tokens are too few for one window of {seq_len}")
  inputs = ids[:n * seq_len].reshape(n, seq_len)
  targets = ids[1:n * seq_len + 1].reshape(n, seq_len)
  return inputs.astype(np.int32), targets.astype(np.int32)


def pseudo_words(count: int, syllables: Sequence[str], rng: np.random.Generator,
                 max_syllables: int = 3) -> list[str]:
  """`count` distinct made-up words of 1..max_syllables syllables."""
  words: dict[str, None] = {}
  while len(words) < count:
    n = int(rng.integers(1, max_syllables + 1))
    words["".join(rng.choice(syllables, size=n))] = None
  return list(words)


def markov_text(num_lines: int, seed: int = 0, vocab_size: int = 200, branching: int = 3,
                line_length: tuple[int, int] = (6, 20)) -> list[str]:
  """Lines from a sparse random Markov chain over made-up words.

  Each word has `branching` possible successors with fixed random weights, so
  a model that learns the chain reaches a perplexity near `branching` while
  unigram guessing stays near `vocab_size`. The chain is fixed by `seed`; the
  line stream draws from the same chain for any `num_lines`.
  """
  chain_rng = np.random.default_rng([seed, 0])
  words = pseudo_words(vocab_size, ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi",
                                    "pu", "da", "fe"], chain_rng)
  successors = np.stack([chain_rng.choice(vocab_size, branching, replace=False)
                         for _ in range(vocab_size)])
  weights = chain_rng.dirichlet(np.ones(branching), size=vocab_size)
  rng = np.random.default_rng([seed, 1])
  lines = []
  for _ in range(num_lines):
    length = int(rng.integers(line_length[0], line_length[1] + 1))
    w, line = int(rng.integers(vocab_size)), []
    for _ in range(length):
      line.append(words[w])
      w = int(successors[w, rng.choice(branching, p=weights[w])])
    lines.append(" ".join(line))
  return lines


def synthetic_translation(num_pairs: int, seed: int = 0, vocab_size: int = 60,
                          length: tuple[int, int] = (3, 8), stream: int = 0
                          ) -> list[tuple[str, str]]:
  """Made-up sentence pairs: target = source reversed, word by word translated.

  The dictionary (source word -> target word) is fixed by `seed`; `stream`
  picks an independent sequence of sentences (e.g. 0 train, 1 test).
  """
  lex_rng = np.random.default_rng([seed, 0])
  source_words = pseudo_words(vocab_size, ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo",
                                           "zi", "pu"], lex_rng)
  target_words = pseudo_words(vocab_size, ["ba", "de", "fi", "go", "hu", "ja", "ko", "li",
                                           "mo", "nu"], lex_rng)
  rng = np.random.default_rng([seed, 2 + stream])
  pairs = []
  for _ in range(num_pairs):
    ids = rng.integers(vocab_size, size=int(rng.integers(length[0], length[1] + 1)))
    pairs.append((" ".join(source_words[i] for i in ids),
                  " ".join(target_words[i] for i in ids[::-1])))
  return pairs
