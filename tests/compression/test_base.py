"""tf_dct.compression.base: `exclude` (variables aggregated as they are)."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import compression
from tests import util


def setUpModule():
  util.setup_cpus()


COMPRESSORS = {
    "Dense": compression.Dense,
    "DCTDP": lambda **kw: compression.DCTDP(sparsity=0.8, threshold_life=3, **kw),
    "DEFT": lambda **kw: compression.DEFT(density=0.2, **kw),
    "TopK": lambda **kw: compression.TopK(density=0.2, **kw),
    "CLTK": lambda **kw: compression.CLTK(density=0.2, **kw),
    "HardThreshold": lambda **kw: compression.HardThreshold(0.5, **kw),
}
ROWS, WIDTH, K, N, STEPS, REPLICAS = 6, 3, 4, 40, 3, 2


def _run(make):
  """Feeds an IndexedSlices gradient of `table` and a dense one of `w`.

  Two compressors see the same gradients: one with exclude=("table",) given
  both variables, one without exclude given `w` alone. Returns per step the
  per-replica outputs (table as dense, w with exclude, w alone) and the two
  compressors.
  """
  rng = np.random.default_rng(0)
  ids = rng.integers(0, ROWS, size=(STEPS, REPLICAS, K)).astype(np.int32)
  vals = rng.normal(size=(STEPS, REPLICAS, K, WIDTH)).astype(np.float32)
  dense = rng.normal(size=(STEPS, REPLICAS, N)).astype(np.float32)
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)],
                           input_replication=tf_dct.PER_REPLICA)
  with_exclude, alone = make(exclude=("^table",)), make()
  for c in (with_exclude, alone):
    c.bind(repl)
  with repl.scope():
    table = tf.Variable(tf.zeros([ROWS, WIDTH]), name="table")
    w = tf.Variable(tf.zeros([N]), name="w")

  def input_fn(replica_id):
    return tf.data.Dataset.from_tensor_slices(
        (ids[:, replica_id], vals[:, replica_id], dense[:, replica_id]))

  def step_fn(batch):
    i, v, d = batch
    g = tf.IndexedSlices(v, i, tf.constant([ROWS, WIDTH]))
    (t_out, _), (w_out, _) = with_exclude.aggregate([(g, table), (d, w)])
    ((w_alone, _),) = alone.aggregate([(d, w)])
    return tf.convert_to_tensor(t_out), w_out, w_alone

  history = [util.local(repl, repl.run(step_fn, input_fn)) for _ in range(STEPS)]
  return history, ids, vals, with_exclude, alone, table


class ExcludeTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in COMPRESSORS])
  def test_excluded_variable_is_summed_as_is(self, name):
    history, ids, vals, with_exclude, alone, table = _run(COMPRESSORS[name])
    for t, out in enumerate(history):
      expected = np.zeros([ROWS, WIDTH], np.float32)
      for r in range(REPLICAS):
        np.add.at(expected, ids[t, r], vals[t, r])
      for r in range(REPLICAS):
        table_out, w_out, w_alone = out[r]
        self.assertAllClose(table_out, expected, atol=1e-6, rtol=0)
        # The compressed variable is untouched by the exclusion of the other.
        self.assertAllEqual(w_out, w_alone, msg=f"step {t} replica {r}")
    self.assertEqual(with_exclude.state_for(table), {})
    stats = with_exclude.communication_stats()["variables"]["table"]
    # All-gathered, not densified, as stock TF sends it: the row count, K
    # rows of WIDTH floats and K int32 ids.
    self.assertEqual(stats["last"]["payload_bytes"],
                     [4 + K * WIDTH * 4 + K * 4] * REPLICAS)
    self.assertEqual(stats["last"]["stock_payload_bytes"],
                     stats["last"]["payload_bytes"])
    self.assertNotIn("counters", stats)

  @parameterized.named_parameters(
      ("bare_string", "table"), ("not_a_sequence", 3), ("not_strings", (1,)),
      ("bad_regex", ("(",)))
  def test_bad_exclude(self, exclude):
    for make in COMPRESSORS.values():
      with self.assertRaisesRegex(ValueError, "exclude"):
        make(exclude=exclude)


if __name__ == "__main__":
  tf.test.main()
