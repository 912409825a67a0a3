"""Tests for models/dlrm.py: structure, split points, training under a Replicator."""

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from models import dlrm
from tests import util

TINY = {"vocab_sizes": 20, "embedding_dim": 4, "bottom_mlp": (8, 6, 4), "top_mlp": (8, 6, 1)}
BATCH = 64


def setUpModule():
  util.setup_cpus()


def _fixed_batch(seed=0):
  """Held-out rows labelled by the same teacher as training data of `seed`."""
  return next(iter(dlrm.make_dataset(512, seed=seed, split="eval", vocab_sizes=20)))


def _mean_loss(model, batch) -> float:
  x, y = batch
  return float(tf.reduce_mean(dlrm.loss(y, model(x))))


class StructureTest(tf.test.TestCase):

  def test_default_dims_match_the_paper(self):
    model = dlrm.build_model(vocab_sizes=10)
    dense = [l for role, l in dlrm.layer_sequence(model) if role in ("bottom", "top")]
    self.assertEqual([l.units for l in dense], [512, 256, 64, 16, 512, 256, 128, 1])
    table = model.get_layer("embeddings")
    self.assertEqual(table.embeddings.shape, (26 * 10, 16))
    self.assertAllLessEqual(tf.abs(table.embeddings), 1 / np.sqrt(10))
    self.assertEqual(model.output_shape, (None, 1))
    self.assertEqual(dlrm.split_points(), ["bottom_0", "bottom_1", "bottom_2", "bottom_3",
                                           "top_0", "top_1", "top_2"])
    with self.assertRaisesRegex(ValueError, "embedding_dim"):
      dlrm.build_model(vocab_sizes=10, bottom_mlp=(8, 5))

  def test_split_fn_inserts_at_named_points(self):
    asked = []

    def split_fn(point):
      asked.append(point)
      if point in dlrm.PAPER_SPLITS:
        return tf_keras.layers.Lambda(lambda t: t * 1.0, name=f"split_{point}")
      return None

    model = dlrm.build_model(split_fn=split_fn, **TINY)
    plain = dlrm.build_model(**TINY)
    self.assertEqual(asked, dlrm.split_points(TINY["bottom_mlp"], TINY["top_mlp"]))
    seq = [(role, layer.name) for role, layer in dlrm.layer_sequence(model)]
    names = [name for _, name in seq]
    self.assertEqual(names[:4], ["bottom_0", "bottom_1", "split_bottom_1", "bottom_2"])
    self.assertEqual(names[-4:], ["top_0", "top_1", "split_top_1", "top_2"])
    self.assertIn(("split:top_1", "split_top_1"), seq)
    self.assertEqual(model.get_layer("split_bottom_1").output.shape.as_list(), [None, 6])
    self.assertEqual(model.get_layer("split_top_1").output.shape.as_list(), [None, 6])
    # the split layer consumes the ReLU output and feeds the next layer
    self.assertIs(model.get_layer("split_bottom_1").input, model.get_layer("bottom_1").output)
    self.assertIs(model.get_layer("bottom_2").input, model.get_layer("split_bottom_1").output)
    stages = [[l.name for l in s] for s in dlrm.stages(model)]
    self.assertLen(stages, 3)
    self.assertEqual(stages[0], ["bottom_0", "bottom_1", "split_bottom_1"])
    self.assertEqual(stages[2], ["top_2"])
    self.assertLen(dlrm.stages(plain), 1)
    # an identity split changes nothing
    plain.set_weights(model.get_weights())
    x, _ = _fixed_batch()
    self.assertAllClose(model(x), plain(x))


class TrainTest(tf.test.TestCase):

  def test_fit_under_replicator(self):
    # 2 data-parallel replicas over the 4 logical CPUs (the second device of
    # each idles): half the replica graphs of the default 4 x 1 to trace, the
    # same global batch.
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    batch = _fixed_batch(seed=1)
    with repl.scope():
      model = dlrm.build_model(seed=1, **TINY)
      opt = repl.wrap_optimizer(tf_keras.optimizers.Adam(0.02))
      model.compile(optimizer=opt, loss=dlrm.loss, metrics=dlrm.metrics())
    # Slots first, as launch/train.py does: variables created inside the
    # first trace would force a second trace of the train function.
    opt.build(model.trainable_variables)
    before = _mean_loss(model, batch)
    model.fit(dlrm.make_dataset(BATCH, seed=1, vocab_sizes=20), steps_per_epoch=40,
              epochs=1, verbose=0)
    self.assertLess(_mean_loss(model, batch), before - 0.05)

  def test_custom_step_under_replicator(self):
    repl = tf_dct.Replicator(num_devices_per_replica=2)  # as above
    batch = _fixed_batch(seed=2)
    with repl.scope():
      model = dlrm.build_model(seed=2, **TINY)
      opt = repl.wrap_optimizer(tf_keras.optimizers.Adam(0.02))
    opt.build(model.trainable_variables)  # slots first: the step traces once
    data = dlrm.make_dataset(BATCH, seed=2, vocab_sizes=20)
    input_fn = lambda ctx: data

    def step_fn(inputs):
      x, y = inputs
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dlrm.loss(y, model(x, training=True))) / BATCH
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    before = _mean_loss(model, batch)
    losses = []
    for _ in range(40):
      per_replica = repl.experimental_local_results(repl.run(step_fn, input_fn))
      self.assertLen(per_replica, 2)
      losses.append(sum(float(t) for t in per_replica))
    self.assertLess(_mean_loss(model, batch), before - 0.05)
    self.assertLess(np.mean(losses[-10:]), np.mean(losses[:10]))


if __name__ == "__main__":
  tf.test.main()
