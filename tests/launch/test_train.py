"""Tests for launch/train.py: the Quick-start job, in process, on the local config."""

from absl import flags
from absl.testing import flagsaver
import tensorflow as tf

from launch import train
from tests import util


def setUpModule():
  util.setup_cpus()


class TrainTest(tf.test.TestCase):

  def _cfg(self, **overrides):
    with flagsaver.flagsaver(config="local", **overrides):
      return train.resolved_config()

  def test_local_config_learns_and_resumes(self):
    model_dir = self.create_tempdir().full_path
    first = train.train(self._cfg(steps=40, log_every=20, model_dir=model_dir))
    self.assertEqual(first["steps"], 40)
    self.assertLess(first["final_loss"], 0.6 * first["first_loss"])
    resumed = train.train(self._cfg(steps=60, log_every=20, model_dir=model_dir))
    self.assertEqual(resumed["steps"], 60)  # 20 more steps, not 60 from scratch
    self.assertLess(resumed["first_loss"], first["first_loss"])

  def test_bad_flags(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "model"):
      flags.FLAGS["model"].parse("resnet-9000")
    with self.assertRaisesRegex(Exception, "--steps must be >= 1, got 0"):
      self._cfg(steps=0)
    with self.assertRaisesRegex(ValueError, r"--batch_size \(30\) must be divisible by "
                                r"the number of replicas \(4\)"):
      train.train(self._cfg(batch_size=30))


if __name__ == "__main__":
  tf.test.main()
