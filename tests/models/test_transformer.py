"""Tests for models/transformer: data, split points, training under a Replicator, BLEU eval."""

import os

import numpy as np
import tensorflow as tf
import tf_keras

import tf_dct
from models import transformer
from models.data import tokenizer
from tests import util

MAX_LEN = 24


def setUpModule():
  util.setup_cpus()


class Probe(tf_keras.layers.Layer):
  """Records the shapes it sees; multiplies by `scale`."""

  def __init__(self, point: str, scale: float = 1.0):
    super().__init__(name=f"{point}_probe")
    self.point, self.scale, self.shapes = point, scale, []

  def call(self, x):
    self.shapes.append(tuple(x.shape.as_list()))
    return x * self.scale


def _write(directory, name, lines):
  with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
    f.write("".join(line + "\n" for line in lines))


class DataTest(tf.test.TestCase):

  def test_parallel_files_with_byte_tokenizer(self):
    d = self.create_tempdir().full_path
    _write(d, "train.de", ["ab", "", "Grüß"])
    _write(d, "train.en", ["xy z", "", "hi"])
    _write(d, "test.de", ["a"])
    _write(d, "test.en", ["b"])
    data = transformer.load_data(d, tokenizer="bytes", max_len=6)
    self.assertEqual(data.pairs["train"], [("ab", "xy z"), ("Grüß", "hi")])
    self.assertNotIn("valid", data.pairs)
    source, target_in, target_out = data.arrays["train"]
    o = tokenizer.ByteTokenizer.OFFSET
    self.assertAllEqual(source[0], [97 + o, 98 + o, 0, 0, 0, 0])
    self.assertAllEqual(source[1, :6], [71 + o, 114 + o, 0xC3 + o, 0xBC + o, 0xC3 + o, 0x9F + o])
    self.assertAllEqual(target_in[0], [2, 120 + o, 121 + o, 32 + o, 122 + o, 0])
    self.assertAllEqual(target_out[0], [120 + o, 121 + o, 32 + o, 122 + o, 3, 0])
    (s, t_in), t_out = next(iter(transformer.make_dataset(4, data_dir=d, split="test",
                                                          tokenizer="bytes", max_len=6)))
    self.assertAllEqual(t_out, [[98 + o, 3, 0, 0, 0, 0]])

  def test_errors(self):
    d = self.create_tempdir().full_path
    with self.assertRaisesRegex(FileNotFoundError, "nothing_here"):
      transformer.load_data(os.path.join(d, "nothing_here"))
    _write(d, "train.de", ["a", "b"])
    _write(d, "train.en", ["a"])
    with self.assertRaisesRegex(ValueError, r"train\.de has 2 lines, .*train\.en has 1"):
      transformer.load_data(d, tokenizer="bytes")
    with self.assertRaisesRegex(ValueError, "unknown tokenizer 'spm'"):
      transformer.load_data(None, tokenizer="spm")

  def test_wordpiece_vocab_file_learned_then_reused(self):
    d = self.create_tempdir().full_path
    _write(d, "train.de", ["der hund", "die katze"] * 5)
    _write(d, "train.en", ["the dog", "the cat"] * 5)
    _write(d, "test.de", ["die katze"])
    _write(d, "test.en", ["the cat"])
    vocab_file = os.path.join(d, "vocab.txt")
    data = transformer.load_data(d, tokenizer="wordpiece", max_len=8, vocab_file=vocab_file)
    self.assertTrue(os.path.exists(vocab_file))
    self.assertEqual(data.tokenizer.decode([data.arrays["test"][2][0]]), ["the cat"])
    again = transformer.load_data(d, tokenizer="wordpiece", max_len=4, vocab_file=vocab_file)
    self.assertEqual(again.tokenizer.vocab, data.tokenizer.vocab)


