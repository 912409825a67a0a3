"""launch/summaries.py: the TensorBoard layout of a launcher run, read back
from the event files (one short DCT-DP run of the mlp on 2 replicas, shared)."""

import contextlib
import glob
import io
import os
import re
import shutil
import sys
import tempfile
from unittest import mock

from absl.testing import flagsaver
import numpy as np
import tensorflow as tf

from launch import summaries
from launch import train
from tests import util
from tests.launch.test_train import TWO_REPLICAS


def setUpModule():
  util.setup_cpus()


def _cfg(**overrides):
  with flagsaver.flagsaver(config="local", **overrides):
    return train.resolved_config()


def _groups(tags):
  return {t.split("/")[0] for t in tags}


def _steps(series):
  return [s for s, _ in series]


class LayoutTest(tf.test.TestCase):
  """Steps 1..6, logged at 2, 4, 6; per-variable at 4 and 6 (the last);
  evaluated at 3 and 6."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model_dir = model_dir = tempfile.mkdtemp(prefix="tf_dct_summaries_")
    cls.cfg = _cfg(model="mlp", compression="dct", **TWO_REPLICAS, steps=6, log_every=2,
                   summary_every=4, eval_every=3, model_dir=model_dir)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      cls.job = train.Job(cls.cfg).setup()
      cls.summary = cls.job.run()
    cls.printed = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"^step +(\d+)/6  loss ([\d.]+)", out.getvalue(), re.M)}
    cls.train = util.events(os.path.join(model_dir, "train"))
    cls.eval = util.events(os.path.join(model_dir, "eval"))

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.model_dir, ignore_errors=True)
    super().tearDownClass()

  def test_writers_and_groups(self):
    self.assertEqual(_groups(self.train),
                     {"metrics", "training", "tf_dct", "tf_dct_variables"})
    self.assertEqual(set(self.eval), {"metrics/mse"})
    self.assertEqual(util.events(self.model_dir), {})  # the root: hparams only

  def test_loss_is_what_the_run_printed_at_the_logged_steps(self):
    loss = self.train["metrics/loss"]
    self.assertEqual(_steps(loss), [2, 4, 6])
    self.assertEqual(sorted(self.printed), [2, 4, 6])
    for step, value in loss:
      self.assertEqual(value, np.float32(self.summary["losses"][step - 1]))
      self.assertEqual(round(value, 5), self.printed[step])

  def test_library_scalars_at_the_steps_of_the_loss(self):
    for tag, series in self.train.items():
      want = [4, 6] if tag.startswith("tf_dct_variables/") else [2, 4, 6]
      self.assertEqual(_steps(series), want, tag)
    # The value at step 6 is the 6th step's: the totals after six steps.
    stats = self.job.optimizer.communication_stats()
    self.assertEqual(stats["steps"], [6, 6])
    total = stats["total"]
    self.assertEqual(self.train["tf_dct/total_bytes_sent"][-1][1], total["bytes_sent"][0])
    self.assertAllClose(self.train["tf_dct/compression_ratio"][-1][1],
                        total["stock_bytes"][0] / total["bytes_sent"][0])
    self.assertAllClose(self.train["tf_dct/density"][-1][1], stats["last"]["density"][0])
    compressor = self.job.compressor
    residuals = [compressor.state_for(v)["residual"].numpy()[0]
                 for v in self.job.model.trainable_variables]
    self.assertAllClose(self.train["tf_dct/residual_norm"][-1][1],
                        np.sqrt(sum(np.sum(np.square(r)) for r in residuals)), rtol=1e-5)
    # Every logged threshold is the variable's at step 6; the first kernel (a
    # compressed one) is among them. Layer names depend on what the process
    # built before ("dense" or "dense_3"), so they are read from the model.
    prefix = "tf_dct_variables/threshold/"
    logged = [tag[len(prefix):] for tag in self.train if tag.startswith(prefix)]
    first = self.job.model.trainable_variables[0].name.split(":")[0]
    self.assertIn(first, logged)
    for name in logged:
      tau = self.train[prefix + name][-1][1]
      self.assertEqual(tau, np.float32(stats["variables"][name]["last"]
                                       ["threshold"][0]), name)

  def test_training_scalars(self):
    self.assertEqual(self.train["training/learning_rate"],
                     [(s, np.float32(self.cfg["learning_rate"])) for s in (2, 4, 6)])
    # Steady state between logs; step 2's interval has one timed step (2).
    rates = self.train["training/steps_per_sec"]
    examples = self.train["training/examples_per_sec"]
    self.assertEqual(_steps(rates), [2, 4, 6])
    self.assertAllClose([v for _, v in examples], [32 * v for _, v in rates], rtol=1e-6)
    self.assertTrue(all(v > 0 for _, v in rates))

  def test_evaluation_only_in_the_eval_writer(self):
    self.assertEqual(_steps(self.eval["metrics/mse"]), [3, 6])
    self.assertEqual([v for _, v in self.eval["metrics/mse"]],
                     [np.float32(self.job.evals[s]["mse"]) for s in (3, 6)])
    self.assertNotIn("metrics/mse", self.train)

  def test_hparams(self):
    from tensorboard.plugins.hparams import metadata  # pylint: disable=g-import-not-at-top
    infos = []
    for path in glob.glob(os.path.join(self.model_dir, "events.out.tfevents.*")):
      for event in tf.compat.v1.train.summary_iterator(path):
        for v in event.summary.value:
          if v.tag == metadata.SESSION_START_INFO_TAG:
            infos.append(metadata.parse_session_start_info_plugin_data(
                v.metadata.plugin_data.content))
    (info,) = infos
    hp = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    self.assertEqual(hp["model"], "mlp")
    self.assertEqual(hp["compression"], "dct")
    self.assertEqual(hp["num_replicas"], 2)
    self.assertEqual(hp["batch_size"], 32)
    self.assertAllClose(hp["sparsity"], 0.9)
    self.assertAllClose(hp["learning_rate"], self.cfg["learning_rate"])
    self.assertNotIn("density", hp)  # not a dct option
    self.assertEqual(hp["value_dtype"], "auto")
    self.assertEqual(hp["mp_splits"], "none")


class FitLoopTest(tf.test.TestCase):

  def test_fit_loop_aligns_the_library_scalars_with_the_loss(self):
    model_dir = self.create_tempdir().full_path
    train.train(_cfg(model="mlp", compression="topk", **TWO_REPLICAS, steps=4, log_every=2,
                     summary_every=0, loop="fit", model_dir=model_dir))
    events = util.events(os.path.join(model_dir, "train"))
    self.assertEqual(_steps(events["metrics/loss"]), [2, 4])
    self.assertEqual(_steps(events["tf_dct/bytes_sent"]), [2, 4])
    self.assertEqual(_groups(events), {"metrics", "training", "tf_dct"})  # summary_every=0


class FlagsTest(tf.test.TestCase):

  def test_summary_every(self):
    self.assertEqual(_cfg(model="mlp")["summary_every"], 100)  # 10 x --log_every (10)
    self.assertEqual(_cfg(model="mlp", log_every=5, summary_every=0)["summary_every"], 0)
    for bad in (15, -10):
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--summary_every must be 0 \(never\) or a multiple of "
                                  rf"--log_every \(10\), got {bad}$"):
        _cfg(model="mlp", summary_every=bad)

  def test_without_tensorboard_no_hparams_and_a_warning(self):
    model_dir = self.create_tempdir().full_path
    writer = summaries.Summaries(_cfg(model="mlp"), model_dir)
    with mock.patch.dict(sys.modules, {"tensorboard.plugins.hparams": None}), \
        self.assertLogs(level="WARNING") as logs:
      self.assertFalse(writer.write_hparams({"model": "mlp"}, "mse"))
    self.assertIn("no hparams summary", logs.output[0])
    self.assertEmpty(glob.glob(os.path.join(model_dir, "events.out.tfevents.*")))
    self.assertTrue(writer.write_hparams({"model": "mlp"}, "mse"))
    self.assertLen(glob.glob(os.path.join(model_dir, "events.out.tfevents.*")), 1)


if __name__ == "__main__":
  tf.test.main()
