"""Hybrid DP+MP: DCTSplit across logical devices 0 -> 1 inside each of 2
replicas, DCT-DP across the replicas (DCT §3.1 Table 3 setting, 4 logical CPUs)."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from tf_dct import dct_mp as layers
from tf_dct.compression import DCTDP
from tests import util



def setUpModule():
  util.setup_cpus()


class HybridTest(tf.test.TestCase):

  def test_dct_mp_inside_replicas_dct_dp_across(self):
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    global_batch = 16
    with repl.scope():
      tf_keras.utils.set_random_seed(0)
      first = tf_keras.layers.Dense(32, activation="relu")
      split = layers.DCTSplit(0.9, target_logical_device=1)
      second = tf_keras.layers.Dense(1)
      first.build((None, 8))
      split.build((None, 32))
      second.build((None, 32))
      compression = DCTDP(0.9, threshold_life=2)
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.05),
                                compression=compression)
    variables = first.trainable_variables + second.trainable_variables

    rng = np.random.default_rng(1)
    x = rng.normal(size=(global_batch, 8)).astype(np.float32)
    y = np.sin(x[:, :1] + x[:, 1:2]).astype(np.float32)
    # The same batch every step, so the loss curve is not batch noise.
    input_fn = lambda ctx: tf.data.Dataset.from_tensors((x, y)).repeat()
    placed = {}

    def step_fn(batch):
      features, target = batch
      with tf.GradientTape() as tape:
        h = split(first(features), training=True)   # computed on device 0
        with repl.logical_device(1):
          out = second(h)
          loss = tf.reduce_sum(tf.square(out - target)) / global_batch
      placed[repl.local_replica_index()] = h.device
      grads = tape.gradient(loss, variables)
      opt.apply_gradients(zip(grads, variables))
      return loss

    losses = []
    for _ in range(30):
      losses.append(float(repl.reduce("sum", repl.run(step_fn, input_fn), axis=None)))
    self.assertTrue(np.all(np.isfinite(losses)), losses)
    self.assertLess(np.mean(losses[-5:]), 0.5 * np.mean(losses[:5]), losses)
    self.assertIn("CPU:1", placed[0])
    self.assertIn("CPU:3", placed[1])
    stats = split.bytes_stats()  # per replica: 8 rows x k = 4 of 32
    self.assertEqual(stats["forward_bytes"], 8 * 4 * (4 + 1))
    self.assertEqual(stats["calls"], 30)


if __name__ == "__main__":
  tf.test.main()
