"""Adam correction in the sparsifying compressors and the tf-keras adapter."""

from __future__ import annotations

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import keras
import tf_keras

import tf_dct
from tf_dct import compression
from tests import util
from tests.compression import correction
from tests.compression import harness

DCTDP = harness.compress_all(compression.DCTDP)
TopK = harness.compress_all(compression.TopK)
DEFT = harness.compress_all(compression.DEFT)


def setUpModule():
  util.setup_cpus()


SHAPES = harness.SHAPES
BETAS = (0.9, 0.999, 1e-7)


def adam_topk_reference(grads, k, mode, select, betas=BETAS,
                        first_moment="aggregate", decay=1.0):
  """Adam correction around top-k error feedback; grads[t][r] of one
  variable (no ties). select "normalized": each replica's gradient is scaled
  by Adam's step scale before error feedback; "raw": error feedback on the
  gradient, Adam's scale after the exchange. first_moment "aggregate": m
  averages what was sent; "replica": each replica's own m, bias-corrected,
  is what error feedback works on. decay: the factor the residuals are
  multiplied by after each step (`DCTDP(residual_decay)`).

  Returns per step (direction, residuals, m per replica, v).
  """
  beta_1, beta_2, eps = betas
  replicas = len(grads[0])
  shape = np.asarray(grads[0][0]).shape
  n = int(np.prod(shape))
  e = [np.zeros(n, np.float64) for _ in range(replicas)]
  m, v = np.zeros(n), np.zeros(n)
  ms = [np.zeros(n) for _ in range(replicas)]
  out = []
  for t, step in enumerate(grads, start=1):
    second = correction.second_moment_reference(step, shape, mode, t - 1).reshape(-1)
    v = beta_2 * v + (1 - beta_2) * second
    scale = np.sqrt(1 - beta_2**t) / (np.sqrt(v) + eps)
    update = np.zeros(n)
    for r in range(replicas):
      g = np.asarray(step[r], np.float64).reshape(-1)
      q = g * scale if select == "normalized" else g
      if first_moment == "replica":
        ms[r] = beta_1 * ms[r] + (1 - beta_1) * q
        q = ms[r] / (1 - beta_1**t)
      acc = q + e[r]
      mask = np.zeros(n, bool)
      mask[np.argsort(-np.abs(acc), kind="stable")[:k]] = True
      update += np.where(mask, acc, 0)
      e[r] = np.where(mask, 0, acc) * decay
    if first_moment == "replica":
      d = update
    else:
      m = beta_1 * m + (1 - beta_1) * update
      ms = [m] * replicas
      d = m / (1 - beta_1**t)
    if select == "raw":
      d = d * scale
    out.append((d.reshape(shape), [x.reshape(shape) for x in e],
                [x.reshape(shape) for x in ms], v.reshape(shape)))
  return out


def _with_adam(compressor, betas=BETAS):
  compressor.set_adam(*betas)  # what wrap_optimizer does with an Adam
  return compressor


class ReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("topk_factored", "topk", "factored", "normalized", 2, "aggregate"),
      ("topk_exact_raw", "topk", "exact", "raw", 2, "aggregate"),
      ("topk_replica_m", "topk", "factored", "normalized", 2, "replica"),
      ("topk_replica_m_raw", "topk", "exact", "raw", 2, "replica"),
      ("topk_sketched", "topk", "sketched", "normalized", 2, "replica"),
      # The correction sits outside `reduce`: DCT-DP's stock path needs no
      # case of its own.
      ("dct_dp_native", "dct_native", "factored", "normalized", 4,
       "aggregate"),
      ("dct_dp_native_replica_m", "dct_native", "factored", "normalized", 4,
       "replica"),
      ("dct_dp_native_sketched", "dct_native", "sketched", "normalized", 4,
       "replica"),
  )
  def test_matches_numpy_reference(self, kind, mode, select, replicas,
                                   first_moment):
    # density 0.2 of 120 / 17 entries: k = 24 / 4 (no floor), the same top-k
    # for TopK and for DCT-DP refreshing tau every step (L = 1). The matrix
    # is large enough for the factored side channel.
    options = dict(adam=True, adam_second_moment=mode, adam_select=select,
                   adam_first_moment=first_moment)
    make = {
        "topk": lambda: TopK(0.2, min_count=0, **options),
        # float32 values, as TopK's and the reference's
        # and a residual decay, which the reference applies to DCT-DP's
        "dct_native": lambda: DCTDP(
            0.8, threshold_life=1, capacity_factor=1.0, density_band=None,
            min_count=0, value_dtype=None, residual_decay=0.9, **options),
    }[kind]
    grads = harness.continuous_gradients(6, replicas, seed=replicas,
                                         shapes=harness.FACTORED_SHAPES)
    compressor = _with_adam(make())
    _, _, variables, history = harness.run(compressor, grads, replicas,
                                           shapes=harness.FACTORED_SHAPES)
    decay = 0.9 if kind == "dct_native" else 1.0
    for v, shape in enumerate(harness.FACTORED_SHAPES):
      k = {120: 24, 17: 4}[int(np.prod(shape))]
      ref = adam_topk_reference([[g[v] for g in step] for step in grads], k,
                                mode, select, first_moment=first_moment,
                                decay=decay)
      for t, ((d, residuals, m, second), (out, states)) in enumerate(
          zip(ref, history)):
        where = f"var {v} step {t}"
        for r in range(replicas):
          self.assertAllClose(out[r][v], d, atol=1e-5, rtol=1e-4,
                              msg=f"direction {where}")
          self.assertAllClose(states[v]["residual"][r], residuals[r],
                              atol=1e-5, rtol=1e-5, msg=f"residual {where}")
          # m sums Adam-scaled terms of order 1 in float32: an entry that
          # cancels to ~0.01 carries their rounding (atol as the direction's).
          self.assertAllClose(states[v]["adam_m"][r], m[r], atol=1e-5,
                              rtol=1e-5, msg=f"m {where}")
          self.assertAllClose(states[v]["adam_v"][r], second, atol=1e-6,
                              rtol=1e-5, msg=f"v {where}")
          self.assertEqual(states[v]["adam_t"][r], t + 1)

  @parameterized.named_parameters(
      ("dct_dp", lambda: DCTDP(
          0.9, threshold_life=3, adam=True, adam_first_moment="aggregate",
          residual_decay=1.0)),
      ("deft", lambda: DEFT(0.1, adam=True,
                                        adam_first_moment="aggregate")),
  )
  def test_error_feedback_conserves_the_scaled_gradient(self, make):
    # first_moment="aggregate": error feedback works on q = g * scale_t:
    # sum of what was sent + sum_r E equals the sum of the q fed in. m is a
    # linear filter of what was sent, m_t = b1 m_{t-1} + (1 - b1) sent_t, so
    # the m and v in the state after each step give back both sides.
    replicas, steps = 2, 7
    beta_1, beta_2, eps = BETAS
    grads = harness.continuous_gradients(steps, replicas, seed=5)
    compressor = _with_adam(make())
    _, _, variables, history = harness.run(compressor, grads, replicas)
    for v, shape in enumerate(SHAPES):
      fed = np.zeros(shape)
      for t, (step, (_, states)) in enumerate(zip(grads, history), start=1):
        scale = np.sqrt(1 - beta_2**t) / (
            np.sqrt(states[v]["adam_v"][0].astype(np.float64)) + eps)
        fed += sum(np.asarray(g[v], np.float64) for g in step) * scale
      ms = [np.zeros(shape)] + [h[1][v]["adam_m"][0] for h in history]
      sent = [(ms[t + 1] - beta_1 * ms[t]) / (1 - beta_1) for t in range(steps)]
      residual = sum(history[-1][1][v]["residual"])
      self.assertAllClose(sum(sent) + residual, fed,
                          atol=1e-4 * np.abs(fed).max(), rtol=0)
      for r in range(1, replicas):  # replicas hold the same m, v, t
        for key in ("adam_m", "adam_v", "adam_t"):
          self.assertAllEqual(history[-1][1][v][key][r],
                              history[-1][1][v][key][0])
      self.assertTrue(compressor.corrects_optimizer(variables[v]))


  def test_error_feedback_conserves_the_replicas_first_moments(self):
    # first_moment="replica": error feedback works on each replica's
    # bias-corrected m_r / (1 - b1^t), and the aggregate of what was sent
    # is the direction itself: sum of the directions + sum_r E_r equals the
    # sum over steps and replicas of m_r / (1 - b1^t) (m_r from the state).
    replicas, steps = 2, 7
    beta_1 = BETAS[0]
    grads = harness.continuous_gradients(steps, replicas, seed=6)
    compressor = _with_adam(DCTDP(
        0.9, threshold_life=3, adam=True, adam_first_moment="replica",
        residual_decay=1.0))
    _, _, _, history = harness.run(compressor, grads, replicas)
    for v, shape in enumerate(SHAPES):
      fed, sent = np.zeros(shape), np.zeros(shape)
      for t, (out, states) in enumerate(history, start=1):
        fed += sum(np.asarray(m, np.float64)
                   for m in states[v]["adam_m"]) / (1 - beta_1**t)
        sent += np.asarray(out[0][v], np.float64)
        for r in range(1, replicas):  # every replica applies the same sum
          self.assertAllEqual(out[r][v], out[0][v])
      residual = sum(history[-1][1][v]["residual"])
      self.assertAllClose(sent + residual, fed,
                          atol=1e-4 * np.abs(fed).max(), rtol=0)
      # the replicas' first moments differ (each sees its own gradients)
      self.assertNotAllClose(history[-1][1][v]["adam_m"][0],
                             history[-1][1][v]["adam_m"][1])


