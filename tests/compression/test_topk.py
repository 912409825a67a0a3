"""Tests for tf_dct.compression.TopK against the numpy reference.

TopK's gradient build-up (density growing with replicas) is tested next to
CLTK's constant density in test_cltk.py.
"""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tf_dct import compression
from tf_dct.compression import topk
from tests import util
from tests.compression import harness
from tests.compression import reference
from tests.compression import reference_baselines as ref_lib

TopK = harness.compress_all(compression.TopK)


def setUpModule():
  util.setup_cpus()


def _refs(grads, **kwargs):
  return [ref_lib.topk_reference([[g[v] for g in step] for step in grads],
                                 **kwargs)
          for v in range(len(harness.SHAPES))]


class TopKReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("1_replica", 1, {}),
      ("2_replicas_warmup_capacity", 2, {"warmup_steps": 2,
                                         "capacity_factor": 1.5}),
      ("4_replicas", 4, {}),
      # The default floor: 8 entries of both variables (k would be 6 and 4).
      ("2_replicas_min_count", 2, {"min_count": 8}),
      ("2_replicas_residual_decay", 2, {"residual_decay": 0.75}),
  )
  def test_matches_reference(self, replicas, extra):
    # min_count=0 unless given: k = ceil(n * density) as published.
    kwargs = dict(density=0.2, **{"min_count": 0, **extra})
    grads = harness.gradients(6, replicas, seed=replicas)
    _, _, _, history = harness.run(TopK(**kwargs), grads, replicas,
                                      autograph=True)
    refs = _refs(grads, **kwargs)
    harness.assert_matches(self, history, refs, replicas, check_tau=True)
    if "residual_decay" in extra:
      # What was held back shrank: the undecayed reference keeps more.
      plain = _refs(grads, density=0.2, min_count=0)
      self.assertLess(np.abs(refs[0][-1].residuals[0]).sum(),
                      np.abs(plain[0][-1].residuals[0]).sum())
    elif "min_count" in extra:
      for _, states in history:
        self.assertAllEqual(states[0]["sent"], [8] * replicas)
    elif not extra:
      # The tied variable really had more ties than slots (overflow).
      overflow = np.array([h[1][1]["overflow"] for h in history])
      self.assertGreater(overflow.max(), 0)
      # capacity_factor 1: exactly k = ceil(0.2 n) entries per replica.
      for v, shape in enumerate(harness.SHAPES):
        k = topk.selected_count(int(np.prod(shape)), 0.2)
        for _, states in history:
          self.assertAllEqual(states[v]["sent"], [k] * replicas)
    else:  # spare slots carried ties beyond k = 4 of the tied variable
      sent = np.array([h[1][1]["sent"] for h in history[2:]])
      self.assertGreater(sent.max(), 4)

  def test_reference_is_dct_with_life_one(self):
    # Without ties beyond capacity, Top-k is DCT Algorithm 1 with L = 1.
    grads = [[g[0] for g in step] for step in harness.gradients(5, 3, seed=9)]
    ours = ref_lib.topk_reference(grads, density=0.3)
    dct = reference.dct_dp_reference(grads, sparsity=0.7, threshold_life=1,
                                     capacity_factor=1.0)
    for a, b in zip(ours, dct):
      self.assertAllEqual(a.update, b.update)
      self.assertAllEqual(a.residuals, b.residuals)

  def test_compiles_with_xla(self):
    kwargs = dict(density=0.2, warmup_steps=1, min_size=20, min_count=8)
    grads = harness.gradients(3, 1, seed=11)
    repl, step_fn, _, history = harness.run(TopK(**kwargs), grads, 1,
                                            jit_compile=True)
    harness.assert_matches(self, history, _refs(grads, **kwargs), 1,
                           check_tau=True)
    self.assertTrue(harness.jit_step_compiled(repl, step_fn))


