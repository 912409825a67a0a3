"""CIFAR ResNet-18 (DEFT Table 2: ResNet-18 on CIFAR-10) and its data.

The CIFAR variant of ResNet-18: a 3x3 stride-1 stem (no max-pool), four stages
of two BasicBlocks (widths 64-128-256-512, strides 1-2-2-2), global average
pooling and a linear classifier. Data: CIFAR-10 binary batches from
`data_dir`, or class-templated synthetic images when `data_dir` is empty.

Entry points: `build_model`, `make_dataset`, `loss`, `evaluate`, `METRIC`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from models.flavour import keras

from models.data import cifar
from models.data import order

METRIC = "accuracy"
DEFAULT_CONFIG = {"widths": (64, 128, 256, 512), "blocks_per_stage": 2}
TINY_CONFIG = {"widths": (4, 8, 8, 16), "blocks_per_stage": 1}
SYNTHETIC_TEST_EXAMPLES = 1024


def _conv(filters: int, kernel: int, stride: int, name: str) -> keras.layers.Conv2D:
  return keras.layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False,
                                kernel_initializer="he_normal", name=name)


def _bn(name: str) -> keras.layers.BatchNormalization:
  return keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=name)


def _basic_block(x: tf.Tensor, filters: int, stride: int, name: str) -> tf.Tensor:
  """conv3x3-BN-ReLU-conv3x3-BN, plus an identity or 1x1-conv shortcut, then ReLU."""
  shortcut = x
  if stride != 1 or x.shape[-1] != filters:
    shortcut = _bn(f"{name}_short_bn")(_conv(filters, 1, stride, f"{name}_short_conv")(x))
  y = keras.layers.ReLU(name=f"{name}_relu1")(
      _bn(f"{name}_bn1")(_conv(filters, 3, stride, f"{name}_conv1")(x)))
  y = _bn(f"{name}_bn2")(_conv(filters, 3, 1, f"{name}_conv2")(y))
  return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")(
      [shortcut, y]))


def resnet(widths: Sequence[int] = (64, 128, 256, 512), blocks_per_stage: int = 2,
           num_classes: int = cifar.NUM_CLASSES, weight_decay: float = 0.0,
           name: str = "resnet18") -> keras.Model:
  """CIFAR ResNet: 3x3 stem, len(widths) stages of BasicBlocks, linear head (logits).

  Args:
    widths: Channels of each stage; the stem has widths[0].
    blocks_per_stage: BasicBlocks per stage (2 for ResNet-18).
    num_classes: Output logits.
    weight_decay: L2 factor on conv/dense kernels, added as model losses.
    name: Model name.
  """
  inputs = keras.Input(cifar.IMAGE_SHAPE, name="image")
  x = keras.layers.ReLU(name="stem_relu")(_bn("stem_bn")(_conv(widths[0], 3, 1, "stem_conv")(
      inputs)))
  for stage, width in enumerate(widths):
    for block in range(blocks_per_stage):
      stride = 2 if stage > 0 and block == 0 else 1
      x = _basic_block(x, width, stride, f"stage{stage}_block{block}")
  x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
  logits = keras.layers.Dense(num_classes, name="logits")(x)
  model = keras.Model(inputs, logits, name=name)
  if weight_decay:
    for layer in model.layers:
      if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)):
        model.add_loss(lambda k=layer.kernel: weight_decay * tf.nn.l2_loss(k))
  return model


def build_model(seed: int = 0, data_dir: str | None = None, **config) -> keras.Model:
  """ResNet-18 for CIFAR-10; `config` overrides `resnet` arguments.

  `data_dir` is accepted for a uniform signature (the class count is fixed).
  """
  del data_dir
  keras.utils.set_random_seed(seed)
  return resnet(**{**DEFAULT_CONFIG, **config})


def make_dataset(batch_size: int, seed: int = 0, data_dir: str | None = None,
                 split: str = "train", augment: bool = True,
                 start: int = 0) -> tf.data.Dataset:
  """(images float32 [b, 32, 32, 3], labels int32 [b]) batches.

  Train: endless, whole batches, every epoch in its own seeded order (and
  augmented on real data, each image by a seed of its stream position),
  from batch `start` on (made directly, for a resume; `models.data.order`).
  Test: one pass in file order, last batch may be short. Empty `data_dir`:
  synthetic images (test = 1024 held-out images from another stream).
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if start and split != "train":
    raise ValueError(f"start is for the endless train split, not {split!r}")
  if not data_dir:
    ds = cifar.synthetic_batches(batch_size, seed, stream=0 if split == "train" else 1,
                                 start=start)
    return ds if split == "train" else ds.take(-(-SYNTHETIC_TEST_EXAMPLES // batch_size))
  images, labels = cifar.load(data_dir, split)
  if split == "test":
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    return ds.batch(batch_size).map(lambda x, y: (cifar.normalize(x), y)).prefetch(2)
  images, labels = tf.constant(images), tf.constant(labels)
  n = int(labels.shape[0])

  def example(k):
    i = order.shuffled_indices(k, n, seed)
    image = tf.gather(images, i)
    if augment:
      image = cifar.augment(image, tf.stack([tf.constant(seed, tf.int64), k]))
    return image, tf.gather(labels, i)

  ds = tf.data.Dataset.range(start * batch_size, order.ENDLESS).map(
      example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return ds.batch(batch_size, drop_remainder=True).map(
      lambda x, y: (cifar.normalize(x), y)).prefetch(2)


def loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
  """Per-example softmax cross-entropy, [batch]."""
  return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(labels, tf.int32), logits)


def evaluate(model: keras.Model, batch_size: int = 256, seed: int = 0,
             data_dir: str | None = None) -> dict[str, float]:
  """Test-split accuracy and mean loss."""
  correct = total = loss_sum = 0.0
  predict = tf.function(lambda x: model(x, training=False))
  for images, labels in make_dataset(batch_size, seed, data_dir, split="test"):
    logits = predict(images)
    loss_sum += float(tf.reduce_sum(loss(labels, logits)))
    correct += float(np.sum(np.argmax(logits.numpy(), -1) == labels.numpy()))
    total += len(labels)
  return {"accuracy": correct / total, "loss": loss_sum / total}
