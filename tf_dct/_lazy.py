"""Package attributes imported on first use (PEP 562 module `__getattr__`).

`import tf_dct` (or any `tf_dct.distribute.<module>`) then loads neither
TensorFlow nor Keras: a process that needs one light module, such as
`launch/ps_cluster.py` picking ports with `tf_dct.distribute.ports`, does not
pay for the rest. Standard library only.
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def exports(package: str, names: Mapping[str, str]
            ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
  """(`__getattr__`, `__dir__`) of `package` for its lazy public names.

  Args:
    package: the package's `__name__`.
    names: public name -> the module defining it (a submodule of the same
      name stands for itself, e.g. "compression" -> "tf_dct.compression").

  The first read of a name imports its module and stores the value in the
  package, so later reads are plain attribute reads.
  """
  namespace = importlib.import_module(package).__dict__

  def __getattr__(name: str):  # pylint: disable=invalid-name
    module = names.get(name)
    if module is None:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    loaded = importlib.import_module(module)
    value = loaded if module == f"{package}.{name}" else getattr(loaded, name)
    namespace[name] = value
    return value

  def __dir__():  # pylint: disable=invalid-name
    return sorted(set(namespace) | set(names))

  return __getattr__, __dir__
