"""Phases: a dense warm-up and the compressed steps as separately traced steps."""

from __future__ import annotations

import collections
import os
import tempfile
from unittest import mock

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tf_dct import keras as dct_keras
from tests import util
from tests.compression import harness
from tests.compression import reference

DCTDP = harness.compress_all(compression.DCTDP)
TopK = harness.compress_all(compression.TopK)
DEFT = harness.compress_all(compression.DEFT)


def setUpModule():
  util.setup_cpus()


WARMUP = 2
COMPRESSORS = (
    ("dct_dp", lambda: DCTDP(0.8, threshold_life=2, min_count=0,
                                         warmup_steps=WARMUP)),
    ("dct_dp_stock", lambda: DCTDP(
        0.8, threshold_life=2, min_count=0, warmup_steps=WARMUP, native=False)),
    ("topk", lambda: TopK(0.2, min_count=0, warmup_steps=WARMUP)),
)


def _collectives(compressor, phase):
  """(dense all-reduce ops in the traced graph, all_gather calls, all_reduce
  calls) of one step of `compressor` on 2 replicas, traced in `phase`."""
  repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
  compressor.bind(repl)
  with repl.scope():
    variables = [tf.Variable(tf.zeros(s), name=f"w{i}")
                 for i, s in enumerate(harness.SHAPES)]
  grads = [tf.ones(s) for s in harness.SHAPES]

  # Without autograph, as `wrap_optimizer` traces a compressor (the
  # collectives are the same; the trace is shorter).
  @tf.function(autograph=False)
  def step():
    return repl.run(lambda: [a for a, _ in compressor.aggregate(
        list(zip(grads, variables)))])

  calls = collections.Counter()
  originals = {name: getattr(tf.distribute.ReplicaContext, name)
               for name in ("all_gather", "all_reduce")}

  def spy(name):
    def call(ctx, *args, **kwargs):
      calls[name] += 1
      return originals[name](ctx, *args, **kwargs)
    return call

  compressor.phase = phase
  try:
    with mock.patch.object(tf.distribute.ReplicaContext, "all_gather",
                           spy("all_gather")), \
         mock.patch.object(tf.distribute.ReplicaContext, "all_reduce",
                           spy("all_reduce")):
      ops = util.graph_ops(step)
  finally:
    compressor.phase = None
  reduce_ops = ops.count("CollectiveReduceV2")
  return reduce_ops, calls["all_gather"], calls["all_reduce"]


