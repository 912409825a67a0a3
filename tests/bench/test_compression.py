"""bench/compression.py: its flag validation (the benchmark itself is not a test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.bench import ROOT
from tests.bench import assert_refused
from tests.bench import run_bench


@pytest.mark.parametrize("args, message", [
    (["--repeats=0"], "flag --repeats=0: 0 is not a positive integer"),
    (["--block=0"], "flag --block=0: 0 is not a positive integer"),
    (["--steps=0"], "flag --steps=0: 0 is not a positive integer"),
    (["--sim_steps=0"], "flag --sim_steps=0: 0 is not a positive integer"),
    (["--batch_size=2"], "flag --batch_size=2: 2 is not integer >= 4"),
    (["--batch_size=10"], "--batch_size must be a multiple of 4"),
])
def test_bad_flags_are_refused_by_name(args, message):
  assert_refused("compression.py", args, message)


def test_unknown_compressor_is_refused_with_the_allowed_names():
  proc = run_bench("compression.py", "--step_time_only",
                   "--compressors=DCTDP(L=1000)", "--compressors=Foo")
  assert proc.returncode != 0
  assert "--compressors: each must be one of" in proc.stderr
  assert "'DCTDP(L=1000,cf=1)'" in proc.stderr  # the allowed names are listed


def _json_of(script: str):
  """What `script` prints as its last line, parsed as JSON. In a subprocess:
  the benchmark's absl flags would clash with other modules' flags in the
  test process (e.g. launch.train's --steps)."""
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                        capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_listed_compressor_is_built_as_named():
  script = (
      "import json\n"
      "from bench import compression as b\n"
      "out = {}\n"
      "for name in b.NAMES:\n"
      "  c = b.make_compressor(name, 1e-3)\n"
      "  out[name] = [type(c).__name__, getattr(c, 'min_size', None),\n"
      "               getattr(c, 'threshold_life', None),\n"
      "               getattr(c, 'capacity_factor', None),\n"
      "               getattr(c, 'value_dtype', None)]\n"
      "print(json.dumps(out))\n")
  built = _json_of(script)
  assert built["DCTDP(L=1000)"] == ["DCTDP", 0, 1000, 2.0, "bfloat16"]
  assert built["DCTDP(L=1000,fp32)"] == ["DCTDP", 0, 1000, 2.0, None]
  assert built["TopK(bf16)"][-1] == "bfloat16" and built["TopK"][-1] is None
  assert built["DCTDP(L=1000,min=1024)"] == ["DCTDP", 1024, 1000, 2.0,
                                             "bfloat16"]
  assert built["DCTDP(L=1000,cf=1)"] == ["DCTDP", 0, 1000, 1.0, "bfloat16"]
  assert built["DCTDP(L=1)"][2] == 1
  assert built["DEFT"][0] == "DEFT" and built["Dense"][0] == "Dense"


def test_wire_capacity_prices_what_each_compressor_sends():
  # The index-bits table needs each compressor's wire slots: they give the
  # gather bytes the compressor itself reports, for a few variable sizes;
  # compressors that do not use sparse_wire have none (and no exact-size
  # twin run).
  script = (
      "import json\n"
      "import tensorflow as tf\n"
      "from bench import compression as b\n"
      "from tf_dct.compression import sparse_wire\n"
      "out = {}\n"
      "for name in b.NAMES:\n"
      "  c = b.make_compressor(name, 1e-3)\n"
      "  rows = []\n"
      "  for n in (2000, 131072):\n"
      "    cap = b.wire_capacity(c, n)\n"
      "    rows.append(None if cap is None else [\n"
      "        sparse_wire.wire_bytes(n, cap, sparse_wire.wire_dtype(\n"
      "            tf.float32, c.value_dtype)),\n"
      "        c.compressed_bytes(tf.Variable(tf.zeros([n])))[0]])\n"
      "  out[name] = rows + [b.exchanges_sparse_wire(name)]\n"
      "print(json.dumps(out))\n")
  priced = _json_of(script)
  on_wire = {"DCTDP(L=1000)", "DCTDP(L=1000,fp32)", "DCTDP(L=1000,cf=1)",
             "DCTDP(L=1000,min=1024)", "DCTDP(L=1)", "TopK", "TopK(bf16)",
             "HardThreshold"}
  for name, rows in priced.items():
    # The same compressors get a twin run with exact sizes forced.
    assert rows.pop() == (name in on_wire), name
    if name in on_wire:
      assert all(ours == theirs for ours, theirs in rows), (name, rows)
      # Two bytes a value (DCT-DP's default, the "bf16" names): fewer than
      # the float32 twin ("fp32", TopK's default).
      twins = {"DCTDP(L=1000)": "DCTDP(L=1000,fp32)", "TopK(bf16)": "TopK"}
      if name in twins:
        twin = priced[twins[name]]
        assert all(ours[0] < theirs[0] for ours, theirs in zip(rows, twin))
    else:
      assert rows == [None, None], name
