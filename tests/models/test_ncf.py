"""Tests for models/ncf.py: NeuMF structure, HR@k, training under a Replicator."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from models import ncf
from models.data import movielens
from tests import util

TINY = {"mf_dim": 8, "mlp_layers": (16, 8)}


def setUpModule():
  util.setup_cpus()


def _reference_hr(scores: np.ndarray, k: int) -> float:
  """HR@k by sorting: the positive (column 0) ranks after every tied negative."""
  hits = []
  for row in scores:
    order = sorted(range(len(row)), key=lambda j: (-row[j], j == 0))
    hits.append(order.index(0) < k)
  return float(np.mean(hits))


class HitRateTest(tf.test.TestCase):

  def test_matches_numpy_reference(self):
    # 4 users x (1 positive + 5 negatives); score = table[user, item]
    table = np.array([[0.9, 0.1, 0.2, 0.3, 0.4, 0.5, 0.0],
                      [0.1, 0.9, 0.8, 0.7, 0.6, 0.5, 0.0],
                      [0.5, 0.5, 0.5, 0.1, 0.0, 0.0, 0.6],
                      [0.3, 0.2, 0.4, 0.6, 0.1, 0.0, 0.35]], np.float32)
    data = movielens.EvalData(np.arange(4, dtype=np.int32),
                              np.array([[0, 1, 2, 3, 4, 5],
                                        [0, 1, 2, 3, 4, 5],
                                        [1, 0, 2, 3, 4, 5],
                                        [6, 0, 1, 2, 3, 4]], np.int32))
    scorer = lambda x: tf.gather_nd(table, tf.stack(x, axis=1))[:, None]
    scores = table[data.users[:, None], data.items]
    for k in (1, 2, 3, 5, 10):
      want = _reference_hr(scores, k)
      self.assertAllClose(ncf.hit_rate_at_k(scorer, data, k=k, batch_size=7), want, msg=k)
    # hand-checked: user 0 ranks 1st, user 1 6th, user 2 3rd (ties lose), user 3 3rd
    self.assertEqual(ncf.hit_rate_at_k(scorer, data, k=1), 0.25)
    self.assertEqual(ncf.hit_rate_at_k(scorer, data, k=3), 0.75)
    self.assertEqual(ncf.hit_rate_at_k(lambda x: tf.zeros_like(x[0], tf.float32), data), 1.0)
    self.assertEqual(ncf.hit_rate_at_k(lambda x: tf.zeros_like(x[0], tf.float32), data, k=5), 0.0)


  def test_ndcg_matches_numpy_reference(self):
    # ranks 0, 5, 2, 2 as in the HR test above; one relevant item per user
    ranks = np.array([0, 5, 2, 2])
    want10 = np.mean([1.0, 1 / np.log2(7.0), 0.5, 0.5])
    self.assertAllClose(ncf.ndcg_at_k(ranks, 10), want10)
    self.assertEqual(ncf.ndcg_at_k(ranks, 3), 0.5)  # the rank-5 user scores 0
    self.assertEqual(ncf.ndcg_at_k(ranks, 1), 0.25)
    self.assertEqual(ncf.ndcg_at_k(np.array([99, 99]), 10), 0.0)
    scores = np.array([[0.9, 0.1, 0.2, 0.3, 0.4, 0.5],
                       [0.1, 0.9, 0.8, 0.7, 0.6, 0.5],
                       [0.5, 0.5, 0.5, 0.1, 0.0, 0.0],
                       [0.3, 0.6, 0.2, 0.1, 0.4, 0.0]])
    self.assertAllEqual(ncf.positive_ranks(scores), ranks)

  def test_bad_cutoff(self):
    for k in (0, -1, 2.5, True, "10"):
      with self.assertRaisesRegex(ValueError, r"k \(the ranking cut-off\) must be an int "
                                  r">= 1, got"):
        ncf.ndcg_at_k(np.array([0]), k)
    with self.assertRaisesRegex(ValueError, "k .* must be an int >= 1, got 0"):
      ncf.hit_rate_at_k(lambda x: tf.zeros_like(x[0], tf.float32),
                        movielens.EvalData(np.zeros(1, np.int32), np.zeros((1, 2), np.int32)),
                        k=0)


class EvaluateTest(tf.test.TestCase):

  def test_reports_hr_ndcg_and_loss(self):
    model = ncf.build_model(seed=0, **TINY)
    result = ncf.evaluate(model)
    self.assertEqual(set(result), {"hr@10", "ndcg@10", "loss"})
    data = ncf.make_eval_data(0)
    scores = ncf.candidate_scores(lambda x: model(x, training=False), data)
    ranks = ncf.positive_ranks(scores)
    self.assertAllClose(result["ndcg@10"], ncf.ndcg_at_k(ranks, 10))
    self.assertLessEqual(result["ndcg@10"], result["hr@10"])
    labels = np.zeros_like(scores)
    labels[:, 0] = 1
    p = np.clip(scores, 1e-7, 1 - 1e-7)
    want = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    self.assertAllClose(result["loss"], want, rtol=1e-4)


class ModelTest(tf.test.TestCase):

  def test_structure_and_sizes_from_data(self):
    model = ncf.build_model(num_users=7, num_items=5)
    self.assertEqual(model.get_layer("mf_user").input_dim, 7)
    self.assertEqual(model.get_layer("mlp_item").output_dim, ncf.MLP_LAYERS[0] // 2)
    self.assertEqual([model.get_layer(f"mlp_{i}").units for i in range(3)], [256, 128, 64])
    self.assertEqual(model.output_shape, (None, 1))
    train, _ = ncf.load(0)
    synthetic = ncf.build_model(**TINY)
    self.assertEqual(synthetic.get_layer("mf_item").input_dim, train.num_items)
    out = synthetic((tf.constant([0, 1]), tf.constant([2, 3])))
    self.assertAllInRange(out, 0.0, 1.0)

  def test_fit_under_replicator_learns(self):
    # 2 data-parallel replicas over the 4 logical CPUs (the second device of
    # each idles): half the replica graphs of the default 4 x 1 to trace, the
    # same global batch.
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    with repl.scope():
      model = ncf.build_model(seed=0, **TINY)
      opt = repl.wrap_optimizer(tf_keras.optimizers.Adam(0.01))
      model.compile(optimizer=opt, loss=ncf.loss, metrics=ncf.metrics())
    opt.build(model.trainable_variables)  # slots first: fit traces its step once
    hr_before = ncf.evaluate(model)["hr@10"]
    history = model.fit(ncf.make_dataset(256, seed=0), steps_per_epoch=30, epochs=3,
                        verbose=0).history["loss"]
    self.assertLess(history[-1], history[0] - 0.02)
    self.assertGreater(ncf.evaluate(model)["hr@10"], hr_before + 0.1)


if __name__ == "__main__":
  tf.test.main()
