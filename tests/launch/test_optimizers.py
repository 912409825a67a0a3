"""Tests of the launcher's optimizers: `--optimizer`, the learning rate each
model uses with each optimizer, the error when training diverges, and the
compressor options that go with them (`--min_count`, `--momentum_correction`).

The training runs use `--config=local` with one replica spanning the 4
logical CPUs (`--num_replicas=1 --num_devices_per_replica=4`, no split
layers): the loss of one replica over the global batch is that of 4, and
there is one replica graph to trace instead of 4. Tracing dominates the cost
of these runs.
"""

import contextlib
import inspect
import io
import math
import pickle
import re
from unittest import mock

from absl import flags
from absl.testing import flagsaver
from absl.testing import parameterized
import ml_collections
import tensorflow as tf
import tf_keras

import tf_dct
from launch import registry
from launch import summaries
from launch import train
from tests import util

ONE_REPLICA = {"num_replicas": 1, "num_devices_per_replica": 4}
# Steps of the runs where the preset's 30 cost seconds more and a dozen
# already show the loss going down; DLRM, NCF and the MLP run the preset's 30
# (DLRM's tiny MLPs need them under the SGD family).
STEPS = {"transformer": 12, "resnet": 12, "lstm_lm": 12}
PAIRS = [(f"{m}_{o}", m, o) for m in train.MODELS for o in train.OPTIMIZERS]


def setUpModule():
  util.setup_cpus()


def _cfg(**overrides):
  with flagsaver.flagsaver(**overrides):
    return train.resolved_config()


class LocalPresetLearnsTest(parameterized.TestCase, tf.test.TestCase):
  """Every model's local preset lowers its loss with every optimizer's rate."""

  @parameterized.named_parameters(*PAIRS)
  def test_loss_goes_down(self, model, optimizer):
    steps = {"steps": STEPS[model]} if model in STEPS else {}
    cfg = _cfg(model=model, config="local", optimizer=optimizer, compression="none",
               mp_splits="none", **steps, **ONE_REPLICA)
    self.assertEqual(cfg["learning_rate"], registry.SPECS[model].local_learning_rates[optimizer])
    # The training loss is what this test checks; evaluation (a few seconds
    # for the Transformer's greedy decoding) is covered by test_train.py.
    with mock.patch.object(train.Job, "_evaluate", return_value={}):
      s = train.train(cfg)
    losses = s["losses"]
    self.assertLen(losses, cfg["steps"])
    self.assertTrue(all(math.isfinite(l) for l in losses), losses)
    self.assertLess(s["final_loss_mean"], s["first_loss_mean"], losses)


