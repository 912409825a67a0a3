"""Tests for tf_dct.keras: wrap_optimizer with tf-keras and Keras 3."""

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import compression
from tests import util

FLAVOURS = {"tf_keras": tf_keras, "keras3": keras}


def setUpModule():
  util.setup_cpus()


def _data(n=32):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 5)).astype(np.float32)
  y = (x @ rng.normal(size=(5, 1)) + 0.1).astype(np.float32)
  return x, y


def _model(k, seed=7):
  rng = np.random.default_rng(seed)
  model = k.Sequential([k.Input((5,)), k.layers.Dense(4, activation="relu"),
                        k.layers.Dense(1)])
  model.set_weights([rng.normal(size=w.shape).astype(np.float32) * 0.3
                     for w in model.get_weights()])
  return model


class RecordingCompressor(compression.Compressor):
  """Dense SUM that also accumulates each replica's own gradients in state.

  Exercises the seam's per-replica state the way error feedback will.
  """

  def create_state(self, variable):
    return {"seen": self.per_replica_state(
        tf.zeros(variable.shape, variable.dtype), name=f"seen_{variable.name.split(':')[0]}")}

  def reduce(self, ctx, grads, variables, states):
    for grad, state in zip(grads, states):
      state["seen"].local().assign_add(grad)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


