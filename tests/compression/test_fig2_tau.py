"""DCT Fig 2 on a real training run: tau is stable, so a reused tau holds.

DCT (KDD'21) §2.1 / Fig 2: for a fixed sparsity eta the top-K threshold tau of
a layer's error-corrected gradient barely moves across iterations (at 95% it
stays within 26% of its running mean), which is why DCT-DP (Algorithm 1) may
recompute it only every L iterations.

One short training run checks both halves. A 16 -> 128 (ReLU) -> 1 MLP learns a
noisy teacher on two logical CPU replicas; two copies of it, with the same
initial weights and the same batches, train side by side in one step (one
trace keeps the test short). Only the 2048-entry hidden kernel is compressed
(min_size), at eta = 0.95 (K = 103 entries per replica and step):

* "every": DCTDP(L=1), tau recomputed every step. After a warm-up (the
  residual needs about 1 / (1 - eta) = 20 steps to build up, and tau rises
  with it) tau stays in a band around its median.
* "reused": DCTDP(L=1000) with the density guard (0.5, 2): tau is computed
  once and reused while the entries it selects stay within [K/2, 2K]. After
  the warm-up it is reused for long stretches (few early refreshes), and the
  tau it holds matches the per-step tau of "every".

Why the guard: with plain L=1000 the only tau of the run is computed at step
0, on the bare gradient (no error yet). The error-corrected gradient soon
grows several times larger, so that stale tau selects far more than K (see
docs/reproduction/dct_fig2_tau.md; the surplus stays in the residual as
overflow). The guard re-anchors tau once the residual has built up, which is
the regime Fig 2 describes (the paper's later refreshes, at L, 2L, ..., all
happen on a warm accumulator).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tf_dct.compression import dct_dp
from tests import util

SPARSITY = 0.95
IN, HIDDEN = 16, 128
K = dct_dp.expected_count(IN * HIDDEN, SPARSITY)  # 103
REPLICAS = 2
BATCH = 256          # global (128 per replica)
STEPS = 300
WARMUP = 50          # steps excluded from the stability checks
NOISE = 0.5          # label noise: the loss levels off within ~50 steps
LR = 0.05
BAND = (0.5, 2.0)    # density guard of the "reused" compressor

# Thresholds, measured on 10 variants of this setup (data and initial
# weights from seeds 0-9, both replicas each): after step 50 the per-step tau
# of "every" stayed within 0.83-1.30 x its median (max |tau / median - 1| =
# 0.30), and the paper's measure, the largest deviation from the running mean,
# was at most 0.20 (paper, eta = 0.95: 26%). "reused" changed tau 1-8 times in
# steps 50-299 (14-26 times over the whole run: the warm-up needs many), and
# the tau it held was 0.83-1.44 x the median tau of "every". The bounds leave
# about 1.5x margin on those deviations (2x on the refresh count); a tau that
# drifts, e.g. with gradients shrinking by half over the run, breaks them.
MAX_DEVIATION = 0.45          # |tau / median - 1| after warm-up, "every"
MAX_RUNNING_DEVIATION = 0.3   # |tau / running mean - 1|, the paper's measure
MAX_EARLY_REFRESHES = 15      # in STEPS - WARMUP = 250 steps
REUSED_BAND = (0.65, 1.8)     # reused tau / median tau of "every"


def setUpModule():
  util.setup_cpus()


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4096, IN)).astype(np.float32)
  w1 = rng.normal(size=(IN, 32)) / np.sqrt(IN)
  w2 = rng.normal(size=(32, 1)) / np.sqrt(32)
  y = np.tanh(x @ w1) @ w2 * 2.0 + NOISE * rng.normal(size=(4096, 1))
  return x, y.astype(np.float32)


def _train():
  """Trains both copies; returns per-step tau and selected counts of each.

  Returns:
    {"every" | "reused": (tau [STEPS, REPLICAS], selected [STEPS, REPLICAS])}
    and the "reused" compressor. `selected` counts the entries reaching tau
    (sent plus overflow) on each replica.
  """
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)])
  compressors = {
      "every": compression.DCTDP(SPARSITY, threshold_life=1, min_size=1000),
      "reused": compression.DCTDP(SPARSITY, threshold_life=1000, min_size=1000,
                                  density_band=BAND)}
  models, optimizers = {}, {}
  with repl.scope():
    for name, comp in compressors.items():
      tf_keras.utils.set_random_seed(1)  # the same initial weights for both
      models[name] = tf_keras.Sequential([
          tf_keras.Input((IN,)),
          tf_keras.layers.Dense(HIDDEN, activation="relu"),
          tf_keras.layers.Dense(1)])
      optimizers[name] = repl.wrap_optimizer(tf_keras.optimizers.SGD(LR),
                                             compression=comp)
  x, y = _data()

  def input_fn(ctx):
    del ctx
    return util.without_autotune(tf.data.Dataset.from_tensor_slices(
        (x, y)).repeat().batch(BATCH, drop_remainder=True))

  def step_fn(batch):
    xb, yb = batch
    for name, model in models.items():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / BATCH
      variables = model.trainable_variables
      grads = tape.gradient(loss, variables)
      optimizers[name].apply_gradients(zip(grads, variables))
    return loss

  kernels = {name: models[name].layers[0].kernel for name in compressors}
  log = {name: ([], []) for name in compressors}
  for _ in range(STEPS):
    repl.run(step_fn, input_fn)
    for name, kernel in kernels.items():
      st = compressors[name].state_values(kernel)
      log[name][0].append(st["threshold"])
      log[name][1].append(np.add(st["sent"], st["overflow"]))
  return ({name: (np.array(t), np.array(s)) for name, (t, s) in log.items()},
          compressors["reused"])


class Fig2TauTest(tf.test.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.log, cls.reused = _train()

  def test_tau_recomputed_every_step_is_stable_after_warmup(self):
    taus, selected = self.log["every"]
    self.assertAllEqual(selected, np.full_like(selected, K))  # fresh tau: K
    for r in range(REPLICAS):
      tau = taus[WARMUP:, r]
      median = np.median(tau)
      self.assertGreater(median, 0)
      deviation = np.max(np.abs(tau / median - 1))
      self.assertLessEqual(deviation, MAX_DEVIATION,
                           msg=f"replica {r}: tau / median spans "
                               f"{tau.min() / median:.2f}..{tau.max() / median:.2f}")
      running = np.cumsum(tau) / np.arange(1, tau.size + 1)
      self.assertLessEqual(np.max(np.abs(tau / running - 1)),
                           MAX_RUNNING_DEVIATION, msg=f"replica {r}")

  def test_reused_tau_holds_after_warmup(self):
    taus, selected = self.log["reused"]
    every = np.median(self.log["every"][0][WARMUP:])
    low, high = BAND
    for r in range(REPLICAS):
      changes = np.count_nonzero(np.diff(taus[WARMUP - 1:, r]))
      self.assertLessEqual(changes, MAX_EARLY_REFRESHES,
                           msg=f"replica {r}: tau refreshed {changes} times "
                               f"in {STEPS - WARMUP} steps")
      ratio = taus[WARMUP:, r] / every
      self.assertAllInRange(ratio, *REUSED_BAND)
      # The guard's promise: the reused tau selects between K/2 and 2K.
      self.assertAllInRange(selected[WARMUP:, r], low * K, high * K)
    counters = self.reused.communication_stats()["variables"]
    (stats,) = [v for v in counters.values() if "counters" in v]
    self.assertEqual(stats["counters"]["refreshes"],
                     [1 + e for e in stats["counters"]["early_refreshes"]])


if __name__ == "__main__":
  tf.test.main()
