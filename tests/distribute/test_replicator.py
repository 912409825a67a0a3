"""Tests for tf_dct.distribute.replicator: run(step_fn, input_fn), logical_device,
paper examples; what every replicator kind shares runs on each
(`replicator_test_utils.named_replicators`)."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tests import util
from tests.distribute import replicator_test_utils


def setUpModule():
  util.setup_cpus()


def _rows(n, width=3):
  return np.arange(n * width, dtype=np.float32).reshape(n, width)


class InputReplicationTest(parameterized.TestCase, tf.test.TestCase):
  """`run(step_fn, input_fn)` feeds every replicator kind alike."""

  @parameterized.named_parameters(*replicator_test_utils.named_replicators())
  def test_per_worker_dataset_is_split_on_batch_and_advances(self, make_replicator):
    repl = make_replicator()
    n = repl.num_replicas_in_sync
    data = _rows(4 * n)
    ds = tf.data.Dataset.from_tensor_slices(data).batch(2 * n)
    input_fn = lambda ctx: ds
    traces = []

    def step_fn(x):
      traces.append(1)
      return x

    first = util.local(repl, repl.run(step_fn, input_fn))
    second = util.local(repl, repl.run(step_fn, input_fn))
    for r in range(n):
      self.assertAllEqual(first[r], data[2 * r:2 * r + 2])
      self.assertAllEqual(second[r], data[2 * n + 2 * r:2 * n + 2 * r + 2])
    self.assertLen(traces, n)  # traced once (one trace per replica), then cached
    with self.assertRaises(tf.errors.OutOfRangeError):
      repl.run(step_fn, input_fn)

  @parameterized.named_parameters(*replicator_test_utils.named_replicators())
  def test_per_replica_input_fn_called_once_per_replica(self, make_replicator):
    repl = make_replicator(input_replication=tf_dct.PER_REPLICA)
    n = repl.num_replicas_in_sync
    calls = []

    def input_fn(replica_id):
      calls.append(replica_id)
      return tf.data.Dataset.from_tensors(
          {"id": tf.constant([replica_id])}).repeat()

    out = util.local(repl, repl.run(lambda x: x["id"] * 10, input_fn))
    self.assertEqual(calls, list(range(n)))
    self.assertEqual([o.tolist() for o in out], [[10 * r] for r in range(n)])


class RunTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    self.repl = tf_dct.Replicator()

  def test_is_a_builtin_strategy(self):
    self.assertIsInstance(self.repl, tf.distribute.MirroredStrategy)
    self.assertEqual(self.repl.num_replicas, 4)

  def test_recreated_input_fn_warns(self):
    ds = tf.data.Dataset.from_tensor_slices(_rows(16)).batch(8)
    step_fn = lambda x: x
    make_input_fn = lambda: (lambda ctx: ds)  # a new object, same code, per call
    self.repl.run(step_fn, make_input_fn())
    with self.assertWarnsRegex(UserWarning, "same code as one used before"):
      self.repl.run(step_fn, make_input_fn())

  def test_input_fn_gets_an_input_context(self):
    seen = []

    def input_fn(ctx):
      seen.append(ctx)
      return tf.data.Dataset.from_tensor_slices(_rows(8)).batch(4)

    self.repl.run(lambda x: x, input_fn)
    self.assertLen(seen, 1)
    self.assertIsInstance(seen[0], tf.distribute.InputContext)
    self.assertEqual(seen[0].num_replicas_in_sync, 4)
    self.assertEqual(seen[0].get_per_replica_batch_size(8), 2)

  def test_callable_source_and_nested_structure(self):
    counter = tf.Variable(0.0)

    def input_fn(ctx):
      del ctx
      def next_batch():
        counter.assign_add(1.0)
        return (tf.fill([4, 2], counter.read_value()), {"y": tf.range(4)})
      return next_batch

    out = util.local(self.repl, self.repl.run(lambda e: (e[0], e[1]["y"]), input_fn))
    for r in range(4):
      self.assertAllEqual(out[r][0], [[1.0, 1.0]])
      self.assertAllEqual(out[r][1], [r])

  def test_failed_step_reads_one_element_on_every_replica(self):
    """Every replica reads its element in a call of its own, before the step.

    An error in the step (replica 1's element is bad at step 1) then cannot
    cancel replica 0's pending read, which would leave replica 0 an element
    behind replica 1 from then on, or end a prefetching iterator early. That
    race is rare, so the step's graph is checked for reads too.
    """
    repl = tf_dct.Replicator(util.setup_cpus()[:2],
                             input_replication=tf_dct.PER_REPLICA)
    steps = 4

    def input_fn(replica_id):
      values = np.ones(steps, np.float32)
      if replica_id == 1:
        values[1] = np.nan
      return tf.data.Dataset.from_tensor_slices(
          (np.arange(steps, dtype=np.float32), values)).prefetch(2)

    def step_fn(element):
      index, value = element
      return index + 0.0 * tf.debugging.check_numerics(value, "bad input")

    self.assertAllEqual(util.local(repl, repl.run(step_fn, input_fn)), [0, 0])
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "bad input"):
      repl.run(step_fn, input_fn)
    for t in (2, 3):
      self.assertAllEqual(util.local(repl, repl.run(step_fn, input_fn)),
                          [t, t], msg=f"step {t}")
    step = repl._steps[(step_fn, input_fn)]  # pylint: disable=protected-access
    self.assertEqual(util.graph_ops(step.read).count("IteratorGetNext"), 2)
    self.assertNotIn("IteratorGetNext", util.graph_ops(step))
    self.assertIn("CheckNumerics", util.graph_ops(step))

  def test_custom_split_fn_time_major(self):
    def split_time_major(element, n):
      return tf.split(element, n, axis=1)  # [time, batch] -> batch pieces

    repl = tf_dct.Replicator(input_split_fn=split_time_major)
    seq = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    input_fn = lambda ctx: tf.data.Dataset.from_tensors(seq)
    out = util.local(repl, repl.run(lambda x: x, input_fn))
    for r in range(4):
      self.assertAllEqual(out[r], seq[:, 2 * r:2 * r + 2])

  def test_standard_signature_unchanged(self):
    x = self.repl.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group)))
    out = self.repl.run(lambda a, b=1.0: a * b, args=(x,), kwargs={"b": 2.0})
    self.assertAllEqual(util.local(self.repl, out), [0.0, 2.0, 4.0, 6.0])

  def test_batch_not_divisible_is_a_clear_error(self):
    static = tf.data.Dataset.from_tensor_slices(_rows(6)).batch(6, drop_remainder=True)
    with self.assertRaisesRegex(ValueError, "batch size 6 does not divide by the 4"):
      self.repl.run(lambda x: x, lambda ctx: static)
    dynamic = tf.data.Dataset.from_tensor_slices(_rows(6)).batch(6)
    with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                "batch size does not divide by the 4 local replicas"):
      self.repl.run(lambda x: x, lambda ctx: dynamic)

  def test_bad_run_arguments(self):
    ds = tf.data.Dataset.range(4)
    with self.assertRaisesRegex(TypeError, "step_fn must be callable"):
      self.repl.run(42, lambda ctx: ds)
    with self.assertRaisesRegex(TypeError, "input_fn must be callable"):
      self.repl.run(lambda x: x, input_fn=ds)
    with self.assertRaisesRegex(TypeError, "got a Dataset"):
      self.repl.run(lambda x: x, ds)
    with self.assertRaisesRegex(TypeError, "input_fn must return a tf.data.Dataset"):
      self.repl.run(lambda x: x, lambda ctx: 3)
    with self.assertRaisesRegex(ValueError, "takes no args"):
      self.repl.run(lambda x: x, input_fn=lambda ctx: ds, kwargs={"a": 1})

  def test_constructor_errors(self):
    devices = [f"/cpu:{i}" for i in range(4)]
    with self.assertRaisesRegex(ValueError, r"devices \(4\) must be divisible by "
                                r"num_devices_per_replica \(3\)"):
      tf_dct.Replicator(devices, num_devices_per_replica=3)
    with self.assertRaisesRegex(ValueError, "num_devices_per_replica must be an int >= 1"):
      tf_dct.Replicator(devices, num_devices_per_replica=0)
    with self.assertRaisesRegex(ValueError, "input_replication must be"):
      tf_dct.Replicator(devices, input_replication="per_worker")
    with self.assertRaisesRegex(TypeError, "input_split_fn must be callable"):
      tf_dct.Replicator(devices, input_split_fn=3)
    with self.assertRaisesRegex(ValueError, r"jit_compile=True needs exactly "
                                r"one device, got 2 \(/cpu:0, /cpu:1\)"):
      tf_dct.Replicator(devices[:2], jit_compile=True)
    with self.assertRaisesRegex(ValueError, "jit_compile=True needs exactly one"):
      tf_dct.Replicator(devices[:2], num_devices_per_replica=2, jit_compile=True)
    tf_dct.Replicator(devices[:1], jit_compile=True)  # one device: allowed

  def test_device_names_are_checked(self):
    with self.assertRaisesRegex(ValueError, r"devices: '/cpu:99' is not a "
                                r"logical device of this process; available: "
                                r".*device:CPU:0, .*device:CPU:3"):
      tf_dct.Replicator(["/cpu:0", "/cpu:99"])
    if not tf.config.list_logical_devices("GPU"):
      with self.assertRaisesRegex(ValueError, r"devices: '/gpu:0' is not a "
                                  r"logical device of this process"):
        tf_dct.Replicator(["/gpu:0"])
    with self.assertRaisesRegex(TypeError, r"devices must be a list of device "
                                r"names, e.g. \['/cpu:0'\], got the string"):
      tf_dct.Replicator("/cpu:0")
    with self.assertRaisesRegex(TypeError, "devices must hold device names"):
      tf_dct.Replicator([0, 1])
    full = tf_dct.Replicator(["/device:CPU:2", "/cpu:3"])
    self.assertLen(full.replica_devices, 2)


class LogicalDeviceTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    self.repl = tf_dct.Replicator(num_devices_per_replica=2)

  def test_placement(self):
    placed = {}

    def step_fn(x):
      rid = self.repl.local_replica_index()
      a = tf.identity(x, name="on_first")
      with self.repl.logical_device(1):
        b = tf.identity(x, name="on_second")
      placed[rid] = (a.device, b.device)
      return b

    self.repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(_rows(2)))
    self.assertEqual(self.repl.num_replicas, 2)
    self.assertIn("CPU:0", placed[0][0])
    self.assertIn("CPU:1", placed[0][1])
    self.assertIn("CPU:2", placed[1][0])
    self.assertIn("CPU:3", placed[1][1])

  def test_errors(self):
    with self.assertRaisesRegex(ValueError, r"logical_device index must be an int in \[0, 2\)"):
      with self.repl.logical_device(2):
        pass
    with self.assertRaisesRegex(RuntimeError, "must be called inside step_fn"):
      with self.repl.scope(), self.repl.logical_device(1):
        pass
    with self.assertRaisesRegex(RuntimeError, "outside a replica of this replicator"):
      with self.repl.logical_device(0):
        pass

    def step_fn(x):
      with self.repl.logical_device(-1):
        return x
    with self.assertRaisesRegex(ValueError, "logical_device index"):
      self.repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(_rows(2)))


def _dense_model(seed, sizes=(4, 3, 1)):
  rng = np.random.default_rng(seed)
  model = tf_keras.Sequential([tf_keras.Input((sizes[0],))] + [
      tf_keras.layers.Dense(n, activation="relu" if i < len(sizes) - 2 else None)
      for i, n in enumerate(sizes[1:])])
  model.set_weights([rng.normal(size=w.shape).astype(np.float32) * 0.5
                     for w in model.get_weights()])
  return model


class PaperExamplesTest(parameterized.TestCase, tf.test.TestCase):
  """The three snippets of TF-Replicator §3.2–3.4, checked against numpy."""

  # Each Keras step costs seconds to trace, so not every kind: "one_device"
  # is one replica as "xla" and "multi_worker_local" are, and
  # test_data_and_model_parallel wraps optimizers on 2 x 2 devices.
  @parameterized.named_parameters(*replicator_test_utils.named_replicators(
      "four_devices", "xla", "multi_worker_local"))
  def test_multi_optimizer_step(self, make_replicator):
    # §3.2: two losses, two optimizers in one step_fn (D4PG-style critic/actor),
    # each wrapped by wrap_optimizer.
    repl = make_replicator()
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(8, 4)).astype(np.float32)
    target = rng.normal(size=(8, 1)).astype(np.float32)
    with repl.scope():
      critic, actor = _dense_model(1), _dense_model(2)
      critic_opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1))
      actor_opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.05))
    ref_critic, ref_actor = _dense_model(1), _dense_model(2)
    global_batch = 8

    def losses(c, a, o, t):
      critic_loss = tf.reduce_sum(tf.square(c(o) - t)) / global_batch
      actor_loss = tf.reduce_sum(tf.square(a(o) - tf.stop_gradient(c(o)))) / global_batch
      return critic_loss, actor_loss

    def step_fn(batch):
      o, t = batch
      with tf.GradientTape(persistent=True) as tape:
        critic_loss, actor_loss = losses(critic, actor, o, t)
      critic_opt.apply_gradients(zip(tape.gradient(critic_loss, critic.trainable_variables),
                                     critic.trainable_variables))
      actor_opt.apply_gradients(zip(tape.gradient(actor_loss, actor.trainable_variables),
                                    actor.trainable_variables))
      return critic_loss, actor_loss

    input_fn = lambda ctx: tf.data.Dataset.from_tensors((obs, target))
    per_replica = repl.run(step_fn, input_fn)
    if repl.jit_compile:  # an op XLA cannot compile fails the step
      step = repl._steps[(step_fn, input_fn)]  # pylint: disable=protected-access
      self.assertTrue(step.replicated_step._jit_compile)  # pylint: disable=protected-access
    total_critic = repl.reduce("sum", per_replica[0], axis=None)

    with tf.GradientTape(persistent=True) as tape:
      ref_cl, ref_al = losses(ref_critic, ref_actor, obs, target)
    for loss, model, lr in ((ref_cl, ref_critic, 0.1), (ref_al, ref_actor, 0.05)):
      for g, v in zip(tape.gradient(loss, model.trainable_variables),
                      model.trainable_variables):
        v.assign_sub(lr * g)
    self.assertAllClose(total_critic, ref_cl, rtol=1e-5)
    for got, want in zip(critic.get_weights() + actor.get_weights(),
                         ref_critic.get_weights() + ref_actor.get_weights()):
      self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(*replicator_test_utils.named_replicators())
  def test_cross_replica_batch_norm(self, make_replicator):
    # §3.4: batch norm over the global batch through all_sum.
    repl = make_replicator()
    h = np.random.default_rng(3).normal(size=(8, 5)).astype(np.float32)

    def batch_norm(x):
      mean = repl.all_sum(tf.reduce_mean(x, axis=0) / repl.num_replicas)
      mean_sq = repl.all_sum(tf.reduce_mean(x ** 2, axis=0) / repl.num_replicas)
      return (x - mean) / tf.sqrt(mean_sq - mean ** 2)

    out = util.local(repl, repl.run(batch_norm, lambda ctx: tf.data.Dataset.from_tensors(h)))
    want = (h - h.mean(0)) / h.std(0)
    self.assertAllClose(np.concatenate(out), want, rtol=1e-4, atol=1e-5)

  def test_data_and_model_parallel(self):
    # §3.3: 2 data-parallel replicas of a 2-device model-parallel replica.
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    x = np.random.default_rng(4).normal(size=(4, 4)).astype(np.float32)
    y = np.random.default_rng(5).normal(size=(4, 1)).astype(np.float32)
    with repl.scope():
      model = _dense_model(6)
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.1))
    ref = _dense_model(6)
    first, second = model.layers
    devices = []

    def step_fn(batch):
      xb, yb = batch
      with tf.GradientTape() as tape:
        h = first(xb)                       # logical device 0
        with repl.logical_device(1):
          out = second(h)                   # logical device 1
          devices.append(out.device)
          loss = tf.reduce_sum(tf.square(out - yb)) / 4
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors((x, y)))
    self.assertTrue(any("CPU:1" in d for d in devices))
    self.assertTrue(any("CPU:3" in d for d in devices))
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(ref(x) - y)) / 4
    for g, v in zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables):
      v.assign_sub(0.1 * g)
    for got, want in zip(model.get_weights(), ref.get_weights()):
      self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  tf.test.main()