class SecondMomentTest(tf.test.TestCase):
  """The sketched estimate's total follows the square of the replicas' sum."""

  def _totals(self, grads, step, mode="sketched"):
    var = tf.Variable(tf.zeros(grads[0].shape))
    ac = compression.adam_correction
    summed = sum(ac.side_channel(g, var, mode, step) for g in grads)
    return float(tf.reduce_sum(ac.second_moment(summed, var, mode, len(grads))))

  def test_total_tracks_the_square_of_the_sum(self):
    # 4 replicas: a shared signal plus each replica's noise, 3x larger.
    rng = np.random.default_rng(0)
    signal = rng.normal(size=(40, 30))
    ratios = []
    for step in range(200):
      grads = [(signal + 3 * rng.normal(size=signal.shape)).astype(np.float32)
               for _ in range(4)]
      ratios.append(self._totals(grads, step) / np.sum(np.square(sum(grads))))
    # The mean over steps (what v averages) is within a few % of the square
    # of the sum (clipping at the bounds costs a little); "factored", the
    # replicas' mean square, is about 3x too large here.
    self.assertBetween(np.mean(ratios), 0.97, 1.06)
    unscaled = self._totals(grads, 0, "factored") / np.sum(np.square(sum(grads)))
    self.assertGreater(unscaled, 2.5)

  def test_sketch_signs(self):
    signs = compression.adam_correction.sketch_signs
    a, b = signs(4096, 3).numpy(), signs(4096, 4).numpy()
    self.assertAllEqual(np.unique(a), [-1.0, 1.0])
    self.assertAllEqual(a, signs(4096, tf.constant(3.0)).numpy())  # every replica
    self.assertBetween(np.mean(a), -0.1, 0.1)
    self.assertBetween(np.mean(a == b), 0.4, 0.6)  # new signs every step
    g = np.arange(70, dtype=np.float32)
    self.assertAllClose(compression.adam_correction.sketch(tf.constant(g), a[:70]),
                        correction.sketch_reference(g.astype(np.float64), 3))

  def test_total_is_kept_within_its_bounds(self):
    g = np.random.default_rng(1).normal(size=(40, 30)).astype(np.float32)
    squares = 2 * float(np.sum(np.square(g)))  # the replicas' summed squares
    # Opposite gradients sum to 0: the total is their summed squares (as if
    # independent); equal ones to at most 2x that (the replicas' count).
    self.assertAllClose(self._totals([g, -g], 3), squares, rtol=1e-5)
    self.assertBetween(self._totals([g, g], 3), squares, 2 * squares * (1 + 1e-5))


