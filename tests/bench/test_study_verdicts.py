"""The verdict logic of the DCT DLRM table studies, on hand-made results.

No training: the noise reference (the spread of the dense runs), the
"no loss" verdict it bounds and the byte sentence of `dct_table2_dp`, with
exact expectations.
"""

import argparse

from absl.testing import absltest

from bench.studies import dct_table1_mp as t1
from bench.studies import dct_table2_dp as t2
from bench.studies import dct_table4_transformer as t4


def _run(test_loss: float, label: str = "run", dp: dict | None = None) -> dict:
  return {"label": label, "test": {"loss": test_loss, "acc": 80.0},
          "train": {"loss": test_loss, "acc": 80.0}, "dp": dp}


class NoiseReferenceTest(absltest.TestCase):

  def test_spread_of_all_dense_runs_relative_to_the_baseline(self):
    dense = _run(0.5)
    # 0.499 .. 0.503: (0.503 - 0.499) / 0.5 = 0.8%; the baseline is not an end
    reinits = [_run(0.503), _run(0.499)]
    self.assertAlmostEqual(t1.noise_floor(dense, reinits), 0.8, places=9)

  def test_one_reinit_gives_the_absolute_difference(self):
    self.assertAlmostEqual(t1.noise_floor(_run(0.5), [_run(0.499)]), 0.2, places=9)

  def test_no_reinit_gives_the_default(self):
    self.assertEqual(t1.noise_floor(_run(0.5), []), 0.1)
    self.assertIn("not measured", t1.noise_source([]))

  def test_reinit_count(self):
    args = argparse.Namespace(no_reinit=False, dense_seeds=2)
    self.assertEqual(t1.reinit_count(args), 2)
    args.no_reinit = True
    self.assertEqual(t1.reinit_count(args), 0)

  def test_dense_seeds_below_one_is_refused(self):
    args = argparse.Namespace(no_reinit=False, dense_seeds=0)
    with self.assertRaisesRegex(ValueError, r"--dense_seeds must be >= 1.*got 0"):
      t1.reinit_count(args)
    with self.assertRaisesRegex(ValueError, r"reinits must be >= 0, got -1"):
      t1.dense_runs({}, 1, reinits=-1)

  def test_settings_line_names_the_runs_and_the_spread(self):
    line = t1.noise_settings(_run(0.5), [_run(0.503), _run(0.499)])
    self.assertIn("2 more dense run(s)", line)
    self.assertIn("the 3 dense test losses, 0.80% here", line)


class EtaSweepVerdictTest(absltest.TestCase):

  def test_no_loss_is_judged_against_the_dense_spread(self):
    dense = _run(0.5)
    runs = {0.75: _run(0.5025), 0.995: _run(0.52)}  # +0.50%, +4.00%
    wide = t1.eta_sweep_verdict(dense, runs, [_run(0.503), _run(0.499)],
                                t2.PAPER_TABLE2, 0.98)
    self.assertIn("at most 0.80% above dense (the spread of the test loss over 3 "
                  "dense runs", wide[0])
    self.assertIn("**No loss up to 98%: reproduced.**", wide[1])
    self.assertIn("ours 75%: +0.50%", wide[1])
    narrow = t1.eta_sweep_verdict(dense, runs, [_run(0.5005), _run(0.4995)],
                                  t2.PAPER_TABLE2, 0.98)
    self.assertIn("at most 0.20% above dense", narrow[0])
    self.assertIn("**No loss up to 98%: not reproduced.**", narrow[1])
    self.assertIn("**99.5% loses a little: reproduced in direction, but the loss "
                  "is 20x the paper's.**", narrow[2])


class Table2BytesTest(absltest.TestCase):

  def test_bytes_sentence_follows_the_exact_size_payloads(self):
    dp = {"payload_ratio": 2.5, "density": 0.2, "bytes_per_entry": 8.0}
    text = t2._verdict(_run(0.5), {0.9: _run(0.5, dp=dp)}, [_run(0.5)])
    self.assertIn("shrinks 2.5x at 90%. Only the used slots are sent", text)
    self.assertIn("costs 8.00 B at 90%", text)
    self.assertNotIn("capacity factor", text)


class Table4ToleranceTest(absltest.TestCase):

  def test_loss_and_bleu_tolerances_are_the_dense_spreads(self):
    dense = {"test_loss": 0.5, "bleu": 78.0}
    reinits = [{"test_loss": 0.51, "bleu": 77.5}, {"test_loss": 0.495, "bleu": 78.3}]
    loss, bleu = t4._spreads(dense, reinits)
    self.assertAlmostEqual(loss, 3.0, places=9)  # (0.51 - 0.495) / 0.5
    self.assertAlmostEqual(bleu, 0.8, places=9)  # 78.3 - 77.5
    runs = {(1, 0.9): {"test_loss": 0.514, "bleu": 77.3},   # +2.80%, -0.70
            (4, 0.95): {"test_loss": 0.52, "bleu": 78.0}}   # +4.00%, +0.00
    text = t4._verdict(dense, reinits, runs, [0.9, 0.95], [1, 4])
    self.assertIn("test loss at most 3.00% above dense and BLEU at most 0.80 below "
                  "(the spread of 3 dense runs", text)
    self.assertIn("eta 90%, 1 split(s): test loss +2.80%, BLEU -0.70 -> same as dense",
                  text)
    self.assertIn("eta 95%, 4 split(s): test loss +4.00%, BLEU +0.00 -> worse than dense",
                  text)
    self.assertIn("partly reproduced (1/2 settings)", text)


if __name__ == "__main__":
  absltest.main()
