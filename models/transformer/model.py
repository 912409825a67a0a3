"""Encoder-decoder Transformer (DCT §3.2) with optional layers after FFN ReLUs.

Pre-LayerNorm blocks (stable with a constant Adam learning rate), sinusoidal
positions, separate source/target embeddings over one joint vocabulary, and a
linear output projection. Every block's feed-forward network is
Dense(ffn_dim, ReLU) -> [split point] -> Dense(d_model); the split point of
encoder layer i is named "encoder_ffn_<i>", of decoder layer i
"decoder_ffn_<i>". `split_fn(name)` may return a layer to insert there (it is
called on [batch, time, ffn_dim] activations) or None; the model knows nothing
else about it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf
from models.flavour import keras

from models.data.tokenizer import END_ID, PAD_ID, START_ID

SplitFn = Callable[[str], "keras.layers.Layer | None"]


def split_points(num_encoder_layers: int, num_decoder_layers: int) -> list[str]:
  """Names of every split point, in forward order."""
  return ([f"encoder_ffn_{i}" for i in range(num_encoder_layers)] +
          [f"decoder_ffn_{i}" for i in range(num_decoder_layers)])


def sinusoid_table(length: int, depth: int) -> np.ndarray:
  """Vaswani et al.'s positional encodings, float32 [length, depth]."""
  positions = np.arange(length)[:, None]
  rates = 1.0 / np.power(10000.0, (2 * (np.arange(depth) // 2)) / depth)
  angles = positions * rates[None, :]
  angles[:, 0::2], angles[:, 1::2] = np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])
  return angles.astype(np.float32)


class TokenEmbedding(keras.layers.Layer):
  """Token embedding scaled by sqrt(d_model) plus sinusoidal positions."""

  def __init__(self, vocab_size: int, d_model: int, max_positions: int = 1024, **kwargs):
    super().__init__(**kwargs)
    self.d_model = d_model
    self.embedding = keras.layers.Embedding(vocab_size, d_model)
    self.positions = tf.constant(sinusoid_table(max_positions, d_model))

  def call(self, ids: tf.Tensor) -> tf.Tensor:
    x = self.embedding(ids) * tf.sqrt(tf.cast(self.d_model, tf.float32))
    return x + self.positions[tf.newaxis, :tf.shape(ids)[1]]


class FeedForward(keras.layers.Layer):
  """Dense(ffn_dim, ReLU) -> optional split layer -> Dense(d_model) -> dropout."""

  def __init__(self, d_model: int, ffn_dim: int, dropout: float,
               split: keras.layers.Layer | None = None, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(ffn_dim, activation="relu")
    self.split = split
    self.outer = keras.layers.Dense(d_model)
    self.dropout = keras.layers.Dropout(dropout)

  def call(self, x: tf.Tensor, training: bool | None = None) -> tf.Tensor:
    h = self.inner(x)
    if self.split is not None:
      h = self.split(h)  # training mode propagates through Keras
    return self.dropout(self.outer(h), training=training)


class EncoderLayer(keras.layers.Layer):
  """Pre-LN self-attention and feed-forward, each with a residual."""

  def __init__(self, d_model: int, ffn_dim: int, num_heads: int, dropout: float,
               split: keras.layers.Layer | None = None, **kwargs):
    super().__init__(**kwargs)
    self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
    self.attention = keras.layers.MultiHeadAttention(num_heads, d_model // num_heads,
                                                        dropout=dropout)
    self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
    self.ffn = FeedForward(d_model, ffn_dim, dropout, split)
    self.dropout = keras.layers.Dropout(dropout)

  def call(self, x: tf.Tensor, source_mask: tf.Tensor,
           training: bool | None = None) -> tf.Tensor:
    h = self.norm1(x)
    mask = _key_mask(source_mask, tf.shape(x)[1])
    x = x + self.dropout(self.attention(h, h, attention_mask=mask, training=training),
                         training=training)
    return x + self.ffn(self.norm2(x), training=training)


class DecoderLayer(keras.layers.Layer):
  """Pre-LN causal self-attention, cross-attention and feed-forward."""

  def __init__(self, d_model: int, ffn_dim: int, num_heads: int, dropout: float,
               split: keras.layers.Layer | None = None, **kwargs):
    super().__init__(**kwargs)
    self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
    self.self_attention = keras.layers.MultiHeadAttention(
        num_heads, d_model // num_heads, dropout=dropout)
    self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)
    self.cross_attention = keras.layers.MultiHeadAttention(
        num_heads, d_model // num_heads, dropout=dropout)
    self.norm3 = keras.layers.LayerNormalization(epsilon=1e-6)
    self.ffn = FeedForward(d_model, ffn_dim, dropout, split)
    self.dropout = keras.layers.Dropout(dropout)

  def call(self, x: tf.Tensor, memory: tf.Tensor, source_mask: tf.Tensor,
           training: bool | None = None) -> tf.Tensor:
    h = self.norm1(x)
    x = x + self.dropout(self.self_attention(h, h, use_causal_mask=True, training=training),
                         training=training)
    h = self.norm2(x)
    mask = _key_mask(source_mask, tf.shape(x)[1])
    x = x + self.dropout(self.cross_attention(h, memory, attention_mask=mask,
                                              training=training), training=training)
    return x + self.ffn(self.norm3(x), training=training)


class PaddingMask(keras.layers.Layer):
  """True where an id is not padding, [batch, time]."""

  def call(self, ids: tf.Tensor) -> tf.Tensor:
    return tf.not_equal(ids, PAD_ID)


def _key_mask(key_mask: tf.Tensor, query_length: tf.Tensor) -> tf.Tensor:
  """[batch, keys] validity -> [batch, queries, keys] attention mask."""
  shape = tf.stack([tf.shape(key_mask)[0], query_length, tf.shape(key_mask)[1]])
  return tf.broadcast_to(key_mask[:, tf.newaxis, :], shape)


def transformer(vocab_size: int, d_model: int = 512, ffn_dim: int = 1024, num_heads: int = 4,
                num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                dropout: float = 0.1, split_fn: SplitFn | None = None,
                name: str = "transformer") -> keras.Model:
  """(source ids [b, s], target-in ids [b, t]) -> next-token logits [b, t, vocab_size].

  Args:
    vocab_size: Joint source/target vocabulary size.
    d_model: Model width.
    ffn_dim: Inner width of every feed-forward network.
    num_heads: Attention heads (must divide d_model).
    num_encoder_layers: Encoder blocks.
    num_decoder_layers: Decoder blocks.
    dropout: Dropout rate (residuals, attention weights).
    split_fn: Called once per split point name (see `split_points`); a layer it
      returns is applied to the [batch, time, ffn_dim] ReLU output there.
    name: Model name.
  """
  if d_model % num_heads:
    raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
  split = split_fn or (lambda point: None)
  source = keras.Input((None,), dtype=tf.int32, name="source")
  target_in = keras.Input((None,), dtype=tf.int32, name="target_in")
  source_mask = PaddingMask(name="source_mask")(source)
  drop = keras.layers.Dropout(dropout)
  x = drop(TokenEmbedding(vocab_size, d_model, name="source_embedding")(source))
  for i in range(num_encoder_layers):
    x = EncoderLayer(d_model, ffn_dim, num_heads, dropout, split(f"encoder_ffn_{i}"),
                     name=f"encoder_{i}")(x, source_mask=source_mask)
  memory = keras.layers.LayerNormalization(epsilon=1e-6, name="encoder_norm")(x)
  y = drop(TokenEmbedding(vocab_size, d_model, name="target_embedding")(target_in))
  for i in range(num_decoder_layers):
    y = DecoderLayer(d_model, ffn_dim, num_heads, dropout, split(f"decoder_ffn_{i}"),
                     name=f"decoder_{i}")(y, memory=memory, source_mask=source_mask)
  y = keras.layers.LayerNormalization(epsilon=1e-6, name="decoder_norm")(y)
  logits = keras.layers.Dense(vocab_size, name="logits")(y)
  return keras.Model((source, target_in), logits, name=name)


def greedy_decoder(model: keras.Model, max_len: int) -> Callable[[tf.Tensor], tf.Tensor]:
  """A compiled greedy decoder: source ids [b, s] -> output ids [b, max_len].

  Starts from START, feeds back the argmax token, stops when every row has
  produced END (or after `max_len` tokens); positions after a row's END are PAD.
  The decoder re-runs the whole model each step (no key/value cache).
  """

  @tf.function(reduce_retracing=True)
  def decode(source: tf.Tensor) -> tf.Tensor:
    source = tf.cast(source, tf.int32)
    batch = tf.shape(source)[0]
    tokens = tf.concat([tf.fill([batch, 1], START_ID),
                        tf.fill([batch, max_len], PAD_ID)], axis=1)
    done = tf.zeros([batch], tf.bool)
    columns = tf.range(max_len + 1)[tf.newaxis, :]
    for i in tf.range(max_len):
      logits = model((source, tokens[:, :max_len]), training=False)
      step = tf.argmax(logits[:, i], axis=-1, output_type=tf.int32)
      step = tf.where(done, PAD_ID, step)
      tokens = tf.where(columns == i + 1, step[:, tf.newaxis], tokens)
      done = tf.logical_or(done, tf.equal(step, END_ID))
      if tf.reduce_all(done):
        break
    return tokens[:, 1:]

  return decode


def strip_output(ids: np.ndarray) -> list[list[int]]:
  """Decoded rows cut before their first END (and PAD)."""
  rows = []
  for row in np.asarray(ids).tolist():
    cut = row.index(END_ID) if END_ID in row else len(row)
    rows.append([i for i in row[:cut] if i != PAD_ID])
  return rows
