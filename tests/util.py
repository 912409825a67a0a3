"""Shared test helpers."""

import glob
import os

import tensorflow as tf

import tf_dct

NUM_CPUS = 4


def setup_cpus() -> list[str]:
  """Splits the CPU into NUM_CPUS logical devices (idempotent across modules)."""
  return tf_dct.split_cpu(NUM_CPUS)


def builtin_mirrored(devices) -> tf.distribute.MirroredStrategy:
  """A plain built-in MirroredStrategy with its own collective key range.

  Every built-in instance starts its collective keys at the same base, so two
  of them over the same devices in one process clash; TF's own tests bump the
  class attribute the same way (strategy_combinations.py).
  """
  tf.distribute.MirroredStrategy._collective_key_base += 100_000  # pylint: disable=protected-access
  return tf.distribute.MirroredStrategy(devices)


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` without tf.data autotuning, for small in-memory test data.

  An autotuned iterator's model thread sleeps for periods that grow to a
  minute, and destroying the iterator (when fit returns, or when a replicator
  holding it is collected) waits for that thread: a stall of up to a minute
  in whatever test runs then.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


def local(strategy, value):
  """Per-replica results of `value` as a list of numpy arrays (nested ok)."""
  return [tf.nest.map_structure(lambda t: t.numpy(), v)
          for v in strategy.experimental_local_results(value)]


def graph_ops(function) -> list[str]:
  """Op types of `function`'s graph, with those of its nested functions
  (`tf.cond` branches, inner tf.functions)."""
  graph = function.get_concrete_function().graph.as_graph_def()
  return [n.op for n in graph.node] + [
      n.op for f in graph.library.function for n in f.node_def]


def squared_error_step(model, optimizer, batch_size: int, before=None):
  """A replica's step function: summed squared error over `batch_size`
  (the global batch), gradients applied with `optimizer`; returns the loss.
  `before()`, if given, runs first (e.g. to record a trace)."""
  def step_fn(batch):
    if before is not None:
      before()
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x) - y)) / batch_size
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
  return step_fn


def events(logdir: str) -> dict:
  """{tag: [(step, value), ...]} of the scalars in `logdir`'s event files, in
  the order written (one directory, not its subdirectories)."""
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    for raw in tf.data.TFRecordDataset(path):
      event = tf.compat.v1.Event.FromString(raw.numpy())
      for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name == "scalars":
          out.setdefault(v.tag, []).append((event.step, tf.make_ndarray(v.tensor).item()))
  return out
