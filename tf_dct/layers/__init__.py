"""Keras split-point layers for DCT-MP (tf-keras and Keras 3).

`DCTSplit` is the tf-keras layer, `Keras3DCTSplit` the Keras 3 one; both wrap
the Keras-free `SplitCore` of `tf_dct.layers.dct_split`.
"""

from tf_dct.layers.dct_split import MODES
from tf_dct.layers.dct_split import SplitCore
from tf_dct.layers.keras3_split import DCTSplit as Keras3DCTSplit
from tf_dct.layers.tf_keras_split import DCTSplit

__all__ = ["DCTSplit", "Keras3DCTSplit", "MODES", "SplitCore"]