class PhasesTest(tf.test.TestCase, parameterized.TestCase):

  def test_phase_of_a_step(self):
    comp = DCTDP(warmup_steps=3)
    self.assertEqual(comp.phase_starts(), (0, 3))
    self.assertEqual([comp.phase_for(s) for s in (0, 2, 3, 100)], [0, 0, 1, 1])
    self.assertTrue(comp.phase_is_dense(0))
    self.assertFalse(comp.phase_is_dense(1))
    with comp.in_phase(5) as key:
      self.assertEqual((key, comp.phase), (1, 1))
    self.assertIsNone(comp.phase)
    single = TopK(0.1)
    self.assertEqual(single.phase_starts(), (0,))
    with single.in_phase(0) as key:
      self.assertIsNone(key)
      self.assertIsNone(single.phase)

  @parameterized.named_parameters(*COMPRESSORS)
  def test_each_phase_issues_only_its_collectives(self, make):
    # Traced without a phase, a step issues the dense all-reduce of the
    # warm-up and the sparse exchange (2 replicas: every call twice).
    reduce_ops, gathers, reduces = _collectives(make(), None)
    self.assertEqual((gathers, reduces), (2, 2))
    self.assertEqual(reduce_ops, 2)
    # The dense phase: the all-reduce only; the compressed: the exchange only.
    self.assertEqual(_collectives(make(), 0), (2, 0, 2))
    self.assertEqual(_collectives(make(), 1), (0, 2, 0))

  @parameterized.parameters(True, False)
  def test_mixing_driven_and_undriven_steps_is_refused(self, driven_first):
    # A driven run counts steps per phase, an undriven one decides the
    # phase from its own counter: mixing them would repeat the warm-up.
    comp = DCTDP(0.8, warmup_steps=WARMUP)
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    comp.bind(repl)
    with repl.scope():
      v = tf.Variable(tf.zeros([4, 3]), name="w")

    def trace(driven):
      step = tf.function(lambda: repl.run(
          lambda: comp.aggregate([(tf.ones([4, 3]), v)])[0][0]))
      if not driven:
        return step.get_concrete_function()
      with comp.in_phase(0):
        return step.get_concrete_function()

    trace(driven_first)
    first, then = (("with a phase driver", "without one") if driven_first
                   else ("without one", "with a phase driver"))
    with self.assertRaisesRegex(
        ValueError, f"DCTDP: steps were traced {first} and now {then}; with "
        "warmup_steps or a schedule"):
      trace(not driven_first)
    self.assertEqual(list(comp.state_values(v)["step"]), [0, 0])
    # Without phases there is nothing to mix.
    plain = DCTDP(0.8)
    plain.bind(repl)
    plain._check_driven()  # pylint: disable=protected-access
    plain.phase = 0
    plain._check_driven()  # pylint: disable=protected-access

  def test_deft_phases(self):
    make = lambda: DEFT(0.2, warmup_steps=WARMUP, budget="norm")
    # DEFT's exchange is three all-reduces (norms, union, values); the int32
    # union is summed without a collective op between local devices.
    self.assertEqual(_collectives(make(), None), (6, 0, 8))
    self.assertEqual(_collectives(make(), 0), (2, 0, 2))
    self.assertEqual(_collectives(make(), 1), (4, 0, 6))
    # Split by size (the default), the budget needs no norms.
    make = lambda: DEFT(0.2, warmup_steps=WARMUP)
    self.assertEqual(_collectives(make(), None), (4, 0, 6))
    self.assertEqual(_collectives(make(), 0), (2, 0, 2))
    self.assertEqual(_collectives(make(), 1), (2, 0, 4))

  @parameterized.named_parameters(*COMPRESSORS)
  def test_driven_phases_send_what_the_in_graph_warmup_sends(self, make):
    # Same aggregates and residuals at every step, across the switch.
    grads = harness.continuous_gradients(6, 2, seed=4)
    _, _, _, graph_history = harness.run(make(), grads, 2)
    _, _, _, driven_history = harness.run(make(), grads, 2, phases=True)
    for t, ((out_a, st_a), (out_b, st_b)) in enumerate(
        zip(graph_history, driven_history)):
      for r in range(2):
        for v in range(len(harness.SHAPES)):
          self.assertAllEqual(out_a[r][v], out_b[r][v], msg=f"step {t}")
          self.assertAllEqual(st_a[v]["residual"][r], st_b[v]["residual"][r],
                              msg=f"step {t}")

  def test_under_xla_each_phase_is_its_own_program(self):
    # One replica (TF cannot XLA-compile multi-replica CPU collectives).
    grads = harness.continuous_gradients(5, 1, seed=2)
    make = COMPRESSORS[1][1]
    _, _, _, graph_history = harness.run(make(), grads, 1, jit_compile=True)
    repl, _, _, driven_history = harness.run(make(), grads, 1, jit_compile=True,
                                             phases=True)
    self.assertLen(repl._steps, 2)  # pylint: disable=protected-access
    for (out_a, st_a), (out_b, st_b) in zip(graph_history, driven_history):
      for v in range(len(harness.SHAPES)):
        self.assertAllClose(out_a[0][v], out_b[0][v], atol=1e-6, rtol=1e-6)
        self.assertAllClose(st_a[v]["residual"][0], st_b[v]["residual"][0],
                            atol=1e-6, rtol=1e-6)

  @parameterized.named_parameters(
      *COMPRESSORS,
      ("deft", lambda: DEFT(0.2, warmup_steps=WARMUP)))
  def test_error_feedback_conserves_across_the_switch(self, make):
    # sum of the aggregates + sum_r E_r == sum of every gradient fed in.
    grads = harness.continuous_gradients(6, 2, seed=8)
    _, _, _, history = harness.run(make(), grads, 2, phases=True)
    for v, shape in enumerate(harness.SHAPES):
      fed = sum(np.asarray(g[v], np.float64) for step in grads for g in step)
      sent = sum(np.asarray(out[0][v], np.float64) for out, _ in history)
      held = sum(np.asarray(e, np.float64)
                 for e in history[-1][1][v]["residual"])
      self.assertAllClose(sent + held, fed, atol=1e-5, rtol=0)
      for t in range(WARMUP):  # nothing is held back in the dense phase
        self.assertAllEqual(history[t][1][v]["residual"][0], np.zeros(shape))


