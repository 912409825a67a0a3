"""Tests of the benchmark scripts (flags, small smoke runs; never timings)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(script: str, *args: str, timeout: int = 300):
  """Runs `bench/<script>` with `args` in a subprocess; returns the result.

  A subprocess, because each benchmark defines absl flags that would clash
  with other modules' flags in the test process (e.g. launch.train's --steps).
  """
  return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script),
                         *args], capture_output=True, text=True,
                        timeout=timeout, check=False)


def assert_refused(script: str, args, message: str) -> None:
  """`bench/<script>` with `args` exits non-zero and says `message`."""
  proc = run_bench(script, *args)
  assert proc.returncode != 0, proc.stdout[-2000:]
  assert message in proc.stderr, proc.stderr[-2000:]
