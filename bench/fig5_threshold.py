r"""DCT Fig. 5 on a small MLP: the mean top-K threshold with and without DCT-MP.

A 16 -> 128 (ReLU) -> [split] -> 64 (ReLU) -> 1 MLP is trained on synthetic
teacher-labelled binary data (fixed seeds) once without compression and once
per sparsity eta with DCTSplit(eta) after the first ReLU. At every logged
iteration the script prints the mean over a fixed probe batch of tau_i, the
k-th largest |activation| of row i entering the split (k = d - floor(d*eta)).
For the uncompressed run tau is measured for every eta without masking
anything (the paper's solid lines); for a DCT-MP run at eta it is measured
at that eta (dotted lines). The paper's claim: tau falls faster with DCT-MP.

Usage:
  python bench/fig5_threshold.py --quick    # < 2 minutes
  python bench/fig5_threshold.py            # longer run
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_keras  # pylint: disable=g-import-not-at-top,wrong-import-position

from tf_dct import dct_mp as layers  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct import dct_mp as ops  # pylint: disable=g-import-not-at-top,wrong-import-position

D_IN, HIDDEN = 16, 128
SPARSITIES = (0.75, 0.9)


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Labels of a random 2-layer ReLU teacher, 5% flipped."""
  teacher = np.random.default_rng(0)
  w1 = teacher.normal(size=(D_IN, 32)) / np.sqrt(D_IN)
  w2 = teacher.normal(size=(32, 1))
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, D_IN)).astype(np.float32)
  logit = np.maximum(x @ w1, 0) @ w2
  y = (logit > np.median(logit)).astype(np.float32)
  flip = rng.random(n) < 0.05
  y[flip] = 1 - y[flip]
  return x, y


def mean_threshold(h: tf.Tensor, sparsity: float) -> float:
  """Mean over rows of tau_i, the k-th largest |h_i|."""
  k = ops.num_kept(h.shape[-1], sparsity)
  return float(tf.reduce_mean(tf.math.top_k(tf.abs(h), k).values[:, -1]))


def train(sparsity: float | None, iterations: int, log_every: int,
          batch: int, data, probe, optimizer: str,
          sparsities: tuple[float, ...] = SPARSITIES) -> list[dict[float, float]]:
  tf_keras.utils.set_random_seed(1)
  first = tf_keras.layers.Dense(HIDDEN, activation="relu")
  split = layers.DCTSplit(sparsity) if sparsity is not None else None
  rest = tf_keras.Sequential([tf_keras.layers.Dense(64, activation="relu"),
                              tf_keras.layers.Dense(1)])
  opt = (tf_keras.optimizers.Adam(1e-3) if optimizer == "adam"
         else tf_keras.optimizers.SGD(0.1))
  bce = tf_keras.losses.BinaryCrossentropy(from_logits=True)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      h = first(x)
      if split is not None:
        h = split(h, training=True)
      loss = bce(y, rest(h))
    variables = first.trainable_variables + rest.trainable_variables
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return loss

  x, y = data
  rng = np.random.default_rng(2)  # the same data order for every run
  log = []
  for it in range(iterations + 1):
    if it % log_every == 0:
      h = first(probe)
      wanted = sparsities if sparsity is None else (sparsity,)
      log.append({s: mean_threshold(h, s) for s in wanted})
    idx = rng.integers(0, len(x), batch)
    step(x[idx], y[idx])
  return log


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--optimizer", choices=("adam", "sgd"), default="sgd",
                      help="Adam(1e-3) or SGD(0.1) (the paper's DLRM uses SGD)")
  args = parser.parse_args()
  iterations, log_every = (1500, 100) if args.quick else (6000, 300)
  data = make_data(8192, 1)
  probe = tf.constant(make_data(512, 2)[0])
  run = lambda s: train(s, iterations, log_every, 64, data, probe, args.optimizer)
  base = run(None)
  runs = {s: run(s) for s in SPARSITIES}
  head = " | ".join(f"no DCT, eta={s} | DCT-MP eta={s}" for s in SPARSITIES)
  print(f"| iteration | {head} |")
  print("|---" * (1 + 2 * len(SPARSITIES)) + "|")
  for i, row in enumerate(base):
    cells = " | ".join(f"{row[s]:.4f} | {runs[s][i][s]:.4f}" for s in SPARSITIES)
    print(f"| {i * log_every} | {cells} |")
  for s in SPARSITIES:
    b0, b1 = base[0][s], base[-1][s]
    d0, d1 = runs[s][0][s], runs[s][-1][s]
    print(f"eta={s}: mean tau from {b0:.4f} to {b1:.4f} without DCT-MP "
          f"({100 * (b1 / b0 - 1):+.1f}%), {d0:.4f} to {d1:.4f} with DCT-MP "
          f"({100 * (d1 / d0 - 1):+.1f}%)")


if __name__ == "__main__":
  main()
