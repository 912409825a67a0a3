"""bench/adam_bursts.py: its flag validation and the table it prints."""

from __future__ import annotations

import pytest

from tests.bench import assert_refused
from tests.bench import run_bench


def _run(*args):
  return run_bench("adam_bursts.py", *args)


@pytest.mark.parametrize("args, message", [
    (["--steps=10", "--periods=1,3"],
     "--periods: each must be an int >= 1 that divides --steps=10, got ['3']"),
    (["--periods=0"], "--periods: each must be an int >= 1"),
    (["--periods=2,x"], "got ['x']"),
    (["--learning_rate=0"], "--learning_rate must be > 0"),
])
def test_bad_flags_are_refused_by_name(args, message):
  assert_refused("adam_bursts.py", args, message)


def test_sgd_moves_as_far_with_bursts_and_adam_does_not():
  proc = _run("--steps=8", "--periods=1,2,8", "--tail=8")
  assert proc.returncode == 0, proc.stderr
  rows = [line.strip("|").split("|") for line in proc.stdout.splitlines()
          if line.startswith("| ") and line[2].isdigit()]
  ratios = {int(t): (float(sgd), float(adam)) for t, sgd, adam, _ in rows}
  assert sorted(ratios) == [1, 2, 8]
  assert ratios[1] == (1.0, 1.0)
  for t in (2, 8):
    assert ratios[t][0] == 1.0                 # SGD: linear in the gradient
    assert ratios[t][1] < 0.9                  # Adam: bursts move it less
  assert ratios[8][1] < ratios[2][1]
