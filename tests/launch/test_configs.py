"""Tests of the launcher's configs (`launch/configs`, `--config`, `--mode`).

Parsing runs absl's flags in process (restored after each test); the one
training run is the MLP's local preset, a few steps on 4 logical CPUs.
"""

import ast
import contextlib
import io
import json
import os
import pathlib
import sys
from unittest import mock

from absl import flags
from absl.testing import flagsaver
from absl.testing import parameterized
import ml_collections
import tensorflow as tf

from launch import configs
from launch import registry
from launch import train
from tests import util

ROOT = pathlib.Path(__file__).resolve().parents[2]


def setUpModule():
  util.setup_cpus()


@contextlib.contextmanager
def _parsed(*args):
  """The launcher's flags parsed from `args` as from the command line."""
  with flagsaver.flagsaver():
    train.parse_flags(["tf-dct-train", *args])
    yield


def _resolved(*args) -> dict:
  with _parsed(*args):
    return train.resolved_config()


class ParseTest(parameterized.TestCase, tf.test.TestCase):

  def test_override_of_a_nested_value_reaches_the_built_model(self):
    cfg = _resolved("--model=mlp", "--config=local", "--config.model.hidden=(8, 4)")
    self.assertEqual(cfg["model_kwargs"], {"hidden": (8, 4)})
    self.assertIn("hidden", repr(cfg["model_kwargs"]))
    job = train.Job(cfg).setup()
    widths = [v.shape[-1] for v in job.model.trainable_variables if "kernel" in v.name]
    self.assertEqual(widths, [8, 4, 1])
    # Without --config: the default preset of --model, overridden the same way.
    cfg = _resolved("--model=ncf", "--config.model.mf_dim=12")
    self.assertEqual(cfg["model_kwargs"], {"mf_dim": 12, "mlp_layers": (256, 256, 128, 64)})
    self.assertEqual(cfg["config"], "default")
    self.assertIn("model_kwargs", train.STATE_SETTINGS)

  def test_config_file_path_and_presets(self):
    path = os.path.join(ROOT, "launch", "configs", "transformer.py")
    cfg = _resolved(f"--config={path}:local", "--config.model.d_model=48")
    self.assertEqual(cfg["model"], "transformer")
    self.assertEqual(cfg["config"], "local")
    self.assertEqual(cfg["model_kwargs"]["d_model"], 48)
    self.assertEqual(cfg["data"], {"tokenizer": "bytes", "max_len": 24})
    # A preset, space-separated, becomes the file of --model with that preset.
    self.assertEqual(
        train.expand_config_argv(["p", "--model", "ncf", "--config", "local", "--steps=2"]),
        ["p", "--model", "ncf", "--config", f"{configs.path('ncf')}:local", "--steps=2"])
    # The Quick start: no flag at all is the default DLRM, as before.
    cfg = _resolved()
    self.assertEqual((cfg["model"], cfg["config"], cfg["steps"], cfg["batch_size"]),
                     ("dlrm", "default", 300, 256))
    self.assertEqual(cfg["splits"], ("bottom_1", "top_1"))
    self.assertEqual(cfg["model_kwargs"]["bottom_mlp"], (512, 256, 64, 16))
    self.assertEqual(cfg["explicit"], frozenset())

  def test_flags_win_over_the_config_file_and_must_agree_with_overrides(self):
    path = os.path.join(self.create_tempdir().full_path, "mine.py")
    with open(path, "w", encoding="utf-8") as f:
      f.write("from launch import configs\n\n"
              "def get_config():\n"
              "  config = configs.get('mlp', 'local')\n"
              "  config.steps = 7\n"
              "  return config\n")
    cfg = _resolved(f"--config={path}")
    self.assertEqual(cfg["steps"], 7)
    self.assertIn("steps", cfg["explicit"])  # differs from the model's own
    self.assertEqual(_resolved(f"--config={path}", "--steps=9")["steps"], 9)
    self.assertEqual(_resolved("--steps=9", "--config.steps=9")["steps"], 9)
    with self.assertRaisesRegex(train.FlagError,
                                "^--steps=9 and --config.steps=8 disagree; give one of them$"):
      _resolved("--steps=9", "--config.steps=8")
    with self.assertRaisesRegex(train.FlagError, "^--model=ncf but the --config file is a "
                                "config of 'mlp'"):
      _resolved(f"--config={path}", "--model=ncf")

  @parameterized.named_parameters(
      ("nested", ["--config.model.d_model=3"],
       "^--config.model.d_model: config.model of --model=dlrm has no field 'd_model'; its "
       "fields: bottom_mlp, embedding_dim, top_mlp, vocab_sizes$"),
      ("top_level", ["--model=ncf", "--config=local", "--config.stepz=3"],
       "^--config.stepz: the config of --model=ncf has no field 'stepz'; its fields: "
       "adam_correction, adam_residual_decay, adam_second_moment, batch_size, "),
      ("below_a_value", ["--config.steps.x=3"],
       "^--config.steps.x: config.steps of --model=dlrm has no field 'x'; its fields: "
       "none: it is a value$"),
      ("preset", ["--config=huge"], "is neither a preset \\(default, local\\) nor a config"),
      ("arg", [f"--config={ROOT}/launch/configs/mlp.py:huge"],
       "unknown preset 'huge'; expected one of \\('default', 'local'\\)"),
  )
  def test_bad_config_names_the_key(self, args, message):
    with self.assertRaisesRegex(train.FlagError, message):
      train.expand_config_argv(["tf-dct-train", *args])
    # From the command line: one line, exit status 1, nothing started.
    stderr = io.StringIO()
    with flagsaver.flagsaver(), contextlib.redirect_stderr(stderr), \
        self.assertRaises(SystemExit) as stop:
      train.parse_flags(["tf-dct-train", *args])
    self.assertEqual(stop.exception.code, 1)
    self.assertRegex(stderr.getvalue(), "^launch.train: error: --config")
    self.assertEqual(stderr.getvalue().count("\n"), 1)

  @parameterized.named_parameters(
      ("zero_width", "--config.model.bottom_mlp=(8, 0)",
       r"^--config.model.bottom_mlp must be a non-empty list of integers >= 1, got \(8, 0\)$"),
      ("dim", "--config.model.embedding_dim=0",
       "^--config.model.embedding_dim must be an integer >= 1, got 0$"),
      ("eval", "--config.eval.steps=0", "^--config.eval.steps must be an integer >= 1, got 0$"),
  )
  def test_bad_values_name_the_field(self, arg, message):
    with self.assertRaisesRegex(train.FlagError, message):
      _resolved("--config=local", arg)

  def test_mode(self):
    self.assertEqual(_resolved("--model=mlp")["mode"], "train_and_eval")
    with self.assertRaisesRegex(train.FlagError, "^--mode=eval evaluates the latest "
                                "checkpoint of --model_dir; give --model_dir$"):
      _resolved("--model=mlp", "--mode=eval")
    empty = self.create_tempdir().full_path
    with self.assertRaisesRegex(train.FlagError, "holds no checkpoint to evaluate"):
      train.Job(_resolved("--model=mlp", "--mode=eval", f"--model_dir={empty}")).setup()
    self.assertEqual(os.listdir(empty), [])


