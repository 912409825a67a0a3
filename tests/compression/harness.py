"""Test harness shared by the baseline compressors' tests.

Runs a compressor on fixed per-replica gradient sequences (PER_REPLICA input,
as tests/compression/test_dct_dp.py does), compares it with a numpy reference,
and checks conservation across a checkpoint and the non-finite discipline.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tf_dct
from tests import conservation
from tests import util

SHAPES = [(6, 5), (17,)]
# A matrix large enough for Adam / Adagrad correction's factored side channel
# (rows + columns + its 32-float sketch < entries) and a vector.
FACTORED_SHAPES = [(12, 10), (17,)]


def compress_all(cls):
  """`cls` with `dense_gradients="compress"` unless given: the tests of an
  algorithm run it on variables of a few dozen entries, which the default
  "auto" would all-reduce whole (that policy is tested in test_base)."""
  def make(*args, **kwargs):
    kwargs.setdefault("dense_gradients", "compress")
    return cls(*args, **kwargs)
  return make


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


def continuous_gradients(steps: int, replicas: int, seed: int = 0,
                         shapes=SHAPES):
  """grads[t][r][v] without ties, so every selection rule agrees on top-k."""
  rng = np.random.default_rng(seed)
  return [[[rng.normal(size=s).astype(np.float32) for s in shapes]
           for _ in range(replicas)] for _ in range(steps)]


def run(compressor, grads, replicas: int, jit_compile: bool = False,
        shapes=SHAPES, phases: bool = False, autograph: bool = False):
  """Feeds grads[t][r][v] to `compressor.aggregate` on `replicas` replicas.

  With `phases`, step t is traced and run in the compressor's phase of t
  (`Compressor.in_phase`, as `wrap_optimizer` drives it); without, every
  step decides its phase in the graph. By default the step function, hence
  the compressor, is traced as plain Python, as it is when a Keras optimizer
  calls it through `wrap_optimizer` (Keras code is not converted);
  conversion is a large part of tracing on many replicas. `autograph=True`
  converts it, as a user's own `tf.function` step does; one reference test
  per compressor runs that way.

  Returns `(repl, step_fn, variables, history)`; history[t] is `(out,
  states)`: out[r][v] the aggregate on replica r, states[v] the state of
  variable v after step t ({key: per-replica numpy list}; {} if dense).
  """
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA,
                           jit_compile=jit_compile)
  compressor.bind(repl)
  if phases:
    repl.add_trace_hook(lambda: compressor.in_phase(len(history)))
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s), name=f"w{i}")
                 for i, s in enumerate(shapes)]

  def input_fn(replica_id):
    return util.without_autotune(tf.data.Dataset.from_tensor_slices(tuple(
        np.stack([step[replica_id][v] for step in grads])
        for v in range(len(shapes)))))

  def step_fn(g):
    return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]

  if not autograph:
    step_fn = tf.autograph.experimental.do_not_convert(step_fn)
  history = []
  for _ in grads:
    out = [tf.nest.map_structure(lambda t: t.numpy(), o)
           for o in repl.experimental_local_results(repl.run(step_fn, input_fn))]
    states = [compressor.state_values(v) for v in variables]
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


def check_conservation(test, compressor, steps: int = 200,
                       layers=conservation.ONE_LAYER):
  """SGD(lr=1) on 4 replicas, checkpoint half-way (tests/conservation.py).

  Checks w0 - w_T + sum_r E_T == sum_t sum_r g_t per variable, that the
  restore brought back every piece of scrambled state exactly, and the step
  counters. Returns the final residuals per variable (per-replica lists).
  """
  replicas = 4
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  out = conservation.run(repl, compressor, steps,
                         test.create_tempdir().full_path + "/ckpt", layers)
  test.assertTrue(out["scrambled"])
  test.assertTrue(out["restored"], "a state variable was not restored exactly")
  for i in range(len(out["w"])):
    conservation.assert_conserved(test, out["w0"][i], out["w"][i],
                                  out["residual"][i], out["seen"][i], f"w{i}")
    if out["steps"][i] is not None:
      test.assertAllEqual(out["steps"][i], [steps] * replicas)
  return [np.asarray(r) for r in out["residual"]]


def check_non_finite(test, compressor, message: str, grads=None,
                     shapes=SHAPES):
  """A non-finite entry on one replica raises and leaves every state alone.

  `grads[t][r][v]` (2 replicas, 4 steps, 2 variables of `shapes`) must hold
  the non-finite entry at step 2 only; default: a NaN in variable 1 of
  replica 1. Neither replica's state may move (replica 0 must not run
  ahead), and the next finite step proceeds normally.
  """
  replicas = 2
  if grads is None:
    grads = gradients(4, replicas, seed=4, shapes=shapes)
    grads[2][1][1][3] = np.nan
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(replicas)],
                           input_replication=tf_dct.PER_REPLICA)
  compressor.bind(repl)
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(tuple(
        np.stack([g[replica_id][v] for g in grads]) for v in range(2)))

  def step_fn(g):
    return [a for a, _ in compressor.aggregate(list(zip(g, variables)))]

  repl.run(step_fn, input_fn)
  repl.run(step_fn, input_fn)
  before = [compressor.state_values(v) for v in variables]
  test.assertTrue(np.any(before[0]["residual"][0] != 0))
  with test.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
    repl.run(step_fn, input_fn)
  for want, v in zip(before, variables):
    after = compressor.state_values(v)
    test.assertEqual(set(after), set(want))
    for key, value in after.items():
      test.assertAllEqual(value, want[key], msg=key)
  repl.run(step_fn, input_fn)
  for v in variables:
    test.assertAllEqual(compressor.state_values(v)["step"], [3, 3])


def check_non_finite_xla(test, make, bad=np.inf):
  """Under XLA (which cannot raise) a non-finite step is undone, not applied.

  `make()` returns a fresh compressor (two runs are compared). One replica, `jit_compile=True`; step 2 of 4 holds `bad` in variable 1.
  That step's aggregate is NaN in every variable (as a dense all-reduce
  would be), every state is exactly what it was before the step, and the
  next finite step runs as if step 2 had never come.
  """
  grads = gradients(4, 1, seed=4)
  grads[2][0][1][3] = bad
  repl, step_fn, _, history = run(make(), grads, 1, jit_compile=True)
  test.assertTrue(jit_step_compiled(repl, step_fn))
  (_, before), (out, after), (_, later) = history[1], history[2], history[3]
  for v, (want, got) in enumerate(zip(before, after)):
    test.assertTrue(np.all(np.isnan(out[0][v])), msg=f"aggregate of w{v}")
    test.assertTrue(want, msg="the compressor keeps state")
    for key in want:
      test.assertAllEqual(got[key], want[key], msg=f"w{v} {key}")
  # The step after goes on from the state before the bad one, so it equals
  # a run that never saw step 2.
  skipped = [g for t, g in enumerate(grads) if t != 2]
  _, _, _, clean = run(make(), skipped, 1, jit_compile=True)
  out3, clean_out = history[3][0], clean[2][0]
  for v in range(len(SHAPES)):
    test.assertAllClose(out3[0][v], clean_out[0][v], rtol=0, atol=0)
    for key in later[v]:
      test.assertAllEqual(later[v][key], clean[2][1][v][key], msg=f"w{v} {key}")


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
