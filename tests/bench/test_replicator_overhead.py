"""bench/replicator_overhead.py: its flag validation (the timing is not a test)."""

from __future__ import annotations

import pytest

from tests.bench import assert_refused


@pytest.mark.parametrize("args, message", [
    (["--repeats=0"], "flag --repeats=0: 0 is not a positive integer"),
    (["--steps=0"], "flag --steps=0: 0 is not a positive integer"),
    (["--batch_size=2"], "flag --batch_size=2: 2 is not integer >= 4"),
    (["--batch_size=10"], "--batch_size must be a multiple of 4"),
    (["--warmup_steps=-1"],
     "flag --warmup_steps=-1: -1 is not a non-negative integer"),
    (["--num_classes=1"], "flag --num_classes=1: 1 is not integer >= 2"),
])
def test_bad_flags_are_refused_by_name(args, message):
  assert_refused("replicator_overhead.py", args, message)
