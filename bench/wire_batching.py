r"""Exchange time of `sparse_wire.exchange_many`: short buffers batched or not.

In one process on 4 logical CPU devices, each replica exchanges V packed
buffers of `capacity` slots (vectors of n = 50 * capacity entries, random
increasing positions, "auto" and "int32" index encodings), on stock ops
(`use_native=False`: the native exchange has no batching). The same exchange
is traced twice: with `exchange_many(batch_capacity=...)` at the library's
`sparse_wire.BATCH_CAPACITY` (buffers of at most that many slots share one
set of ops) and at 0 (every buffer on its own). Timed blocks alternate; the medians and their ratio are printed. Both
sides return the same sums (checked bit for bit before timing).

With `--mlp_layers=L` it also times whole training steps: an MLP of L
hidden layers of `--mlp_width` units (2 L + 2 variables, every buffer short),
4 replicas, SGD, global batch 256, DCTDP(0.99, threshold_life=1000,
native=False) (the grouping is a stock-op path; the native kernel selects
every variable in one op) built three ways: with the wire's batching off
(`DCTDP(batch_capacity=0)`), with the selection's grouping of small variables
off (`DCTDP(fuse_size=0)`), and with both on, against Dense; interleaved
blocks, medians. It also prints how long each side took to trace and run
its first step.

Usage:
  python bench/wire_batching.py                       # ~5 min
  python bench/wire_batching.py --shapes=200x40 --mlp_layers=20 --mlp_width=32
  python bench/wire_batching.py --shapes=200x40 --repeats=3
  python bench/wire_batching.py --shapes=40x200,16x600 --batch_capacity=1000
      # longer buffers batched too: why BATCH_CAPACITY stops at 128
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app, flags  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["200x40", "100x100", "50x128"],
                  "buffers per replica x slots per buffer")
flags.DEFINE_integer("batch_capacity", None, "batched side: buffers of at most "
                     "this many slots are batched (default: the library's "
                     "sparse_wire.BATCH_CAPACITY)", lower_bound=1)
flags.DEFINE_integer("mlp_layers", 0, "also time whole steps of an MLP with "
                     "this many hidden layers (0: off; each DCTDP side "
                     "takes up to ~1 s per variable to trace)", lower_bound=0)
flags.DEFINE_integer("mlp_width", 32, "units per hidden layer of --mlp_layers",
                     lower_bound=1)
flags.DEFINE_integer("repeats", 7, "timed blocks per side", lower_bound=1)
flags.DEFINE_integer("calls", 10, "exchanges per timed block", lower_bound=1)


def parse(shape: str) -> tuple[int, int]:
  """'VxC' -> (V, C), or a ValueError naming --shapes."""
  try:
    count, capacity = (int(x) for x in shape.split("x"))
  except ValueError:
    count = capacity = 0
  if count < 1 or capacity < 1:
    raise ValueError(f"--shapes: each must be 'VxC' with integers V, C >= 1, "
                     f"got {shape!r}")
  return count, capacity


def _check_shapes(shapes) -> bool:
  """The --shapes validator: `parse`'s error, before TensorFlow loads."""
  for shape in shapes:
    try:
      parse(shape)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
  return True


flags.register_validator("shapes", _check_shapes)

if __name__ == "__main__":
  # A bad flag is refused here, before TensorFlow loads (seconds earlier);
  # app.run parses the flags again.
  app.define_help_flags()
  app.parse_flags_with_usage(sys.argv)
  FLAGS.unparse_flags()

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tf_dct  # pylint: disable=wrong-import-position
from tf_dct.compression import sparse_wire  # pylint: disable=wrong-import-position


REPLICAS = 4


def exchange_fn(repl, data, n, encoding, batch_capacity):
  """A traced exchange of `data[replica]` batching buffers of at most
  `batch_capacity` slots."""

  def fn():
    ctx = tf.distribute.get_replica_context()
    mine = data[tf.get_static_value(ctx.replica_id_in_sync_group)]
    bufs = [(tf.constant(i), tf.constant(v), n) for i, v in mine]
    # Stock ops: the native exchange takes every buffer in one op and has
    # no batching to compare.
    return sparse_wire.exchange_many(ctx, bufs, encoding=encoding,
                                     presorted=True, use_native=False,
                                     batch_capacity=batch_capacity)

  step = tf.function(lambda: repl.run(fn))
  step.get_concrete_function()  # traced before timing
  return step


