"""A numpy reference of DCT Algorithm 2 with the conventions of tf_dct.dct_mp."""

import decimal
import math

import numpy as np


def num_kept(d: int, sparsity: float) -> int:
  return d - math.floor(decimal.Decimal(repr(float(sparsity))) * d)


def threshold_mask(x: np.ndarray, sparsity: float) -> np.ndarray:
  """Lines 4-9 as written: keep |x| >= tau_i, tau_i the k-th largest |x_i|."""
  a = np.abs(x.astype(np.float64))
  d = a.shape[-1]
  k = num_kept(d, sparsity)
  tau = np.sort(a, axis=-1)[..., d - k]  # (m + 1)-th smallest, 1-based
  return a >= tau[..., None]


def topk_mask(x: np.ndarray, sparsity: float) -> np.ndarray:
  """Exactly k per row: largest |x| first, ties to the lower column index."""
  a = np.abs(x.astype(np.float64))
  d = a.shape[-1]
  k = num_kept(d, sparsity)
  flat = a.reshape(-1, d)
  mask = np.zeros(flat.shape, bool)
  for i, row in enumerate(flat):
    order = sorted(range(d), key=lambda j: (-row[j], j))
    mask[i, order[:k]] = True
  return mask.reshape(a.shape)


def topk_mask_k(x: np.ndarray, k: int) -> np.ndarray:
  """`topk_mask` keeping k entries per row."""
  d = x.shape[-1]
  return topk_mask(x, (d - k) / d) if k < d else np.ones(x.shape, bool)


def kept_at(step: int, d: int, k: int, warmup_steps: int, warmup: str) -> int:
  """The warm-up schedule: d (dense) or d -> k linearly over W steps, then k."""
  if step >= warmup_steps:
    return k
  if warmup == "dense":
    return d
  return d - math.floor((d - k) * step / warmup_steps)


def forward(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Line 10: X ⊙ M (dropped entries are +0)."""
  return np.where(mask, x, np.zeros_like(x))


def backward(dy: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Line 13: X_grad ⊙ M with the forward mask."""
  return np.where(mask, dy, np.zeros_like(dy))


def distinct(shape, seed=0) -> np.ndarray:
  """Values whose magnitudes are distinct (no ties) in every row."""
  rng = np.random.default_rng(seed)
  d = shape[-1]
  rows = int(np.prod(shape[:-1]))
  mags = np.stack([rng.permutation(d) + 1.0 for _ in range(rows)]) / 4
  signs = rng.choice([-1.0, 1.0], size=(rows, d))
  return (mags * signs).reshape(shape).astype(np.float32)


def row_scale(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """The "l1" factor per row, [..., 1] in float32 (1 where the kept sum is 0).

  For the exactly representable test values the float32 sums are exact, so
  only the division rounds, as in the op.
  """
  a = np.abs(x.astype(np.float64))
  full = np.float32(a.sum(-1, keepdims=True))
  part = np.float32(np.where(mask, a, 0).sum(-1, keepdims=True))
  return np.where(part > 0, full / np.where(part > 0, part, 1), np.float32(1))


def rescaled_forward(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """s_i · (X_i ⊙ M_i), the product rounded once in x's dtype."""
  s = row_scale(x, mask).astype(x.dtype)
  return np.where(mask, x * s, np.zeros_like(x))


def rescaled_backward(dy: np.ndarray, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """s_i · (dY_i ⊙ M_i) with the forward's s_i (a constant)."""
  s = row_scale(x, mask).astype(dy.dtype)
  return np.where(mask, dy * s, np.zeros_like(dy))
