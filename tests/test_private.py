"""Fails loudly when a private TF / Keras API that tf_dct pins has drifted."""

from unittest import mock

import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops as mdi
from tensorflow.python.eager import context

import tf_dct
from tf_dct import _private
from tests import util


def setUpModule():
  util.setup_cpus()


class PrivateApiTest(tf.test.TestCase):

  def test_pinned_apis_exist(self):
    _private.check()

  def test_in_xla_context_sees_jit_compile_and_its_inner_functions(self):
    seen = {}

    def probe(key):
      seen[key] = _private.in_xla_context()
      return tf.constant(0)

    probe("eager")
    tf.function(lambda: probe("graph"))()
    tf.function(lambda: probe("xla"), jit_compile=True)()
    inner = tf.function(lambda: probe("inner"))
    tf.function(lambda: inner(), jit_compile=True)()  # pylint: disable=unnecessary-lambda
    self.assertEqual(seen, {"eager": False, "graph": False, "xla": True,
                            "inner": True})

  def test_each_replicator_has_its_own_collective_keys(self):
    a, b = tf_dct.Replicator(), tf_dct.Replicator()
    base_a = a.extended._collective_keys._group_key  # pylint: disable=protected-access
    base_b = b.extended._collective_keys._group_key  # pylint: disable=protected-access
    self.assertGreater(base_a, 0)
    self.assertNotEqual(base_a, base_b)
    self.assertEqual(tf.distribute.MirroredStrategy._collective_key_base % 100_000, 0)  # pylint: disable=protected-access

  def test_unmirrored_variable_escapes_the_strategy_creator(self):
    repl = tf_dct.Replicator()
    with repl.scope():
      var = _private.unmirrored_variable(1.0, "v", repl.replica_devices[2])
      mirrored = tf.Variable(1.0)
    self.assertNotIsInstance(var, tf.distribute.DistributedValues)
    self.assertIsInstance(mirrored, tf.distribute.DistributedValues)
    self.assertEqual(var.device, repl.replica_devices[2])

  def test_static_replica_id_matches_the_public_one_and_builds_no_op(self):
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    seen = []

    def step():
      ctx = tf.distribute.get_replica_context()
      graph = tf.compat.v1.get_default_graph()
      before = len(graph.get_operations())
      mine = _private.static_replica_id(ctx)
      built = len(graph.get_operations()) - before
      public = tf.get_static_value(ctx.replica_id_in_sync_group)
      seen.append((mine, int(public), built))
      return tf.constant(0)

    tf.function(lambda: repl.run(step))()
    self.assertEqual(sorted(seen), [(0, 0, 0), (1, 1, 0)])

  def test_static_replica_id_of_a_tensor_id(self):
    class Ctx:  # TPU replication keeps the id as a tensor
      def __init__(self, value):
        self._replica_id_in_sync_group = value

    self.assertEqual(_private.static_replica_id(Ctx(tf.constant(3))), 3)

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32)])
    def dynamic(x):
      self.assertIsNone(_private.static_replica_id(Ctx(x)))
      return x

    dynamic(tf.constant(1))

  def test_bounded_coordination_service_is_configured_as_tf_would_and_bounded(self):
    ctx = context.context()
    saved = ctx._coordination_service_config  # pylint: disable=protected-access
    spec = tf.train.ClusterSpec({"chief": ["h:0"], "worker": ["h:1", "h:2"]})
    try:
      ctx._coordination_service_config = None  # pylint: disable=protected-access
      self.assertIsNone(_private.configure_bounded_coordination_service(
          spec, "evaluator", 2.5))   # TF coordinates chief and workers only
      self.assertFalse(_private.coordination_service_configured())
      leader = _private.configure_bounded_coordination_service(spec, "worker", 2.5)
      self.assertEqual(leader, "/job:chief/replica:0/task:0")
      config = ctx.coordination_service
      self.assertEqual(config.service_type, "standalone")
      self.assertEqual(config.service_leader, leader)
      self.assertEqual([(j.name, j.num_tasks) for j in config.coordinated_job_list],
                       [("chief", 1), ("worker", 2)])
      self.assertEqual(config.cluster_register_timeout_in_ms, 2500)
      self.assertTrue(config.cluster_register_with_barrier)
      # Configured once per process, like TF's own strategy does.
      self.assertIsNone(_private.configure_bounded_coordination_service(spec, "worker", 1))
      self.assertEqual(ctx.coordination_service.cluster_register_timeout_in_ms, 2500)
    finally:
      ctx._coordination_service_config = saved  # pylint: disable=protected-access

  def test_per_device_iterators_without_autotune(self):
    _private.per_device_iterators_without_autotune()
    _private.per_device_iterators_without_autotune()   # idempotent
    create = mdi._create_device_dataset  # pylint: disable=protected-access
    self.assertFalse(hasattr(create.__wrapped__, "__wrapped__"))  # wrapped once
    made = []

    def spy(*args, **kwargs):
      made.append(create(*args, **kwargs))
      return made[-1]

    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
    dataset = tf.data.Dataset.range(8).batch(4)
    with mock.patch.object(mdi, "_create_device_dataset", spy):
      got = [util.local(repl, batch)
             for batch in repl.experimental_distribute_dataset(dataset)]
    self.assertLen(made, 2)   # one per device, neither autotuned
    self.assertEqual([d.options().autotune.enabled for d in made], [False] * 2)
    self.assertEqual([[b.tolist() for b in step] for step in got],
                     [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])

  def test_run_independently_takes_a_stateful_op_out_of_program_order(self):
    stamps = {}

    def build(independent):
      first, second = tf.timestamp(), tf.timestamp()
      if independent:
        _private.run_independently(second.op)
      stamps[independent] = (first.op, second.op)
      return second - first

    for independent in (False, True):
      tf.function(lambda i=independent: build(i)).get_concrete_function()
      first, second = stamps[independent]
      # In program order the second waits for the first; independent, not.
      self.assertEqual(first in second.control_inputs, not independent,
                       msg=f"independent={independent}")


if __name__ == "__main__":
  tf.test.main()

