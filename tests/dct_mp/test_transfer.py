"""Compact transfer: bit-identical to dct_mp, placement, wire types, XLA."""

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

import tf_dct
from tf_dct import dct_mp as ops
from tests import util
from tests.dct_mp import crossing


def setUpModule():
  util.setup_cpus()


def _bits(t) -> np.ndarray:
  a = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
  return a.view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")


def _forward_and_grad(fn, x, dy):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = fn(x)
  return y, tape.gradient(y, x, output_gradients=dy)


class CompactTransferTest(tf.test.TestCase, parameterized.TestCase):

  @parameterized.parameters(
      (dtype, shape, jit) for dtype in (tf.float32, tf.bfloat16, tf.float16)
      for shape, jit in (((4, 12), False), ((2, 3, 300), False), ((2, 300), True)))
  def test_bit_identical_to_dense_form(self, dtype, shape, jit):
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=shape)
    x_np[0, :5] = 0.0          # ties at zero, as after a ReLU
    x_np[-1, -1] = -0.0
    x = tf.cast(x_np, dtype)
    dy = tf.cast(rng.normal(size=shape), dtype)
    dense = tf.function(lambda v: ops.dct_mp(v, 0.9), jit_compile=jit)
    compact = tf.function(lambda v: ops.dct_mp_transfer(v, 0.9, "/cpu:1"),
                          jit_compile=jit)
    if jit:  # XLA compiles for one device: keep the target on it
      compact = tf.function(lambda v: ops.dct_mp_transfer(v, 0.9, "/cpu:0"),
                            jit_compile=True)
    y0, g0 = _forward_and_grad(dense, x, dy)
    y1, g1 = _forward_and_grad(compact, x, dy)
    self.assertAllEqual(_bits(y0), _bits(y1))
    self.assertAllEqual(_bits(g0), _bits(g1))
    eager_y, eager_g = _forward_and_grad(lambda v: ops.dct_mp(v, 0.9), x, dy)
    self.assertAllEqual(_bits(eager_y), _bits(y1))
    self.assertAllEqual(_bits(eager_g), _bits(g1))

  @parameterized.product(dtype=(tf.float32, tf.bfloat16), rescale=("l1", "l1_backward"))
  def test_rescale_bit_identical_to_dense_form(self, dtype, rescale):
    rng = np.random.default_rng(1)
    x_np = np.maximum(rng.normal(size=(4, 300)), 0)  # after a ReLU: ties at 0
    x_np[1] = 0.0                                     # a zero row: s = 1
    x = tf.cast(x_np, dtype)
    dy = tf.cast(rng.normal(size=x_np.shape), dtype)
    y0, g0 = _forward_and_grad(lambda v: ops.dct_mp(v, 0.9, rescale), x, dy)
    compact = tf.function(lambda v: ops.dct_mp_transfer(v, 0.9, "/cpu:1", rescale=rescale))
    y1, g1 = _forward_and_grad(compact, x, dy)
    self.assertAllEqual(_bits(y0), _bits(y1))
    self.assertAllEqual(_bits(g0), _bits(g1))
    _, g_plain = _forward_and_grad(lambda v: ops.dct_mp(v, 0.9), x, dy)
    self.assertNotAllEqual(g0, g_plain)  # the gradient was scaled
    if rescale == "l1":
      self.assertNotAllEqual(y0, ops.dct_mp(x, 0.9))  # the rows were scaled
    else:
      self.assertAllEqual(_bits(y0), _bits(ops.dct_mp(x, 0.9)))  # Algorithm 2's

  def test_index_types(self):
    self.assertEqual(ops.index_dtype_for(256), tf.uint8)
    self.assertEqual(ops.index_dtype_for(257), tf.int16)
    self.assertEqual(ops.index_dtype_for(32768), tf.int16)
    self.assertEqual(ops.index_dtype_for(32769), tf.int32)
    # 26 float32 values + 26 indices bit-packed in 8 int32 words per row.
    self.assertEqual(ops.compact_bytes(256, 512, 26, tf.float32), 256 * (26 * 4 + 32))
    self.assertEqual(ops.compact_bytes(256, 64, 7, tf.float32), 256 * 7 * 5)  # uint8
    self.assertEqual(ops.dense_bytes(256, 512, tf.float32), 256 * 512 * 4)

  @parameterized.parameters(
      # d = 64, k = 7: uint8 indices (7 bytes a row; packed would take 8).
      (64, {(tf.float32, (4, 7), "CPU:1"), (tf.uint8, (4, 7), "CPU:1"),
            (tf.float32, (4, 7), "CPU:0")}),
      # d = 512, k = 26: 9-bit indices packed in 8 int32 words a row.
      (512, {(tf.float32, (4, 26), "CPU:1"), (tf.int32, (4, 8), "CPU:1"),
             (tf.float32, (4, 26), "CPU:0")}))
  def test_only_compact_tensors_cross_the_boundary(self, d, want):
    w = tf.Variable(tf.ones([d, 3]))
    sparsity = 0.9 if d == 64 else 0.95

    @tf.function
    def step(x):
      with tf.device("/cpu:0"):
        h = tf.nn.relu(x)
        y = ops.dct_mp_transfer(h, sparsity, "/cpu:1")
        with tf.device("/cpu:1"):
          loss = tf.reduce_sum(tf.square(tf.matmul(y, w)))
        # tf.gradients colocates each backward op with its forward op; a
        # GradientTape would put the backward of the CPU:1 ops on CPU:0.
        return tf.gradients(loss, x)[0]

    graph = step.get_concrete_function(tf.TensorSpec([4, d])).graph
    edges = crossing.crossing(graph)
    # Forward: values and indices to CPU:1; backward: the gathered gradient
    # to CPU:0. Nothing of width d crosses.
    self.assertEqual({(dtype, shape, dst) for (_, dst), (dtype, shape, _) in edges.items()},
                     want)
    k = ops.num_kept(d, sparsity)
    self.assertEqual(crossing.bytes_to(edges, "CPU:1"), ops.compact_bytes(4, d, k, tf.float32))
    # A dynamic batch: the same tensors (no shape vector crosses).
    graph = step.get_concrete_function(tf.TensorSpec([None, d])).graph
    self.assertEqual({(dtype, shape, dst) for (_, dst), (dtype, shape, _)
                      in crossing.crossing(graph).items()},
                     {(dtype, (None,) + shape[1:], dst) for dtype, shape, dst in want})

  def test_densify_runs_on_the_receiving_logical_device(self):
    repl = tf_dct.Replicator(num_devices_per_replica=2)
    placed = {}

    def step_fn(x):
      rid = repl.local_replica_index()
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = ops.dct_mp_transfer(x, 0.75, lambda: repl.logical_device(1))
        loss = tf.reduce_sum(y)
      dx = tape.gradient(loss, x)
      placed[rid] = (x.device, y.device, dx.device)
      return y, dx

    x = np.arange(32, dtype=np.float32).reshape(4, 8) - 10
    y, dx = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(x))
    self.assertIn("CPU:1", placed[0][1])
    self.assertIn("CPU:3", placed[1][1])
    self.assertIn("CPU:0", placed[0][2])  # the gradient densifies on the source
    self.assertIn("CPU:2", placed[1][2])
    want = ops.dct_mp(tf.constant(x), 0.75).numpy()
    self.assertAllEqual(np.concatenate(util.local(repl, y)), want)
    self.assertAllEqual(np.concatenate(util.local(repl, dx)), (want != 0).astype(np.float32))

  def test_jit_on_a_one_replica_replicator(self):
    repl = tf_dct.Replicator(["/cpu:0"], jit_compile=True)
    x = np.random.default_rng(3).normal(size=(4, 20)).astype(np.float32)

    def step_fn(v):
      with tf.GradientTape() as tape:
        tape.watch(v)
        y = ops.dct_mp_transfer(v, 0.8, lambda: repl.logical_device(0))
        loss = tf.reduce_sum(y * tf.range(20.0))
      return y, tape.gradient(loss, v)

    y, dx = repl.run(step_fn, lambda ctx: tf.data.Dataset.from_tensors(x))
    mask = ops.dct_mp_mask(x, 0.8).numpy()
    self.assertAllEqual(util.local(repl, y)[0], np.where(mask, x, 0))
    self.assertAllEqual(util.local(repl, dx)[0], np.where(mask, np.arange(20.0), 0))


if __name__ == "__main__":
  tf.test.main()
