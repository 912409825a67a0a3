"""Runs the `>>>` examples of the public docstrings (doctest).

Each module listed here must keep at least one example, and every example
must print exactly what its docstring shows.
"""

import doctest
import importlib

from absl.testing import absltest
from absl.testing import parameterized

from tests import util

# The modules whose docstrings carry examples. Imported by name: the package
# `tf_dct.dct_mp` exports functions that hide modules of the same name
# (`gaussian_sketch`, `xgrad_topk`).
MODULES = (
    "tf_dct.compression.accounting",
    "tf_dct.compression.sparse_wire",
    "tf_dct.dct_mp.transfer",
    "tf_dct.dct_mp.op",
    "tf_dct.validation",
)


def setUpModule():
  # The examples run TensorFlow ops; split the CPU first, as the other test
  # modules of this process expect.
  util.setup_cpus()


class DoctestTest(parameterized.TestCase):

  @parameterized.named_parameters(
      (name.rpartition(".")[2], name) for name in MODULES)
  def test_examples(self, name):
    module = importlib.import_module(name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=True, verbose=False)
    self.assertGreater(result.attempted, 0, f"{name} has no examples")
    self.assertEqual(result.failed, 0,
                     f"{result.failed} of {result.attempted} examples of "
                     f"{name} failed (the report above shows which)")


if __name__ == "__main__":
  absltest.main()
