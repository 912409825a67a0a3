"""Tests for tf_dct.distribute.per_replica_state: distinct values per replica, exact checkpoints."""

import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tests import util


def setUpModule():
  util.setup_cpus()


class PerReplicaStateTest(tf.test.TestCase):

  def setUp(self):
    super().setUp()
    self.repl = tf_dct.Replicator()

  def _state(self):
    with self.repl.scope():  # creatable inside the scope, yet not mirrored
      return self.repl.per_replica_state(
          lambda rid: tf.fill([2, 3], float(rid)), name="residual")

  def test_values_differ_per_replica_and_update_per_replica(self):
    state = self._state()
    self.assertEqual([v.numpy()[0, 0] for v in state.variables_per_replica],
                     [0.0, 1.0, 2.0, 3.0])
    for var, device in zip(state.variables_per_replica, self.repl.replica_devices):
      self.assertEqual(var.device, device)
      self.assertNotIsInstance(var, tf.distribute.DistributedValues)

    def step_fn(x):
      var = state.local()
      var.assign_add(x[0])  # this replica's slice of the batch: [1, 2, 3]
      return var.read_value()

    data = np.arange(4 * 6, dtype=np.float32).reshape(4, 2, 3)
    out = util.local(self.repl, self.repl.run(
        step_fn, lambda ctx: tf.data.Dataset.from_tensors(data)))
    for r in range(4):
      want = r + data[r]
      self.assertAllEqual(out[r], want)
      self.assertAllEqual(state.numpy()[r], want)

  def test_checkpoint_round_trip_is_exact_per_replica(self):
    state = self._state()
    rng = np.random.default_rng(0)
    values = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(4)]
    state.assign_all(values)
    path = tf.train.Checkpoint(state=state).save(self.create_tempdir().full_path + "/c")
    # A fresh state object (as after a restart) restores every replica's own value.
    fresh = self._state()
    tf.train.Checkpoint(state=fresh).restore(path).assert_consumed()
    for want, got in zip(values, fresh.numpy()):
      self.assertAllEqual(got, want)
    names = sorted(n for n, _ in tf.train.list_variables(path) if "replica_" in n)
    self.assertLen(names, 4)

  def test_local_outside_step_fn_is_an_error(self):
    state = self._state()
    with self.assertRaisesRegex(RuntimeError, r"PerReplicaState.local\(\) must be called inside step_fn"):
      with self.repl.scope():
        state.local()

  def test_name_must_be_a_string(self):
    for name in (5, "", None):
      with self.assertRaisesRegex(TypeError, "per_replica_state: name must be "
                                  f"a non-empty string, got {name!r}"):
        self.repl.per_replica_state(0.0, name=name)
    c = compression.Dense()
    c.bind(self.repl)
    with self.assertRaisesRegex(TypeError, "name must be a non-empty string"):
      c.per_replica_state(0.0, name=5)

  def test_assign_all_checks_count(self):
    state = self._state()
    with self.assertRaisesRegex(ValueError, "values must hold 4 entries"):
      state.assign_all([np.zeros((2, 3))] * 3)


if __name__ == "__main__":
  tf.test.main()
