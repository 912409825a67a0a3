"""Corpus BLEU-4 (Papineni et al. 2002) with brevity penalty, no smoothing.

Matches multi-bleu.perl / sacrebleu's "none" smoothing on pre-tokenised text:
clipped n-gram matches and n-gram counts are summed over the whole corpus
before the precisions are taken, and the brevity penalty uses the total
hypothesis and reference lengths (one reference per sentence).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import math


def ngrams(tokens: Sequence[str], n: int) -> collections.Counter:
  """Counts of the n-grams of `tokens`."""
  return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def corpus_stats(hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[str]],
                 max_order: int = 4) -> tuple[list[int], list[int], int, int]:
  """Clipped matches and totals per order, hypothesis and reference lengths.

  Returns:
    (matches[n-1], totals[n-1], hypothesis_length, reference_length).
  """
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
  matches, totals = [0] * max_order, [0] * max_order
  hyp_len = ref_len = 0
  for hyp, ref in zip(hypotheses, references):
    hyp_len, ref_len = hyp_len + len(hyp), ref_len + len(ref)
    for n in range(1, max_order + 1):
      hyp_counts, ref_counts = ngrams(hyp, n), ngrams(ref, n)
      matches[n - 1] += sum(min(c, ref_counts[g]) for g, c in hyp_counts.items())
      totals[n - 1] += max(len(hyp) - n + 1, 0)
  return matches, totals, hyp_len, ref_len


def corpus_bleu(hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[str]],
                max_order: int = 4) -> float:
  """BLEU in [0, 1] of token lists against one reference token list each.

  BLEU = BP * exp(mean_n log p_n), p_n = clipped matches / hypothesis n-grams,
  BP = min(1, exp(1 - r / c)). Any p_n of zero (or an empty hypothesis corpus)
  gives 0.
  """
  matches, totals, c, r = corpus_stats(hypotheses, references, max_order)
  if c == 0 or min(matches) == 0:
    return 0.0
  log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / max_order
  brevity = 1.0 if c > r else math.exp(1.0 - r / c)
  return brevity * math.exp(log_precision)


def corpus_bleu_text(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """`corpus_bleu` of whitespace-tokenised sentences."""
  return corpus_bleu([h.split() for h in hypotheses], [r.split() for r in references])
