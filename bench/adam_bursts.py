r"""How far an optimizer moves a weight whose gradient arrives in bursts.

Error feedback (DCT-DP, DEFT, TopK) holds a coordinate's gradient back until
it is large enough to send, so a coordinate that would receive g on every
step receives about T * g once every T steps instead. SGD is linear in the
gradient: after any whole number of bursts the weight has moved exactly as
far as with dense gradients. Adam divides each step by the running root mean
square of the coordinate's own gradients, which a burst inflates by about
sqrt(T), so it moves the weight about 1 / sqrt(T) as far.

This script measures that with tf-keras's own optimizers on one scalar
weight: a constant gradient of 1 for `--steps` steps (dense), against T on
every T-th step and 0 otherwise (bursts), both followed by `--tail` steps of
zero gradient (so that momentum a burst already gave still counts), and
prints the displacement of the burst run divided by the dense run's, for
several T. It is the mechanism
behind the loss gap of Adam-trained runs in docs/performance.md (end-to-end
runs); it does not model the interplay of many coordinates.

Usage:
  python bench/adam_bursts.py                  # ~10 s
  python bench/adam_bursts.py --steps=1000
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 100, "steps per run, a multiple of every period",
                     lower_bound=1)
flags.DEFINE_list("periods", ["1", "2", "5", "10", "25", "100"],
                  "burst periods T (steps between sends), each >= 1")
flags.DEFINE_float("learning_rate", 1e-3, "learning rate of both optimizers")
flags.DEFINE_integer("tail", 100, "steps with zero gradient after the last "
                     "burst, so momentum already received still counts", lower_bound=0)


def displacement(optimizer, grads) -> float:
  """How far `optimizer` moves a scalar weight (from 0) fed `grads` in turn."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  w = tf.Variable(0.0)
  step = tf.function(lambda g: optimizer.apply_gradients([(g, w)]))
  for g in grads:
    step(tf.constant(g, tf.float32))
  return abs(float(w.numpy()))


def main(argv):
  del argv
  periods = [int(t) if t.strip().isdigit() else -1 for t in FLAGS.periods]
  bad = [t for t, p in zip(FLAGS.periods, periods) if p < 1 or FLAGS.steps % p]
  if bad:
    raise app.UsageError(f"--periods: each must be an int >= 1 that divides "
                         f"--steps={FLAGS.steps}, got {bad}")
  lr = FLAGS.learning_rate
  if lr <= 0:
    raise app.UsageError(f"--learning_rate must be > 0, got {lr}")
  import tf_keras  # pylint: disable=g-import-not-at-top  (after the flag checks: slow)
  makers = {"SGD": lambda: tf_keras.optimizers.SGD(lr),
            "Adam": lambda: tf_keras.optimizers.Adam(lr)}
  tail = [0.0] * FLAGS.tail
  dense = [1.0] * FLAGS.steps + tail
  base = {name: displacement(make(), dense) for name, make in makers.items()}
  print(f"{FLAGS.steps} steps of gradient and {FLAGS.tail} of zeros, learning "
        f"rate {lr}; displacement with bursts every T steps / displacement with "
        f"dense gradients")
  print("| T | SGD | Adam | 1 / sqrt(T) |")
  print("|---|---|---|---|")
  for t in periods:
    bursts = [float(t) if (i + 1) % t == 0 else 0.0
              for i in range(FLAGS.steps)] + tail
    ratio = {name: displacement(make(), bursts) / base[name]
             for name, make in makers.items()}
    print(f"| {t} | {ratio['SGD']:.3f} | {ratio['Adam']:.3f} | {t ** -0.5:.3f} |")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
