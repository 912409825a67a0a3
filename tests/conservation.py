"""Error-feedback mass conservation, shared by single- and multi-process tests.

With SGD(lr=1) every entry a compressor does not apply stays in some
replica's residual, so after T steps

    w_0 - w_T + sum_r E_T^r == sum_t sum_r g_t^r       (DCT Alg. 1 lines 10-11,
                                                        DEFT Alg. 1 lines 11-12)

`run` trains a small tf-keras model for `steps` steps on the replicator it is
given (4 logical CPUs, or one replica per worker process), saves a checkpoint
half-way, scrambles every piece of compressor state, restores it and trains
on. It returns plain numpy values so a multi-process test can sum the
residuals of all workers; `assert_conserved` checks the identity.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
import tf_keras


IN_DIM = 4
ONE_LAYER = ((3, "tanh"),)             # kernel 4x3, bias 3
TWO_LAYERS = ((8, "tanh"), (1, None))  # its output bias has 1 entry


def build_model(layers: Sequence[tuple[int, str | None]]) -> tf_keras.Model:
  return tf_keras.Sequential(
      [tf_keras.Input((IN_DIM,))]
      + [tf_keras.layers.Dense(units, activation=act) for units, act in layers])


def run(repl, compressor, steps: int, ckpt_prefix: str,
        layers: Sequence[tuple[int, str | None]] = ONE_LAYER) -> dict:
  """Trains with `compressor` on `repl`; checkpoint + scramble + restore midway.

  The replicator must use PER_REPLICA input (replica r reads data seeded r).

  Returns:
    dict with `w0`, `w` (initial / final weights per variable), `residual`
    and `seen` (per variable, a list over this worker's replicas: the final
    residual, zeros for a stateless variable, and the sum of the gradients
    the replica computed), `restored` (every state variable equal to its
    saved value after the restore), `scrambled` (the scramble changed the
    state, so `restored` means something) and `steps` (per variable, the
    compressor's step counters, None when stateless).
  """
  n = repl.num_replicas
  with repl.scope():
    model = build_model(layers)
    opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(1.0),
                              compression=compressor)
  variables = model.trainable_variables
  w0 = [w.numpy() for w in variables]
  seen = [repl.per_replica_state(tf.zeros_like(w), name=f"seen{i}")
          for i, w in enumerate(variables)]

  def input_fn(replica_id):
    rng = np.random.default_rng(replica_id)
    x = rng.normal(size=(64, IN_DIM)).astype(np.float32)
    y = np.sin(x[:, :1] + x[:, 1:] * x[:, :1]).astype(np.float32)
    y = y[:, :layers[-1][0]]
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = 0.02 * tf.reduce_mean(tf.square(model(x) - y)) / n
    grads = tape.gradient(loss, variables)
    for s, g in zip(seen, grads):
      s.local().assign_add(g)
    opt.apply_gradients(zip(grads, variables))

  def states():
    return [s for v in variables for s in compressor.state_for(v).values()]

  for _ in range(steps // 2):
    repl.run(step_fn, input_fn)
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  path = ckpt.save(ckpt_prefix)
  saved = [s.numpy() for s in states()]
  rng = np.random.default_rng(5)
  for s in states():
    s.assign_all([(v + np.abs(rng.normal(size=v.shape)) * 3 + 1).astype(v.dtype)
                  for v in s.numpy()])  # every entry moves by >= 1
  scrambled = all(any(np.any(a != b) for a, b in zip(want, s.numpy()))
                  for want, s in zip(saved, states()))
  ckpt.restore(path).assert_existing_objects_matched()
  restored = all(np.array_equal(a, b) for want, s in zip(saved, states())
                 for a, b in zip(want, s.numpy()))
  for _ in range(steps - steps // 2):
    repl.run(step_fn, input_fn)

  local = len(repl.replica_devices)
  out = {"w0": w0, "w": [v.numpy() for v in variables], "residual": [],
         "seen": [list(s.numpy()) for s in seen], "steps": [],
         "restored": restored, "scrambled": scrambled}
  for var in variables:
    st = compressor.state_for(var)
    out["residual"].append(list(st["residual"].numpy()) if st
                           else [np.zeros(var.shape, np.float32)] * local)
    out["steps"].append([int(s) for s in compressor.state_values(var)["step"]]
                        if st else None)
  return out


def assert_conserved(test, w0, w, residuals, seen, name: str = "") -> None:
  """w0 - w + sum(residuals) == sum(seen) to 1e-5 of the gradient mass."""
  lhs = np.asarray(w0) - np.asarray(w) + sum(np.asarray(r) for r in residuals)
  rhs = sum(np.asarray(s) for s in seen)
  scale = np.abs(rhs).max()
  test.assertGreater(scale, 1e-3, msg=f"{name}: no gradient mass")
  test.assertAllClose(lhs, rhs, atol=1e-5 * scale, rtol=0,
                      msg=f"conservation of {name}")
