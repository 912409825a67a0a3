"""The rooms of docs/architecture.md import only what they may."""

import ast
import pathlib

import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parent.parent

# room -> module prefixes its files must not import (at any level).
FORBIDDEN = {
    "tf_dct/distribute": ("tf_dct.compression", "tf_dct.dct_mp", "tf_dct.keras",
                          "keras", "tf_keras"),
    "tf_dct/compression": ("tf_dct.dct_mp", "tf_dct.keras", "keras", "tf_keras"),
    "tf_dct/dct_mp": ("tf_dct.compression", "tf_dct.keras", "keras", "tf_keras"),
    "models": ("tf_dct",),
}
# (file, module): the documented exceptions.
ALLOWED = {
    ("tf_dct/distribute/replicator.py", "tf_dct.keras"),  # wrap_optimizer shorthand
    ("tf_dct/dct_mp/keras3_split.py", "keras"),
    ("tf_dct/dct_mp/tf_keras_split.py", "tf_keras"),
}
# Attribute names of strategies that other rooms read only through accessors.
STRATEGY_NAMES = ("replicator", "repl", "strategy", "extended")


def _imports(tree: ast.AST) -> set[str]:
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def _matches(module: str, prefix: str) -> bool:
  return module == prefix or module.startswith(prefix + ".")


class ArchitectureTest(tf.test.TestCase):

  def test_rooms_import_only_what_they_may(self):
    bad = []
    for room, forbidden in FORBIDDEN.items():
      for path in sorted((ROOT / room).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for module in _imports(ast.parse(path.read_text())):
          for prefix in forbidden:
            if _matches(module, prefix) and (rel, prefix) not in ALLOWED:
              bad.append(f"{rel} imports {module}")
    self.assertEqual(bad, [])

  def test_no_private_strategy_attributes_outside_distribute(self):
    bad = []
    for room in ("tf_dct/compression", "tf_dct/dct_mp", "tf_dct/keras"):
      for path in sorted((ROOT / room).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
          if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__")):
            owner = node.value
            name = (owner.attr if isinstance(owner, ast.Attribute)
                    else getattr(owner, "id", ""))
            if name.lstrip("_") in STRATEGY_NAMES:
              bad.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
          if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and str(node.args[1].value).startswith("_")
              and getattr(node.args[0], "attr", getattr(node.args[0], "id", "")
                          ).lstrip("_") in STRATEGY_NAMES):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[1].value}")
    self.assertEqual(bad, [])

  def test_the_check_finds_a_forbidden_import(self):
    tree = ast.parse("def f():\n  from tf_dct.compression import DCTDP\n")
    self.assertTrue(any(_matches(m, "tf_dct.compression") for m in _imports(tree)))


if __name__ == "__main__":
  tf.test.main()
