"""Tests for models/lstm_lm.py: the word LSTM LM, its text data and perplexity."""

import os

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from models import lstm_lm
from tests import util


def setUpModule():
  util.setup_cpus()


def _write(directory, name, content):
  with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
    f.write(content)


class DataTest(tf.test.TestCase):

  def test_wikitext_dir(self):
    d = self.create_tempdir().full_path
    _write(d, "wiki.train.tokens", " = Title = \n\n the cat sat \n the cat ran \n")
    _write(d, "wiki.valid.tokens", " the dog sat \n")
    _write(d, "wiki.test.tokens", " the cat \n")
    data = lstm_lm.load_data(d, min_count=2)
    self.assertEqual(data.vocab.words, ("<unk>", "<eos>", "=", "cat", "the"))
    # = Title = <eos> the cat sat <eos> the cat ran <eos>
    self.assertAllEqual(data.ids["train"], [2, 0, 2, 1, 4, 3, 0, 1, 4, 3, 0, 1])
    self.assertAllEqual(data.ids["valid"], [4, 0, 0, 1])
    x, y = next(iter(lstm_lm.make_dataset(2, data_dir=d, split="train", seq_len=3,
                                          min_count=2)))
    self.assertEqual(x.shape, (2, 3))
    self.assertAllEqual(list(lstm_lm.make_dataset(4, data_dir=d, split="test", seq_len=2,
                                                  min_count=2))[0],
                        ([[4, 3]], [[3, 1]]))

  def test_missing(self):
    d = self.create_tempdir().full_path
    with self.assertRaisesRegex(FileNotFoundError, "no_dir"):
      lstm_lm.load_data(os.path.join(d, "no_dir"))
    _write(d, "train.txt", "a b\n")
    _write(d, "test.txt", "a b\n")
    with self.assertRaisesRegex(FileNotFoundError, r"no valid text in .*wiki\.valid\.tokens"):
      lstm_lm.load_data(d)

  def test_malformed_line_reported(self):
    d = self.create_tempdir().full_path
    for split in lstm_lm.SPLITS:
      _write(d, f"{split}.txt", "a b\n")
    with open(os.path.join(d, "test.txt"), "ab") as f:
      f.write(b"ok\nbad \xfe\n")
    with self.assertRaisesRegex(ValueError, r"test\.txt:3: not valid UTF-8"):
      lstm_lm.load_data(d)


class TrainTest(tf.test.TestCase):

  def test_trains_under_replicator(self):
    # 2 data-parallel replicas over the 4 logical CPUs (the second device of
    # each idles): half the replica graphs of the default 4 x 1 to trace, the
    # same global batch.
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    global_batch = 32
    with repl.scope():
      model = lstm_lm.build_model(seed=0, **lstm_lm.TINY_CONFIG)
      optimizer = repl.wrap_optimizer(tf_keras.optimizers.Adam(3e-2))
      optimizer.build(model.trainable_variables)  # slots first: the step traces once
    dataset = lstm_lm.make_dataset(global_batch, seed=0, seq_len=20)
    input_fn = lambda ctx: dataset

    def step_fn(batch):
      inputs, targets = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(lstm_lm.loss(targets, model(inputs, training=True)))
        loss /= global_batch
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    losses = [sum(float(t) for t in repl.experimental_local_results(repl.run(step_fn, input_fn)))
              for _ in range(30)]
    self.assertLess(np.mean(losses[-5:]), 0.85 * np.mean(losses[:5]))
    vocab_size = len(lstm_lm.load_data().vocab)
    result = lstm_lm.evaluate(model, batch_size=128, seq_len=20)
    self.assertAllClose(result["perplexity"], np.exp(result["loss"]))
    self.assertLess(result["perplexity"], 0.5 * vocab_size)


if __name__ == "__main__":
  tf.test.main()
