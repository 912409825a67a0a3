"""Smoke tests of the DCT table studies of bench/reproduce.py, tiny settings.

Runs `dct_table1_mp` on the launcher's tiny `local` DLRM (a dense run and a
two-split run, a few steps each), `dct_tables_6_7` (DCT-MP, Gaussian sketch,
top-k of X_grad) and `dct_table4_transformer` (a one-layer Transformer) for 2
steps: the shared helpers (`job_config`, the `launch.train.Job` subclass, the
metrics, the byte model) and the markdown / PNG output. They check the
plumbing, not the numbers (those are in docs/reproduction/).
"""

import contextlib
import io
import os

import pytest
import tensorflow as tf

from bench import reproduce
from tests import util


def run_tiny(test: tf.test.TestCase, study: str, *args: str) -> str:
  """Runs `study` in quick mode for 2 steps with `args`; returns its markdown."""
  out = test.create_tempdir().full_path
  reproduce.main([study, "--quick", "--steps", "2", "--no_reinit",
                  "--out_dir", out, *args])
  png = os.path.join(out, f"{study}_quick.png")
  test.assertTrue(os.path.exists(png))
  # the plotted series are stored beside it; --replot redraws the PNG from them
  test.assertTrue(os.path.exists(os.path.join(out, f"{study}_quick.json")))
  os.remove(png)
  reproduce.main([study, "--quick", "--replot", "--out_dir", out])
  test.assertTrue(os.path.exists(png))
  with open(os.path.join(out, f"{study}_quick.md"), encoding="utf-8") as f:
    return f.read()


def setUpModule():
  util.setup_cpus()


class ReproduceDctTest(tf.test.TestCase):

  def test_help_lists_every_study(self):
    # A study description with a literal % once broke argparse's help.
    out = io.StringIO()
    with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as done:
      reproduce.main(["--help"])
    self.assertEqual(done.exception.code, 0)
    for study in reproduce.discover():
      self.assertIn(study, out.getvalue())

  @pytest.mark.slow(seconds=12)
  def test_table1_tiny_run_writes_table_and_plot(self):
    out = self.create_tempdir().full_path
    reproduce.main(["dct_table1_mp", "--quick", "--model_config", "local", "--steps", "2",
                    "--sparsities", "none", "--two_split_sparsities", "0.5",
                    "--eval_batches", "2", "--batch_size", "32", "--no_reinit",
                    "--out_dir", out])
    with open(os.path.join(out, "dct_table1_mp_quick.md"), encoding="utf-8") as f:
      md = f.read()
    self.assertTrue(os.path.exists(os.path.join(out, "dct_table1_mp_quick.png")))
    for text in ("## Data and settings", "## Verdict", "| 0% (dense) | - | none |",
                 "| 50% | 3 | bottom_1,top_1 |",
                 "The paper's Table 1"):
      self.assertIn(text, md)

  @pytest.mark.slow(seconds=14)
  def test_tables_6_7_tiny_run(self):
    md = run_tiny(self, "dct_tables_6_7", "--model_config", "local",
                  "--sparsities", "0.9", "--eval_batches", "1", "--batch_size", "32")
    for text in ("| DCT-MP | 90% |", "| Gaussian sketch X_act | 90% |",
                 "| top-k X_grad + EF | 90% |", "The paper's Table 7"):
      self.assertIn(text, md)

  @pytest.mark.slow(seconds=17)
  def test_table4_transformer_tiny_run(self):
    md = run_tiny(self, "dct_table4_transformer", "--sparsities", "0.9", "--num_splits",
                    "1", "--layers", "1", "--d_model", "16", "--ffn_dim", "32",
                    "--batch_size", "16")
    for text in ("## Verdict", "The paper's Table 4"):
      self.assertIn(text, md)


if __name__ == "__main__":
  tf.test.main()