class ResidualDecayTest(tf.test.TestCase):

  def test_decay_scales_the_residuals_of_rows_and_dense_gradients(self):
    # Algorithm 1 keeps every held-back entry (the default, 1); a decay r
    # multiplies each residual by r after the step, whether it holds Adam
    # correction's first moments (a dense gradient) or gradient rows (a
    # compressed table, Adam on the aggregate). After one step the same
    # entries were sent, so the residuals differ by r exactly.
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 6, size=(2, 4)).astype(np.int32)
    vals = rng.normal(size=(2, 4, 3)).astype(np.float32)
    dense = rng.normal(size=(2, 40)).astype(np.float32)
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"],
                             input_replication=tf_dct.PER_REPLICA)
    kept, decayed = (_with_adam(DCTDP(
        0.9, threshold_life=1, adam=True, sparse_gradients="compress",
        dense_gradients="compress", min_count=0, value_dtype=None, **kw))
                      for kw in ({}, {"residual_decay": 0.5}))
    self.assertEqual(kept.residual_decay, 1.0)
    for c in (kept, decayed):
      c.bind(repl)
    with repl.scope():
      table = tf.Variable(tf.zeros([6, 3]), name="table")
      w = tf.Variable(tf.zeros([40]), name="w")

    def input_fn(replica_id):
      return util.without_autotune(tf.data.Dataset.from_tensors(
          (ids[replica_id], vals[replica_id], dense[replica_id])))

    def step_fn(batch):
      i, v, d = batch
      pairs = [(tf.IndexedSlices(v, i, tf.constant([6, 3])), table), (d, w)]
      return ([tf.convert_to_tensor(g) for g, _ in kept.aggregate(pairs)]
              + [tf.convert_to_tensor(g) for g, _ in decayed.aggregate(pairs)])

    repl.run(step_fn, input_fn)
    for var in (table, w):
      full = np.asarray(kept.state_values(var)["residual"])
      self.assertGreater(np.count_nonzero(full), 0)
      self.assertAllEqual(np.asarray(decayed.state_values(var)["residual"]),
                          full * np.float32(0.5))


class AccountingTest(tf.test.TestCase):

  def test_the_side_channel_is_counted(self):
    for mode in ("factored", "sketched"):
      correction.check_side_channel_counted(
          self, lambda on, mode=mode: _with_adam(TopK(
              0.2, min_count=0, adam=True, adam_second_moment=mode)) if on
          else TopK(0.2, min_count=0, adam=False), mode)


class NonFiniteTest(tf.test.TestCase):

  def test_a_non_finite_step_moves_no_state(self):
    harness.check_non_finite(self, _with_adam(TopK(0.2, adam=True)),
                             "TopK: non-finite gradient for variable")

  def test_a_non_finite_step_under_xla_is_undone(self):
    harness.check_non_finite_xla(self, lambda: _with_adam(DCTDP(
        0.9, threshold_life=2, adam=True)))


