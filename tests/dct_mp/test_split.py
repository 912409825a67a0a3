"""DCTSplit layers (tf-keras and Keras 3): config, inference, modes, accounting."""

import glob

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf
import tf_keras

from tf_dct import dct_mp as layers
from tf_dct import dct_mp as ops
from tests import util
from tests.dct_mp import crossing
from tests.dct_mp import reference

FLAVOURS = (("tf_keras", layers.DCTSplit), ("keras3", layers.Keras3DCTSplit))


def setUpModule():
  util.setup_cpus()


def _x(shape=(4, 16), seed=0):
  return tf.constant(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


class DCTSplitTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*FLAVOURS)
  def test_config_round_trip(self, cls):
    layer = cls(0.75, mode="gaussian_sketch", apply_at_inference=True,
                target_logical_device=1, sketch_seed=7, name="split")
    self.assertEqual(cls(0.9, warmup_steps=7, warmup="dense").get_config()["warmup_steps"], 7)
    self.assertEqual(cls.from_config(cls(0.9, rescale="l1").get_config()).get_config()["rescale"],
                     "l1")
    config = layer.get_config()
    again = cls.from_config(config)
    self.assertEqual(again.get_config(), config)
    self.assertEqual((again.sparsity, again.mode), (0.75, "gaussian_sketch"))
    if cls is layers.DCTSplit:
      restored = tf_keras.layers.deserialize(tf_keras.layers.serialize(layer))
    else:
      restored = keras.saving.deserialize_keras_object(
          keras.saving.serialize_keras_object(layer))
    self.assertIsInstance(restored, cls)
    self.assertEqual(restored.get_config(), config)

  @parameterized.named_parameters(*FLAVOURS)
  def test_inference_behaviour(self, cls):
    x = _x()
    masked = ops.dct_mp(x, 0.75)
    self.assertAllEqual(cls(0.75)(x, training=True), masked)
    self.assertAllEqual(cls(0.75)(x, training=False), masked)  # default: "dct" applies
    self.assertAllEqual(cls(0.75, apply_at_inference=False)(x, training=False), x)
    self.assertAllEqual(cls(0.75, rescale="l1")(x, training=False), ops.dct_mp(x, 0.75, "l1"))
    self.assertAllEqual(cls(0.75, rescale="l1_backward")(x, training=False), masked)
    self.assertAllEqual(cls(0.75, mode="gaussian_sketch")(x, training=False), x)
    sketched = cls(0.75, mode="gaussian_sketch", apply_at_inference=True)(x)
    self.assertNotAllClose(sketched, x)

  @parameterized.named_parameters(*FLAVOURS)
  def test_gradient_is_that_of_x_times_fixed_mask(self, cls):
    x = tf.constant(reference.distinct((3, 8), seed=1))  # no ties
    layer = cls(0.75)
    mask = reference.threshold_mask(x.numpy(), 0.75).astype(np.float32)
    theoretical, numerical = tf.test.compute_gradient(
        lambda v: layer(v, training=True), [x], delta=1e-2)
    self.assertAllClose(theoretical[0], np.diag(mask.reshape(-1)))
    self.assertAllClose(numerical[0], np.diag(mask.reshape(-1)), atol=1e-3)

  @parameterized.named_parameters(*FLAVOURS)
  def test_gaussian_sketch(self, cls):
    x = _x((4, 16))
    dy = _x((4, 16), seed=2)
    layer = cls(0.75, mode="gaussian_sketch", sketch_seed=3)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = layer(x, training=True)
    s = ops.sketch_matrix(16, 4, 3, tf.float32).numpy()
    self.assertEqual(s.shape, (16, 4))
    self.assertAllClose(y, x.numpy() @ s @ s.T, rtol=1e-5, atol=1e-5)
    self.assertAllClose(tape.gradient(y, x, output_gradients=dy),
                        dy.numpy() @ s @ s.T, rtol=1e-5, atol=1e-5)
    self.assertEqual(layer.bytes_stats()["forward_bytes"], 4 * 4 * 4)   # B * r floats
    self.assertEqual(layer.bytes_stats()["backward_bytes"], 4 * 16 * 4)  # dense

  @parameterized.named_parameters(*FLAVOURS)
  def test_xgrad_topk_error_feedback(self, cls):
    x = _x((3, 8))
    layer = cls(0.75, mode="xgrad_topk")
    residual = np.zeros([3, 8], np.float32)
    for step in range(3):
      dy = _x((3, 8), seed=10 + step)
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
      self.assertAllEqual(y, x)  # the forward is dense
      dx = tape.gradient(y, x, output_gradients=dy).numpy()
      g = dy.numpy() + residual
      mask = reference.topk_mask(g, 0.75)
      self.assertAllClose(dx, np.where(mask, g, 0))
      residual = np.where(mask, 0, g)
      self.assertAllClose(layer.residual, residual)
    self.assertEqual(layer.residual.shape, (3, 8))

  @parameterized.named_parameters(*FLAVOURS)
  def test_xgrad_topk_non_finite_gradient_leaves_the_residual_alone(self, cls):
    x = _x((3, 8))
    layer = cls(0.75, mode="xgrad_topk")

    def backward(dy):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
      return tape.gradient(y, x, output_gradients=dy)

    backward(_x((3, 8), seed=1))  # a residual to protect
    before = np.array(layer.residual)
    self.assertGreater(np.abs(before).sum(), 0)
    for bad in (np.nan, np.inf):
      dy = _x((3, 8), seed=2).numpy()
      dy[1, 3] = bad
      with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                  "xgrad_topk: non-finite gradient"):
        backward(tf.constant(dy))
      self.assertAllEqual(layer.residual, before)
      with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                  "xgrad_topk: non-finite gradient"):
        tf.function(backward)(tf.constant(dy))
      self.assertAllEqual(layer.residual, before)

  @parameterized.named_parameters(*FLAVOURS)
  def test_accounting_and_summaries(self, cls):
    x = _x((4, 64))
    layer = cls(0.9, name="split0")
    layer(x, training=True)
    layer(x, training=True)
    stats = layer.bytes_stats()
    compact = 4 * 7 * (4 + 1)  # k = 7 float32 values + 7 uint8 indices per row
    back = 4 * 7 * 4  # values only: the source kept the indices
    self.assertEqual(stats, {
        "forward_bytes": compact, "backward_bytes": back,
        "dense_bytes": 4 * 64 * 4, "total_forward_bytes": 2 * compact,
        "total_backward_bytes": 2 * back, "total_dense_bytes": 4 * 4 * 64 * 4,
        "calls": 2})
    layer(x, training=False)  # inference: nothing comes back
    self.assertEqual(layer.bytes_stats()["backward_bytes"], 0)

    logdir = self.create_tempdir().full_path
    writer = tf.summary.create_file_writer(logdir)
    step_fn = tf.function(lambda v: layer(v, training=True))
    with writer.as_default(step=5):
      step_fn(x)
    writer.flush()
    seen = {}
    for path in glob.glob(f"{logdir}/events*"):
      for event in tf.compat.v1.train.summary_iterator(path):
        for value in event.summary.value:
          seen[value.tag] = (event.step, float(tf.make_ndarray(value.tensor)),
                             value.metadata.plugin_data.plugin_name)
    self.assertEqual(seen, {
        "tf_dct_mp/split0/forward_bytes": (5, compact, "scalars"),
        "tf_dct_mp/split0/backward_bytes": (5, back, "scalars"),
        "tf_dct_mp/split0/dense_bytes": (5, 4 * 64 * 4, "scalars")})

  @parameterized.named_parameters(*FLAVOURS)
  def test_rank_3_and_low_precision(self, cls):
    for dtype in (tf.bfloat16, tf.float16):
      x = tf.cast(_x((2, 3, 10)), dtype)
      y = cls(0.8)(x, training=True)
      self.assertEqual(y.dtype, dtype)
      self.assertAllEqual(tf.math.count_nonzero(y, axis=-1), tf.fill([2, 3], 2))

  @parameterized.named_parameters(*FLAVOURS)
  def test_errors(self, cls):
    for bad in (-0.1, 1.0, 2, None, "0.9"):
      with self.assertRaisesRegex(ValueError, r"sparsity must be a number in \[0, 1\)"):
        cls(bad)
    with self.assertRaisesRegex(ValueError, "mode must be one of"):
      cls(0.9, mode="topk")
    with self.assertRaisesRegex(ValueError, "target_logical_device must be None or an int >= 0"):
      cls(0.9, target_logical_device=-1)
    for bad in (-1, 1.5, True, "3"):
      with self.assertRaisesRegex(ValueError, r"warmup_steps must be an int >= 0"):
        cls(0.9, warmup_steps=bad)
    with self.assertRaisesRegex(ValueError, r"warmup must be one of \('linear', 'dense'\)"):
      cls(0.9, warmup_steps=5, warmup="cosine")
    with self.assertRaisesRegex(ValueError, "warmup_steps > 0 needs mode='dct'"):
      cls(0.9, mode="gaussian_sketch", warmup_steps=5)
    with self.assertRaisesRegex(ValueError, "not both"):
      cls(0.9, target_device="/cpu:1", target_logical_device=1)
    with self.assertRaisesRegex(
        ValueError,
        r"DCTSplit: rescale must be one of \('none', 'l1', 'l1_backward'\), got 'l2'"):
      cls(0.9, rescale="l2")
    with self.assertRaisesRegex(ValueError, "rescale='l1' needs mode='dct'"):
      cls(0.9, mode="gaussian_sketch", rescale="l1")
    with self.assertRaisesRegex(ValueError, "rescale='l1_backward' needs mode='dct'"):
      cls(0.9, mode="xgrad_topk", rescale="l1_backward")
    with self.assertRaisesRegex(ValueError, r"inputs must have rank >= 2"):
      cls(0.9)(tf.ones([8]), training=True)
    with self.assertRaisesRegex(ValueError, r"inputs must have rank >= 2"):
      cls(0.9)(tf.constant(1.0), training=True)
    with self.assertRaisesRegex(ValueError, r"k = d - floor\(d \* sparsity\) must be >= 1.*d = 0"):
      cls(0.9)(tf.ones([2, 0]), training=True)
    layer = cls(0.9)
    with self.assertRaisesRegex(TypeError, "floating-point.*int32"):
      layer(tf.ones([2, 16], tf.int32), training=True)
    layer(tf.ones([2, 16]), training=True)
    self.assertEqual(layer.bytes_stats()["calls"], 1)  # the failed call left no trace
    # target_logical_device outside a tf_dct replica runs in place, and an
    # index past the replicator's devices is an error: test_split_replicas.py.

  @parameterized.product(flavour=FLAVOURS, warmup=("linear", "dense"))
  def test_warmup_schedule_accounting_and_restore(self, flavour, warmup):
    _, cls = flavour
    d, w = 10, 3
    k = ops.num_kept(d, 0.8)  # 2
    x_np = reference.distinct((3, d), seed=4)
    x = tf.constant(x_np)
    layer = cls(0.8, warmup_steps=w, warmup=warmup)
    step_fn = tf.function(lambda v: layer(v, training=True))

    def check(y, t, training=True):
      kt = reference.kept_at(t, d, k, w, warmup)
      self.assertAllEqual(y, reference.forward(x_np, reference.topk_mask_k(x_np, kt)))
      stats = layer.bytes_stats()
      dense = 3 * d * 4
      want = (dense, dense if training else 0) if t < w else (3 * k * 5, 3 * k * 4 * training)
      self.assertEqual((stats["forward_bytes"], stats["backward_bytes"]), want)

    for t in range(2):  # eager, then traced: the same schedule
      check(layer(x, training=True) if t == 0 else step_fn(x), t)
    check(layer(x, training=False), 2, training=False)  # inference: current k, no step
    ckpt = tf.train.Checkpoint(layer=layer)
    path = ckpt.save(self.create_tempdir().full_path + "/ckpt")
    for t in range(2, w + 2):
      check(step_fn(x), t)
    # A fresh layer restored from step 2 resumes the schedule there.
    again = cls(0.8, warmup_steps=w, warmup=warmup)
    again.build(x.shape)
    tf.train.Checkpoint(layer=again).restore(path).assert_existing_objects_matched()
    layer = again
    for t in range(2, w + 1):
      check(layer(x, training=True), t)

  def test_warmup_with_a_target_device_sends_dense_then_compact(self):
    layer = layers.DCTSplit(0.95, warmup_steps=1, target_device="/cpu:1")
    x = _x((4, 512))
    with tf.device("/cpu:1"):
      w = tf.Variable(tf.ones([512, 1]))

    @tf.function
    def step(x):
      with tf.device("/cpu:0"):
        y = layer(x, training=True)
        with tf.device("/cpu:1"):
          loss = tf.reduce_sum(tf.matmul(y, w))
        return y, tf.gradients(loss, x)[0]

    for t, kept in ((0, 512), (1, 26)):
      y, g = step(x)
      mask = reference.topk_mask_k(x.numpy(), kept)
      self.assertAllEqual(y, reference.forward(x.numpy(), mask))
      self.assertAllEqual(g, mask.astype(np.float32))
    self.assertEqual(layer.bytes_stats()["total_forward_bytes"],
                     4 * 512 * 4 + 4 * (26 * 4 + 8 * 4))

  @parameterized.parameters(("dct", "none"), ("dct", "l1"), ("dct", "l1_backward"),
                            ("gaussian_sketch", "none"),
                            ("xgrad_topk", "none"))
  def test_bytes_stats_are_the_bytes_that_cross(self, mode, rescale):
    # d = 512, sparsity 0.95: k = 26; the indices cross bit-packed (8 words).
    # A rescale sends nothing more: the source scales the values it sends.
    layer = layers.DCTSplit(0.95, mode=mode, target_device="/cpu:1", rescale=rescale)
    layer.build((4, 512))
    if mode == "xgrad_topk":  # the residual lives where the backward uses it
      self.assertIn("CPU:1", layer.residual.device)
    with tf.device("/cpu:1"):
      w = tf.Variable(tf.ones([512, 1]))

    @tf.function
    def step(x):
      with tf.device("/cpu:0"):
        y = layer(tf.nn.relu(x), training=True)
        with tf.device("/cpu:1"):
          loss = tf.reduce_sum(tf.matmul(y, w))
        return tf.gradients(loss, x)[0]  # keeps backward ops on their device

    x = _x((4, 512))
    edges = crossing.crossing(step.get_concrete_function(x).graph)
    step(x)
    stats = layer.bytes_stats()
    self.assertEqual(crossing.bytes_to(edges, "CPU:1"), stats["forward_bytes"])
    self.assertEqual(crossing.bytes_to(edges, "CPU:0"), stats["backward_bytes"])
    compact = 4 * (26 * 4 + 8 * 4)
    self.assertEqual((stats["forward_bytes"], stats["backward_bytes"]), {
        "dct": (compact, 4 * 26 * 4),
        "gaussian_sketch": (4 * 26 * 4, 4 * 512 * 4),
        "xgrad_topk": (4 * 512 * 4, compact)}[mode])
    if mode == "dct":  # DCT §2.2 at eta = 0.95: >= 15x, all metadata counted
      self.assertGreaterEqual(stats["dense_bytes"] / stats["forward_bytes"], 15)

  def test_xgrad_topk_needs_static_rows(self):
    model_input = tf_keras.Input((16,))
    with self.assertRaisesRegex(ValueError, "static number of rows.*feedback_rows"):
      layers.DCTSplit(0.9, mode="xgrad_topk")(model_input)
    layer = layers.DCTSplit(0.9, mode="xgrad_topk", feedback_rows=4)
    layer(model_input)
    self.assertEqual(layer.residual.shape, (4, 16))
    with self.assertRaisesRegex(ValueError, r"residual has shape \(4, 16\).*3 rows"):
      layer(tf.ones([3, 16]), training=True)


if __name__ == "__main__":
  tf.test.main()