class PresetTest(tf.test.TestCase):

  def test_presets_are_the_models_sizes(self):
    from models import dlrm, lstm_lm, ncf, resnet  # pylint: disable=g-import-not-at-top
    import models.transformer as transformer  # pylint: disable=g-import-not-at-top
    tuples = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    for name, module in (("transformer", transformer), ("resnet", resnet),
                         ("lstm_lm", lstm_lm)):
      self.assertEqual(configs.get(name).model.to_dict(), tuples(module.DEFAULT_CONFIG))
      self.assertEqual(configs.get(name, "local").model.to_dict(), tuples(module.TINY_CONFIG))
    self.assertEqual(configs.get("dlrm").model.to_dict(),
                     {"vocab_sizes": None, "embedding_dim": dlrm.EMBEDDING_DIM,
                      "bottom_mlp": dlrm.BOTTOM_MLP, "top_mlp": dlrm.TOP_MLP})
    self.assertEqual(configs.get("ncf").model.to_dict(),
                     {"mf_dim": ncf.MF_DIM, "mlp_layers": ncf.MLP_LAYERS})
    self.assertEqual(configs.get("lstm_lm").data.seq_len, lstm_lm.SEQ_LEN)

  def test_every_config_flag_is_a_field_with_the_flags_default(self):
    for model in train.MODELS:
      for preset in configs.PRESETS:
        config = configs.get(model, preset)
        self.assertEqual((config.model_name, config.preset), (model, preset))
        settings = registry.settings(model, preset)
        for name in train.CONFIG_FLAGS:
          self.assertIn(name, config)
          if name in configs.LAUNCHER_DEFAULTS:
            self.assertEqual(config[name], train._plain(flags.FLAGS[name].default), name)  # pylint: disable=protected-access
          elif name != "learning_rate":
            self.assertEqual(config[name], settings[name], (model, preset, name))
        self.assertIsNone(config.learning_rate)
        self.assertEqual(config.learning_rates[settings["optimizer"]],
                         settings["learning_rate"])