class SplitPointTest(tf.test.TestCase):

  def test_split_fn_inserts_layers_at_ffn_points(self):
    config = dict(transformer.TINY_CONFIG, num_encoder_layers=2, num_decoder_layers=2)
    asked, probes = [], {}

    def split_fn(point):
      asked.append(point)
      if point in ("encoder_ffn_1", "decoder_ffn_0"):
        probes[point] = Probe(point)
        return probes[point]
      return None

    model = transformer.transformer(50, split_fn=split_fn, **config)
    self.assertEqual(asked, ["encoder_ffn_0", "encoder_ffn_1", "decoder_ffn_0",
                             "decoder_ffn_1"])
    self.assertEqual(asked, transformer.split_points(2, 2))
    self.assertIs(model.get_layer("encoder_1").ffn.split, probes["encoder_ffn_1"])
    self.assertIs(model.get_layer("decoder_0").ffn.split, probes["decoder_ffn_0"])
    self.assertIsNone(model.get_layer("encoder_0").ffn.split)
    source = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], np.int32)
    target = np.array([[2, 5, 6], [2, 7, 0]], np.int32)
    for probe in probes.values():
      probe.shapes.clear()
    identity_out = model((source, target))
    # Rank-3 [batch, time, ffn_dim] activations: source length for the encoder,
    # target length for the decoder.
    self.assertEqual(probes["encoder_ffn_1"].shapes, [(2, 4, config["ffn_dim"])])
    self.assertEqual(probes["decoder_ffn_0"].shapes, [(2, 3, config["ffn_dim"])])

    tf_keras.utils.set_random_seed(0)
    plain = transformer.transformer(50, **config)
    plain.set_weights(model.get_weights())  # probes have no weights
    self.assertAllClose(plain((source, target)), identity_out)
    probes["decoder_ffn_0"].scale = 0.0  # the probe's output is really used
    self.assertNotAllClose(model((source, target)), identity_out)

  def test_heads_must_divide_width(self):
    with self.assertRaisesRegex(ValueError, r"num_heads \(3\) must divide d_model \(32\)"):
      transformer.transformer(10, d_model=32, num_heads=3)


class TrainTest(tf.test.TestCase):

  def test_trains_under_replicator_and_evaluates(self):
    # 2 data-parallel replicas over the 4 logical CPUs (the second device of
    # each idles): half the replica graphs of the default 4 x 1 to trace, the
    # same global batch and the same losses (up to rounding).
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    self.assertEqual(repl.num_replicas, 2)
    global_batch = 32
    with repl.scope():
      model = transformer.build_model(seed=0, max_len=MAX_LEN, **transformer.TINY_CONFIG)
      optimizer = repl.wrap_optimizer(tf_keras.optimizers.Adam(3e-3))
      optimizer.build(model.trainable_variables)  # slots first: the step traces once
    dataset = transformer.make_dataset(global_batch, seed=0, max_len=MAX_LEN)
    input_fn = lambda ctx: dataset

    def step_fn(batch):
      inputs, targets = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(transformer.loss(targets, model(inputs, training=True)))
        loss /= global_batch
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    losses = [sum(float(t) for t in repl.experimental_local_results(repl.run(step_fn, input_fn)))
              for _ in range(50)]
    self.assertLess(np.mean(losses[-5:]), 0.85 * np.mean(losses[:5]))
    result = transformer.evaluate(model, batch_size=32, max_len=MAX_LEN, max_examples=32)
    self.assertBetween(result["bleu"], 0.0, 100.0)
    self.assertLess(result["loss"], losses[0])
    # Greedy decoding: [batch, max_len]; only PAD after a row's END.
    (source, _), _ = next(iter(transformer.make_dataset(8, split="test", max_len=MAX_LEN)))
    out = transformer.greedy_decoder(model, 6)(source).numpy()
    self.assertEqual(out.shape, (8, 6))
    for row in out.tolist():
      if tokenizer.END_ID in row:
        self.assertTrue(all(t == 0 for t in row[row.index(tokenizer.END_ID) + 1:]))
    self.assertEqual(transformer.model.strip_output([[5, 6, 3, 0], [7, 8, 9, 4]]),
                     [[5, 6], [7, 8, 9, 4]])



if __name__ == "__main__":
  tf.test.main()