class OptimizerFlagTest(parameterized.TestCase, tf.test.TestCase):

  def test_every_model_has_a_rate_for_every_optimizer(self):
    self.assertEqual(train.OPTIMIZERS, ("sgd", "momentum", "adam", "adamw", "adagrad"))
    for name, spec in registry.SPECS.items():
      for table in (spec.learning_rates, spec.local_learning_rates):
        self.assertCountEqual(table, train.OPTIMIZERS, msg=name)
        for optimizer, lr in table.items():
          self.assertTrue(math.isfinite(lr) and lr > 0, (name, optimizer, lr))

  @parameterized.parameters("default", "local")
  def test_each_optimizer_builds_its_class_with_the_models_rate(self, config):
    expected = {"sgd": (tf_keras.optimizers.SGD, 0.0),
                "momentum": (tf_keras.optimizers.SGD, 0.9),
                "adam": (tf_keras.optimizers.Adam, None),
                "adamw": (tf_keras.optimizers.AdamW, None),
                "adagrad": (tf_keras.optimizers.Adagrad, None)}
    self.assertCountEqual(expected, train.OPTIMIZERS)
    for model in train.MODELS:
      for name, (cls, momentum) in expected.items():
        cfg = _cfg(model=model, config=config, optimizer=name)
        rate = registry.learning_rate(model, config, name)
        self.assertEqual(cfg["learning_rate"], rate)
        opt = train.make_optimizer(cfg)
        self.assertIs(type(opt), cls, (model, name))
        self.assertAllClose(float(opt.learning_rate.numpy()), rate)
        if momentum is not None:
          self.assertEqual(opt.momentum, momentum)
        if name == "adamw":
          self.assertEqual(opt.weight_decay, train.ADAMW_WEIGHT_DECAY)

  def test_preset_optimizer_takes_its_own_rate(self):
    # resnet: momentum by default, adam under --config=local.
    cfg = _cfg(model="resnet", config="default")
    self.assertEqual((cfg["optimizer"], cfg["learning_rate"]),
                     ("momentum", registry.SPECS["resnet"].learning_rates["momentum"]))
    cfg = _cfg(model="resnet", config="local")
    self.assertEqual((cfg["optimizer"], cfg["learning_rate"]),
                     ("adam", registry.SPECS["resnet"].local_learning_rates["adam"]))
    self.assertEqual(registry.settings("resnet", "local")["learning_rate"],
                     cfg["learning_rate"])

  @parameterized.parameters("default", "local")
  def test_explicit_learning_rate_wins(self, config):
    for model in train.MODELS:
      for optimizer in train.OPTIMIZERS:
        cfg = _cfg(model=model, config=config, optimizer=optimizer, learning_rate=0.123)
        self.assertEqual(cfg["learning_rate"], 0.123)
        self.assertIn("learning_rate", cfg["explicit"])
        self.assertAllClose(float(train.make_optimizer(cfg).learning_rate.numpy()), 0.123)
    # Without --optimizer, the given rate goes to the preset's optimizer.
    cfg = _cfg(model="ncf", config=config, learning_rate=0.5)
    self.assertEqual((cfg["optimizer"], cfg["learning_rate"]), ("adam", 0.5))

  def test_bad_optimizer_and_learning_rate(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "optimizer"):
      flags.FLAGS["optimizer"].parse("rmsprop")
    # A configuration built without the flags (as bench/ does) is checked too.
    cfg = dict(_cfg(model="mlp", config="local"), optimizer="rmsprop")
    with self.assertRaisesRegex(train.FlagError, r"--optimizer: unknown optimizer 'rmsprop'; "
                                r"expected one of \('sgd', 'momentum', 'adam', 'adamw', "
                                r"'adagrad'\)"):
      train.validate(cfg)
    with self.assertRaisesRegex(train.FlagError, "--optimizer: unknown optimizer 'rmsprop'"):
      train.make_optimizer(cfg)
    with self.assertRaisesRegex(ValueError, "--optimizer=rmsprop: no learning rate for "
                                "--model=mlp"):
      registry.learning_rate("mlp", "local", "rmsprop")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
      with self.assertRaisesRegex(train.FlagError,
                                  rf"--learning_rate must be in \(0, inf\), got {bad}"):
        _cfg(model="mlp", learning_rate=bad)


