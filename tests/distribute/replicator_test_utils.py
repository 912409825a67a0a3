"""Replicator kinds that one test process can build (Sonnet 2's pattern).

`named_replicators()` gives (name, factory) pairs for
`parameterized.named_parameters`, so a test of the TF-Replicator API runs on
every kind: in-graph on one, four and 2 x 2 logical CPUs, XLA-compiled, and
`MultiWorkerReplicator` as a single local worker. `AsyncReplicator` needs a
parameter-server cluster and `TpuReplicator` a TPU; their own tests cover
them.
"""

from __future__ import annotations

from typing import Callable

import tf_dct
from tests import util


def named_replicators(*names: str
                      ) -> list[tuple[str, Callable[..., tf_dct.distribute.ReplicatorMixin]]]:
  """(name, factory) pairs, all or those `names`; call the factory in the test.

  A factory passes its keyword arguments on to the replicator's constructor
  (e.g. `input_replication=tf_dct.PER_REPLICA`).
  """

  def devices(n):
    return util.setup_cpus()[:n]

  kinds = [
      ("one_device", lambda **kw: tf_dct.Replicator(devices(1), **kw)),
      ("four_devices", lambda **kw: tf_dct.Replicator(devices(4), **kw)),
      ("two_by_two", lambda **kw: tf_dct.Replicator(
          devices(4), num_devices_per_replica=2, **kw)),
      ("xla", lambda **kw: tf_dct.Replicator(devices(1), jit_compile=True, **kw)),
      ("multi_worker_local", lambda **kw: tf_dct.MultiWorkerReplicator(**kw)),
  ]
  unknown = set(names) - {name for name, _ in kinds}
  if unknown:
    raise ValueError(f"named_replicators: unknown names {sorted(unknown)}")
  return [(name, make) for name, make in kinds if not names or name in names]
