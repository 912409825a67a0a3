r"""Time and peak memory of the Criteo and MovieLens file readers.

Writes synthetic files with the readers' own writers (`criteo.write_tsv`,
`movielens.write_ratings_csv`, `movielens.write_u_data`), then reads each in
fresh subprocesses (`--repeats`, the least of each figure shown: other load
on the machine only ever adds) and reports

* `build`: seconds until the reader returns (for Criteo, `read_tsv` checks a
  file up to `eager_check_bytes` here);
* `iterate`: seconds to pull every batch of the Criteo dataset;
* `cpu`: CPU seconds of both (all threads), less disturbed by other load;
* `peak MB`: the rise of the process's peak resident memory over its memory
  after the imports (`VmHWM - VmRSS`), so it counts what the read holds at once.

    python bench/readers.py                      # 100k Criteo rows, 1M MovieLens rows
    python bench/readers.py --criteo_rows=1000 --movielens_rows=10000   # smoke run
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_integer("criteo_rows", 100_000, "Rows of the Criteo TSV file.")
flags.DEFINE_integer("movielens_rows", 1_000_000, "Rows of each MovieLens file.")
flags.DEFINE_integer("batch_size", 4096, "Criteo batch size while iterating.")
flags.DEFINE_integer("repeats", 3, "Fresh processes per file; the least of each figure is shown.")
flags.DEFINE_string("dir", "", "Where to write the files (default: a temporary directory).")
flags.DEFINE_string("_child", "", "Internal: read one file (`kind:path`) and print figures.")

FLAGS = flags.FLAGS


def _status_mb(field: str) -> float:
  """`VmRSS` (now) or `VmHWM` (peak) of this process, in MB.

  Not `ru_maxrss`: that keeps the parent's peak across fork and exec.
  """
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def _child(spec: str) -> None:
  """Reads one file in this (fresh) process and prints `build iterate peak`."""
  kind, path = spec.split(":", 1)
  from models.data import criteo  # pylint: disable=import-outside-toplevel
  from models.data import movielens  # pylint: disable=import-outside-toplevel
  base = _status_mb("VmRSS")
  cpu = time.process_time()
  start = time.perf_counter()
  iterate = 0.0
  if kind == "criteo":
    data = criteo.read_tsv(path, FLAGS.batch_size)
    built = time.perf_counter()
    rows = sum(int(label.shape[0]) for _, label in data)
    iterate = time.perf_counter() - built
  else:
    reader = movielens.read_ratings_csv if kind == "csv" else movielens.read_u_data
    rows = len(reader(path).users)
    built = time.perf_counter()
  cpu = time.process_time() - cpu
  peak = _status_mb("VmHWM") - base
  print(f"{built - start:.3f} {iterate:.3f} {cpu:.3f} {peak:.0f} {rows}")


def _measure(kind: str, path: str) -> None:
  runs = []
  for _ in range(FLAGS.repeats):
    out = subprocess.run(
        [sys.executable, __file__, f"--_child={kind}:{path}",
         f"--batch_size={FLAGS.batch_size}"],
        check=True, capture_output=True, text=True).stdout.split()
    runs.append([float(x) for x in out[-5:]])
  build, iterate, cpu, peak, rows = (min(r[i] for r in runs) for i in range(5))
  size = os.path.getsize(path) / 2**20
  print(f"{kind:<7} {int(rows):>9} rows {size:7.1f} MB   build {build:6.2f} s   "
        f"iterate {iterate:6.2f} s   cpu {cpu:6.2f} s   peak +{peak:.0f} MB", flush=True)


def main(argv):
  del argv
  if FLAGS._child:  # pylint: disable=protected-access
    _child(FLAGS._child)  # pylint: disable=protected-access
    return
  from models.data import criteo  # pylint: disable=import-outside-toplevel
  from models.data import movielens  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    d = FLAGS.dir or tmp
    tsv = os.path.join(d, "train.txt")
    criteo.write_tsv(tsv, FLAGS.criteo_rows)
    _measure("criteo", tsv)
    users = max(1, FLAGS.movielens_rows // 100)
    ratings = movielens.synthetic_ratings(0, users, 1000, FLAGS.movielens_rows // users)
    for kind, name, writer in (("csv", "ratings.csv", movielens.write_ratings_csv),
                               ("u.data", "u.data", movielens.write_u_data)):
      path = os.path.join(d, name)
      writer(path, ratings)
      _measure(kind, path)


if __name__ == "__main__":
  app.run(main)
