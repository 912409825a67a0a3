"""The tensors a traced graph moves between devices."""

import tensorflow as tf


def crossing(graph: tf.Graph) -> dict:
  """{(tensor name, destination): (dtype, shape, bytes)} of cross-device edges.

  A tensor consumed on a device other than its producer's crosses once per
  destination. Devices are compared by their last 5 characters ("CPU:1").
  Bytes are None for a shape that is not fully known.
  """
  edges = {}
  for op in graph.get_operations():
    for t in op.inputs:
      src, dst = t.op.device[-5:], op.device[-5:]
      if src and dst and src != dst:
        n = t.shape.num_elements()
        edges[(t.name, dst)] = (t.dtype, tuple(t.shape.as_list()),
                                None if n is None else n * t.dtype.size)
  return edges


def bytes_to(edges: dict, dst: str) -> int:
  """Total bytes of `edges` (from `crossing`) arriving on `dst`."""
  return sum(b for (_, to), (_, _, b) in edges.items() if to == dst)
