"""DLRM (DCT §3.1) on Criteo-shaped data, in tf-keras with TFRS's dot interaction.

13 dense features go through the bottom MLP, each of the 26 categorical
features through its own embedding table; TFRS `DotInteraction` takes the
pairwise dot products of the bottom output and the embeddings, and the top MLP
(sigmoid output) maps them, with the bottom output, to a click probability.
The 26 tables are stacked row-wise in one variable (layer "embeddings"): the
same model, but one variable instead of 26, which keeps tracing of replicated
steps (and per-variable gradient compression) cheap.

Model parallelism (DCT Fig 6) is expressed without knowing about compression:
`split_fn(point)` may return a layer to insert at a named point, e.g.
"bottom_1" (after the ReLU of the 2nd bottom layer) or "top_1" (after the ReLU
of the 2nd top layer). `stages(model)` lists the layers between the inserted
ones, in forward order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # TFRS needs tf.keras = Keras 2

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf
import tensorflow_recommenders as tfrs
import tf_keras

from models.data import criteo
from models.data import order

BOTTOM_MLP = (512, 256, 64, 16)
TOP_MLP = (512, 256, 128, 1)
EMBEDDING_DIM = 16
PAPER_SPLITS = ("bottom_1", "top_1")  # DCT Fig 6: two MP splits

SplitFn = Callable[[str], "tf_keras.layers.Layer | None"]


def split_points(bottom_mlp: Sequence[int] = BOTTOM_MLP,
                 top_mlp: Sequence[int] = TOP_MLP) -> list[str]:
  """Names of the points where `split_fn` may insert a layer, in forward order.

  "bottom_i" follows the ReLU of bottom layer i; "top_i" follows the ReLU of
  top layer i (the sigmoid output layer has no point).
  """
  return ([f"bottom_{i}" for i in range(len(bottom_mlp))] +
          [f"top_{i}" for i in range(len(top_mlp) - 1)])


def default_vocab_sizes(data_dir: str | None) -> int:
  """Hash buckets per feature: small for synthetic data, larger for Criteo."""
  return criteo.CRITEO_VOCAB_SIZE if data_dir else criteo.SYNTHETIC_VOCAB_SIZE


def build_model(seed: int = 0, data_dir: str | None = None, *,
                vocab_sizes: int | Sequence[int] | None = None,
                embedding_dim: int = EMBEDDING_DIM,
                bottom_mlp: Sequence[int] = BOTTOM_MLP,
                top_mlp: Sequence[int] = TOP_MLP,
                split_fn: SplitFn | None = None) -> tf_keras.Model:
  """Builds DLRM taking `(dense [B,13] float32, sparse [B,26] int32)`.

  Args:
    seed: initialisation seed.
    data_dir: only picks the default `vocab_sizes` (see `default_vocab_sizes`).
    vocab_sizes: rows per embedding table (one int for all 26).
    embedding_dim: embedding width; must equal `bottom_mlp[-1]`.
    bottom_mlp: widths of the bottom MLP (ReLU after each).
    top_mlp: widths of the top MLP; ReLU after each but the last, which must
      be 1 wide (sigmoid).
    split_fn: called with each name of `split_points(...)`; a returned layer
      is inserted there, None inserts nothing.

  Returns:
    A functional tf-keras model with output [B, 1] (click probability).
  """
  sizes = criteo.vocab_list(default_vocab_sizes(data_dir) if vocab_sizes is None
                            else vocab_sizes)
  if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
    raise ValueError(f"bottom_mlp must end in embedding_dim ({embedding_dim}), "
                     f"got {tuple(bottom_mlp)}")
  if not top_mlp or top_mlp[-1] != 1:
    raise ValueError(f"top_mlp must end in 1 (the click output), got {tuple(top_mlp)}")
  tf_keras.utils.set_random_seed(seed)
  order: list[tuple[str, str]] = []  # (role, layer name) in forward order

  def apply(role, layer, x):
    order.append((role, layer.name))
    return layer(x)

  def maybe_split(point, x):
    layer = split_fn(point) if split_fn else None
    return x if layer is None else apply(f"split:{point}", layer, x)

  dense_in = tf_keras.Input((criteo.NUM_DENSE,), dtype=tf.float32, name="dense")
  sparse_in = tf_keras.Input((criteo.NUM_SPARSE,), dtype=tf.int32, name="sparse")
  x = dense_in
  for i, width in enumerate(bottom_mlp):
    x = apply("bottom", tf_keras.layers.Dense(width, activation="relu",
                                              name=f"bottom_{i}"), x)
    x = maybe_split(f"bottom_{i}", x)
  # The 26 tables live in one variable, stacked row-wise (feature j owns rows
  # offsets[j]..offsets[j+1]): the same model as 26 tables, far fewer variables.
  offsets = np.cumsum([0] + sizes[:-1]).astype(np.int32)
  scale = 1.0 / np.sqrt(np.repeat(np.array(sizes, np.float64), sizes))  # DLRM init
  table = tf_keras.layers.Embedding(
      sum(sizes), embedding_dim, name="embeddings",
      embeddings_initializer=_RowUniform(scale.astype(np.float32), seed))
  rows = _TableRows(offsets.tolist(), name="table_rows")(sparse_in)
  stacked = apply("embedding", table, rows)  # [B, 26, embedding_dim]
  embedded = _Unstack(name="unstack")(stacked)  # 26 x [B, embedding_dim]
  interaction = tfrs.layers.feature_interaction.DotInteraction(name="interaction")
  order.append(("interaction", interaction.name))
  z = tf_keras.layers.Concatenate(name="concat")([x, interaction([x, *embedded])])
  for i, width in enumerate(top_mlp):
    last = i == len(top_mlp) - 1
    z = apply("top", tf_keras.layers.Dense(width, activation="sigmoid" if last else "relu",
                                           name=f"top_{i}"), z)
    if not last:
      z = maybe_split(f"top_{i}", z)
  model = tf_keras.Model([dense_in, sparse_in], z, name="dlrm")
  model._dlrm_order = tuple(order)  # pylint: disable=protected-access
  return model


class _TableRows(tf_keras.layers.Layer):
  """Maps per-feature ids [B, F] to rows of the stacked table."""

  def __init__(self, offsets: Sequence[int], **kwargs):
    super().__init__(**kwargs)
    self.offsets = list(offsets)

  def call(self, ids):
    return ids + tf.constant(self.offsets, ids.dtype)

  def get_config(self):
    return {**super().get_config(), "offsets": self.offsets}


class _Unstack(tf_keras.layers.Layer):
  """[B, F, D] -> F tensors [B, D] (the list TFRS DotInteraction takes)."""

  def call(self, stacked):
    return tf.unstack(stacked, axis=1)


class _RowUniform(tf_keras.initializers.Initializer):
  """Uniform(-scale[r], scale[r]) for row r (per-table DLRM initialisation)."""

  def __init__(self, scale: np.ndarray, seed: int):
    self.scale, self.seed = scale, seed

  def __call__(self, shape, dtype=None, **kwargs):
    u = tf_keras.initializers.RandomUniform(-1.0, 1.0, seed=self.seed)(shape, dtype)
    return u * tf.constant(self.scale, u.dtype)[:, None]

  def get_config(self):
    return {"scale": self.scale.tolist(), "seed": self.seed}


def layer_sequence(model: tf_keras.Model) -> list[tuple[str, tf_keras.layers.Layer]]:
  """(role, layer) pairs in forward order; role is "bottom", "embedding",
  "interaction", "top" or "split:<point>" for a layer `split_fn` inserted."""
  return [(role, model.get_layer(name)) for role, name in model._dlrm_order]  # pylint: disable=protected-access


def stages(model: tf_keras.Model) -> list[list[tf_keras.layers.Layer]]:
  """The layers of each model-parallel stage: the sequence cut at split layers.

  A split layer ends its stage (it sits where the activation leaves a
  worker). With splits at "bottom_1" and "top_1" there are three stages, as
  the three workers of DCT Fig 6.
  """
  result: list[list[tf_keras.layers.Layer]] = [[]]
  for role, layer in layer_sequence(model):
    result[-1].append(layer)
    if role.startswith("split:"):
      result.append([])
  return result


def make_dataset(batch_size: int, seed: int = 0, data_dir: str | None = None,
                 split: str = "train", *,
                 vocab_sizes: int | Sequence[int] | None = None,
                 start: int = 0, repeat: bool = False) -> tf.data.Dataset:
  """Batches `((dense, sparse), label)`: synthetic when `data_dir` is empty.

  Synthetic data is endless (`criteo.synthetic_dataset`). Real data reads
  `{data_dir}/{split}.txt` or `.tsv` in order, dropping a last partial
  batch: once, or pass after pass with `repeat` (`criteo.tsv_stream`).
  Either begins at batch `start`, made directly (for a resume): real rows
  before it are passed over unparsed.
  """
  order.check_start(start)
  sizes = default_vocab_sizes(data_dir) if vocab_sizes is None else vocab_sizes
  if not data_dir:
    return criteo.synthetic_dataset(batch_size, seed, sizes, split=split, start=start)
  files = criteo.find_files(data_dir, split)
  if repeat:
    return criteo.tsv_stream(files, batch_size, sizes, start=start).prefetch(2)
  return criteo.read_tsv(files, batch_size, sizes, drop_remainder=True,
                         skip_rows=start * batch_size).prefetch(2)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
  """Per-example binary cross-entropy, shape [B]."""
  return tf_keras.losses.binary_crossentropy(labels, predictions)


def metrics() -> list[tf_keras.metrics.Metric]:
  """Metrics for `model.compile`: accuracy and AUC."""
  return [tf_keras.metrics.BinaryAccuracy(name="accuracy"),
          tf_keras.metrics.AUC(name="auc")]


def evaluate(model: tf_keras.Model, batch_size: int, seed: int = 0,
             data_dir: str | None = None, steps: int | None = 20, *,
             vocab_sizes: int | Sequence[int] | None = None) -> dict[str, float]:
  """Loss, accuracy and AUC on the eval split (`steps` batches; None = all)."""
  data = make_dataset(batch_size, seed, data_dir, "eval", vocab_sizes=vocab_sizes)
  if steps is not None:
    data = data.take(steps)
  mean_loss = tf_keras.metrics.Mean()
  tracked = metrics()
  for x, y in data:
    p = model(x, training=False)
    mean_loss.update_state(loss(y, p))
    for m in tracked:
      m.update_state(y, p)
  return {"loss": float(mean_loss.result()),
          **{m.name: float(m.result()) for m in tracked}}