class SparsityScheduleTest(tf.test.TestCase, parameterized.TestCase):

  def test_phases_of_a_schedule(self):
    comp = DCTDP(0.99, warmup_steps=3,
                             sparsity_schedule=[(4, 0.75), (5, 0.9375)])
    self.assertEqual(comp.phase_starts(), (0, 3, 7, 12))
    self.assertEqual([comp.phase_is_dense(p) for p in range(4)],
                     [True, False, False, False])
    sparsities = []
    for step in (0, 3, 6, 7, 12, 1000):
      with comp.in_phase(step):
        sparsities.append(comp._phase_sparsity())  # pylint: disable=protected-access
    self.assertEqual(sparsities, [0.99, 0.75, 0.75, 0.9375, 0.99, 0.99])
    without_warmup = DCTDP(0.99, sparsity_schedule=[(4, 0.75)])
    self.assertEqual(without_warmup.phase_starts(), (0, 4))
    self.assertFalse(without_warmup.phase_is_dense(0))

  @parameterized.named_parameters(("native", None), ("stock", False))
  def test_matches_numpy_reference(self, native):
    # Warm-up, two stages and the final sparsity, each stage starting with a
    # fresh tau; a long threshold life otherwise (no other refresh).
    settings = dict(sparsity=0.9, threshold_life=100, capacity_factor=1.5,
                    warmup_steps=1, sparsity_schedule=((2, 0.5), (2, 0.7)))
    grads = harness.gradients(7, 2, seed=3)
    # float32 values, as the reference sends them
    comp = DCTDP(density_band=None, min_count=0, native=native,
                 value_dtype=None, **settings)
    _, _, _, history = harness.run(comp, grads, 2, phases=True)
    for v in range(len(harness.SHAPES)):
      ref = reference.dct_dp_reference([[g[v] for g in step] for step in grads],
                                       **settings)
      for t, (want, (out, states)) in enumerate(zip(ref, history)):
        for r in range(2):
          self.assertAllClose(out[r][v], want.update, atol=1e-6, rtol=0,
                              msg=f"var {v} step {t}")
          self.assertAllClose(states[v]["residual"][r], want.residuals[r],
                              atol=1e-6, rtol=0, msg=f"var {v} step {t}")

  def test_bad_schedules_are_rejected(self):
    for schedule, pattern in (
        (5, r"sparsity_schedule must be a sequence of pairs \(steps, "
            r"sparsity\), got 5"),
        ("ab", r"sparsity_schedule must be a sequence of pairs"),
        ([(0, 0.5)], r"sparsity_schedule\[0\] steps must be an int >= 1, "
                     r"got 0"),
        ([(3, 0.5), (2, 1.0)], r"sparsity_schedule\[1\] sparsity must be a "
                               r"number in \(0, 1\), got 1.0"),
        ([(3,)], r"sparsity_schedule must be a sequence of pairs")):
      with self.assertRaisesRegex(ValueError, "DCTDP: " + pattern):
        DCTDP(sparsity_schedule=schedule)


