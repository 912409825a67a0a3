"""The rooms of docs/architecture.md import only what they may.

`bench/` uses only public names of the project's packages: no name with a
leading underscore imported from, or read as an attribute of, a module of
`tf_dct`, `bench`, `launch` or `models` (BENCH_ALLOWED lists the documented
exceptions), and no library-private attribute (`_tf_dct_*`) of an object.
"""

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
# Packages whose private names bench/ must not use.
PROJECT_PACKAGES = ("tf_dct", "bench", "launch", "models")
# (file, dotted name): private names bench/ may use, each with its reason.
# Empty: every bench script goes through public functions.
BENCH_ALLOWED: dict[tuple[str, str], str] = {}
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


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_uses(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, dotted name) of every private name of PROJECT_PACKAGES that
  `tree` imports or reads as an attribute of an imported module, and of
  every `_tf_dct*` attribute it reads."""
  bound, found = {}, []

  def project(module: str) -> bool:
    return any(_matches(module, p) for p in PROJECT_PACKAGES)

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if project(a.name):
          if any(map(_private, a.name.split("."))):
            found.append((node.lineno, a.name))
          if a.asname:
            bound[a.asname] = a.name
          else:
            bound[a.name.split(".")[0]] = a.name.split(".")[0]
    elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
          and project(node.module)):
      for a in node.names:
        dotted = f"{node.module}.{a.name}"
        if any(map(_private, dotted.split("."))):
          found.append((node.lineno, dotted))
        bound[a.asname or a.name] = dotted
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute):
      continue
    if node.attr.startswith("_tf_dct"):
      found.append((node.lineno, node.attr))
      continue
    if not _private(node.attr):
      continue
    chain, owner = [node.attr], node.value
    while isinstance(owner, ast.Attribute):
      chain.append(owner.attr)
      owner = owner.value
    if isinstance(owner, ast.Name) and owner.id in bound:
      found.append((node.lineno,
                    ".".join([bound[owner.id]] + chain[::-1])))
  return sorted(found)


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

  def test_bench_uses_only_public_names(self):
    bad, used = [], set()
    for path in sorted((ROOT / "bench").rglob("*.py")):
      rel = path.relative_to(ROOT).as_posix()
      for line, name in private_uses(ast.parse(path.read_text())):
        if (rel, name) in BENCH_ALLOWED:
          used.add((rel, name))
        else:
          bad.append(f"{rel}:{line} {name}")
    self.assertEqual(bad, [])
    self.assertEqual(sorted(set(BENCH_ALLOWED) - used), [],
                     "BENCH_ALLOWED lists uses that are gone")

  def test_the_bench_check_finds_private_names(self):
    tree = ast.parse(
        "import os\nimport tf_dct\nimport tf_dct._private\n"
        "from bench.studies import dct_table1_mp as t1\n"
        "from launch.train import _helper, Job\n"
        "def f(opt, flags):\n"
        "  t1._floats('1'); t1.run(); os._exit(0); flags._child\n"
        "  tf_dct.compression._x.y; opt._tf_dct_compressor; Job.__name__\n")
    self.assertEqual([name for _, name in private_uses(tree)], [
        "tf_dct._private", "launch.train._helper",
        "bench.studies.dct_table1_mp._floats", "_tf_dct_compressor",
        "tf_dct.compression._x"])

  def test_the_check_finds_a_forbidden_import(self):
    tree = ast.parse("def f():\n  from tf_dct.compression import DCTDP\n")
    self.assertTrue(any(_matches(m, "tf_dct.compression") for m in _imports(tree)))


if __name__ == "__main__":
  tf.test.main()
