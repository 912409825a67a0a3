"""Train a model under a tf_dct replicator: `python -m launch.train --config=local`.

The default job trains the synthetic-teacher MLP (models/mlp.py) on 4 logical
CPU replicas through `Replicator.run(step_fn, input_fn)` with a wrapped
optimizer, checkpoints to --model_dir (resuming from the latest checkpoint)
and prints a progress line and a final summary table.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging
import tensorflow as tf
import tf_keras

import tf_dct
from models import mlp

CONFIGS = {
    # name: overrides applied on top of the flags' defaults
    "default": {},
    "local": {"steps": 30, "batch_size": 32, "log_every": 10},
}

flags.DEFINE_enum("model", "mlp", ["mlp"], "Model to train.")
flags.DEFINE_enum("config", "default", sorted(CONFIGS),
                  "Preset; 'local' shrinks the run to a smoke test.")
flags.DEFINE_enum("replicator", "cpu", ["auto", "cpu", "gpu", "multi_worker", "tpu"],
                  "Replicator kind (see tf_dct.create_replicator).")
flags.DEFINE_integer("num_replicas", 4, "Replicas on this machine (cpu/gpu).")
flags.DEFINE_integer("num_devices_per_replica", 1, "Devices per model-parallel replica.")
flags.DEFINE_string("tpu", None, "TPU name or 'local' (with --replicator=tpu).")
flags.DEFINE_integer("steps", 300, "Training steps (total, including resumed ones).")
flags.DEFINE_integer("batch_size", 256, "Global batch size.")
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.")
flags.DEFINE_integer("log_every", 50, "Steps between progress lines.")
flags.DEFINE_string("model_dir", "", "Checkpoint directory; empty: no checkpoints.")
flags.DEFINE_integer("seed", 0, "Seed for model init and data.")

FLAGS = flags.FLAGS


def resolved_config() -> dict:
  """The flag values; a flag left at its default takes the preset's value."""
  cfg = {name: FLAGS[name].value for name in
         ("model", "replicator", "num_replicas", "num_devices_per_replica", "tpu",
          "steps", "batch_size", "learning_rate", "log_every", "model_dir", "seed")}
  for name, value in CONFIGS[FLAGS.config].items():
    if not FLAGS[name].present and FLAGS[name].value == FLAGS[name].default:
      cfg[name] = value
  for name in ("steps", "batch_size", "log_every", "num_replicas"):
    if cfg[name] < 1:
      raise app.UsageError(f"--{name} must be >= 1, got {cfg[name]}")
  return cfg


def train(cfg: dict) -> dict:
  """Runs the job; returns a summary dict (first/last loss, steps, wall time)."""
  per_kind = {"num_replicas": cfg["num_replicas"]} if cfg["replicator"] in ("cpu", "gpu") else {}
  repl = tf_dct.create_replicator(cfg["replicator"],
                                  num_devices_per_replica=cfg["num_devices_per_replica"],
                                  tpu=cfg["tpu"], **per_kind)
  if cfg["batch_size"] % repl.num_replicas:
    raise ValueError(f"--batch_size ({cfg['batch_size']}) must be divisible by the "
                     f"number of replicas ({repl.num_replicas})")
  with repl.scope():
    model = mlp.build_model(seed=cfg["seed"])
    optimizer = repl.wrap_optimizer(tf_keras.optimizers.SGD(cfg["learning_rate"]))
    step_counter = tf.Variable(0, dtype=tf.int64, trainable=False)
  ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step_counter)
  manager = None
  if cfg["model_dir"]:
    manager = tf.train.CheckpointManager(ckpt, cfg["model_dir"], max_to_keep=3)
    if manager.latest_checkpoint:
      ckpt.restore(manager.latest_checkpoint).assert_existing_objects_matched()
      print(f"restored {manager.latest_checkpoint} at step {int(step_counter.numpy())}")

  global_batch = cfg["batch_size"]
  dataset = mlp.make_dataset(global_batch, seed=cfg["seed"]).skip(int(step_counter.numpy()))
  input_fn = lambda ctx: dataset

  def step_fn(batch):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / global_batch
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

  first_loss = last_loss = None
  start = time.perf_counter()
  start_step = int(step_counter.numpy())
  for step in range(start_step, cfg["steps"]):
    per_replica = repl.experimental_local_results(repl.run(step_fn, input_fn))
    loss = float(sum(t.numpy() for t in per_replica))  # each is a share of the mean
    step_counter.assign_add(1)
    first_loss = loss if first_loss is None else first_loss
    last_loss = loss
    if (step + 1) % cfg["log_every"] == 0 or step + 1 == cfg["steps"]:
      rate = (step + 1 - start_step) / (time.perf_counter() - start)
      print(f"step {step + 1:>6}/{cfg['steps']}  loss {loss:.5f}  {rate:.1f} steps/s",
            flush=True)
      if manager:
        manager.save(checkpoint_number=step + 1)
  wall = time.perf_counter() - start
  summary = {"model": cfg["model"], "replicas": repl.num_replicas,
             "steps": int(step_counter.numpy()), "first_loss": first_loss,
             "final_loss": last_loss, "wall_seconds": wall}
  print("\n| model | replicas | steps | first loss | final loss | wall time |")
  print("|---|---|---|---|---|---|")
  fmt = lambda v: "-" if v is None else f"{v:.5f}"
  print(f"| {summary['model']} | {summary['replicas']} | {summary['steps']} | "
        f"{fmt(first_loss)} | {fmt(last_loss)} | {wall:.1f} s |")
  return summary


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  tf.get_logger().setLevel("WARNING")
  train(resolved_config())


if __name__ == "__main__":
  app.run(main)