class KerasPhasesTest(tf.test.TestCase, parameterized.TestCase):
  """Phases driven by `Replicator.run` and by `fit` with `phase_callback`."""

  def _setup(self, k=tf_keras):
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    with repl.scope():
      k.utils.set_random_seed(0)
      model = k.Sequential([k.Input((4,)), k.layers.Dense(64, activation="tanh"),
                            k.layers.Dense(1)])
      comp = DCTDP(threshold_life=2, warmup_steps=WARMUP,
                               min_count=8)  # 64 would send these layers whole
      opt = repl.wrap_optimizer(k.optimizers.SGD(0.05), compression=comp)
    opt.build(model.trainable_variables)  # state first: the step traces once
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = rng.normal(size=(80, 1)).astype(np.float32)
    dense = sum(v.shape.num_elements() * 4 for v in model.trainable_variables)
    return repl, model, comp, opt, (x, y), dense

  @staticmethod
  def _payload(comp):
    """Bytes replica 0 put on the wire so far."""
    return comp.communication_stats()["total"]["payload_bytes"][0]

  def _step_fn(self, model, opt, traces):
    return util.squared_error_step(
        model, opt, 16,
        lambda: traces.append(opt._tf_dct_compressor.phase))  # pylint: disable=protected-access

  def test_replicator_run_traces_once_per_phase(self):
    repl, model, comp, opt, (x, y), dense = self._setup()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()
    input_fn = lambda ctx: data
    traces = []
    step_fn = self._step_fn(model, opt, traces)
    totals = []
    for _ in range(WARMUP + 3):
      repl.run(step_fn, input_fn)
      totals.append(self._payload(comp))
    self.assertEqual(traces, [0, 0, 1, 1])  # traced per phase, per replica
    per_step = np.diff([0] + totals)
    self.assertAllEqual(per_step[:WARMUP], [dense] * WARMUP)
    self.assertLess(max(per_step[WARMUP:]), dense / 2)
    # Each phase's totals hold its own steps, and together the whole run.
    stats = comp.communication_stats()
    phases = stats["phases"]
    self.assertEqual([(p["start"], p["dense"]) for p in phases],
                     [(0, True), (WARMUP, False)])
    self.assertEqual([p["steps"] for p in phases], [[WARMUP] * 2, [3] * 2])
    self.assertEqual(phases[0]["total"]["payload_bytes"][0], WARMUP * dense)
    self.assertEqual(phases[1]["total"]["payload_bytes"][0],
                     totals[-1] - totals[WARMUP - 1])
    for field in ("payload_bytes", "bytes_sent", "dense_bytes", "nnz"):
      self.assertEqual(sum(p["total"][field][1] for p in phases),
                       stats["total"][field][1], msg=field)
    self.assertEqual(phases[0]["total"]["dense_payload_bytes"][0],
                     phases[0]["total"]["payload_bytes"][0])  # ratio 1 dense

  def test_a_checkpoint_of_the_dense_phase_resumes_across_the_switch(self):
    repl, model, comp, opt, (x, y), _ = self._setup()
    del comp
    data = tf.data.Dataset.from_tensors((x[:16], y[:16])).repeat()  # one batch
    input_fn = lambda ctx: data
    step_fn = self._step_fn(model, opt, [])
    repl.run(step_fn, input_fn)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(os.path.join(tempfile.mkdtemp(), "ckpt"))

    def train():
      weights = []
      for _ in range(4):
        repl.run(step_fn, input_fn)
        weights.append([w.numpy() for w in model.trainable_variables])
      return weights

    first = train()
    ckpt.restore(path)
    self.assertEqual(int(opt.iterations.numpy()), 1)
    for a, b in zip(first, train()):
      for wa, wb in zip(a, b):
        self.assertAllEqual(wa, wb)

  @parameterized.named_parameters(("tf_keras", tf_keras), ("keras3", keras))
  def test_fit_with_the_phase_callback_sends_each_phase_alone(self, k):
    steps = WARMUP + 3
    sent = {}
    for with_callback in (False, True):
      repl, model, comp, opt, (x, y), dense = self._setup(k)
      comp.exact_sizes = True  # a warm-up step's exchange: its header alone
      with repl.scope():
        model.compile(optimizer=opt, loss="mse")
      callbacks = [dct_keras.phase_callback(opt)] if with_callback else []
      model.fit(x[:16 * steps], y[:16 * steps], batch_size=16, epochs=1,
                shuffle=False, verbose=0, callbacks=callbacks)
      self.assertEqual(int(opt.iterations.numpy()), steps)
      self.assertIsNone(comp.phase)
      sent[with_callback] = self._payload(comp)
    # With the callback a dense step sends the all-reduce alone and a
    # compressed step the exchange alone. Traced once, every step all-reduces
    # densely besides its exchange; the exchange of a warm-up step uses no
    # slot, so only its header crosses (the row length, one count per
    # exchanged variable, TensorFlow's length word); the compressed steps
    # select and send the same as with the callback.
    phases = comp.communication_stats()["phases"]  # the callback's run
    self.assertEqual([p["steps"][0] for p in phases], [WARMUP, steps - WARMUP])
    self.assertEqual(phases[0]["total"]["payload_bytes"][0], WARMUP * dense)
    compressed = phases[1]["total"]["payload_bytes"][0]
    self.assertGreater(compressed, 0)
    self.assertLess(compressed / (steps - WARMUP), dense / 2)
    self.assertAllClose(sent[True], WARMUP * dense + compressed, rtol=1e-12,
                        atol=0)
    exchanged = sum(not comp.sends_whole(v) for v in model.trainable_variables)
    header = 4 * (1 + exchanged) + 4
    self.assertAllClose(sent[False],
                        steps * dense + WARMUP * header + compressed,
                        rtol=1e-12, atol=0)

  def test_phase_callback_needs_a_wrapped_optimizer(self):
    with self.assertRaisesRegex(ValueError, "phase_callback: optimizer is not "
                                "wrapped by tf_dct.wrap_optimizer"):
      dct_keras.phase_callback(tf_keras.optimizers.SGD(0.1))


if __name__ == "__main__":
  tf.test.main()
