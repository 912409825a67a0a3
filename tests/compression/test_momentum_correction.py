"""Momentum correction (DGC) in the sparsifying compressors and the tf-keras adapter."""

from __future__ import annotations

import os
import tempfile

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
DEFT = harness.compress_all(compression.DEFT)


def setUpModule():
  util.setup_cpus()


SHAPES = harness.SHAPES
MOMENTUM = 0.9


def dgc_topk_reference(grads, k, momentum, masking=True):
  """DGC on grads[t][r] (one variable, no ties): velocity, top-k of u + E.

  Returns per step (update, residuals, velocities fed in, velocities kept).
  """
  replicas = len(grads[0])
  n = np.asarray(grads[0][0]).size
  dtype = np.asarray(grads[0][0]).dtype
  u = [np.zeros(n, dtype) for _ in range(replicas)]
  e = [np.zeros(n, dtype) for _ in range(replicas)]
  out = []
  for step in grads:
    update = np.zeros(n, np.float64)
    fed = []
    for r in range(replicas):
      u[r] = (dtype.type(momentum) * u[r]
              + np.asarray(step[r], dtype).reshape(-1))   # u = m u + g
      fed.append(u[r].copy())
      acc = u[r] + e[r]                                   # acc = u + E
      mask = np.zeros(n, bool)
      mask[np.argsort(-np.abs(acc), kind="stable")[:k]] = True
      sent = np.where(mask, acc, dtype.type(0))
      e[r] = acc - sent
      update += sent
      if masking:                                         # factor masking
        u[r] = np.where(mask, dtype.type(0), u[r])
    out.append((update, [x.copy() for x in e], fed, [x.copy() for x in u]))
  return out


class ReferenceTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("topk_masking", "topk", True, 2),
      ("topk_no_masking", "topk", False, 2),
      ("dct_dp_native", "dct_native", True, 2),
      ("dct_dp_stock", "dct_stock", True, 4),
  )
  def test_matches_numpy_reference(self, kind, masking, replicas):
    # density 0.2 of 30 / 17 entries: k = 6 / 4 (no floor), the same top-k
    # for TopK and for DCT-DP refreshing tau every step (L = 1).
    make = {
        "topk": lambda: TopK(0.2, min_count=0, momentum=MOMENTUM,
                                         momentum_masking=masking),
        "dct_native": lambda: DCTDP(
            0.8, threshold_life=1, capacity_factor=1.0, density_band=None,
            min_count=0, momentum=MOMENTUM, momentum_masking=masking),
        "dct_stock": lambda: DCTDP(
            0.8, threshold_life=1, capacity_factor=1.0, density_band=None,
            min_count=0, native=False, momentum=MOMENTUM,
            momentum_masking=masking),
    }[kind]
    grads = harness.continuous_gradients(6, replicas, seed=replicas)
    _, _, _, history = harness.run(make(), grads, replicas)
    for v, shape in enumerate(SHAPES):
      k = {30: 6, 17: 4}[int(np.prod(shape))]
      ref = dgc_topk_reference([[g[v] for g in step] for step in grads], k,
                               MOMENTUM, masking)
      for t, ((update, residuals, _, kept), (out, states)) in enumerate(
          zip(ref, history)):
        for r in range(replicas):
          self.assertAllClose(out[r][v], update.reshape(shape), atol=1e-5,
                              rtol=1e-5, msg=f"update var {v} step {t}")
          self.assertAllClose(states[v]["residual"][r],
                              residuals[r].reshape(shape), atol=1e-5, rtol=1e-5)
          self.assertAllClose(states[v]["velocity"][r], kept[r].reshape(shape),
                              atol=1e-5, rtol=1e-5)

  @parameterized.named_parameters(
      ("dct_dp", lambda: DCTDP(0.9, threshold_life=3,
                                           momentum=MOMENTUM,
                                           momentum_masking=True)),
      ("topk", lambda: TopK(0.1, momentum=MOMENTUM,
                                        momentum_masking=True)),
      ("deft", lambda: DEFT(0.1, momentum=MOMENTUM,
                                        momentum_masking=True)),
      ("dct_dp_no_masking", lambda: DCTDP(
          0.9, threshold_life=3, momentum=MOMENTUM), False),
  )
  def test_conserves_the_velocities_fed_in(self, make, masking=True):
    # Error feedback now conserves u: sum of updates + sum_r E == sum of
    # the velocities fed in, u_t = m * (u_{t-1} masked) + g_t.
    replicas, steps = 2, 7
    grads = harness.continuous_gradients(steps, replicas, seed=5)
    compressor = make()
    _, _, _, history = harness.run(compressor, grads, replicas)
    for v, shape in enumerate(SHAPES):
      fed = np.zeros(shape, np.float64)
      kept = [np.zeros(shape, np.float32) for _ in range(replicas)]
      for t in range(steps):
        for r in range(replicas):
          u = MOMENTUM * kept[r] + grads[t][r][v]
          fed += u
          # The velocity kept is u with the entries this replica sent
          # zeroed (masking), or u itself.
          kept[r] = history[t][1][v]["velocity"][r]
          if masking:
            self.assertTrue(np.all((kept[r] == 0) | np.isclose(kept[r], u,
                                                               rtol=1e-5)))
          else:
            self.assertAllClose(kept[r], u, rtol=1e-5, atol=1e-6)
      applied = sum(out[0][v] for out, _ in history)
      residual = sum(history[-1][1][v]["residual"])
      self.assertAllClose(applied + residual, fed,
                          atol=1e-4 * np.abs(fed).max(), rtol=0)
      # Masking really dropped momentum somewhere (and only with masking).
      self.assertEqual(masking, any(
          (history[-1][1][v]["velocity"][r] == 0).any()
          for r in range(replicas)))

  def test_deft_masks_the_same_entries_on_every_replica(self):
    # DEFT's replicas all send at the union of the owners' picks, so masking
    # zeroes the same entries of every replica's velocity.
    replicas = 2
    grads = harness.continuous_gradients(5, replicas, seed=7)
    _, _, _, history = harness.run(
        DEFT(0.2, min_count=0, momentum=MOMENTUM, momentum_masking=True),
        grads, replicas)
    for t, (_, states) in enumerate(history):
      for v in range(len(SHAPES)):
        zeros = [states[v]["velocity"][r] == 0 for r in range(replicas)]
        self.assertTrue(zeros[0].any(), msg=f"step {t} var {v}")
        self.assertAllEqual(zeros[0], zeros[1], msg=f"step {t} var {v}")


