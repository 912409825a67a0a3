"""State whose value differs per replica and survives checkpoints exactly.

Built-in distributed variables cannot hold it: a SyncOnRead variable saves the
cross-replica aggregate and restores that one value into every replica, and a
MirroredVariable saves only its primary copy. Error-feedback residuals are
different on every replica, so we keep one ordinary variable per replica,
placed on that replica's device, each under its own checkpoint key
(`replica_<global id>`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_dct import _private


class PerReplicaState(tf.Module):
  """One variable per local replica of a replicator.

  Create it with `replicator.per_replica_state(...)` in or out of the strategy
  scope (creation is lifted out of any tf.function). Inside `step_fn` use
  `local()` to get this replica's variable; from Python use `numpy()` to read
  every local replica's value. Track it on a `tf.train.Checkpoint` (or any
  trackable) and each replica's value is saved and restored as it is.
  """

  def __init__(self, replicator, initial_value: Callable[[int], object] | object,
               name: str = "per_replica_state"):
    """Creates the variables.

    Args:
      replicator: the `tf_dct` replicator whose replicas own the values.
      initial_value: a tensor-like (same start on every replica) or a callable
        `replica_id -> tensor-like` for a different start per replica.
      name: variable name prefix, a non-empty string.
    """
    if not isinstance(name, str) or not name:
      raise TypeError(f"per_replica_state: name must be a non-empty string, "
                      f"got {name!r}")
    super().__init__(name=name.replace("/", "_"))
    self._replicator = replicator
    first = replicator.first_local_replica_id
    values = {}
    for local, device in enumerate(replicator.replica_devices):
      gid = first + local
      init = initial_value(gid) if callable(initial_value) else initial_value
      values[f"replica_{gid}"] = _private.unmirrored_variable(
          init, name=f"{name}/replica_{gid}", device=device)
    self._values = values

  @property
  def variables_per_replica(self) -> Sequence[tf.Variable]:
    """This worker's variables, in local replica order."""
    return list(self._values.values())

  def local(self) -> tf.Variable:
    """The variable of the replica running the current step_fn."""
    return self.variables_per_replica[
        self._replicator.local_replica_index("PerReplicaState.local")]

  def numpy(self) -> list[np.ndarray]:
    """Every local replica's current value, in local replica order."""
    return [v.numpy() for v in self.variables_per_replica]

  def assign_all(self, values: Sequence[object]) -> None:
    """Assigns one value per local replica (from Python, eagerly)."""
    variables = self.variables_per_replica
    if len(values) != len(variables):
      raise ValueError(f"values must hold {len(variables)} entries (one per "
                       f"local replica), got {len(values)}")
    for var, value in zip(variables, values):
      var.assign(value)
