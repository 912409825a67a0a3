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
