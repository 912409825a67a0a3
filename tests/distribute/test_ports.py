"""Tests for tf_dct.distribute.ports.free_ports: distinct bindable ports, `n` checked."""

import socket

import tensorflow as tf

from tf_dct.distribute import ports


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


if __name__ == "__main__":
  tf.test.main()
