"""Adagrad correction in the sparsifying compressors and the Keras adapters."""

from __future__ import annotations

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import keras
import tf_keras

from tf_dct import compression
from tests import util
from tests.compression import correction
from tests.compression import harness

DCTDP = harness.compress_all(compression.DCTDP)
TopK = harness.compress_all(compression.TopK)

SHAPES = harness.SHAPES
HPARAMS = (0.1, 1e-7)  # the Keras default initial_accumulator_value, epsilon


def setUpModule():
  util.setup_cpus()


def adagrad_topk_reference(grads, k, mode, hparams=HPARAMS):
  """Adagrad correction around top-k error feedback; grads[t][r] of one
  variable (no ties): acc += V (the side channel's estimate of g^2), each
  replica feeds g_r / sqrt(acc + eps) to error feedback, the direction is
  the sum of what was sent.

  Returns per step (direction, residuals, acc).
  """
  initial, eps = hparams
  replicas = len(grads[0])
  shape = np.asarray(grads[0][0]).shape
  n = int(np.prod(shape))
  e = [np.zeros(n) for _ in range(replicas)]
  acc = np.full(n, initial, np.float64)
  out = []
  for step in grads:
    acc = acc + correction.second_moment_reference(
        step, shape, mode).reshape(-1)
    d = np.zeros(n)
    for r in range(replicas):
      q = np.asarray(step[r], np.float64).reshape(-1) / np.sqrt(acc + eps)
      a = q + e[r]
      mask = np.zeros(n, bool)
      mask[np.argsort(-np.abs(a), kind="stable")[:k]] = True
      d += np.where(mask, a, 0)
      e[r] = np.where(mask, 0, a)
    out.append((d.reshape(shape), [x.reshape(shape) for x in e],
                acc.reshape(shape)))
  return out


def _with_adagrad(compressor, hparams=HPARAMS):
  compressor.set_adagrad(*hparams)  # what wrap_optimizer does with Adagrad
  return compressor


class ReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("topk_factored", "topk", "factored", 2),
      ("topk_exact", "topk", "exact", 2),
      ("topk_sketched", "topk", "sketched", 2),
      # The correction sits outside `reduce`: one DCT-DP path suffices.
      ("dct_dp_factored", "dct", "factored", 4),
  )
  def test_matches_numpy_reference(self, kind, mode, replicas):
    # density 0.2 of 120 / 17 entries: k = 24 / 4 (no floor), the same top-k
    # for TopK and for DCT-DP refreshing tau every step (L = 1). The matrix
    # is large enough for the factored side channel.
    options = dict(adagrad=True, adagrad_accumulator=mode)
    make = {
        "topk": lambda: TopK(0.2, min_count=0, **options),
        # float32 values, as TopK's and the reference's
        "dct": lambda: DCTDP(0.8, threshold_life=1, capacity_factor=1.0,
                             density_band=None, min_count=0, value_dtype=None,
                             **options),
    }[kind]
    grads = harness.continuous_gradients(6, replicas, seed=replicas,
                                         shapes=harness.FACTORED_SHAPES)
    _, _, variables, history = harness.run(_with_adagrad(make()), grads,
                                           replicas, shapes=harness.FACTORED_SHAPES)
    for v, shape in enumerate(harness.FACTORED_SHAPES):
      k = {120: 24, 17: 4}[int(np.prod(shape))]
      ref = adagrad_topk_reference([[g[v] for g in step] for step in grads],
                                   k, mode)
      for t, ((d, residuals, acc), (out, states)) in enumerate(
          zip(ref, history)):
        where = f"var {v} step {t}"
        for r in range(replicas):
          self.assertAllClose(out[r][v], d, atol=1e-5, rtol=1e-4,
                              msg=f"direction {where}")
          self.assertAllClose(states[v]["residual"][r], residuals[r],
                              atol=1e-5, rtol=1e-5, msg=f"residual {where}")
          self.assertAllClose(states[v]["adagrad_acc"][r], acc, atol=1e-6,
                              rtol=1e-5, msg=f"accumulator {where}")

  def test_error_feedback_conserves_the_scaled_gradient(self):
    # Sum of the directions + sum_r E_r equals the sum over steps and
    # replicas of g_r / sqrt(acc_t + eps), acc_t read from the state.
    replicas, steps = 2, 7
    eps = HPARAMS[1]
    grads = harness.continuous_gradients(steps, replicas, seed=5)
    compressor = _with_adagrad(DCTDP(0.9, threshold_life=3, min_count=2,
                                        adagrad=True))
    _, _, variables, history = harness.run(compressor, grads, replicas)
    for v, shape in enumerate(SHAPES):
      fed, sent = np.zeros(shape), np.zeros(shape)
      for step, (out, states) in zip(grads, history):
        acc = np.asarray(states[v]["adagrad_acc"][0], np.float64)
        fed += sum(np.asarray(g[v], np.float64) for g in step) / np.sqrt(
            acc + eps)
        sent += np.asarray(out[0][v], np.float64)
        for r in range(1, replicas):  # every replica applies the same sum
          self.assertAllEqual(out[r][v], out[0][v])
          self.assertAllEqual(states[v]["adagrad_acc"][r],
                              states[v]["adagrad_acc"][0])
      residual = sum(history[-1][1][v]["residual"])
      self.assertGreater(np.abs(residual).max(), 0)  # something held back
      self.assertAllClose(sent + residual, fed,
                          atol=1e-4 * np.abs(fed).max(), rtol=0)
      self.assertTrue(compressor.corrects_optimizer(variables[v]))


