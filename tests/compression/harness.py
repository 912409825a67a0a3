"""Test harness shared by the baseline compressors' tests.

Runs a compressor on fixed per-replica gradient sequences (PER_REPLICA input,
as tests/compression/test_dct_dp.py does), compares it with a numpy reference,
and checks conservation across a checkpoint and the non-finite discipline.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct

SHAPES = [(6, 5), (17,)]


def gradients(steps: int, replicas: int, seed: int = 0, shapes=SHAPES):
  """grads[t][r][v]: variable 0 continuous, the others full of ties."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    per_replica = []
    for _ in range(replicas):
      g = [rng.normal(size=shapes[0]).astype(np.float32)]
      g += [(np.round(rng.normal(size=s) * 2) / 2).astype(np.float32)
            for s in shapes[1:]]
      per_replica.append(g)
    out.append(per_replica)
  return out


def run(compressor, grads, replicas: int, jit_compile: bool = False,
        shapes=SHAPES):
  """Feeds grads[t][r][v] to `compressor.aggregate` on `replicas` replicas.

  Returns `(repl, step_fn, variables, history)`; history[t] is `(out,
  states)`: out[r][v] the aggregate on replica r, states[v] the state of
  variable v after step t ({key: per-replica numpy list}; {} if dense).
  """
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA,
                           jit_compile=jit_compile)
  compressor.bind(repl)
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s), name=f"w{i}")
                 for i, s in enumerate(shapes)]

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(tuple(
        np.stack([step[replica_id][v] for step in grads])
        for v in range(len(shapes))))

  def step_fn(g):
    return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]

  history = []
  for _ in grads:
    out = [tf.nest.map_structure(lambda t: t.numpy(), o)
           for o in repl.experimental_local_results(repl.run(step_fn, input_fn))]
    states = [{key: s.numpy() for key, s in compressor.state_for(v).items()}
              for v in variables]
    history.append((out, states))
  return repl, step_fn, variables, history


def assert_matches(test, history, refs, replicas: int, shapes=SHAPES,
                   check_tau: bool = False):
  """Same update (1e-6), residuals, sent / overflow counts and steps.

  `refs[v]` is the reference (a list of `ReferenceStep`) of variable v.
  """
  for v, ref in enumerate(refs):
    for t, (ref_step, (out, states)) in enumerate(zip(ref, history)):
      st = states[v]
      where = f"var {v} step {t}"
      for r in range(replicas):
        test.assertAllClose(out[r][v], ref_step.update, atol=1e-6, rtol=0,
                            msg=f"update {where} replica {r}")
        if not st:  # dense variable: nothing held back
          test.assertAllEqual(ref_step.residuals[r], np.zeros(shapes[v]))
          continue
        test.assertAllEqual(st["residual"][r], ref_step.residuals[r],
                            msg=f"residual {where} replica {r}")
        test.assertEqual(st["sent"][r], ref_step.masks[r].sum(),
                         msg=f"sent {where} replica {r}")
        test.assertEqual(
            st["overflow"][r],
            ref_step.selected[r].sum() - ref_step.masks[r].sum(),
            msg=f"overflow {where} replica {r}")
        test.assertEqual(st["step"][r], t + 1)
        if check_tau and ref_step.taus[r] is not None:
          test.assertEqual(st["threshold"][r], ref_step.taus[r],
                           msg=f"tau {where} replica {r}")


def achieved_density(compressors, replicas: int, n: int = 400,
                     seed: int = 0) -> list[float]:
  """nnz(aggregate) / n of each compressor after one step, on one replicator.

  Each compressor aggregates its own n-entry variable; every replica's
  gradient is independent standard normal noise.
  """
  rng = np.random.default_rng(seed)
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  with repl.scope():
    variables = [tf.Variable(tf.zeros([n])) for _ in compressors]
  for c in compressors:
    c.bind(repl)
  grads = rng.normal(size=(replicas, 1, n)).astype(np.float32)

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(grads[replica_id])

  def step_fn(g):
    return [c.aggregate([(g, v)])[0][0] for c, v in zip(compressors, variables)]

  out = repl.experimental_local_results(repl.run(step_fn, input_fn))[0]
  return [np.count_nonzero(o.numpy()) / n for o in out]


