"""NeuMF (He et al., NCF, 2017) on implicit feedback, as in DEFT Table 2.

A GMF tower (element-wise product of user and item embeddings) and an MLP
tower (concatenated embeddings through ReLU layers) are joined by one sigmoid
unit. Trained with binary cross-entropy on observed interactions plus sampled
negatives; evaluated by HR@10 and NDCG@10 of each user's held-out item against
99 sampled items the user never interacted with, and by the loss on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools

import numpy as np
import tensorflow as tf
import tf_keras

from models.data import movielens

MF_DIM = 64  # MLPerf / NVIDIA NCF reference sizes
MLP_LAYERS = (256, 256, 128, 64)
NUM_NEGATIVES = 4
EVAL_NEGATIVES = 99


@functools.lru_cache(maxsize=4)
def load(seed: int = 0, data_dir: str | None = None
         ) -> tuple[movielens.Interactions, movielens.Interactions]:
  """(train, test) leave-one-out interactions: MovieLens or synthetic (cached)."""
  ratings = (movielens.read_dir(data_dir) if data_dir
             else movielens.synthetic_ratings(seed))
  return movielens.leave_one_out(movielens.to_implicit(ratings))


def build_model(seed: int = 0, data_dir: str | None = None, *,
                num_users: int | None = None, num_items: int | None = None,
                mf_dim: int = MF_DIM, mlp_layers: Sequence[int] = MLP_LAYERS
                ) -> tf_keras.Model:
  """Builds NeuMF taking `(users [B] int32, items [B] int32)`.

  Args:
    seed: initialisation seed (and the synthetic data's, for its sizes).
    data_dir: the sizes default to those of this data (empty: synthetic).
    num_users: user-table rows; default from the data.
    num_items: item-table rows; default from the data.
    mf_dim: GMF embedding width.
    mlp_layers: MLP tower widths; the first is the concatenated embedding
      width (half for users, half for items), ReLU layers follow for the rest.

  Returns:
    A functional tf-keras model with output [B, 1] (interaction probability).
  """
  if num_users is None or num_items is None:
    train, _ = load(seed, data_dir or None)
    num_users = train.num_users if num_users is None else num_users
    num_items = train.num_items if num_items is None else num_items
  if len(mlp_layers) < 1 or mlp_layers[0] % 2:
    raise ValueError(f"mlp_layers[0] must be even (user + item halves), got {tuple(mlp_layers)}")
  tf_keras.utils.set_random_seed(seed)
  users = tf_keras.Input((), dtype=tf.int32, name="users")
  items = tf_keras.Input((), dtype=tf.int32, name="items")

  def table(rows, width, name):
    return tf_keras.layers.Embedding(rows, width, name=name,
        embeddings_initializer=tf_keras.initializers.RandomNormal(stddev=0.01))

  gmf = tf_keras.layers.Multiply(name="gmf")([
      table(num_users, mf_dim, "mf_user")(users), table(num_items, mf_dim, "mf_item")(items)])
  half = mlp_layers[0] // 2
  x = tf_keras.layers.Concatenate(name="mlp_input")([
      table(num_users, half, "mlp_user")(users), table(num_items, half, "mlp_item")(items)])
  for i, width in enumerate(mlp_layers[1:]):
    x = tf_keras.layers.Dense(width, activation="relu", name=f"mlp_{i}")(x)
  joined = tf_keras.layers.Concatenate(name="neumf")([gmf, x])
  out = tf_keras.layers.Dense(1, activation="sigmoid", name="prediction")(joined)
  return tf_keras.Model([users, items], out, name="ncf")


def make_dataset(batch_size: int, seed: int = 0, data_dir: str | None = None, *,
                 num_negatives: int = NUM_NEGATIVES, start: int = 0) -> tf.data.Dataset:
  """Endless shuffled `((users, items), labels [B,1])` training batches.

  Positives are the leave-one-out training interactions; each comes with
  `num_negatives` freshly sampled negatives per epoch. Synthetic (a hidden
  latent-factor teacher) when `data_dir` is empty. `start`: the index of the
  first batch (the stream from there on, made directly: a resume).
  """
  train, _ = load(seed, data_dir or None)
  return movielens.training_dataset(train, batch_size, num_negatives, seed, start)


def make_eval_data(seed: int = 0, data_dir: str | None = None,
                   num_negatives: int = EVAL_NEGATIVES) -> movielens.EvalData:
  """Each user's held-out item plus `num_negatives` never-seen items."""
  train, test = load(seed, data_dir or None)
  return movielens.eval_data(train, test, num_negatives, seed)


def loss(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
  """Per-example binary cross-entropy, shape [B]."""
  return tf_keras.losses.binary_crossentropy(labels, predictions)


def metrics() -> list[tf_keras.metrics.Metric]:
  """Metrics for `model.compile` (training pairs): accuracy."""
  return [tf_keras.metrics.BinaryAccuracy(name="accuracy")]


Scorer = Callable[[tuple[tf.Tensor, tf.Tensor]], tf.Tensor]


def _check_k(k) -> None:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k (the ranking cut-off) must be an int >= 1, got {k!r}")


def candidate_scores(model: Scorer, data: movielens.EvalData,
                     batch_size: int = 100_000) -> np.ndarray:
  """The model's score of every candidate, [users, 1 + negatives].

  Args:
    model: maps `(users [N] int32, items [N] int32)` to scores [N] or [N, 1].
    data: candidates; `data.items[:, 0]` is the positive.
    batch_size: pairs scored per model call.
  """
  num_users, width = data.items.shape
  users = np.repeat(data.users, width).astype(np.int32)
  items = data.items.reshape(-1).astype(np.int32)
  return np.concatenate([
      np.reshape(np.asarray(model((tf.constant(users[s:s + batch_size]),
                                   tf.constant(items[s:s + batch_size])))), [-1])
      for s in range(0, len(users), batch_size)]).reshape(num_users, width)


def positive_ranks(scores: np.ndarray) -> np.ndarray:
  """0-based rank of each row's positive (column 0) among its candidates.

  Ties count against the positive: the rank is the number of negatives that
  score at least as high, so a constant model ranks every positive last.
  """
  return np.sum(scores[:, 1:] >= scores[:, :1], axis=1)


def hit_rate_at_k(model: Scorer, data: movielens.EvalData, k: int = 10,
                  batch_size: int = 100_000) -> float:
  """Fraction of users whose held-out item ranks in the top k of its candidates.

  A user scores a hit when fewer than k of its negatives score at least as
  high as the positive (ties count against the positive, so a constant model
  scores 0 unless k exceeds the number of negatives).

  Args:
    model: maps `(users [N] int32, items [N] int32)` to scores [N] or [N, 1].
    data: candidates; `data.items[:, 0]` is the positive.
    k: cut-off.
    batch_size: pairs scored per model call.
  """
  _check_k(k)
  return float(np.mean(positive_ranks(candidate_scores(model, data, batch_size)) < k))


def ndcg_at_k(ranks: np.ndarray, k: int = 10) -> float:
  """Mean NDCG@k of one relevant item per user at the given 0-based ranks.

  With a single relevant item the ideal DCG is 1, so a user contributes
  `1 / log2(rank + 2)` when its item ranks in the top k and 0 otherwise.
  """
  _check_k(k)
  ranks = np.asarray(ranks)
  return float(np.mean(np.where(ranks < k, 1.0 / np.log2(ranks + 2.0), 0.0)))


def evaluate(model: tf_keras.Model, batch_size: int = 100_000, seed: int = 0,
             data_dir: str | None = None, k: int = 10) -> dict[str, float]:
  """HR@k, NDCG@k and the loss on the held-out items with 99 negatives each.

  The loss is the mean binary cross-entropy over all candidates: label 1
  for each held-out item, 0 for its sampled negatives.
  """
  _check_k(k)
  data = make_eval_data(seed, data_dir)
  scores = candidate_scores(lambda x: model(x, training=False), data, batch_size)
  ranks = positive_ranks(scores)
  labels = np.zeros_like(scores)
  labels[:, 0] = 1.0
  bce = loss(labels.reshape(-1, 1), scores.reshape(-1, 1))
  return {f"hr@{k}": float(np.mean(ranks < k)), f"ndcg@{k}": ndcg_at_k(ranks, k),
          "loss": float(np.mean(bce))}