class KerasTest(correction.KerasRun, parameterized.TestCase):
  """Through `wrap_optimizer` with an Adam of either Keras flavour."""

  @parameterized.named_parameters(
      ("tf_keras_adamw", "AdamW", tf_keras, "aggregate"),
      ("keras3_adam", "Adam", keras, "aggregate"),
      ("tf_keras_adam_replica_m", "Adam", tf_keras, "replica"))
  def test_exact_second_moment_equals_dense_when_nothing_is_held_back(
      self, name, k, first_moment):
    # density 1 sends everything: with the exact side channel the
    # compressor's Adam is tf-keras Adam (AdamW: its weight decay stays
    # with the optimizer). The bias is excluded: it keeps the optimizer's
    # own update. TopK's default (adam=None) turns the correction on.
    make = getattr(k.optimizers, name)
    comp = TopK(1.0, exclude=("bias",), adam_second_moment="exact",
                adam_select="raw", adam_first_moment=first_moment)
    self._check_equals_dense(comp, lambda: make(0.01), k)

  def test_on_by_default_with_adam_only(self):
    for make, on in ((lambda: tf_keras.optimizers.Adam(1e-3), True),
                     (lambda: tf_keras.optimizers.AdamW(1e-3), True),
                     (lambda: tf_keras.optimizers.Adam(1e-3, amsgrad=True), False),
                     (lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9), False),
                     (lambda: tf_keras.optimizers.Adagrad(0.1), False)):
      comp = DCTDP()
      model, _, _ = self._setup(comp, make())  # build creates the state
      self.assertEqual(on, all("adam_m" in comp.state_for(v)
                               for v in model.trainable_variables))
    # TopK and DEFT default to the same (docs/quality.md): on under Adam,
    # each replica keeping Adam's first moment; off under momentum SGD.
    for make_comp in (lambda: TopK(0.1), lambda: DEFT(0.1)):
      for make, on in ((lambda: tf_keras.optimizers.Adam(1e-3), True),
                       (lambda: tf_keras.optimizers.SGD(0.1, momentum=0.9),
                        False)):
        comp = make_comp()
        model, _, _ = self._setup(comp, make())
        self.assertEqual(on, all("adam_m" in comp.state_for(v)
                                 for v in model.trainable_variables))
        self.assertEqual(on, comp.corrects_adam)
        if on:
          self.assertEqual(comp.adam_first_moment, "replica")
    for comp in (DCTDP(adam=False), TopK(0.1, adam=False),
                 DEFT(0.1, adam=False)):
      model, _, _ = self._setup(comp, tf_keras.optimizers.Adam())
      self.assertFalse(any(comp.corrects_optimizer(v)
                           for v in model.trainable_variables))

  def test_checkpoint_restore_leaves_the_trajectory_unchanged(self):
    self._check_restore_keeps_trajectory(
        DCTDP(0.8, threshold_life=2), tf_keras.optimizers.Adam(0.01),
        ("adam_m", "adam_v", "adam_t", "residual"), grown=("adam_v", 0))

  def test_bad_settings_are_rejected(self):
    cases = (({"adam": "yes"}, r"adam must be None, True or False, got 'yes'"),
             ({"adam_second_moment": "full"},
              r"adam_second_moment must be one of \('factored', 'sketched', 'exact'\), got 'full'"),
             ({"adam_select": "scaled"},
              r"adam_select must be one of \('normalized', 'raw'\), got 'scaled'"),
             ({"adam_first_moment": "local"},
              r"adam_first_moment must be one of \('aggregate', 'replica'\), got 'local'"))
    self._check_settings_rejected(
        cases, (compression.DCTDP, compression.TopK, compression.DEFT))
    with self.assertRaisesRegex(ValueError, r"DCTDP: adam=True .* needs an "
                                r"Adam or AdamW optimizer without amsgrad"):
      self._setup(DCTDP(adam=True), tf_keras.optimizers.SGD(0.1))
    comp = DCTDP()
    self._setup(comp, tf_keras.optimizers.SGD(0.1))
    with self.assertRaisesRegex(ValueError, "DCTDP: Adam correction must be "
                                "set before the compressor has state"):
      comp.set_adam(*BETAS)


if __name__ == "__main__":
  tf.test.main()
