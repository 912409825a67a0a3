"""The launcher's TensorBoard summaries: two writers, one step, few groups.

As Keras' TensorBoard callback and the Model Garden do, training writes to
`<model_dir>/train` and evaluation to `<model_dir>/eval`, so TensorBoard
overlays the two runs' `metrics/loss`. A scalar's step is the optimizer step
its value belongs to: the loss of the s-th update and the bytes its
gradients moved are both at step s (the compressors and split layers write
at the default summary step, which is set to s while step s runs).

Training scalars are written every `--log_every` steps and at the last step,
the compressor's per-variable ones every `--summary_every` steps (and at the
last step): `tf.summary.record_if` conditions read inside the traced step,
so the other steps write nothing. Evaluation records nothing while the model
runs (the split layers would add points to the training series) and then
writes its metrics to the eval writer. The run's settings are written as an
hparams summary to `<model_dir>` itself (the session; `train` and `eval` are
its runs), when TensorBoard is installed. docs/launch.md lists every tag.
"""

from __future__ import annotations

import contextlib
import os

from absl import logging
import tensorflow as tf

from launch.flag_checks import ADAM_OPTIMIZERS
from tf_dct.compression.accounting import write_scalar
from tf_dct.dct_mp.split import SUMMARY_GROUP as MP_GROUP

TRAIN, EVAL = "train", "eval"
METRICS = "metrics"    # the loss and the model's metrics, train and eval
TRAINING = "training"  # learning rate, steady-state throughput
# --summary_every when not given: this many --log_every intervals.
SUMMARY_EVERY_LOGS = 10


def resolve_summary_every(cfg: dict) -> int:
  """--summary_every of `cfg`, its default filled in; raises ValueError.

  The per-variable scalars come at logged steps only, so that every point
  has the loss and the compressor's totals beside it: 0 (never) or a
  multiple of --log_every; default `SUMMARY_EVERY_LOGS` x --log_every.
  """
  every, log_every = cfg.get("summary_every"), cfg["log_every"]
  if every is None:
    return SUMMARY_EVERY_LOGS * log_every
  if every < 0 or every % log_every:
    raise ValueError(f"--summary_every must be 0 (never) or a multiple of --log_every "
                     f"({log_every}), got {every}")
  return every


def hparams(cfg: dict, num_replicas: int, *, sparsifier: bool,
            adam_correction: bool) -> dict:
  """The run's settings as TensorBoard hparams (bool, int, float or str).

  The compression options are those that apply to this run's compressor
  (e.g. sparsity for dct, density for topk), as in the summary table.
  `sparsifier`: the compressor keeps an error-feedback residual (it takes
  --min_count and the momentum and Adam corrections); `adam_correction`:
  whether the compressor runs Adam.
  """
  out = {"model": cfg["model"], "config": cfg["config"], "loop": cfg["loop"],
         "replicator": cfg["replicator"], "num_replicas": num_replicas,
         "num_devices_per_replica": cfg["num_devices_per_replica"],
         "batch_size": cfg["batch_size"], "steps": cfg["steps"],
         "optimizer": cfg["optimizer"], "learning_rate": cfg["learning_rate"],
         "seed": cfg["seed"], "compression": cfg["compression"],
         "mp_splits": ",".join(cfg.get("splits", ())) or "none",
         "data": "real" if cfg.get("data_dir") else "synthetic"}
  if cfg.get("splits"):
    out["mp_sparsity"] = cfg["mp_sparsity"]
    out["mp_rescale"] = cfg.get("mp_rescale", "none")
  comp = cfg["compression"]
  if comp != "none":
    out.update(warmup_steps=cfg["warmup_steps"], min_size=cfg["min_size"],
               compression_exclude=",".join(cfg.get("compression_exclude") or ()),
               sparse_gradients=cfg.get("sparse_gradients"),
               dense_gradients=cfg.get("dense_gradients", "auto"))
  if comp == "dct":
    out.update(sparsity=cfg["sparsity"], threshold_life=cfg["threshold_life"],
               sparsity_schedule=",".join(
                   f"{n}:{x}" for n, x in cfg.get("sparsity_schedule") or ()))
  elif comp in ("deft", "topk", "cltk"):
    out["density"] = cfg["density"]
    if comp == "deft":
      out["deft_budget"] = cfg.get("deft_budget", "size")
  elif comp == "threshold":
    out["threshold"] = cfg["threshold"]
    if "density" in cfg.get("explicit", ()):
      out["density"] = cfg["density"]
  if comp in ("dct", "topk", "threshold"):  # train.VALUE_WORDS
    out["value_dtype"] = cfg.get("value_dtype", "auto")
  if sparsifier:
    if cfg.get("min_count") is not None:
      out["min_count"] = cfg["min_count"]
    if cfg.get("whole_below") is not None:
      out["whole_below"] = cfg["whole_below"]
    if cfg["optimizer"] == "momentum":
      out["momentum_correction"] = bool(cfg.get("momentum_correction", True))
    if cfg["optimizer"] in ADAM_OPTIMIZERS:
      out["adam_correction"] = adam_correction
      if adam_correction:
        out["adam_second_moment"] = cfg.get("adam_second_moment", "factored")
        out["adam_residual_decay"] = cfg.get("adam_residual_decay") or 1.0
  return out