class KerasTest(tf.test.TestCase, parameterized.TestCase):
  """Through `wrap_optimizer` with a tf-keras momentum SGD."""

  def _train(self, compressor, optimizer, steps=5, replicas=2, ckpt=None,
             k=tf_keras):
    repl, model, opt = correction.small_model(compressor, optimizer, replicas, k)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16 * steps, 4)).astype(np.float32)
    y = rng.normal(size=(16 * steps, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    step_fn = util.squared_error_step(model, opt, 16)
    input_fn = lambda ctx: data
    weights = []
    for _ in range(steps):
      repl.run(step_fn, input_fn)
      weights.append([w.numpy() for w in model.trainable_variables])
    return repl, model, opt, weights

  @parameterized.named_parameters(("tf_keras", tf_keras), ("keras3", keras))
  def test_takes_momentum_from_sgd_and_equals_dense_when_nothing_is_held_back(
      self, k):
    # density 1 sends everything: momentum correction without masking is
    # then exactly momentum SGD. The bias is excluded: it keeps the
    # optimizer's own momentum.
    comp = TopK(1.0, exclude=("bias",))
    _, model, opt, ours = self._train(
        comp, lambda: k.optimizers.SGD(0.1, momentum=MOMENTUM), k=k)
    self.assertEqual(comp.momentum, MOMENTUM)
    _, _, _, dense = self._train(
        None, lambda: k.optimizers.SGD(0.1, momentum=MOMENTUM), k=k)
    correction.check_kernels_corrected_as_dense(self, comp.corrects_momentum, model,
                                                k, ours, dense)

  def test_other_optimizers_leave_it_off(self):
    comp = DCTDP()
    self._train(comp, tf_keras.optimizers.Adam(1e-3), steps=1)
    self.assertEqual(comp.momentum, 0.0)
    comp = DCTDP()
    self._train(comp, tf_keras.optimizers.SGD(0.1), steps=1)
    self.assertEqual(comp.momentum, 0.0)
    comp = DCTDP(momentum=0)  # explicitly off with momentum SGD
    _, model, _, _ = self._train(comp, tf_keras.optimizers.SGD(0.1, momentum=0.9),
                                 steps=1)
    self.assertFalse(any(comp.corrects_momentum(v)
                         for v in model.trainable_variables))

  def test_checkpoint_restores_the_velocity(self):
    comp = DCTDP(0.8, threshold_life=2)
    repl, model, opt, _ = self._train(
        comp, tf_keras.optimizers.SGD(0.1, momentum=MOMENTUM), steps=3)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    var = model.trainable_variables[0]
    before = comp.state_values(var)["velocity"]
    self.assertGreater(np.abs(before).max(), 0)
    for st in comp.state.values():
      for key in ("velocity", "residual"):
        for v in st[key].variables_per_replica:
          v.assign(tf.zeros_like(v) + 7.0)
    ckpt.restore(path)
    after = comp.state_values(var)["velocity"]
    for a, b in zip(before, after):
      self.assertAllEqual(a, b)

  def test_bad_settings_are_rejected(self):
    for kwargs, pattern in (({"momentum": 1.0}, r"momentum must be None or a "
                             r"number in \[0, 1\), got 1.0"),
                            ({"momentum": -0.1}, r"momentum .* got -0.1"),
                            ({"momentum_masking": "yes"},
                             r"momentum_masking must be True or False"),
                            ({"min_count": -1}, r"min_count must be an int >= 0")):
      for cls in (compression.DCTDP, compression.TopK, compression.DEFT):
        with self.assertRaisesRegex(ValueError, f"{cls.__name__}: {pattern}"):
          cls(**kwargs)
    with self.assertRaisesRegex(ValueError, r"DCTDP: momentum=0.9 .* needs an "
                                r"SGD optimizer"):
      self._train(DCTDP(momentum=0.9), tf_keras.optimizers.Adam(),
                  steps=1)
    with self.assertRaisesRegex(ValueError, r"SGD optimizer has momentum=0.5"):
      self._train(DCTDP(momentum=0.9),
                  tf_keras.optimizers.SGD(0.1, momentum=0.5), steps=1)


if __name__ == "__main__":
  tf.test.main()