class PlaceholderTest(tf.test.TestCase):

  def test_configs_do_not_share_their_unset_fields(self):
    first, second = configs.get("mlp", "local"), configs.get("mlp", "local")
    first.summary_every, first.min_count, first.tpu = 40, 8, "grpc://x"
    self.assertIsNone(second.summary_every)
    self.assertIsNone(second.min_count)
    self.assertIsNone(second.tpu)
    self.assertIsNone(configs.get("ncf").summary_every)


class SavedConfigTest(tf.test.TestCase):
  """One MLP directory: trained, evaluated, trained on without evaluating."""

  def test_config_saved_eval_mode_and_train_mode(self):
    model_dir = self.create_tempdir().full_path
    # 2 replicas x 2 devices: half the replica graphs of the default 4 x 1 to trace.
    args = ("--model=mlp", "--config=local", "--config.model.hidden=(16, 8)",
            "--num_replicas=2", "--num_devices_per_replica=2",
            "--compression=none", "--steps=4", "--log_every=4", f"--model_dir={model_dir}")
    cfg = _resolved(*args)
    with contextlib.redirect_stdout(io.StringIO()):
      trained = train.train(cfg)
    self.assertEqual(trained["steps"], 4)
    # The resolved config, saved at the start, matches and runs again.
    path = os.path.join(model_dir, train.CONFIG_FILE)
    with open(path, encoding="utf-8") as f:
      saved = json.load(f)
    self.assertEqual(saved, json.loads(json.dumps(train.config_of(cfg).to_dict())))
    self.assertEqual(saved["model"], {"hidden": [16, 8]})
    self.assertEqual((saved["model_name"], saved["steps"], saved["learning_rate"]),
                     ("mlp", 4, cfg["learning_rate"]))
    again = _resolved(f"--config={path}", f"--model_dir={model_dir}")
    for key in (*train.CONFIG_FLAGS, "model", "config", "model_kwargs", "data", "eval",
                "split", "splits"):
      self.assertEqual(again[key], cfg[key], key)
    # --mode=eval restores the latest checkpoint (its config.json found in
    # --model_dir) and reproduces the metric of the trained run.
    with contextlib.redirect_stdout(io.StringIO()) as out:
      evaluated = train.train(_resolved("--mode=eval", f"--model_dir={model_dir}"))
    self.assertIn(f"restored {model_dir}/ckpt-4 at step 4", out.getvalue())
    self.assertEqual(evaluated["eval"], trained["eval"])
    self.assertEqual((evaluated["steps"], evaluated["losses"]), (4, []))
    # No step ran: the summary gives no rate for it.
    self.assertRegex(out.getvalue(), r"wall time \(tracing included\) +\| [\d.]+ s "
                                     r"\(no training step this run\)")
    # --mode=train checkpoints without evaluating; the config is rewritten.
    with contextlib.redirect_stdout(io.StringIO()) as out:
      more = train.train(_resolved(*args[:-3], "--steps=6", "--log_every=2",
                                   f"--model_dir={model_dir}", "--mode=train"))
    self.assertEqual((more["steps"], more["eval"]), (6, {}))
    self.assertNotIn("eval at step", out.getvalue())
    self.assertEqual(tf.train.latest_checkpoint(model_dir), f"{model_dir}/ckpt-6")
    with open(path, encoding="utf-8") as f:
      self.assertEqual(json.load(f)["steps"], 6)