class Summaries:
  """The writers of one run, the summary step and the recording conditions.

  Args:
    cfg: the launcher configuration (`log_every`, `steps`, `summary_every`).
    model_dir: the run's directory; empty: nothing is written.
  """

  def __init__(self, cfg: dict, model_dir: str):
    self.log_every, self.steps = cfg["log_every"], cfg["steps"]
    self.summary_every = resolve_summary_every(cfg)
    self.model_dir = model_dir
    # The step being run: the default step of the training writer. Not a
    # distributed variable, so setting it is one assignment.
    with tf.init_scope():
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="summary_step")
    if model_dir:
      self.train_writer = tf.summary.create_file_writer(os.path.join(model_dir, TRAIN))
      self.eval_writer = tf.summary.create_file_writer(os.path.join(model_dir, EVAL))
    else:
      self.train_writer = self.eval_writer = tf.summary.create_noop_writer()
    self._timed = (0, 0.0)  # (steps, seconds) timed at the previous log

  def _logged(self):
    return (self.step % self.log_every == 0) | (self.step == self.steps)

  def _variables_logged(self):
    return (self.step % self.summary_every == 0) | (self.step == self.steps)

  def gate(self, compressor) -> None:
    """Writes `compressor`'s per-variable scalars every --summary_every steps."""
    if compressor is not None:
      compressor.variable_summaries = (self._variables_logged if self.summary_every
                                       else False)

  @contextlib.contextmanager
  def training(self):
    """The training writer at the summary step, recording on logged steps."""
    try:
      with self.train_writer.as_default(step=self.step), tf.summary.record_if(self._logged):
        yield
    finally:
      self.flush()  # also what a diverged run wrote

  def begin_step(self, step: int) -> None:
    """Sets the summary step to `step`, the step about to run (from 1)."""
    if self.model_dir:
      self.step.assign(step)

  def log(self, step: int, *, loss: float, metrics: dict, learning_rate: float,
          timed_steps: int, timed_seconds: float, batch_size: int,
          mp: dict | None) -> None:
    """The launcher's scalars of a logged step.

    Args:
      step: the step.
      loss: its loss, as printed.
      metrics: the model's training metrics (`--loop=fit`), name -> value.
      learning_rate: the optimizer's learning rate.
      timed_steps: steps of the steady state so far (the first step of the
        run, which traces, is not one).
      timed_seconds: their time, evaluations and checkpoints left out.
      batch_size: the global batch.
      mp: `Job.mp_bytes()`, cumulative DCT-MP bytes, or None.
    """
    steps = timed_steps - self._timed[0]
    seconds = timed_seconds - self._timed[1]
    self._timed = (timed_steps, timed_seconds)
    with self.train_writer.as_default(), tf.summary.record_if(True):
      write_scalar(f"{METRICS}/loss", loss, step)
      for name, value in metrics.items():
        write_scalar(f"{METRICS}/{name}", value, step)
      write_scalar(f"{TRAINING}/learning_rate", learning_rate, step)
      if steps > 0 and seconds > 0:  # the steady state since the previous log
        write_scalar(f"{TRAINING}/steps_per_sec", steps / seconds, step)
        write_scalar(f"{TRAINING}/examples_per_sec", steps / seconds * batch_size, step)
      if mp:
        write_scalar(f"{MP_GROUP}/total_bytes", mp["bytes"], step)
        if mp["bytes"]:
          write_scalar(f"{MP_GROUP}/compression_ratio", mp["dense_bytes"] / mp["bytes"],
                       step)

  @contextlib.contextmanager
  def evaluation(self):
    """Around evaluating the model: nothing is recorded."""
    with tf.summary.record_if(False):
      yield

  def eval(self, step: int, result: dict) -> None:
    """The evaluation `result` (name -> value) at `step`, to the eval writer."""
    with self.eval_writer.as_default(), tf.summary.record_if(True):
      for name, value in result.items():
        write_scalar(f"{METRICS}/{name}", value, step)
    self.eval_writer.flush()

  def write_hparams(self, values: dict, metric: str) -> bool:
    """The hparams summary of the run to `<model_dir>`; False if not written.

    `metric`: the model's evaluation metric, shown with the train loss as
    the session's metrics. Needs TensorBoard (the launcher's extra); without
    it a warning is logged and training goes on.
    """
    if not self.model_dir:
      return False
    try:
      from tensorboard.plugins.hparams import api as hp  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      logging.warning("no hparams summary: TensorBoard's hparams plugin cannot be "
                      "imported (%s); install tf-dct[launch]", e)
      return False
    writer = tf.summary.create_file_writer(self.model_dir)
    with writer.as_default(), tf.summary.record_if(True):
      hp.hparams_config(
          hparams=[hp.HParam(name) for name in values],
          metrics=[hp.Metric(f"{METRICS}/loss", group=TRAIN, display_name="train loss"),
                   hp.Metric(f"{METRICS}/{metric}", group=EVAL,
                             display_name=f"eval {metric}")])
      hp.hparams(values)
    writer.close()
    return True

  def flush(self) -> None:
    self.train_writer.flush()
    self.eval_writer.flush()
