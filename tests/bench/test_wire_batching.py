"""bench/wire_batching.py: its flag validation and the table it prints."""

from __future__ import annotations

import pytest

from tests.bench import assert_refused
from tests.bench import run_bench


def _run(*args):
  return run_bench("wire_batching.py", *args)


@pytest.mark.parametrize("args, message", [
    (["--shapes=10"], "--shapes: each must be 'VxC' with integers V, C >= 1, "
                      "got '10'"),
    (["--shapes=3x0"], "got '3x0'"),
    (["--batch_capacity=0"], "--batch_capacity"),
    (["--repeats=0"], "--repeats"),
    (["--mlp_layers=-1"], "--mlp_layers"),
    (["--mlp_width=0"], "--mlp_width"),
])
def test_bad_flags_are_refused_by_name(args, message):
  assert_refused("wire_batching.py", args, message)


@pytest.mark.slow(seconds=18)
def test_prints_one_row_per_shape_and_encoding():
  # The script checks that both sides return the same sums before timing.
  # Two short buffers share one set of ops on the batched side; a buffer
  # longer than the batch capacity goes alone on both sides, so one is
  # enough (each buffer more is another 4 replicas' ops to trace).
  proc = _run("--shapes=2x4,1x200", "--repeats=1", "--calls=1",
              "--mlp_layers=1", "--mlp_width=4")
  assert proc.returncode == 0, proc.stderr[-2000:]
  for side in ("Dense", "DCTDP, wire one by one", "DCTDP, selection one by one",
               "DCTDP batched"):
    assert f"| {side} |" in proc.stdout, side
  assert "trace + first step (s)" in proc.stdout
  rows = [line for line in proc.stdout.splitlines()
          if line.startswith(("| 2 x 4 |", "| 1 x 200 |"))]
  assert [r.split(" | ")[1] for r in rows] == ["auto", "int32"] * 2