def check_conservation(test, compressor, steps: int = 200):
  """SGD(lr=1) on 4 replicas: w0 - w_T + sum_r E_T == sum_t sum_r g_t.

  The model is one tanh layer (kernel 4x3, bias 3). A checkpoint is saved
  half-way, the compressor's state is scrambled and restored. Returns the
  final residuals per variable (per-replica lists).
  """
  replicas = 4
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  with repl.scope():
    model = tf_keras.Sequential([tf_keras.Input((4,)),
                                 tf_keras.layers.Dense(3, activation="tanh")])
    opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(1.0),
                              compression=compressor)
  variables = model.trainable_variables
  w0 = [w.numpy() for w in variables]
  seen = [repl.per_replica_state(tf.zeros_like(w), name=f"seen{i}")
          for i, w in enumerate(variables)]

  def input_fn(replica_id):
    rng = np.random.default_rng(replica_id)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = np.sin(x[:, :3] + x[:, 1:]).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = 0.02 * tf.reduce_mean(tf.square(model(x) - y)) / replicas
    grads = tape.gradient(loss, variables)
    for s, g in zip(seen, grads):
      s.local().assign_add(g)
    opt.apply_gradients(zip(grads, variables))

  def states():
    return [s for v in variables for s in compressor.state_for(v).values()]

  for _ in range(steps // 2):
    repl.run(step_fn, input_fn)
  ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
  path = ckpt.save(test.create_tempdir().full_path + "/ckpt")
  saved = [s.numpy() for s in states()]
  rng = np.random.default_rng(5)
  for s in states():
    values = s.numpy()
    s.assign_all([(rng.normal(size=v.shape) * 3).astype(v.dtype)
                  for v in values])
  test.assertNotAllClose(saved[0], states()[0].numpy())
  ckpt.restore(path).assert_existing_objects_matched()
  for want, s in zip(saved, states()):
    for w, got in zip(want, s.numpy()):
      test.assertAllEqual(got, w)
  for _ in range(steps - steps // 2):
    repl.run(step_fn, input_fn)

  residuals = []
  for i, var in enumerate(variables):
    st = compressor.state_for(var)
    res = st["residual"].numpy() if st else [np.zeros(var.shape)] * replicas
    residuals.append(res)
    lhs = w0[i] - var.numpy() + sum(res)
    rhs = sum(seen[i].numpy())
    scale = np.abs(rhs).max()
    test.assertGreater(scale, 1e-3)
    test.assertAllClose(lhs, rhs, atol=1e-5 * scale, rtol=0,
                        msg=f"conservation of {var.name}")
    if st:
      test.assertAllEqual(st["step"].numpy(), [steps] * replicas)
  return residuals


def check_non_finite(test, compressor, message: str):
  """A NaN on one replica raises and leaves every replica's state alone."""
  replicas = 2
  grads = gradients(4, replicas, seed=4)
  grads[2][1][1][3] = np.nan
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  compressor.bind(repl)
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(tuple(
        np.stack([g[replica_id][v] for g in grads]) for v in range(2)))

  def step_fn(g):
    return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]

  repl.run(step_fn, input_fn)
  repl.run(step_fn, input_fn)
  states = [compressor.state_for(v) for v in variables]
  before = [{k: s.numpy() for k, s in st.items()} for st in states]
  test.assertTrue(np.any(before[0]["residual"][0] != 0))
  with test.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
    repl.run(step_fn, input_fn)
  for want, st in zip(before, states):
    for key, s in st.items():
      test.assertAllEqual(s.numpy(), want[key], msg=key)
  repl.run(step_fn, input_fn)
  for st in states:
    test.assertAllEqual(st["step"].numpy(), [3, 3])


def check_non_float(test, compressor, message: str):
  repl = tf_dct.Replicator(["/cpu:0"])
  compressor.bind(repl)
  with repl.scope():
    counter = tf.Variable(tf.zeros([3], tf.int32), name="counter")
  with test.assertRaisesRegex(TypeError, message):
    compressor.state_for(counter)


def jit_step_compiled(repl, step_fn) -> bool:
  """Whether the cached step of `repl.run(step_fn, ...)` is XLA-compiled."""
  step = repl._steps[(step_fn, next(iter(repl._inputs)))]  # pylint: disable=protected-access
  return step.replicated_step._jit_compile  # pylint: disable=protected-access