class WrapOptimizerTest(tf.test.TestCase, parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.devices = [f"/cpu:{i}" for i in range(util.NUM_CPUS)]
    cls.builtin = util.builtin_mirrored(cls.devices)

  def _fit(self, k, strategy, wrap):
    x, y = _data()
    with strategy.scope():
      model = _model(k)
      opt = k.optimizers.SGD(0.05)
      if wrap:
        opt = strategy.wrap_optimizer(opt)
      model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()

  @parameterized.parameters("tf_keras", "keras3")
  def test_fit_matches_builtin(self, flavour):
    k = FLAVOURS[flavour]
    ours = self._fit(k, tf_dct.Replicator(self.devices), wrap=True)
    want = self._fit(k, self.builtin, wrap=False)
    for got, ref in zip(ours, want):
      self.assertAllEqual(got, ref)
    self.assertNotAllClose(ours[0], _model(k).get_weights()[0])

  def _custom_loop(self, k, strategy, wrap, compressor=None, steps=3):
    x, y = _data()
    with strategy.scope():
      model = _model(k)
      opt = k.optimizers.SGD(0.05)
      if wrap:
        opt = strategy.wrap_optimizer(opt, compression=compressor)

    step_fn = util.squared_error_step(model, opt, 8)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    dist = iter(strategy.experimental_distribute_dataset(ds))
    step = tf.function(lambda b: strategy.run(step_fn, args=(b,)))
    for _ in range(steps):
      step(next(dist))
    return model, opt

  @parameterized.parameters("tf_keras", "keras3")
  def test_custom_loop_matches_builtin(self, flavour):
    k = FLAVOURS[flavour]
    ours, _ = self._custom_loop(k, tf_dct.Replicator(self.devices), wrap=True)
    want, _ = self._custom_loop(k, self.builtin, wrap=False)
    for got, ref in zip(ours.get_weights(), want.get_weights()):
      self.assertAllEqual(got, ref)

  @parameterized.parameters("tf_keras", "keras3")
  def test_per_replica_state_through_optimizer_checkpoint(self, flavour):
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices)
    compressor = RecordingCompressor()
    model, opt = self._custom_loop(k, repl, wrap=True, compressor=compressor, steps=2)
    states = [s["seen"] for s in compressor.state.values()]
    self.assertLen(states, 4)
    before = [s.numpy() for s in states]
    # Replicas saw different data, so their states differ (not one mirrored value).
    self.assertNotAllClose(before[0][0], before[0][1])
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(self.create_tempdir().full_path + "/ckpt")
    for s in states:
      s.assign_all([np.full(v.shape, 99.0, v.dtype) for v in s.numpy()])
    ckpt.restore(path).assert_existing_objects_matched()
    for want, s in zip(before, states):
      for w, got in zip(want, s.numpy()):
        self.assertAllEqual(got, w)
    # The checkpoint holds one key per replica for every variable's state
    # (besides the statistics, under accounting/).
    keys = [name for name, _ in tf.train.list_variables(path)]
    for r in range(4):
      self.assertLen([n for n in keys if "_tf_dct_compressor/state/" in n
                      and f"/replica_{r}/" in n], 4)

  @parameterized.parameters("tf_keras", "keras3")
  def test_wrapped_optimizer_keeps_identity(self, flavour):
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices)
    with repl.scope():
      opt = k.optimizers.Adam(0.01)
      wrapped = repl.wrap_optimizer(opt)
    self.assertIs(wrapped, opt)
    self.assertIsInstance(wrapped, k.optimizers.Adam)
    self.assertEqual(type(wrapped).__name__, "Adam")
    config = k.optimizers.serialize(wrapped)
    self.assertIsInstance(k.optimizers.deserialize(config), k.optimizers.Adam)

  @parameterized.parameters("tf_keras", "keras3")
  def test_stats_and_state_lookup(self, flavour):
    k = FLAVOURS[flavour]
    compressor = compression.DCTDP(sparsity=0.5, threshold_life=2,
                                   dense_gradients="compress")
    model, opt = self._custom_loop(k, tf_dct.Replicator(self.devices),
                                   wrap=True, compressor=compressor, steps=2)
    stats = opt.communication_stats()
    self.assertEqual(stats, compressor.communication_stats())
    self.assertEqual(stats, tf_dct.keras.communication_stats(opt))
    self.assertEqual(stats["steps"], [2] * 4)
    # The model's own variables (Keras 3: keras.Variable) look up the state
    # the aggregation keyed by the backing tf.Variable.
    for v in model.trainable_variables:
      backing = getattr(v, "value", v) if flavour == "keras3" else v
      got, want = compressor.state_values(v), compressor.state_values(backing)
      self.assertEqual(sorted(got), sorted(want))
      self.assertEqual(list(want["step"]), [2] * 4)
      for key in want:
        self.assertAllEqual(got[key], want[key])
      self.assertIs(compressor.state_for(v), compressor.state_for(backing))
      self.assertFalse(compressor.sends_as_is(v))
    self.assertLen(stats["variables"], 4)
    self.assertTrue(all(b > 0 for b in stats["total"]["bytes_sent"]))
    # The default (dense) aggregation reports too: density 1.
    _, dense_opt = self._custom_loop(k, tf_dct.Replicator(self.devices),
                                     wrap=True, steps=1)
    dense = dense_opt.communication_stats()["last"]
    self.assertEqual(dense["density"], [1.0] * 4)
    self.assertEqual(dense["bytes_sent"], dense["dense_bytes"])

  @parameterized.parameters("tf_keras", "keras3")
  def test_build_creates_compressor_state_so_the_step_traces_once(self, flavour):
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices, input_replication=tf_dct.PER_REPLICA)
    compressor = compression.DCTDP(sparsity=0.5, threshold_life=2)
    with repl.scope():
      model = _model(k)
      opt = repl.wrap_optimizer(k.optimizers.SGD(0.05), compression=compressor)
    opt.build(model.trainable_variables)
    self.assertLen(compressor.state, 4)  # before any step
    self.assertEqual(compressor.communication_stats()["steps"], [0] * 4)
    traces = []
    x, y = _data()

    def input_fn(replica_id):
      del replica_id
      return tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()

    # A Python side effect: runs once per trace.
    step_fn = util.squared_error_step(model, opt, 8, lambda: traces.append(1))

    for _ in range(2):
      repl.run(step_fn, input_fn)
    # One trace per replica (MirroredStrategy calls step_fn once per replica
    # while tracing); without build() variables made inside the first trace
    # force a second one.
    self.assertLen(traces, 4)
    self.assertEqual(compressor.communication_stats()["steps"], [2] * 4)

  @parameterized.parameters("tf_keras", "keras3")
  def test_slots_built_outside_the_scope_are_per_replica(self, flavour):
    # Building after the `with` block must still give each replica its own
    # copy of Adam's moments: one shared variable would be updated by every
    # replica in turn (moments advanced num_replicas times a step, replicas'
    # weights drifting apart).
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices)
    with repl.scope():
      model = _model(k)
      opt = repl.wrap_optimizer(k.optimizers.Adam(0.05))
    opt.build(model.trainable_variables)
    x, y = _data()

    step_fn = util.squared_error_step(model, opt, 32)

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    input_fn = lambda ctx: data
    for _ in range(3):
      repl.run(step_fn, input_fn)
    for w in model.trainable_variables:
      w = getattr(w, "value", w) if flavour == "keras3" else w
      copies = [c.numpy() for c in w.values]
      self.assertLen(copies, len(self.devices))
      for c in copies[1:]:
        self.assertAllEqual(c, copies[0])
    # The same steps under the built-in strategy, its optimizer built in scope.
    with self.builtin.scope():
      ref_model = _model(k)
      ref_opt = k.optimizers.Adam(0.05)
      ref_opt.build(ref_model.trainable_variables)

    def ref_step(xb, yb):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(ref_model(xb) - yb)) / 32.0
      grads = tape.gradient(loss, ref_model.trainable_variables)
      ref_opt.apply_gradients(zip(grads, ref_model.trainable_variables))

    dist = iter(self.builtin.experimental_distribute_dataset(data))
    run = tf.function(lambda b: self.builtin.run(ref_step, args=b))
    for _ in range(3):
      run(next(dist))
    for ours, ref in zip(model.get_weights(), ref_model.get_weights()):
      self.assertAllClose(ours, ref, rtol=1e-5, atol=1e-6)

  def test_errors(self):
    repl = tf_dct.Replicator(self.devices)
    with repl.scope():
      with self.assertRaisesRegex(TypeError, "legacy OptimizerV2"):
        repl.wrap_optimizer(tf_keras.optimizers.legacy.SGD(0.1))
      with self.assertRaisesRegex(TypeError, "optimizer must be a tf-keras"):
        repl.wrap_optimizer(object())
      with self.assertRaisesRegex(TypeError, "compression must be a tf_dct.compression.Compressor"):
        repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1), compression="dct")
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1))
      with self.assertRaisesRegex(ValueError, "already wrapped"):
        repl.wrap_optimizer(opt)
      shared = compression.Dense()
      repl.wrap_optimizer(keras.optimizers.SGD(0.1), compression=shared)
      with self.assertRaisesRegex(ValueError, "already bound to another replicator"):
        tf_dct.Replicator(self.devices).wrap_optimizer(keras.optimizers.SGD(0.1),
                                                       compression=shared)


  @parameterized.parameters("tf_keras", "keras3")
  def test_compression_must_be_an_instance_of_its_own(self, flavour):
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices)
    with repl.scope():
      opt = k.optimizers.SGD(0.1, momentum=0.9)
      with self.assertRaisesRegex(TypeError, r"compression must be a Compressor "
                                  r"instance, e.g. DCTDP\(\), got the class DCTDP"):
        repl.wrap_optimizer(opt, compression=compression.DCTDP)
      self.assertFalse(tf_dct.keras.is_wrapped(opt))
      shared = compression.DCTDP()
      repl.wrap_optimizer(k.optimizers.SGD(0.1), compression=shared)
      self.assertEqual(shared.momentum, 0.0)
      with self.assertRaisesRegex(
          ValueError, r"compression: this DCTDP already aggregates for another "
          r"optimizer; create one compressor per wrapped optimizer \(e.g. "
          r"DCTDP\(\) for each\)"):
        repl.wrap_optimizer(opt, compression=shared)
      # Nothing changed: the second optimizer is not wrapped and its momentum
      # did not reach the compressor.
      self.assertFalse(tf_dct.keras.is_wrapped(opt))
      self.assertEqual(shared.momentum, 0.0)

  @parameterized.parameters("tf_keras", "keras3")
  def test_rejected_step_moves_nothing(self, flavour):
    # A NaN gradient is rejected by the compressor: the step raises, and no
    # weight, no Adam slot, no compressor state and not `iterations` moves
    # (Adam's bias correction counts optimizer steps).
    k = FLAVOURS[flavour]
    repl = tf_dct.Replicator(self.devices[:2])
    with repl.scope():
      model = _model(k)
      opt = repl.wrap_optimizer(k.optimizers.Adam(0.1), compression=(
          compression.DCTDP(0.5, min_count=0, dense_gradients="compress")))
      opt.build(model.trainable_variables)
    poison = tf.Variable(0.0)
    x, _ = _data(8)

    def input_fn(ctx):
      del ctx
      return tf.data.Dataset.from_tensor_slices(x).repeat().batch(4)

    def step_fn(batch):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(batch)) * (1.0 + poison)
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    def snapshot():
      return ([v.numpy() for v in model.weights],
              [np.asarray(v.numpy()) for v in opt.variables],
              [np.asarray(a) for v in model.trainable_variables
               for a in opt._tf_dct_compressor.state_values(v).values()])  # pylint: disable=protected-access

    repl.run(step_fn, input_fn)  # a good step
    self.assertEqual(int(opt.iterations.numpy()), 1)
    before = snapshot()
    poison.assign(float("nan"))
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "DCTDP: non-finite gradient"):
      repl.run(step_fn, input_fn)
    self.assertEqual(int(opt.iterations.numpy()), 1)
    for got, want in zip(snapshot(), before):
      self.assertLen(got, len(want))
      for a, b in zip(got, want):
        self.assertAllEqual(a, b)
    poison.assign(0.0)
    repl.run(step_fn, input_fn)
    self.assertEqual(int(opt.iterations.numpy()), 2)


if __name__ == "__main__":
  tf.test.main()
