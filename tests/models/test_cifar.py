"""Tests for models/data/cifar.py: the binary batch reader and synthetic images."""

import os

import numpy as np
import tensorflow as tf

from models.data import cifar
from tests import util


def setUpModule():
  util.setup_cpus()


def _records(labels: list[int], seed: int = 0) -> tuple[bytes, np.ndarray]:
  """Binary CIFAR records and the [n, 3, 32, 32] planes they hold."""
  planes = np.random.default_rng(seed).integers(0, 256, (len(labels), 3, 32, 32), np.uint8)
  raw = b"".join(bytes([label]) + planes[i].tobytes() for i, label in enumerate(labels))
  return raw, planes


class ReadBatchTest(tf.test.TestCase):

  def test_reads_records_exactly(self):
    raw, planes = _records([3, 0, 9])
    path = os.path.join(self.get_temp_dir(), "data_batch_1.bin")
    with open(path, "wb") as f:
      f.write(raw)
    images, labels = cifar.read_batch(path)
    self.assertAllEqual(labels, [3, 0, 9])
    self.assertEqual(images.shape, (3, 32, 32, 3))
    self.assertEqual(images.dtype, np.uint8)
    # Pixel (row 5, col 7) of image 1: red/green/blue from the three planes.
    self.assertAllEqual(images[1, 5, 7], planes[1, :, 5, 7])
    self.assertAllEqual(images[2, ..., 2], planes[2, 2])

  def test_bad_size_names_file(self):
    raw, _ = _records([1, 2])
    path = os.path.join(self.get_temp_dir(), "truncated.bin")
    with open(path, "wb") as f:
      f.write(raw[:-5])
    with self.assertRaisesRegex(ValueError, r"truncated\.bin: size 6141 bytes is not a "
                                r"multiple of the 3073-byte"):
      cifar.read_batch(path)

  def test_bad_label_names_record(self):
    raw, _ = _records([1, 12, 2])
    path = os.path.join(self.get_temp_dir(), "labels.bin")
    with open(path, "wb") as f:
      f.write(raw)
    with self.assertRaisesRegex(ValueError, r"labels\.bin: record 1 has label 12"):
      cifar.read_batch(path)

  def test_missing(self):
    with self.assertRaisesRegex(FileNotFoundError, "nowhere.bin"):
      cifar.read_batch(os.path.join(self.get_temp_dir(), "nowhere.bin"))
    with self.assertRaisesRegex(FileNotFoundError, "no_such_dir"):
      cifar.load(os.path.join(self.get_temp_dir(), "no_such_dir"))

  def test_load_split_from_nested_dir(self):
    root = self.create_tempdir().full_path
    nested = os.path.join(root, "cifar-10-batches-bin")
    os.makedirs(nested)
    for i, name in enumerate(cifar.TRAIN_FILES + cifar.TEST_FILES):
      with open(os.path.join(nested, name), "wb") as f:
        f.write(_records([i, i], seed=i)[0])
    images, labels = cifar.load(root, "train")
    self.assertAllEqual(labels, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    self.assertEqual(images.shape, (10, 32, 32, 3))
    self.assertAllEqual(cifar.load(root, "test")[1], [5, 5])


class SyntheticTest(tf.test.TestCase):

  def test_deterministic_and_class_dependent(self):
    x1, y1 = next(iter(cifar.synthetic_batches(64, seed=2)))
    x2, y2 = next(iter(cifar.synthetic_batches(64, seed=2)))
    self.assertAllEqual(x1, x2)
    self.assertAllEqual(y1, y2)
    self.assertEqual(x1.shape, (64, 32, 32, 3))
    _, y_test = next(iter(cifar.synthetic_batches(64, seed=2, stream=1)))
    self.assertNotAllEqual(y1, y_test)
    # Noise-free images of one class are identical, of different classes not.
    x, y = next(iter(cifar.synthetic_batches(64, seed=2, noise=0.0)))
    x, y = x.numpy(), y.numpy()
    a, b = np.flatnonzero(y == y[0])[:2]
    c = np.flatnonzero(y != y[0])[0]
    self.assertAllClose(x[a], x[b])
    self.assertGreater(np.abs(x[a] - x[c]).mean(), 0.1)


if __name__ == "__main__":
  tf.test.main()
