"""Runs a functional Keras model's layers on a replica's logical devices.

A model split for model parallelism (DCT-MP, `tf_dct.dct_mp.DCTSplit`) runs
each stage on its own device of the replica: the layers after split j run on
the device that split sends its activations to. `place_stages` reads the
model's graph (through `tf_dct._private`) and makes each placed layer's
`call` enter `replicator.logical_device(i)` when it runs inside a replica of
a tf_dct replicator; elsewhere (building the model, evaluation outside a
replica) the layer runs where it is called.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dct import _private
from tf_dct.distribute.replicator import ReplicatorMixin


def place_stages(model, split_layers: list, k: int) -> dict[str, int]:
  """Runs every layer of a functional model on logical device (stage % k).

  A layer's stage is the largest stage among its inputs, plus one after a
  split layer. Split j (in forward order) must send its output to logical
  device (stage + 1) % k (its `target_logical_device`), where the layers
  after it run.

  Args:
    model: a functional tf-keras or Keras 3 model (layers topologically
      sorted in `model.layers`).
    split_layers: the model's split layers (`DCTSplit`), a chain.
    k: logical devices per replica.

  Returns:
    {layer name: logical device index}.

  Raises:
    ValueError: a split targets another device than its successors' stage.
  """
  splits = {id(l) for l in split_layers}
  stage = {}
  for layer in model.layers:
    inbound = _private.inbound_layers(layer)
    stage[id(layer)] = max([stage.get(id(l), 0) + (id(l) in splits) for l in inbound],
                           default=0)
  placed = {}
  for layer in model.layers:
    device = stage[id(layer)] % k
    placed[layer.name] = device
    if id(layer) in splits:
      want = (stage[id(layer)] + 1) % k
      target = layer.get_config()["target_logical_device"]
      if target != want:
        raise ValueError(f"split {layer.name} targets device {target} but the layers "
                         f"after it are on device {want} (splits are not a chain)")
    if device:
      _run_on_logical_device(layer, device)
  return placed


def _run_on_logical_device(layer, index: int) -> None:
  """Makes `layer.call` run under `logical_device(index)` inside a replica."""
  original = layer.call

  def call(*args, **kwargs):
    strategy = tf.distribute.get_strategy()
    if (isinstance(strategy, ReplicatorMixin)
        and tf.distribute.get_replica_context() is not None
        and not tf.distribute.in_cross_replica_context()):
      with strategy.logical_device(index):
        return original(*args, **kwargs)
    return original(*args, **kwargs)

  call.__wrapped__ = original
  call.__name__ = getattr(original, "__name__", "call")
  call.__doc__ = original.__doc__
  layer.call = call
