r"""DCT-MP benchmark: bytes per split (dense vs compact) and step time.

Part 1, bytes. For a DLRM-like activation (batch 256, d = 512 and d = 64,
float32) and sparsity eta in {0.75, 0.9, 0.95}: the dense bytes of one
direction, the compact bytes (k values + k column indices per row, either
byte-aligned (uint8 for d <= 256, int16 up to 32768) or bit-packed into
ceil(log2 d)-bit fields in int32 words, whichever is smaller, see
`tf_dct.dct_mp.index_wire`; backward only the k values, since both sides kept
the indices), and the ratios. The compact count is also
measured: a step with `dct_mp_transfer` from /cpu:0 to /cpu:1 is traced (with
`tf.gradients`, which keeps each backward op on its forward op's device) and
the static sizes of all tensors on cross-device edges are summed, per
direction. That count includes everything that crosses, metadata included.

Part 2, step time. One model-parallel replica on 2 logical CPUs
(`tf_dct.Replicator(["/cpu:0", "/cpu:1"], num_devices_per_replica=2)`):
Dense(512, relu) on device 0, [DCTSplit(eta, target_logical_device=1)], then
Dense(256, relu) -> Dense(1) on device 1, SGD, batch 256. Median step time
over interleaved timed blocks, with vs without the split. Logical CPUs share
memory: there is no network, so this measures the compute overhead of the
selection and (de)compaction, not a bandwidth saving.

Usage:
  python bench/dct_mp.py            # about 1-2 minutes
  python bench/dct_mp.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_keras  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_dct  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct import dct_mp as layers  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct import dct_mp as ops  # pylint: disable=g-import-not-at-top,wrong-import-position

SPARSITIES = (0.75, 0.9, 0.95)


def measured_bytes(batch: int, d: int, sparsity: float) -> tuple[int, int]:
  """(forward, backward) bytes on cross-device edges of a traced step."""
  w = tf.Variable(tf.ones([d, 1]))

  @tf.function
  def step(x):
    with tf.device("/cpu:0"):
      y = ops.dct_mp_transfer(tf.nn.relu(x), sparsity, "/cpu:1")
      with tf.device("/cpu:1"):
        loss = tf.reduce_sum(tf.matmul(y, w))
      return tf.gradients(loss, x)[0]

  graph = step.get_concrete_function(tf.TensorSpec([batch, d])).graph
  edges = {}
  for op in graph.get_operations():
    for t in op.inputs:
      src, dst = t.op.device[-5:], op.device[-5:]
      if src and dst and src != dst:  # one transfer per (tensor, destination)
        edges[(t.name, dst)] = t.shape.num_elements() * t.dtype.size
  forward = sum(b for (_, dst), b in edges.items() if dst == "CPU:1")
  backward = sum(b for (_, dst), b in edges.items() if dst == "CPU:0")
  return forward, backward


def bytes_table(batch: int) -> None:
  print(f"\n## Bytes per split and direction (batch {batch}, float32)\n")
  print("| d | eta | k | index | dense B (one way) | compact fwd / bwd B "
        "(formula) | measured fwd / bwd B | dense / compact fwd | round trip "
        "2*dense / (fwd+bwd) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for d in (512, 64):
    for eta in SPARSITIES:
      k = ops.num_kept(d, eta)
      dense = ops.dense_bytes(batch, d, tf.float32)
      compact = ops.compact_bytes(batch, d, k, tf.float32)
      back = batch * k * 4  # values only: both sides kept the indices
      fwd, bwd = measured_bytes(batch, d, eta)
      index = (f"{ops.index_bits(d)}-bit packed" if ops.index_wire.packs(d, k)
               else ops.index_dtype_for(d).name)
      print(f"| {d} | {eta} | {k} | {index} | {dense} | "
            f"{compact} / {back} | {fwd} / {bwd} | {dense / fwd:.2f}x | "
            f"{2 * dense / (fwd + bwd):.2f}x |")


def step_times(batch: int, steps: int, repeats: int) -> None:
  repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"], num_devices_per_replica=2)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch * 8, 64)).astype(np.float32)
  y = rng.normal(size=(batch * 8, 1)).astype(np.float32)
  input_fn = lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(
      batch, drop_remainder=True).repeat()

  def make(sparsity):
    with repl.scope():
      tf_keras.utils.set_random_seed(1)
      first = tf_keras.layers.Dense(512, activation="relu")
      hidden = tf_keras.layers.Dense(256, activation="relu")
      last = tf_keras.layers.Dense(1)
      split = (layers.DCTSplit(sparsity, target_logical_device=1)
               if sparsity is not None else None)
      for layer, dim in ((first, 64), (split, 512), (hidden, 512), (last, 256)):
        if layer is not None:
          layer.build((None, dim))
      opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.01))
    variables = (first.trainable_variables + hidden.trainable_variables +
                 last.trainable_variables)

    def step_fn(batch_):
      features, target = batch_
      with tf.GradientTape() as tape:
        h = first(features)
        if split is not None:
          h = split(h, training=True)
        with repl.logical_device(1):
          loss = tf.reduce_mean(tf.square(last(hidden(h)) - target))
      opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
      return loss

    return step_fn

  sides = {"dense": make(None), **{f"dct {s}": make(s) for s in (0.9, 0.95)}}
  for fn in sides.values():  # trace and warm up
    for _ in range(3):
      repl.run(fn, input_fn)
  times = {name: [] for name in sides}
  names = list(sides)
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      for _ in range(steps):
        out = repl.run(sides[name], input_fn)
      repl.experimental_local_results(out)[0].numpy()
      times[name].append((time.perf_counter() - start) / steps)
  base = np.median(times["dense"])
  print(f"\n## Step time, 1 replica x 2 logical CPUs (batch {batch}, "
        f"{repeats} blocks of {steps} steps)\n")
  print("| split | median step (ms) | ratio to dense |")
  print("|---|---|---|")
  for name in names:
    med = np.median(times[name])
    print(f"| {name} | {1e3 * med:.2f} | {med / base:.3f} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--batch", type=int, default=256)
  args = parser.parse_args()
  tf_dct.split_cpu(4)
  print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores, logical CPUs")
  bytes_table(args.batch)
  steps, repeats = (10, 3) if args.quick else (30, 9)
  step_times(args.batch, steps, repeats)


if __name__ == "__main__":
  main()
