"""Tests for tf_dct.compression.HardThreshold against the numpy reference."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct.compression import HardThreshold
from tests import util
from tests.compression import harness
from tests.compression import reference_baselines as ref_lib


def setUpModule():
  util.setup_cpus()


def _refs(grads, **kwargs):
  return [ref_lib.hard_threshold_reference(
      [[g[v] for g in step] for step in grads], **kwargs)
          for v in range(len(harness.SHAPES))]


class HardThresholdReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("1_replica", 1, {}),
      ("2_replicas_warmup", 2, {"warmup_steps": 2}),
      ("4_replicas", 4, {}),
  )
  def test_matches_reference(self, replicas, extra):
    # lambda = 1.5 is one of the tied variable's values (multiples of 0.5).
    kwargs = dict(threshold=1.5, capacity_density=0.2, **extra)
    grads = harness.gradients(6, replicas, seed=replicas)
    _, _, _, history = harness.run(HardThreshold(**kwargs), grads,
                                      replicas, autograph=True)
    refs = _refs(grads, **kwargs)
    harness.assert_matches(self, history, refs, replicas)
    # Both regimes happened: fewer than the capacity, and overflow kept back.
    sent = np.array([h[1][0]["sent"] for h in history])[extra.get("warmup_steps", 0):]
    overflow = np.array([[h[1][v]["overflow"] for v in range(2)] for h in history])
    self.assertLess(sent.min(), 6)  # capacity of the 30-entry variable
    self.assertGreater(overflow.max(), 0)

  def test_compiles_with_xla(self):
    kwargs = dict(threshold=1.0, capacity_density=0.3, warmup_steps=1,
                  min_size=20)
    grads = harness.gradients(3, 1, seed=11)
    repl, step_fn, _, history = harness.run(HardThreshold(**kwargs), grads, 1,
                                            jit_compile=True)
    harness.assert_matches(self, history, _refs(grads, **kwargs), 1)
    self.assertTrue(harness.jit_step_compiled(repl, step_fn))


class ConservationTest(tf.test.TestCase):

  def test_conservation_with_checkpoint(self):
    residuals = harness.check_conservation(
        self, HardThreshold(1e-3, capacity_density=0.25, min_size=4))
    self.assertNotAllClose(residuals[0][0], residuals[0][1])
    self.assertAllEqual(residuals[1], np.zeros((4, 3)))  # dense bias


class ArgumentTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("threshold_negative", {"threshold": -0.1},
       "HardThreshold: threshold must be a number >= 0, got -0.1"),
      ("threshold_nan", {"threshold": float("nan")}, "threshold must be"),
      ("threshold_inf", {"threshold": float("inf")}, "threshold must be"),
      ("threshold_str", {"threshold": "1"}, "threshold must be"),
      ("capacity_zero", {"threshold": 1.0, "capacity_density": 0.0},
       "capacity_density must be a number in \\(0, 1\\]"),
      ("capacity_above_one", {"threshold": 1.0, "capacity_density": 1.5},
       "capacity_density must be a number in \\(0, 1\\]"),
      ("min_size_negative", {"threshold": 1.0, "min_size": -3},
       "min_size must be an int >= 0"),
      ("warmup_str", {"threshold": 1.0, "warmup_steps": "2"}, "warmup_steps"),
      ("value_dtype", {"threshold": 1.0, "value_dtype": "bf16"},
       "HardThreshold: value_dtype must be None \\(the variable's dtype\\) "
       "or 'bfloat16', got 'bf16'"),
  )
  def test_bad_argument(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      HardThreshold(**kwargs)

  def test_capacity_convention(self):
    self.assertEqual(HardThreshold(0.0, capacity_density=0.2).capacity(17), 4)
    self.assertEqual(HardThreshold(0.0, capacity_density=0.07).capacity(100), 7)
    self.assertEqual(HardThreshold(0.0, capacity_density=1.0).capacity(5), 5)

  def test_non_float_variable(self):
    harness.check_non_float(self, HardThreshold(1.0), "HardThreshold.*counter.*int32")

  def test_non_finite_gradient_leaves_state_alone(self):
    harness.check_non_finite(self, HardThreshold(1.0, capacity_density=0.2),
                             "HardThreshold: non-finite gradient for variable")

  def test_non_finite_gradient_under_xla_is_undone(self):
    harness.check_non_finite_xla(
        self, lambda: HardThreshold(1.0, capacity_density=0.2))


if __name__ == "__main__":
  tf.test.main()
