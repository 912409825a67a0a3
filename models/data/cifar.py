"""CIFAR-10: reader for the binary batches and synthetic look-alike images.

The binary version (`cifar-10-batches-bin/`) stores records of 1 label byte
followed by 3072 pixel bytes: 1024 red, 1024 green, 1024 blue, each row-major
32x32. Training files are `data_batch_1.bin` .. `data_batch_5.bin`, the test
file `test_batch.bin`.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from models.data import order
from models.data.errors import DataError

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
RECORD_BYTES = 1 + 32 * 32 * 3
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
# Per-channel statistics of the CIFAR-10 training set, for normalisation.
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
STD = np.array([0.2470, 0.2435, 0.2616], np.float32)


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
  """Reads one binary batch file.

  Returns:
    (images uint8 [n, 32, 32, 3], labels int32 [n]).

  Raises:
    FileNotFoundError: `path` does not exist.
    DataError: the size is not a whole number of records, or a label is not
      in 0..9 (the message names the file and the record).
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"CIFAR-10 batch file not found: {path}")
  raw = np.fromfile(path, np.uint8)
  if raw.size % RECORD_BYTES:
    raise DataError(f"{path}: size {raw.size} bytes is not a multiple of the "
                    f"{RECORD_BYTES}-byte CIFAR-10 record")
  records = raw.reshape(-1, RECORD_BYTES)
  labels = records[:, 0].astype(np.int32)
  bad = np.flatnonzero(labels >= NUM_CLASSES)
  if bad.size:
    raise DataError(f"{path}: record {bad[0]} has label {labels[bad[0]]}, expected 0..9")
  images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return np.ascontiguousarray(images), labels


def find_dir(data_dir: str) -> str:
  """`data_dir` or its `cifar-10-batches-bin/` subdirectory, whichever holds the files."""
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"CIFAR-10 data directory not found: {data_dir}")
  nested = os.path.join(data_dir, "cifar-10-batches-bin")
  if not os.path.exists(os.path.join(data_dir, TEST_FILES[0])) and os.path.isdir(nested):
    return nested
  return data_dir


def load(data_dir: str, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
  """Concatenated images and labels of a split ("train" or "test")."""
  files = {"train": TRAIN_FILES, "test": TEST_FILES}[split]
  parts = [read_batch(os.path.join(find_dir(data_dir), f)) for f in files]
  return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def normalize(images: tf.Tensor) -> tf.Tensor:
  """uint8 images -> float32, standardised per channel."""
  return (tf.cast(images, tf.float32) / 255.0 - MEAN) / STD


def augment(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """The usual CIFAR augmentation: pad 4, random 32x32 crop, random flip."""
  padded = tf.pad(image, [[4, 4], [4, 4], [0, 0]], mode="REFLECT")
  seeds = tf.random.experimental.stateless_split(seed, 2)
  image = tf.image.stateless_random_crop(padded, IMAGE_SHAPE, seeds[0])
  return tf.image.stateless_random_flip_left_right(image, seeds[1])


def synthetic_batches(batch_size: int, seed: int = 0, stream: int = 0,
                      noise: float = 1.0, start: int = 0) -> tf.data.Dataset:
  """Endless (images float32 [b, 32, 32, 3], labels int32 [b]) batches.

  Each class has a fixed random template: a colour plus an oriented stripe
  pattern (fixed by `seed`). An image is its class template plus Gaussian
  noise, so the class is learnable but not trivially separable per pixel.
  `stream` picks an independent sequence (e.g. 0 train, 1 test); batch `i`
  depends on `i` alone, and the sequence begins at batch `start`.
  """
  rng = np.random.default_rng([seed, 0])
  colors = rng.normal(size=(NUM_CLASSES, 1, 1, 3))
  yy, xx = np.mgrid[0:32, 0:32] / 32.0
  angles = rng.uniform(0, np.pi, NUM_CLASSES)
  freqs = rng.uniform(1.0, 4.0, NUM_CLASSES)
  stripes = np.sin(2 * np.pi * freqs[:, None, None] * (
      np.cos(angles)[:, None, None] * xx + np.sin(angles)[:, None, None] * yy))
  templates = tf.constant(0.5 * colors + stripes[..., None], tf.float32)

  def make(step):
    key = tf.stack([tf.constant(seed, tf.int64), stream * (1 << 40) + step])
    labels = tf.random.stateless_uniform([batch_size], key, 0, NUM_CLASSES, tf.int32)
    noise_key = tf.random.experimental.stateless_fold_in(key, 1)
    images = tf.gather(templates, labels) + noise * tf.random.stateless_normal(
        [batch_size, *IMAGE_SHAPE], noise_key)
    return images, labels

  order.check_start(start)
  return tf.data.Dataset.range(start, order.ENDLESS).map(make).prefetch(2)
