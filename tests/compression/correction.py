"""Shared by the optimizer-correction tests (Adam, Adagrad).

The numpy reference of the side channel's second-moment estimate, the check
that the side channel is counted, and `KerasRun`: a small model trained
through `wrap_optimizer` on 2 replicas with the step-for-step, checkpoint and
bad-setting checks both corrections run.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import tensorflow as tf
import keras
import tf_keras

import tf_dct
from tf_dct.compression import adam_correction
from tests import util
from tests.compression import harness


SKETCH_SIZE = 32  # adam_correction.SKETCH_SIZE, restated


def sketch_reference(g, step):
  """The count sketch of a flat gradient: entry i in bucket i mod 32 with its
  sign from `adam_correction.sketch_signs` (TensorFlow's stateless generator;
  its signs are checked on their own)."""
  signs = adam_correction.sketch_signs(g.size, step).numpy().astype(np.float64)
  i = np.arange(g.size)
  return np.bincount(i % SKETCH_SIZE, weights=g * signs, minlength=SKETCH_SIZE)


def second_moment_reference(per_replica, shape, mode, step=0):
  """V from the replicas' gradients of one variable, as the module states.

  "exact": the square of their sum. "factored": P times their summed
  squares, for a matrix the rank-1 outer product of its row and column sums
  over the total. "sketched": the square of the sum but for a matrix whose
  rows + columns + 32 floats are fewer than its entries, which takes the
  rank-1 shape scaled to the sketched squared norm of the sum, kept within
  [summed squares, P * summed squares]. `step`: Adam's step count before
  the step (the sketch's signs).
  """
  grads = [np.asarray(g, np.float64).reshape(shape) for g in per_replica]
  p, n = len(grads), int(np.prod(shape))
  matrix = len(shape) >= 2 and (mode == "factored" or (
      mode == "sketched" and shape[-1] + n // shape[-1] + SKETCH_SIZE < n))
  if mode == "exact" or (mode == "sketched" and not matrix):
    return np.square(sum(grads))
  squares = sum(np.square(g) for g in grads)
  if not matrix:
    return p * squares
  mat = squares.reshape(-1, shape[-1])
  rows, cols = mat.sum(axis=1), mat.sum(axis=0)
  total = rows.sum()
  if mode == "factored":
    return (p * np.outer(rows, cols) / total).reshape(shape)
  norm = np.sum(np.square(sum(sketch_reference(g.reshape(-1), step) for g in grads)))
  norm = min(max(norm, total), p * total)
  return (np.outer(rows, cols) * norm / total**2).reshape(shape)


def check_side_channel_counted(test, make, mode="factored"):
  """The side channel's bytes per replica and step on top of what
  `make(False)` sends (`make(True)`: the same compressor with the
  correction on, its side channel in `mode`): "factored" all-reduces rows
  + columns floats of a matrix and every entry of a vector, (12 + 10) * 4
  and 17 * 4 bytes; "sketched" 32 sketch floats more for a matrix, (12 + 10
  + 32) * 4, and every entry of one too small to factor (6 x 5: 30 * 4)."""
  sides = {"factored": [(harness.FACTORED_SHAPES, (22 * 4, 17 * 4)),
                        (harness.SHAPES, (11 * 4, 17 * 4))],
           "sketched": [(harness.FACTORED_SHAPES, (54 * 4, 17 * 4)),
                        (harness.SHAPES, (30 * 4, 17 * 4))]}[mode]
  for shapes, expected in sides:
    grads = harness.continuous_gradients(2, 2, seed=3, shapes=shapes)
    payload = {}
    for on in (False, True):
      comp = make(on)
      harness.run(comp, grads, 2, shapes=shapes)
      stats = comp.communication_stats()["variables"]
      payload[on] = [stats[name]["total"]["payload_bytes"] for name in ("w0", "w1")]
    for v, side in enumerate(expected):
      test.assertAllEqual(np.asarray(payload[True][v]) - payload[False][v],
                          [2 * side, 2 * side])  # 2 steps, per replica


def check_kernels_corrected_as_dense(test, corrects, model, k, ours, dense):
  """`corrects(variable)` holds for both kernels of `small_model`'s `model`
  and for no bias; the weights per step `ours` equal `dense`'s, and moved."""
  backing = [getattr(v, "value", v) if k is keras else v
             for v in model.trainable_variables]
  kernels = [v for v in backing if "kernel" in v.name]
  biases = [v for v in backing if "bias" in v.name]
  test.assertLen(kernels, 2)
  test.assertTrue(all(corrects(v) for v in kernels))
  test.assertFalse(any(corrects(v) for v in biases))
  for a, b in zip(ours, dense):
    for wa, wb in zip(a, b):
      test.assertAllClose(wa, wb, atol=1e-6, rtol=1e-5)
  # Without the correction a sparse aggregate would differ from dense:
  # the run did not degenerate (weights moved).
  test.assertGreater(np.abs(ours[-1][0] - ours[0][0]).max(), 1e-3)


def small_model(compressor, optimizer, replicas=2, k=tf_keras):
  """(replicator, model, wrapped optimizer): a 4-6-1 MLP of Keras flavour `k`
  (seed 0) on `replicas` logical CPUs, `optimizer` (or a callable making
  it) wrapped with `compressor` and built."""
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)])
  with repl.scope():
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((4,)), k.layers.Dense(6, activation="tanh"),
                          k.layers.Dense(1)])
    if callable(optimizer):  # Keras 3 optimizers must be made in the scope
      optimizer = optimizer()
    opt = repl.wrap_optimizer(optimizer, compression=compressor)
  opt.build(model.trainable_variables)
  return repl, model, opt


