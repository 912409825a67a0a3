"""The seam between gradient aggregation and the optimizers.

A `Compressor` receives, on every replica, that replica's gradient of each
variable and returns what every replica applies: the sum over replicas of what
was sent (dense SUM for `Dense`). It may keep per-replica state per variable
(error-feedback residuals, thresholds) in `PerReplicaState`, created lazily the
first time it sees a variable and tracked for checkpoints. Compressors know
nothing of Keras; `tf_dct.keras` adapts each Keras flavour to this interface.
"""

from __future__ import annotations

import re
import threading
from typing import Sequence

import tensorflow as tf


class Compressor(tf.Module):
  """Base class: per-variable state management and the aggregation contract."""

  def __init__(self, name: str | None = None):
    super().__init__(name=name)
    self._replicator = None
    self._lock = threading.Lock()
    self._keys = {}          # variable ref -> state key, in first-seen order
    self.state = {}          # state key -> dict of PerReplicaState (tracked)

  @property
  def replicator(self):
    return self._replicator

  def bind(self, replicator) -> None:
    """Attaches the compressor to the replicator whose replicas it serves."""
    if self._replicator is not None and self._replicator is not replicator:
      raise ValueError("this compressor is already bound to another replicator; "
                       "create one compressor per wrapped optimizer")
    self._replicator = replicator

  # -- to override --------------------------------------------------------------

  def create_state(self, variable: tf.Variable) -> dict:
    """Returns the per-replica state of one variable (default: none)."""
    del variable
    return {}

  def reduce(self, ctx: tf.distribute.ReplicaContext,
             grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable],
             states: Sequence[dict]) -> list:
    """Returns, per variable, the cross-replica sum of what was sent.

    Runs once per replica per step, in replica context. Every replica must
    issue the same collectives in the same order, and none inside `tf.cond`
    or a loop (MirroredStrategy's merge_call forbids it): select with masks
    and static shapes instead of branching around a collective.
    """
    raise NotImplementedError

  # -- shared machinery -----------------------------------------------------------

  def per_replica_state(self, initial_value, name: str):
    if self._replicator is None:
      raise RuntimeError("bind the compressor (replicator.wrap_optimizer) before "
                         "creating state")
    return self._replicator.per_replica_state(initial_value, name=name)

  def state_for(self, variable: tf.Variable) -> dict:
    """The per-replica state of `variable` (created on first use)."""
    return self._states_for([variable])[0]

  def _states_for(self, variables) -> list[dict]:
    with self._lock:
      for var in variables:
        ref = var.ref()
        if ref not in self._keys:
          base = re.sub(r"[^A-Za-z0-9_]+", "_", var.name.split(":")[0])
          key = f"v{len(self._keys):03d}_{base}"
          self._keys[ref] = key
          with tf.init_scope():  # state is created eagerly, once, for all replicas
            self.state[key] = self.create_state(var)
      return [self.state[self._keys[v.ref()]] for v in variables]

  def aggregate(self, grads_and_vars) -> list:
    """Aggregates `(grad, var)` pairs of this replica; `None` grads pass through.

    Outside a replica context (e.g. `apply_gradients` called in cross-replica
    context) the pairs are returned unchanged, like the built-in aggregation.
    """
    grads_and_vars = list(grads_and_vars)
    ctx = tf.distribute.get_replica_context()
    if ctx is None or tf.distribute.in_cross_replica_context():
      return grads_and_vars
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    if not pairs:
      return grads_and_vars
    grads = [g for g, _ in pairs]
    variables = [v for _, v in pairs]
    reduced = iter(self.reduce(ctx, grads, variables, self._states_for(variables)))
    return [(None, v) if g is None else (next(reduced), v)
            for g, v in grads_and_vars]