class AccountingTest(tf.test.TestCase):

  def test_reported_nnz_is_that_of_the_aggregate(self):
    # 3000 entries at density 0.1: 300 slots, a long buffer whose non-zeros
    # the exchange's native kernel counts; 50 entries: a short one.
    shapes = [(3000,), (50,)]
    grads = harness.gradients(3, 2, seed=4, shapes=shapes)
    compressor = TopK(density=0.1)
    _, _, _, history = harness.run(compressor, grads, 2, shapes=shapes)
    self.assertGreater(topk.selected_count(3000, 0.1), 128)
    stats = compressor.communication_stats()["variables"]
    out = history[-1][0]
    for v, name in enumerate(("w0", "w1")):
      want = [int(np.count_nonzero(out[r][v])) for r in range(2)]
      self.assertEqual(stats[name]["last"]["nnz"], want, msg=name)
      self.assertGreater(want[0], 0)


class ConservationTest(tf.test.TestCase):

  def test_conservation_with_checkpoint(self):
    residuals = harness.check_conservation(
        self, TopK(density=0.25, capacity_factor=1.5, min_size=4))
    self.assertNotAllClose(residuals[0][0], residuals[0][1])
    self.assertAllEqual(residuals[1], np.zeros((4, 3)))  # dense bias

  def test_conservation_with_bfloat16_values(self):
    residuals = harness.check_conservation(
        self, TopK(density=0.25, capacity_factor=1.5, min_size=4,
                   value_dtype="bfloat16"), steps=40)
    self.assertNotAllClose(residuals[0][0], residuals[0][1])


class ArgumentTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("density_zero", {"density": 0.0}, "TopK: density must be a number in \\(0, 1\\]"),
      ("density_above_one", {"density": 1.5}, "density must be a number in \\(0, 1\\]"),
      ("density_nan", {"density": float("nan")}, "density"),
      ("density_str", {"density": "0.1"}, "density"),
      ("capacity_low", {"capacity_factor": 0.9}, "capacity_factor must be a number >= 1"),
      ("min_size_negative", {"min_size": -1}, "min_size must be an int >= 0"),
      ("warmup_float", {"warmup_steps": 1.0}, "warmup_steps must be an int"),
      ("residual_decay_zero", {"residual_decay": 0},
       "TopK: residual_decay must be a number in \\(0, 1\\], got 0"),
      ("residual_decay_above_one", {"residual_decay": 1.5}, "residual_decay"),
      ("whole_below_negative", {"whole_below": -1},
       "TopK: whole_below must be an int >= 0, got -1"),
      ("whole_below_float", {"whole_below": 2048.0}, "TopK: whole_below"),
      ("value_dtype", {"value_dtype": "half"},
       "TopK: value_dtype must be None \\(the variable's dtype\\) or "
       "'bfloat16', got 'half'"),
      # "auto" is DCTDP's alone: TopK's values keep the variable's dtype.
      ("value_dtype_auto", {"value_dtype": "auto"},
       "^TopK: value_dtype must be None \\(the variable's dtype\\) or "
       "'bfloat16', got 'auto'$"),
  )
  def test_bad_argument(self, kwargs, message):
    with self.assertRaisesRegex(ValueError, message):
      TopK(**kwargs)

  def test_count_convention(self):
    self.assertEqual(topk.selected_count(100, 0.07), 7)   # not 8
    self.assertEqual(topk.selected_count(100, 0.01), 1)
    self.assertEqual(topk.selected_count(30, 0.2), 6)
    self.assertEqual(topk.selected_count(17, 0.2), 4)     # ceil(3.4)
    self.assertEqual(topk.selected_count(5, 1.0), 5)
    self.assertEqual(topk.slots(17, 4, 1.5), 6)

  def test_non_float_variable(self):
    harness.check_non_float(self, TopK(), "TopK.*counter.*int32")

  def test_non_finite_gradient_leaves_state_alone(self):
    harness.check_non_finite(self, TopK(density=0.2),
                             "TopK: non-finite gradient for variable")

  def test_non_finite_gradient_under_xla_is_undone(self):
    harness.check_non_finite_xla(self, lambda: TopK(density=0.2))


if __name__ == "__main__":
  tf.test.main()