class KerasRun(tf.test.TestCase):
  """A small model trained through `wrap_optimizer` on 2 replicas."""

  def _setup(self, compressor, optimizer, replicas=2, k=tf_keras):
    repl, model, opt = small_model(compressor, optimizer, replicas, k)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()  # the same batch

    @tf.function
    def train_step(iterator):
      return repl.run(util.squared_error_step(model, opt, 16),
                      args=(next(iterator),))

    iterator = iter(repl.experimental_distribute_dataset(data))

    def train(steps):
      weights = []
      for _ in range(steps):
        train_step(iterator)
        weights.append([w.numpy() for w in model.trainable_variables])
      return weights
    return model, opt, train

  def _train(self, compressor, optimizer, steps=5, k=tf_keras):
    model, opt, train = self._setup(compressor, optimizer, k=k)
    return model, opt, train(steps)

  def _check_equals_dense(self, comp, make_optimizer, k):
    """`comp` (density 1, the bias excluded) corrects both kernels and no
    bias, and trains step for step as the plain `make_optimizer()` does."""
    model, _, ours = self._train(comp, make_optimizer, k=k)
    _, _, dense = self._train(None, make_optimizer, k=k)
    check_kernels_corrected_as_dense(self, comp.corrects_optimizer, model, k,
                                     ours, dense)

  def _check_restore_keeps_trajectory(self, comp, optimizer, keys, grown):
    """Three steps, a checkpoint, three more; the state `keys` clobbered, the
    checkpoint restored: the three steps again are the same to the bit.
    `grown` = (key, floor): the first kernel's state[key] exceeds floor
    somewhere at the checkpoint (the state did move)."""
    model, opt, train = self._setup(comp, optimizer)
    train(3)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    var = model.trainable_variables[0]
    key, floor = grown
    self.assertGreater(np.abs(comp.state_values(var)[key][0]).max(), floor)
    first = train(3)
    for st in comp.state.values():
      for name in keys:
        for v in st[name].variables_per_replica:
          v.assign(tf.zeros_like(v) + 7.0)
    ckpt.restore(path)
    again = train(3)
    for a, b in zip(first, again):
      for wa, wb in zip(a, b):
        self.assertAllEqual(wa, wb)

  def _check_settings_rejected(self, cases, classes):
    """Each (kwargs, pattern) of `cases` raises "<Class>: <pattern>" from
    every compressor class."""
    for kwargs, pattern in cases:
      for cls in classes:
        with self.assertRaisesRegex(ValueError, f"{cls.__name__}: {pattern}"):
          cls(**kwargs)