def _patches(path: pathlib.Path) -> list[str]:
  """Lines of `path` that set an attribute of an imported module or class
  (`module.NAME = ...`, `setattr(module, ...)`), replace an object's method
  by a function (`obj.method = function_or_lambda`), or use `mock.patch`."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  imported = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
  functions = {node.name for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

  def root_name(node):
    while isinstance(node, ast.Attribute):
      node = node.value
    return node.id if isinstance(node, ast.Name) else None

  def is_function(node):
    return isinstance(node, ast.Lambda) or (isinstance(node, ast.Name)
                                            and node.id in functions)

  found = []
  for node in ast.walk(tree):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    targets = [t for target in targets
               for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    for target in targets:
      if not isinstance(target, ast.Attribute):
        continue
      if root_name(target) in imported or (root_name(target) != "self"
                                           and is_function(node.value)):
        found.append(f"{path.name}:{node.lineno}")
    if isinstance(node, ast.Call):
      name = ast.unparse(node.func)
      if name == "setattr" and node.args and (
          root_name(node.args[0]) in imported
          or (len(node.args) > 2 and is_function(node.args[2]))):
        found.append(f"{path.name}:{node.lineno}")
      elif ("patch" in name.split(".")[1:]  # mock.patch(...), mock.patch.object
            or name.split(".")[0] == "patch" and "patch" in imported):
        found.append(f"{path.name}:{node.lineno}")
  return sorted(found, key=lambda where: int(where.rsplit(":", 1)[1]))


class BenchStudiesTest(tf.test.TestCase):

  def test_bench_configures_instead_of_patching(self):
    files = sorted((ROOT / "bench").rglob("*.py"))
    self.assertGreater(len(files), 15)
    self.assertEqual([p for f in files for p in _patches(f)], [])
    # The check finds what it looks for, and leaves a script's own objects
    # (its flags, its configs) alone.
    sample = pathlib.Path(self.create_tempdir().full_path) / "sample.py"
    sample.write_text("import tf_dct\nfrom bench import fig5\nfrom unittest import mock\n"
                      "tf_dct.dct_mp.DCTSplit = None\nfig5.SPARSITIES = ()\n"
                      "setattr(tf_dct, 'x', 1)\nmock.patch.object(fig5, 'x')\n"
                      "def hook(x):\n  return x\n"
                      "compressor = tf_dct.compression.Dense()\n"
                      "compressor.aggregate = hook\ncompressor.reduce = lambda *a: a\n"
                      "setattr(compressor, 'aggregate', hook)\n"
                      "local = object()\nargs = fig5.parse()\nargs.steps = int('3')\n"
                      "setattr(args, 'steps', 4)\nconfig = fig5.config()\n"
                      "config.model.width = 8\n"
                      "from unittest.mock import patch\npatch('bench.fig5.x')\n"
                      "patch.object(fig5, 'x')\n", encoding="utf-8")
    self.assertEqual(_patches(sample),
                     [f"sample.py:{i}" for i in (4, 5, 6, 7, 11, 12, 13, 21, 22)])
    # A local variable named `patch` (a matplotlib patch) is not a patch.
    local = sample.with_name("local.py")
    local.write_text("def f(ax):\n  for patch in ax.patches:\n"
                     "    patch.get_y()\n", encoding="utf-8")
    self.assertEqual(_patches(local), [])


if __name__ == "__main__":
  tf.test.main()
