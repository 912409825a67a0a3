"""launch/ps_cluster.py starts 1 chief, 2 workers, 1 ps and always stops them."""

import json
import os
import pathlib
import subprocess
import sys
import time

import tensorflow as tf

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _servers_with(port: str) -> list[int]:
  """Pids of live `launch.ps_cluster --serve` processes of a cluster."""
  pids = []
  for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      cmdline = (entry / "cmdline").read_bytes()
      environ = (entry / "environ").read_bytes()
      state = (entry / "stat").read_text().split(")")[-1].split()[0]
    except OSError:
      continue
    if b"--serve" in cmdline and port.encode() in environ and state != "Z":
      pids.append(int(entry.name))
  return pids


class PsClusterTest(tf.test.TestCase):

  def run_launcher(self, chief_code: str, *flags):
    out = pathlib.Path(self.get_temp_dir()) / f"chief_{time.monotonic_ns()}.json"
    code = (f"import os, json, time; open({str(out)!r}, 'w').write("
            f"os.environ['TF_CONFIG']); {chief_code}")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.ps_cluster", *flags, "--", sys.executable,
         "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    return proc, json.loads(out.read_text())

  def assertServersGone(self, config):
    port = config["cluster"]["ps"][0].split(":")[1]
    deadline = time.monotonic() + 10
    while _servers_with(port) and time.monotonic() < deadline:
      time.sleep(0.1)
    self.assertEqual(_servers_with(port), [])

  def test_cluster_shape_and_teardown(self):
    proc, config = self.run_launcher("import sys; sys.exit(7)")
    self.assertEqual(proc.returncode, 7, msg=proc.stderr)   # the chief's code
    self.assertEqual(config["task"], {"type": "chief", "index": 0})
    cluster = config["cluster"]
    self.assertEqual({k: len(v) for k, v in cluster.items()},
                     {"chief": 1, "worker": 2, "ps": 1})
    addresses = [a for v in cluster.values() for a in v]
    self.assertLen(set(addresses), 4)
    self.assertServersGone(config)

  def test_timeout_stops_everything(self):
    start = time.monotonic()
    proc, config = self.run_launcher("time.sleep(600)", "--timeout", "2",
                                     "--workers", "1")
    self.assertLess(time.monotonic() - start, 60)
    self.assertEqual(proc.returncode, 124, msg=proc.stderr)
    self.assertLen(config["cluster"]["worker"], 1)
    self.assertServersGone(config)


if __name__ == "__main__":
  tf.test.main()
