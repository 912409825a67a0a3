"""pyproject.toml: what each install extra must bring, checked against the code.

Every third-party module that `tf_dct/` imports must be a core dependency;
what `launch/` and `models/` import may also come from the `launch` extra.
The console script must name a function that exists.
"""

import ast
import importlib
import pathlib
import re
import sys

from absl.testing import absltest

try:
  import tomllib  # pylint: disable=g-import-not-at-top
except ModuleNotFoundError:  # Python 3.10
  tomllib = None

import tf_dct

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Distribution name -> the top-level module it provides, where they differ.
MODULE_OF = {"tensorflow-recommenders": "tensorflow_recommenders",
             "tensorflow-text": "tensorflow_text", "tf-keras": "tf_keras",
             "absl-py": "absl"}
OWN = {"tf_dct", "launch", "models", "bench", "tests"}


def _project() -> dict:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return tomllib.load(f)["project"]


def _modules(requirements) -> set[str]:
  """Top-level modules of `requirements` (PEP 508 strings; extras of tf-dct
  itself are expanded by the caller)."""
  out = set()
  for req in requirements:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    out.add(MODULE_OF.get(name, name.replace("-", "_")))
  return out


def _imports(package: str) -> dict[str, str]:
  """{third-party top-level module: a file importing it} under `package`."""
  found = {}
  for path in sorted((ROOT / package).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top not in OWN and top not in sys.stdlib_module_names:
          found.setdefault(top, str(path.relative_to(ROOT)))
  return found


class PackagingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if tomllib is None:
      self.skipTest("reading pyproject.toml needs tomllib (Python 3.11+)")

  def test_library_imports_only_core_dependencies(self):
    core = _modules(_project()["dependencies"])
    for module, path in _imports("tf_dct").items():
      self.assertIn(module, core, f"{path} imports {module}, not a core dependency")

  def test_launcher_and_models_need_only_the_launch_extra(self):
    project = _project()
    allowed = (_modules(project["dependencies"])
               | _modules(project["optional-dependencies"]["launch"]))
    for package in ("launch", "models"):
      for module, path in _imports(package).items():
        self.assertIn(module, allowed,
                      f"{path} imports {module}, in neither core nor [launch]")

  def test_extras_build_on_each_other(self):
    extras = _project()["optional-dependencies"]
    self.assertIn("tf-dct[launch]", extras["bench"])
    self.assertIn("tf-dct[bench]", extras["test"])
    self.assertIn("matplotlib>=3.8", extras["bench"])

  def test_version_has_one_source(self):
    project = _project()
    self.assertIn("version", project["dynamic"])
    self.assertNotIn("version", project)
    self.assertRegex(tf_dct.__version__, r"^\d+\.\d+\.\d+")

  def test_console_script_names_a_function(self):
    target = _project()["scripts"]["tf-dct-train"]
    module, _, attr = target.partition(":")
    self.assertTrue(callable(getattr(importlib.import_module(module), attr)))

  def test_packages_include_launcher_and_models(self):
    with open(ROOT / "pyproject.toml", "rb") as f:
      find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    for package in ("tf_dct*", "launch*", "models*"):
      self.assertIn(package, find["include"])
    self.assertTrue((ROOT / "LICENSE").read_text().startswith(
        " " * 33 + "Apache License"))


if __name__ == "__main__":
  absltest.main()