class CompressorOptionsTest(parameterized.TestCase, tf.test.TestCase):
  """--min_count, --momentum_correction and --adam_correction (dct, deft, topk)."""

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_min_count_reaches_the_compressor(self, compression):
    cls = getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[compression])
    default = inspect.signature(cls).parameters["min_count"].default
    cfg = _cfg(model="mlp", config="local", compression=compression)
    self.assertIsNone(cfg["min_count"])
    self.assertEqual(train.make_compressor(cfg).min_count, default)
    for given in (0, 3):
      cfg = _cfg(model="mlp", config="local", compression=compression, min_count=given)
      self.assertEqual(train.make_compressor(cfg).min_count, given)

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_ncf_default_preset_floor_is_eight(self, compression):
    # NCF's default preset sets a floor of 8 for every sparsifier; its local
    # preset and the other models keep the compressor's own.
    cls = getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[compression])
    default = inspect.signature(cls).parameters["min_count"].default
    cfg = _cfg(model="ncf", compression=compression)
    self.assertEqual(cfg["min_count"], 8)
    self.assertEqual(train.make_compressor(cfg).min_count, 8)
    self.assertEqual(train.make_compressor(_cfg(
        model="ncf", compression=compression, min_count=32)).min_count, 32)
    self.assertEqual(train.make_compressor(_cfg(
        model="ncf", config="local", compression=compression)).min_count, default)
    self.assertEqual(train.make_compressor(_cfg(
        model="dlrm", config="local", compression=compression)).min_count, default)

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_dlrm_default_preset_floor_per_sparsifier(self, compression):
    # DLRM's default preset gives TopK a floor of 64 (`compression_settings`); DCT-DP
    # and DEFT keep their own, and so does every sparsifier of its local preset.
    cls = getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[compression])
    default = inspect.signature(cls).parameters["min_count"].default
    want = 64 if compression == "topk" else default
    self.assertEqual(train.make_compressor(_cfg(
        model="dlrm", compression=compression)).min_count, want)
    self.assertEqual(train.make_compressor(_cfg(
        model="dlrm", compression=compression, min_count=3)).min_count, 3)
    self.assertEqual(train.make_compressor(_cfg(
        model="dlrm", config="local", compression=compression)).min_count, default)

  def test_compression_settings_from_the_config(self):
    config = train.load_config("default", "dlrm")
    config.compression_settings.deft.min_count = 16
    cfg = train.resolve(config, {"compression": "deft"})
    self.assertEqual(train.make_compressor(cfg).min_count, 16)
    self.assertEqual(train.config_of(cfg).compression_settings.to_dict(),
                     {"dct": {"adam_residual_decay": 0.7},
                      "topk": {"min_count": 64, "adam_residual_decay": 0.7},
                      "deft": {"momentum_masking": True, "adam_residual_decay": 0.7,
                               "min_count": 16}})
    self.assertIsNone(train.resolve(config, {"compression": "none"})["min_count"])
    for table, message in (
        ({"cltk": {"min_count": 8}},
         r"--config.compression_settings.cltk: 'cltk' is not a sparsifier"),
        ({"topk": {"min_count": -1}},
         r"--config.compression_settings.topk.min_count must be an int >= 0, got -1"),
        ({"topk": {"min_count": True}},
         r"--config.compression_settings.topk.min_count must be an int >= 0, got True"),
        ({"deft": {"momentum_masking": 1}},
         r"--config.compression_settings.deft.momentum_masking must be true or false, got 1"),
        ({"deft": {"density": 0.1}},
         r"--config.compression_settings.deft.density: not a setting a preset may give; "
         r"expected one of min_count, momentum_masking, whole_below, adam_residual_decay"),
        ({"topk": {"adam_residual_decay": 0.0}},
         r"--config.compression_settings.topk.adam_residual_decay must be a number in "
         r"\(0, 1\], got 0.0"),
        ({"topk": {"adam_residual_decay": True}},
         r"--config.compression_settings.topk.adam_residual_decay must be a number in "
         r"\(0, 1\], got True"),
        ({"dct": {"whole_below": -1}},
         r"--config.compression_settings.dct.whole_below must be an int >= 0, got -1")):
      bad = train.load_config("default", "dlrm")
      bad.compression_settings = ml_collections.ConfigDict(table)
      with self.assertRaisesRegex(train.FlagError, message):
        train.resolve(bad, {"compression": "topk"})

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_dlrm_default_preset_masks_deft_momentum(self, compression):
    # DLRM's default preset turns on DGC's momentum factor masking for DEFT,
    # under momentum correction only; the others and the local preset keep
    # the compressors' own (off); the flag overrides the preset.
    def masking(**kwargs):
      return train.make_compressor(_cfg(model="dlrm", compression=compression,
                                        **kwargs)).momentum_masking
    self.assertEqual(masking(optimizer="momentum"), compression == "deft")
    self.assertFalse(masking(optimizer="momentum", config="local"))
    self.assertFalse(masking(optimizer="adam"))
    self.assertFalse(masking(optimizer="momentum", momentum_masking=False))
    self.assertTrue(masking(optimizer="momentum", momentum_masking=True))
    self.assertFalse(masking(optimizer="momentum", momentum_correction=False))

  def test_momentum_masking_flag_needs_momentum_correction(self):
    for given, shown in (({"optimizer": "adam"}, "--optimizer=adam --compression=deft"),
                         ({"optimizer": "momentum", "momentum_correction": False},
                          "--momentum_correction=false"),
                         ({"optimizer": "momentum", "compression": "none"},
                          "--compression=none")):
      given = {"compression": "deft", **given, "momentum_masking": True}
      with self.assertRaisesRegex(train.FlagError,
                                  "--momentum_masking applies to --optimizer=momentum.*"
                                  + re.escape(shown)):
        train.resolve(train.load_config("default", "dlrm"), given)

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_whole_below_reaches_the_compressor(self, compression):
    cls = getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[compression])
    default = inspect.signature(cls).parameters["whole_below"].default
    cfg = _cfg(model="mlp", config="local", compression=compression)
    self.assertIsNone(cfg["whole_below"])
    self.assertEqual(train.make_compressor(cfg).whole_below, default)
    for given in (0, 2048):
      cfg = _cfg(model="mlp", config="local", compression=compression, whole_below=given)
      self.assertEqual(train.make_compressor(cfg).whole_below, given)
      self.assertEqual(summaries.hparams(cfg, 4, sparsifier=True,
                                         adam_correction=False)["whole_below"], given)

  def test_whole_below_errors(self):
    base = dict(model="mlp", config="local")
    for comp in ("none", "cltk", "threshold"):
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--whole_below is for --compression=dct/deft/topk, not "
                                  rf"--compression={comp}$"):
        _cfg(compression=comp, whole_below=2048, **base)
    with self.assertRaisesRegex(train.FlagError, r"^--whole_below must be >= 0, got -1$"):
      _cfg(compression="topk", whole_below=-1, **base)
    with self.assertRaisesRegex(train.FlagError,
                                r"^--whole_below applies with --dense_gradients=auto; this "
                                r"run has --dense_gradients=compress"):
      _cfg(compression="dct", whole_below=2048, dense_gradients="compress", **base)

  def test_whole_below_from_the_config(self):
    # A preset's value applies to its sparsifier, and is dropped where it
    # cannot apply: another compressor, or every variable compressed.
    config = train.load_config("default", "dlrm")
    config.compression_settings.topk = ml_collections.ConfigDict({"whole_below": 4096})
    self.assertEqual(train.make_compressor(
        train.resolve(config, {"compression": "topk"})).whole_below, 4096)
    self.assertEqual(train.make_compressor(train.resolve(
        config, {"compression": "topk", "whole_below": 0})).whole_below, 0)
    self.assertIsNone(train.resolve(config, {"compression": "dct"})["whole_below"])
    self.assertIsNone(train.resolve(config, {"compression": "topk",
                                             "dense_gradients": "compress"})["whole_below"])

  def test_ncf_default_preset_floor_is_dropped_without_a_sparsifier(self):
    for comp in ("none", "cltk", "threshold"):
      self.assertIsNone(_cfg(model="ncf", compression=comp)["min_count"], comp)
      # Given on the command line it is still an error.
      with self.assertRaisesRegex(train.FlagError, r"^--min_count is for "):
        _cfg(model="ncf", compression=comp, min_count=8)

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_momentum_correction_reaches_the_compressor(self, compression):
    base = dict(model="mlp", config="local", compression=compression)
    comp = train.make_compressor(_cfg(optimizer="momentum", **base))
    self.assertEqual(comp.momentum, train.MOMENTUM)
    comp = train.make_compressor(_cfg(optimizer="momentum", momentum_correction=False,
                                      **base))
    self.assertEqual(comp.momentum, 0.0)
    for optimizer in ("sgd", "adam", "adamw", "adagrad"):
      # The compressor's default (None): no momentum to correct.
      comp = train.make_compressor(_cfg(optimizer=optimizer, **base))
      self.assertFalse(comp.momentum, optimizer)

  @parameterized.parameters(*train.SPARSIFIERS)
  def test_adam_correction_reaches_the_compressor(self, compression):
    base = dict(model="mlp", config="local", compression=compression)
    for optimizer in ("adam", "adamw"):
      # The compressor's default: None (wrap_optimizer turns it on with the
      # optimizer's betas).
      comp = train.make_compressor(_cfg(optimizer=optimizer, **base))
      self.assertIsNone(comp.adam)
      comp = train.make_compressor(_cfg(optimizer=optimizer, adam_correction=False,
                                        **base))
      self.assertIs(comp.adam, False)
      comp = train.make_compressor(_cfg(optimizer=optimizer, adam_correction=True,
                                        **base))
      self.assertIsNone(comp.adam)

  def test_adam_run_with_correction(self):
    cfg = _cfg(model="mlp", config="local", compression="dct", optimizer="adam",
               num_replicas=2, num_devices_per_replica=2)
    job = train.Job(cfg).setup()
    self.assertTrue(all(job.compressor.corrects_optimizer(v)
                        for v in job.model.trainable_variables))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      s = job.run()
    self.assertIn("Adam correction)", out.getvalue())
    self.assertTrue(all(math.isfinite(l) for l in s["losses"]), s["losses"])
    self.assertLess(s["final_loss_mean"], s["first_loss_mean"], s["losses"])

  def test_bad_values_name_the_flag(self):
    with self.assertRaisesRegex(train.FlagError, r"^--adam_correction applies to "
                                r"--optimizer=adam/adamw with --compression=dct/deft/topk; "
                                r"this run has --optimizer=momentum --compression=dct$"):
      _cfg(model="mlp", optimizer="momentum", adam_correction=False)
    with self.assertRaisesRegex(train.FlagError, r"^--min_count must be >= 0, got -1$"):
      _cfg(model="mlp", compression="topk", min_count=-1)
    for comp in ("none", "cltk", "threshold"):
      with self.assertRaisesRegex(train.FlagError, r"^--min_count is for "
                                  rf"--compression=dct/deft/topk, not --compression={comp}$"):
        _cfg(model="mlp", compression=comp, min_count=4, threshold=0.1)
    with self.assertRaisesRegex(train.FlagError, r"^--momentum_correction applies to "
                                r"--optimizer=momentum with --compression=dct/deft/topk; "
                                r"this run has --optimizer=adam --compression=dct$"):
      _cfg(model="mlp", optimizer="adam", momentum_correction=False)
    with self.assertRaisesRegex(train.FlagError, "this run has --optimizer=momentum "
                                "--compression=cltk"):
      _cfg(model="mlp", optimizer="momentum", compression="cltk", momentum_correction=True)

  def test_momentum_sgd_run_with_correction(self):
    cfg = _cfg(model="mlp", config="local", compression="topk", optimizer="momentum",
               min_count=2, num_replicas=2, num_devices_per_replica=2)
    job = train.Job(cfg).setup()
    self.assertIsInstance(job.optimizer, tf_keras.optimizers.SGD)
    self.assertEqual(job.optimizer.momentum, train.MOMENTUM)
    self.assertEqual(job.compressor.momentum, train.MOMENTUM)
    self.assertEqual(job.compressor.min_count, 2)
    for v in job.model.trainable_variables:
      self.assertTrue(job.compressor.corrects_momentum(v), v.name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      s = job.run()
    self.assertIn("topk (density 0.1, values in the variable's dtype, min_count 2, "
                  "momentum correction)", out.getvalue())
    self.assertTrue(all(math.isfinite(l) for l in s["losses"]), s["losses"])
    self.assertLess(s["final_loss_mean"], s["first_loss_mean"], s["losses"])
    self.assertGreater(s["communication"]["dense_bytes"], s["communication"]["bytes_sent"])


class DivergenceTest(tf.test.TestCase):

  def test_divergence_names_the_learning_rate(self):
    cfg = _cfg(model="mlp", config="local", compression="none", optimizer="sgd",
               learning_rate=10.0, steps=20, **ONE_REPLICA)
    with self.assertRaisesRegex(
        train.TrainingDiverged, r"^loss is (nan|inf) at step \d+: training diverged; "
        r"lower --learning_rate \(now 10, --optimizer=sgd\)$") as caught:
      train.train(cfg)
    self.assertIsInstance(caught.exception, FloatingPointError)
    self.assertLess(caught.exception.step, 20)
    self.assertFalse(math.isfinite(caught.exception.loss))

  def test_message_with_the_default_rate(self):
    cfg = _cfg(model="ncf", config="local", optimizer="momentum")
    e = train.TrainingDiverged.at(float("nan"), 12, cfg)
    self.assertEqual(str(e), "loss is nan at step 12: training diverged; lower "
                     "--learning_rate (now 0.1, the default for --model=ncf --config=local "
                     "--optimizer=momentum)")
    copy = pickle.loads(pickle.dumps(e))  # e.g. from a worker process
    self.assertEqual((type(copy), str(copy), copy.step), (type(e), str(e), 12))


if __name__ == "__main__":
  tf.test.main()
