"""Tests for tf_dct.distribute.ports.free_ports: distinct bindable ports, `n`
checked, picked without loading TensorFlow."""

import os
import pathlib
import socket
import subprocess
import sys

import tensorflow as tf

from tf_dct.distribute import ports

REPO = pathlib.Path(__file__).resolve().parents[2]


class FreePortsTest(tf.test.TestCase):

  def test_distinct_and_bindable(self):
    picked = ports.free_ports(5)
    self.assertLen(picked, 5)
    self.assertLen(set(picked), 5)
    for port in picked:
      self.assertBetween(port, 1, 65535)
      with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", port))   # released: a task can bind it now

  def test_bad_n(self):
    for n in (0, -1, 2.0, True, "3", None):
      with self.subTest(n=n):
        with self.assertRaisesRegex(ValueError,
                                    r"free_ports: n must be an int >= 1"):
          ports.free_ports(n)


  def test_picking_ports_loads_no_tensorflow(self):
    # launch/ps_cluster.py picks the ports in a process that runs no TF.
    code = ("import sys; from tf_dct.distribute.ports import free_ports; "
            "free_ports(2); print(sorted(m for m in ('tensorflow', 'keras', "
            "'tf_keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    self.assertEqual(out.stdout.strip(), "[]", out.stderr)


if __name__ == "__main__":
  tf.test.main()