def mlp_step(repl, compressor, layers, width, data):
  """One training step of a fresh MLP under `compressor`, traced.

  Returns the step and the seconds its trace and first call took.
  """
  import tf_keras  # pylint: disable=g-import-not-at-top
  with repl.scope():
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential(
        [tf_keras.Input((width,))]
        + [tf_keras.layers.Dense(width, activation="relu") for _ in range(layers)]
        + [tf_keras.layers.Dense(1)])
    opt = repl.wrap_optimizer(tf_keras.optimizers.SGD(0.01),
                              compression=compressor)

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x) - y)) / 256
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  def input_fn(ctx):
    del ctx
    return tf.data.Dataset.from_tensor_slices(data).repeat().batch(256)

  start = time.perf_counter()
  repl.run(step_fn, input_fn)  # traced
  return (lambda: repl.run(step_fn, input_fn)), time.perf_counter() - start


def time_sides(sides, repeats, calls):
  """Median ms per call of each side, timed in alternating blocks."""
  times = {k: [] for k in sides}
  for _ in range(repeats):
    for k, f in sides.items():
      start = time.perf_counter()
      for _ in range(calls):
        f()
      times[k].append((time.perf_counter() - start) / calls * 1e3)
  return {k: float(np.median(t)) for k, t in times.items()}


def main(argv):
  del argv
  shapes = [parse(s) for s in FLAGS.shapes]
  batched = FLAGS.batch_capacity or sparse_wire.BATCH_CAPACITY
  tf_dct.split_cpu(REPLICAS)
  # The buffers are graph constants; folding would run the encoding once at
  # trace time instead of in every call.
  tf.config.optimizer.set_experimental_options({"constant_folding": False})
  repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(REPLICAS)])
  print(f"exchange_many on {REPLICAS} CPU replicas; batched = buffers of <= "
        f"{batched} slots share one set of ops")
  print("| buffers x slots | encoding | one by one (ms) | batched (ms) | "
        "one by one / batched |")
  print("|---|---|---|---|---|")
  for count, capacity in shapes:
    n = 50 * capacity
    rng = np.random.default_rng(count * 1000 + capacity)
    data = [[(np.sort(rng.choice(n, capacity, replace=False)).astype(np.int32),
              rng.normal(size=capacity).astype(np.float32))
             for _ in range(count)] for _ in range(REPLICAS)]
    for encoding in ("auto", "int32"):
      sides = {"single": exchange_fn(repl, data, n, encoding, 0),
               "batched": exchange_fn(repl, data, n, encoding, batched)}
      results = {k: f() for k, f in sides.items()}
      local = lambda out: [t for o in out
                           for t in repl.experimental_local_results(o)]
      for a, b in zip(local(results["single"]), local(results["batched"])):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
      one, many = time_sides(sides, FLAGS.repeats, FLAGS.calls).values()
      print(f"| {count} x {capacity} | {encoding} | {one:.2f} | {many:.2f} | "
            f"{one / many:.2f}x |")
  if FLAGS.mlp_layers:
    from tf_dct import compression  # pylint: disable=g-import-not-at-top
    layers, width = FLAGS.mlp_layers, FLAGS.mlp_width
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, width)).astype(np.float32)
    data = (x, (x[:, :1] > 0).astype(np.float32))
    dctdp = lambda **kw: compression.DCTDP(0.99, threshold_life=1000,
                                           native=False, **kw)
    built = {
        "Dense": mlp_step(repl, compression.Dense(), layers, width, data),
        "DCTDP, wire one by one": mlp_step(
            repl, dctdp(batch_capacity=0), layers, width, data),
        "DCTDP, selection one by one": mlp_step(
            repl, dctdp(batch_capacity=batched, fuse_size=0), layers, width,
            data),
        "DCTDP batched": mlp_step(repl, dctdp(batch_capacity=batched), layers,
                                  width, data)}
    sides = {k: f for k, (f, _) in built.items()}
    for f in sides.values():  # warm up
      for _ in range(10):
        f()
    ms = time_sides(sides, FLAGS.repeats, 5)
    print(f"\nwhole step, MLP of {layers} x {width} ({2 * layers + 2} "
          "variables), global batch 256")
    print("| side | ms/step | vs Dense | trace + first step (s) |")
    print("|---|---|---|---|")
    for k, v in ms.items():
      print(f"| {k} | {v:.2f} | {v / ms['Dense']:.3f}x | {built[k][1]:.1f} |")
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main)
