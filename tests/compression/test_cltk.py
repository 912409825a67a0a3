"""Tests for tf_dct.compression.CLTK against the numpy reference."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct.compression import CLTK
from tf_dct.compression import TopK
from tests import util
from tests.compression import harness
from tests.compression import reference_baselines as ref_lib


def setUpModule():
  util.setup_cpus()


def _refs(grads, **kwargs):
  return [ref_lib.cltk_reference([[g[v] for g in step] for step in grads],
                                 **kwargs)
          for v in range(len(harness.SHAPES))]


class CLTKReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("1_replica", 1, 4, {}),
      ("2_replicas_warmup", 2, 5, {"warmup_steps": 1}),
      ("4_replicas", 4, 6, {}),
  )
  def test_matches_reference(self, replicas, steps, extra):
    kwargs = dict(density=0.2, **extra)
    grads = harness.gradients(steps, replicas, seed=replicas)
    _, _, _, history = harness.run(CLTK(**kwargs), grads, replicas,
                                      autograph=True)
    refs = _refs(grads, **kwargs)
    harness.assert_matches(self, history, refs, replicas)
    warmup = extra.get("warmup_steps", 0)
    for v, ref in enumerate(refs):
      for t in range(warmup, steps):
        # One support for everyone, chosen by replica t mod n: all replicas
        # cleared their residual exactly there.
        support = ref[t].masks[0]
        for r in range(replicas):
          self.assertAllEqual(ref[t].masks[r], support)
          self.assertAllEqual(history[t][1][v]["residual"][r][support],
                              np.zeros(support.sum()))
        self.assertLessEqual(np.count_nonzero(history[t][0][0][v]),
                             support.sum())

  def test_no_build_up_unlike_topk(self):
    # DEFT §3.1: on independent gradients the union of Top-k selections grows
    # with the replicas while CLT-k stays at k / N.
    k_over_n = 20 / 400
    density = {}
    for replicas in (2, 4):
      density[replicas] = harness.achieved_density(
          [TopK(density=0.05), CLTK(density=0.05)], replicas)
    for replicas in (2, 4):
      self.assertEqual(density[replicas][1], k_over_n)
    self.assertGreater(density[2][0], 1.7 * k_over_n)
    self.assertGreater(density[4][0], 3 * k_over_n)
    self.assertGreater(density[4][0], 1.5 * density[2][0])

  def test_positions_cross_elias_fano_coded(self):
    # k = 10 of n = 1000: the "ef" layout of (1000, 10) takes 6 low bits a
    # position and a bitmap of (999 >> 6) + 10 = 25 bits, 85 bits in 3
    # words, where one int32 a position took 10; the values take 4 bytes each.
    compressor = CLTK(density=0.01, dense_gradients="compress")
    self.assertEqual(compressor.compressed_bytes(tf.Variable(tf.zeros([1000]))),
                     (0, 4 * 3 + 4 * 10))

  def test_compiles_with_xla(self):
    kwargs = dict(density=0.2, warmup_steps=1, min_size=20)
    grads = harness.gradients(3, 1, seed=11)
    repl, step_fn, _, history = harness.run(CLTK(**kwargs), grads, 1,
                                            jit_compile=True)
    harness.assert_matches(self, history, _refs(grads, **kwargs), 1)
    self.assertTrue(harness.jit_step_compiled(repl, step_fn))


class ConservationTest(tf.test.TestCase):

  def test_conservation_with_checkpoint(self):
    residuals = harness.check_conservation(
        self, CLTK(density=0.25, min_size=4))
    self.assertNotAllClose(residuals[0][0], residuals[0][1])
    self.assertAllEqual(residuals[1], np.zeros((4, 3)))  # dense bias


class ArgumentTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("density_zero", {"density": 0}, "CLTK: density must be a number in \\(0, 1\\]"),
      ("density_above_one", {"density": 1.01}, "density must be a number in \\(0, 1\\]"),
      ("density_inf", {"density": float("inf")}, "density"),
      ("density_bool", {"density": True}, "density"),
      ("min_size_float", {"min_size": 2.5}, "min_size must be an int >= 0"),
      ("warmup_negative", {"warmup_steps": -1}, "warmup_steps must be an int >= 0"),
  )
  def test_bad_argument(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      CLTK(**kwargs)

  def test_non_float_variable(self):
    harness.check_non_float(self, CLTK(), "CLTK.*counter.*int32")

  def test_non_finite_gradient_leaves_state_alone(self):
    harness.check_non_finite(self, CLTK(density=0.2),
                             "CLTK: non-finite gradient for variable")

  def test_non_finite_gradient_under_xla_is_undone(self):
    harness.check_non_finite_xla(self, lambda: CLTK(density=0.2), np.nan)


if __name__ == "__main__":
  tf.test.main()
