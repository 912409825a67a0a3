"""Free TCP ports for a cluster whose tasks all run on this host.

A local `TF_CONFIG` cluster (`launch/ps_cluster.py`, the multi-process tests)
needs one port per task, known before any task starts; `free_ports` picks them.
"""

from __future__ import annotations

import numbers
import socket

from tf_dct import validation


def free_ports(n: int) -> list[int]:
  """Returns `n` distinct TCP ports that are free right now.

  TF's gRPC server binds `0.0.0.0:<port>`, so the ports are probed there.
  Every socket stays open until all `n` ports are picked, so they are
  distinct; another process may still take one before the cluster binds it,
  and a caller that must not fail then retries with fresh ports.

  Args:
    n: how many ports, an int >= 1.

  Raises:
    ValueError: `n` is not an int >= 1.
  """
  validation.check_number("free_ports", "n", n, numbers.Integral, 1, False)
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(("0.0.0.0", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()
