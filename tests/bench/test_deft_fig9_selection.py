"""bench/studies/deft_fig9_selection.py: its timed selection function."""

import argparse
import contextlib
import io

import numpy as np
import tensorflow as tf

from bench.studies import deft_fig9_selection as fig9
from tf_dct.compression import deft
from tests import util


def setUpModule():
  util.setup_cpus()  # before any op: later modules of the run need 4 CPUs


class SelectionTest(tf.test.TestCase):

  def test_every_round_runs_the_whole_selection(self):
    # The in-graph timing divides a call by `rounds`: each round must select
    # again (nothing hoisted or merged), so R rounds return R times one round.
    g = np.random.default_rng(0).normal(size=300).astype(np.float32)
    gt = tf.constant(g)
    pieces = [(0, 100, 7), (100, 200, 11)]
    top = [np.sort(np.argsort(-np.abs(g[s:s + z]), kind="stable")[:k]).sum()
           for s, z, k in pieces]
    one = int(fig9.selection(gt, pieces)().numpy())
    self.assertEqual(one, sum(top))
    self.assertEqual(int(fig9.selection(gt, pieces, rounds=5)().numpy()),
                     5 * one)
    # The DEFT selection with k fed at run time, over the same pieces.
    bounded = [p + (p[1],) for p in pieces]
    self.assertEqual(int(fig9.selection(gt, bounded, deft.owned_top_k,
                                        rounds=3)().numpy()), 3 * one)

  def test_bad_rounds_are_refused_by_name(self):
    gt = tf.constant([1.0, 2.0])
    for rounds in (0, -1, 1.5, True):
      with self.assertRaisesRegex(ValueError, "rounds must be an int >= 1"):
        fig9.selection(gt, [(0, 2, 1)], rounds=rounds)
    parser = argparse.ArgumentParser()
    fig9.define(parser)
    err = io.StringIO()
    for bad in ("0", "x"):
      with contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
        parser.parse_args(["--rounds", bad])
    self.assertIn("argument --rounds: must be an int >= 1, got '0'",
                  err.getvalue())
    self.assertIn("got 'x'", err.getvalue())
    self.assertEqual(parser.parse_args(["--rounds", "3"]).rounds, 3)


if __name__ == "__main__":
  tf.test.main()