class AccountingTest(tf.test.TestCase):

  def test_the_side_channel_is_counted(self):
    correction.check_side_channel_counted(
        self, lambda on: _with_adagrad(TopK(0.2, min_count=0, adagrad=True)) if on
        else TopK(0.2, min_count=0, adagrad=False))


class NonFiniteTest(tf.test.TestCase):

  def test_a_non_finite_step_moves_no_state(self):
    harness.check_non_finite(self, _with_adagrad(TopK(0.2, adagrad=True)),
                             "TopK: non-finite gradient for variable")


class KerasTest(correction.KerasRun, parameterized.TestCase):
  """Through `wrap_optimizer` with an Adagrad of either Keras flavour."""

  @parameterized.named_parameters(("tf_keras", tf_keras), ("keras3", keras))
  def test_exact_accumulator_equals_dense_when_nothing_is_held_back(self, k):
    # density 1 sends everything: with the exact side channel the
    # compressor's Adagrad is the optimizer's, step for step. The bias is
    # excluded: it keeps the optimizer's own update.
    comp = TopK(1.0, exclude=("bias",), adagrad=True,
                adagrad_accumulator="exact")
    self._check_equals_dense(comp, lambda: k.optimizers.Adagrad(0.1), k)

  def test_switched_on_by_adagrad_only(self):
    for make, on in ((lambda: tf_keras.optimizers.Adagrad(0.1), True),
                     (lambda: tf_keras.optimizers.Adam(1e-3), False),
                     (lambda: tf_keras.optimizers.SGD(0.1), False)):
      comp = DCTDP(adagrad=None)
      model, _, _ = self._setup(comp, make())  # build creates the state
      self.assertEqual(on, all("adagrad_acc" in comp.state_for(v)
                               for v in model.trainable_variables))
    for comp in (DCTDP(), compression.TopK(0.1), compression.DEFT()):
      model, _, _ = self._setup(comp, tf_keras.optimizers.Adagrad(0.1))
      self.assertFalse(any(comp.corrects_optimizer(v)
                           for v in model.trainable_variables))

  def test_checkpoint_restore_leaves_the_trajectory_unchanged(self):
    self._check_restore_keeps_trajectory(
        DCTDP(0.8, threshold_life=2, adagrad=True), tf_keras.optimizers.Adagrad(0.1),
        ("adagrad_acc", "residual"), grown=("adagrad_acc", HPARAMS[0]))

  def test_bad_settings_are_rejected(self):
    cases = (({"adagrad": "yes"}, r"adagrad must be None, True or False, got 'yes'"),
             ({"adagrad_accumulator": "full"},
              r"adagrad_accumulator must be one of \('factored', 'sketched', 'exact'\), got 'full'"))
    self._check_settings_rejected(
        cases, (compression.DCTDP, compression.TopK, compression.DEFT))
    with self.assertRaisesRegex(ValueError, r"DCTDP: adagrad=True .* needs an "
                                r"Adagrad optimizer"):
      self._setup(DCTDP(adagrad=True), tf_keras.optimizers.SGD(0.1))
    comp = DCTDP()
    self._setup(comp, tf_keras.optimizers.SGD(0.1))
    with self.assertRaisesRegex(ValueError, "DCTDP: Adagrad correction must "
                                "be set before the compressor has state"):
      comp.set_adagrad(*HPARAMS)


if __name__ == "__main__":
  tf.test.main()
