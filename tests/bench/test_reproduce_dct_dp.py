"""Smoke tests of the DCT-DP table studies (Tables 2 and 3), tiny settings.

Two training steps per run through `bench/reproduce.py`: the plumbing of
`dct_table2_dp` (DCT-DP on the FC layers only) and `dct_table3_hybrid`
(2 replicas x 2 devices, DCT-DP + DCT-MP), not the numbers. A file of its own
so that pytest-xdist (`--dist loadfile`) can run it beside the other one.
"""

import pytest
import tensorflow as tf

from tests import util
from tests.bench import test_reproduce_dct


def setUpModule():
  util.setup_cpus()


class ReproduceDctDpTest(tf.test.TestCase):

  @pytest.mark.slow(seconds=13)
  def test_table2_dp_tiny_run(self):
    md = test_reproduce_dct.run_tiny(self, "dct_table2_dp", "--model_config", "local",
                                     "--sparsities", "0.9", "--eval_batches", "1",
                                     "--batch_size", "32")
    for text in ("| 90% |", "density_band=None", "The paper's Table 2"):
      self.assertIn(text, md)

  @pytest.mark.slow(seconds=14)
  def test_table3_hybrid_tiny_run(self):
    md = test_reproduce_dct.run_tiny(self, "dct_table3_hybrid", "--model_config", "local",
                                     "--sparsities", "0.9", "--eval_batches", "1",
                                     "--batch_size", "32")
    for text in ("| 90% |", "The paper's Table 3"):
      self.assertIn(text, md)



if __name__ == "__main__":
  tf.test.main()
