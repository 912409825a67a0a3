"""The Keras flavour of this process, for the models that support both.

TensorFlow reads `TF_USE_LEGACY_KERAS` once, when `tf.keras` is first
resolved: "1", "true" or "True" make `tf.keras` tf-keras, anything else
Keras 3 (`LEGACY` follows TensorFlow's own test).
`keras` is that module; the models written against it run in either flavour.
DLRM and NCF build on TensorFlow Recommenders, which needs tf-keras.
"""

from __future__ import annotations

import os

import tensorflow as tf

LEGACY = os.environ.get("TF_USE_LEGACY_KERAS") in ("true", "True", "1")
keras = tf.keras
