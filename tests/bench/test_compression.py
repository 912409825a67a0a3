"""bench/compression.py: its flag validation (the benchmark itself is not a test)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_unknown_compressor_is_refused_with_the_allowed_names():
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "compression.py"),
       "--step_time_only", "--compressors=DCTDP(L=1000)", "--compressors=Foo"],
      capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode != 0
  assert "--compressors: each must be one of" in proc.stderr
  assert "'DCTDP(L=1000,cf=1)'" in proc.stderr  # the allowed names are listed


def test_every_listed_compressor_is_built_as_named():
  sys.path.insert(0, ROOT)
  from bench import compression as bench  # pylint: disable=g-import-not-at-top
  built = {name: bench.make_compressor(name, 1e-3) for name in bench.NAMES}
  assert type(built["DCTDP(L=1000)"]).__name__ == "DCTDP"
  assert built["DCTDP(L=1000)"].min_size == 0
  assert built["DCTDP(L=1000,min=1024)"].min_size == 1024
  assert built["DCTDP(L=1000,min=1024)"].threshold_life == 1000
  assert built["DCTDP(L=1000,cf=1)"].capacity_factor == 1.0
  assert built["DCTDP(L=1)"].threshold_life == 1
