"""Train a model of `models/` under a tf_dct replicator, with gradient compression
(DCT-DP, DEFT, baselines) and DCT-MP split points: `python -m launch.train`.

With no flags this is the Quick-start main job: DLRM (DCT §3.1 dimensions) on
the embedded synthetic Criteo-shaped data, 4 logical CPUs as 2 data-parallel
replicas x 2 model-parallel devices, DCT-DP (sparsity 0.99) across the
replicas and DCT-MP (sparsity 0.9) at the paper's two splits ("bottom_1",
"top_1"), i.e. DCT Table 3's hybrid setting. It prints progress lines
(steady-state throughput and ETA, the first step's tracing apart) and a
final summary table that puts the bytes sent next to the bytes a dense
all-reduce would have moved. Every flag: `--helpfull` and docs/launch.md.

The run's settings are an `ml_collections` config (`launch/configs/<model>.py`,
`--config=path.py:preset`, `--config=local` for the config of --model with
the tiny preset, `--config.<field>=value` overrides). A flag given on the
command line wins over the config file; a flag and a `--config.<field>`
override of the same setting that disagree are an error. The resolved config
is written to `<model_dir>/config.json`; `--mode` trains, evaluates the
latest checkpoint, or both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import tempfile
import time

KERAS_CHOICES = ("auto", "2", "3")


_TRUE, _FALSE = ("true", "t", "1"), ("false", "f", "0")


def early_flag(argv: list[str], name: str, default):
  """Flag `name` of `argv` as absl will parse it, read before absl parses
  the flags (settings that must hold before TensorFlow is imported).

  `-name` and `--name` alike; the last occurrence wins; parsing stops at
  `--`. A string flag (`default` a str) is `--name=value` or `--name value`.
  A boolean flag (`default` a bool) is `--name`, `--noname` or
  `--name=true|false` (also t/f/1/0, any case); a value absl would reject
  leaves the previous one, and absl reports it when it parses the flags.
  """
  boolean = isinstance(default, bool)
  value, i = default, 0
  while i < len(argv):
    arg = argv[i]
    if arg == "--":
      break
    if arg.startswith("-"):
      key, eq, text = arg[2 if arg.startswith("--") else 1:].partition("=")
      if key == name and eq:
        if not boolean:
          value = text
        elif text.lower() in _TRUE + _FALSE:
          value = text.lower() in _TRUE
      elif key == name and boolean:
        value = True
      elif key == name and i + 1 < len(argv):
        i += 1
        value = argv[i]
      elif boolean and not eq and key == f"no{name}":
        value = False
    i += 1
  return value


def select_keras(argv: list[str]) -> None:
  """Sets `TF_USE_LEGACY_KERAS` from `--keras` in `argv`, before TensorFlow
  resolves `tf.keras` (absl parses the flag later, when it is too late).

  2: tf-keras, 3: Keras 3, auto (or absent): the environment's
  `TF_USE_LEGACY_KERAS`, else tf-keras (TFRS, which DLRM and NCF use, needs it).
  """
  choice = early_flag(argv, "keras", "auto")
  if choice in ("2", "3"):
    os.environ["TF_USE_LEGACY_KERAS"] = "1" if choice == "2" else "0"
  else:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


# Replicators that use no GPU: their runs hide the GPUs from TensorFlow.
NO_GPU_REPLICATORS = ("cpu", "tpu")
# What TensorFlow logs while it loads, before its C++ logging is initialised,
# so that TF_CPP_MIN_LOG_LEVEL does not hold it back (tensorflow#100442): a
# CUDA build's lines on a machine without a GPU, and the oneDNN notice on
# CPUs where oneDNN's custom operations are on.
IMPORT_NOISE = (b"cudart_stub.cc", b"oneDNN custom operations are on")
# The notice that precedes such a line (dropped with it, not on its own).
ABSL_PREAMBLE = b"All log messages before absl::InitializeLog() is called"


def uses_no_gpu(argv: list[str]) -> bool:
  """Whether the run `argv` describes uses no GPU: its --replicator (read
  before absl parses the flags, as `select_keras` does) is cpu (the default)
  or tpu."""
  return early_flag(argv, "replicator", "cpu") in NO_GPU_REPLICATORS


def dropped_lines(lines: list[bytes], markers: tuple[bytes, ...]) -> list[bytes]:
  """`lines` without those holding one of `markers`, and without an absl
  logging notice directly followed by such a line."""
  hit = [any(m in line for m in markers) for line in lines]
  return [line for i, line in enumerate(lines)
          if not hit[i] and not (ABSL_PREAMBLE in line and i + 1 < len(lines) and hit[i + 1])]


@contextlib.contextmanager
def without_stderr_lines(markers: tuple[bytes, ...]):
  """Passes on what is written to file descriptor 2 inside, but for the lines
  `dropped_lines` drops (TensorFlow's C++ logging writes to the descriptor,
  not to sys.stderr)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = dropped_lines(captured.read().splitlines(keepends=True), markers)
      if kept:
        os.write(2, b"".join(kept))


def runs_as_program(module_name: str, argv0: str) -> bool:
  """Whether this module runs as the launcher program (`python -m
  launch.train` or the `tf-dct-train` console script), not imported."""
  return module_name == "__main__" or os.path.basename(argv0) == "tf-dct-train"


# The imports below take a while (TensorFlow, ~20 s on a busy machine): a
# program run says so first.
if runs_as_program(__name__, sys.argv[0]):
  print("loading TensorFlow ...", flush=True)
select_keras(sys.argv[1:])
# On a run without GPUs, TensorFlow loads without the lines saying so, unless
# the user asked for TensorFlow's logging (TF_CPP_MIN_LOG_LEVEL set).
_QUIET_IMPORT = "TF_CPP_MIN_LOG_LEVEL" not in os.environ and uses_no_gpu(sys.argv[1:])
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

with (without_stderr_lines(IMPORT_NOISE) if _QUIET_IMPORT else contextlib.nullcontext()):
  # pylint: disable=g-import-not-at-top,wrong-import-position
  from absl import app
  from absl import flags
  from absl import logging
  import ml_collections
  from ml_collections import config_flags
  import numpy as np
  import tensorflow as tf

  import tf_dct
  from tf_dct import keras as tf_dct_keras
  from tf_dct.keras import placement
  from launch import configs
  from launch import registry
  from launch.flag_checks import ADAM_OPTIMIZERS
  from launch.flag_checks import check_range
  from launch.flag_checks import FlagError
  from launch.flag_checks import parse_schedule
  from launch import summaries
  from models.data.errors import DataError
  from models.data.errors import MALFORMED
  from models.flavour import LEGACY
  from models.flavour import keras
  # pylint: enable=g-import-not-at-top,wrong-import-position

MODELS = tuple(registry.SPECS)
CONFIGS = configs.PRESETS
# --mode: train_and_eval evaluates at every checkpoint (--eval_every, the last
# step); train only checkpoints; eval evaluates the latest checkpoint.
MODES = ("train_and_eval", "train", "eval")
REPLICATORS = ("cpu", "gpu", "multi_worker", "tpu")
COMPRESSIONS = ("none", "dct", "deft", "topk", "cltk", "threshold")
# --compression value -> class name in tf_dct.compression (looked up lazily,
# so the launcher runs before every compressor has landed).
COMPRESSOR_CLASSES = {"none": "Dense", "dct": "DCTDP", "deft": "DEFT", "topk": "TopK",
                      "cltk": "CLTK", "threshold": "HardThreshold"}
LOOPS = ("custom", "fit")
# Models built on TensorFlow Recommenders: tf-keras only (--keras).
TF_KERAS_MODELS = ("dlrm", "ncf")
OPTIMIZERS = registry.OPTIMIZERS
# Momentum of --optimizer=momentum (Keras SGD).
MOMENTUM = 0.9
# Compressors with an error-feedback residual: they take --min_count and can
# keep the momentum themselves (DGC momentum correction).
SPARSIFIERS = ("dct", "deft", "topk")
# Compressors on the sparse wire: they take --value_dtype.
VALUE_WORDS = ("dct", "topk", "threshold")
# --value_dtype -> the compressors' `value_dtype` (auto: not passed, the
# compressor's default).
VALUE_DTYPES = {"float32": None, "bfloat16": "bfloat16"}
# Decoupled weight decay of --optimizer=adamw (scaled by the learning rate, as
# in keras.optimizers.AdamW and torch.optim.AdamW).
ADAMW_WEIGHT_DECAY = 0.01

flags.DEFINE_enum("model", "dlrm", MODELS, "Model to train (models/<name>).")
config_flags.DEFINE_config_file(
    "config", None,
    "The run's config: launch/configs/<model>.py[:default|local], any file with "
    "get_config(arg), a saved <model_dir>/config.json, or a preset name: 'default' "
    "(full-size model; used without --config) or 'local' (tiny dimensions and ~30 "
    "steps: a smoke run) of --model. --config.<field>=value overrides a field, e.g. "
    "--config.model.d_model=128.")
flags.DEFINE_enum("mode", MODES[0], MODES,
                  "train_and_eval: train, evaluate at every checkpoint; train: train and "
                  "checkpoint only; eval: evaluate the latest checkpoint of --model_dir.")
flags.DEFINE_string("data_dir", "", "Real data directory; empty: the embedded synthetic data.")
flags.DEFINE_enum("replicator", "cpu", REPLICATORS, "Replicator kind (tf_dct.create_replicator).")
flags.DEFINE_integer("num_replicas", None,
                     "Data-parallel replicas on this machine (cpu/gpu). Default: per model "
                     "(dlrm 2, others 4).")
flags.DEFINE_integer("num_devices_per_replica", None,
                     "Devices per model-parallel replica. Default: per model (dlrm 2, others 1).")
flags.DEFINE_string("tpu", None, "TPU name or 'local' (with --replicator=tpu).")
flags.DEFINE_enum("compression", "dct", COMPRESSIONS,
                  "Gradient aggregation across replicas: none (dense all-reduce), dct "
                  "(DCT-DP), deft, topk, cltk, threshold (hard threshold).")
flags.DEFINE_float("sparsity", None, "DCT-DP sparsity eta in (0, 1). Default 0.99 (local 0.9).")
flags.DEFINE_integer("threshold_life", None,
                     "DCT-DP threshold life L (steps). Default 1000 (local 10).")
flags.DEFINE_float("density", None,
                   "deft/topk/cltk density in (0, 1]; for threshold, the wire capacity "
                   "density. Default 0.01 (local 0.1).")
flags.DEFINE_float("threshold", None, "Hard-threshold lambda >= 0 (--compression=threshold). "
                   "Default 1e-3.")
flags.DEFINE_integer("warmup_steps", 0, "Dense aggregation steps before compression starts.")
flags.DEFINE_list("sparsity_schedule", [],
                  "--compression=dct: stages of lower sparsity after the warm-up, each "
                  "steps:sparsity (e.g. 13:0.75,13:0.9375), then --sparsity for the rest "
                  "(DGC's sparsity warm-up); each stage is a phase of its own.")
flags.DEFINE_integer("min_size", 0, "Variables with fewer entries are always aggregated densely.")
flags.DEFINE_integer("min_count", None,
                     "dct/deft/topk: every compressed variable sends at least "
                     "min(entries, min_count) entries per step; >= 0 (0: the published "
                     "selection rules). Default: the compressor's (dct 64, deft/topk 8).")
flags.DEFINE_integer("whole_below", None,
                     "dct/deft/topk with --dense_gradients=auto: every variable of fewer "
                     "entries is sent whole through the compressor (its momentum or Adam "
                     "correction kept); >= 0 (0: only where compressing would move more "
                     "bytes). Default: the compressor's (deft 2048, dct/topk 0).")
flags.DEFINE_boolean("momentum_correction", True,
                     "With --optimizer=momentum and --compression=dct/deft/topk: each replica "
                     "keeps the momentum of its own gradients in the compressor (DGC momentum "
                     "correction) and the compressed variables are updated as plain SGD. "
                     "false: the optimizer's momentum acts on the compressed aggregate.")
flags.DEFINE_boolean("momentum_masking", None,
                     "With --optimizer=momentum, --compression=dct/deft/topk and momentum "
                     "correction: zero a replica's velocity where it sent an entry (DGC's "
                     "momentum factor masking). Default: the compressor's (off); on for deft "
                     "on dlrm's default preset.")
flags.DEFINE_boolean("adam_correction", True,
                     "With --optimizer=adam/adamw and --compression=dct/deft/topk: the "
                     "compressor runs Adam itself, its second moment fed every step by a small "
                     "dense side channel and its selection made on Adam-scaled gradients; the "
                     "compressed variables are updated as plain SGD. Default: on; false: the "
                     "optimizer's Adam acts on the compressed aggregate.")
flags.DEFINE_float("adam_residual_decay", None,
                   "With --compression=dct/deft/topk under Adam correction: the factor the "
                   "compressor's residuals are multiplied by after each step, in (0, 1]. 1 "
                   "keeps every held-back entry (error feedback as published); below 1 a "
                   "held-back entry's pile of first moments fades instead of landing late as "
                   "one jump. Default 1 (dlrm: 0.7).")
flags.DEFINE_enum("adam_second_moment", "factored", ("factored", "sketched", "exact"),
                  "With --compression=dct/deft/topk under Adam correction: its second "
                  "moment's side channel. factored: row and column sums of the squared "
                  "gradient; sketched: the same scaled to a 32-float count sketch of the "
                  "summed gradient (closer to Adam; better on the Transformer, worse on the "
                  "LSTM-LM in our runs); exact: the whole gradient (for measurements).")
flags.DEFINE_enum("deft_budget", "size", tf_dct.compression.deft.BUDGETS,
                  "With --compression=deft: how the step's budget is split over its "
                  "partitions. size: in proportion to their sizes (every layer at "
                  "--density); norm: in proportion to their gradient norms (the paper's "
                  "Algorithm 3).")
flags.DEFINE_list("compression_exclude", [],
                  "Regular expressions; variables whose names match one are all-reduced as "
                  "they are (embedding IndexedSlices all-gathered), not compressed. E.g. "
                  "'embedding' compresses only DLRM's MLPs, as DCT §3.1 does.")
flags.DEFINE_enum("sparse_gradients", None, ("auto", "stock", "compress"),
                  "Embedding tables' IndexedSlices gradients: stock sends the touched rows "
                  "as TF does (exact, an all-gather); compress compresses the table; auto "
                  "picks per table whichever moves fewer bytes. Default: the compressor's "
                  "own (stock for deft, auto for the others).")
flags.DEFINE_enum("value_dtype", "auto", ("auto", "float32", "bfloat16"),
                  "dct/topk/threshold: the dtype a sent value travels in. bfloat16: two "
                  "values to an int32 word, each replica keeping the rounding error in its "
                  "residual; float32: the variable's dtype; auto: the compressor's default "
                  "(dct bfloat16, topk and threshold float32).")
flags.DEFINE_enum("dense_gradients", "auto", ("auto", "compress"),
                  "Dense gradients: auto all-reduces a variable whole (keeping the "
                  "compressor's momentum or Adam correction) where that moves no more bytes "
                  "than compressing it (biases, small layers), and with deft every variable "
                  "of fewer than 2048 entries; compress compresses every variable.")
flags.DEFINE_float("mp_sparsity", None, "DCT-MP sparsity in [0, 1) at --mp_splits. Default 0.9.")
flags.DEFINE_integer("mp_warmup_steps", None,
                     "DCT-MP warm-up: training steps before the splits reach --mp_sparsity "
                     "(see --mp_warmup); >= 0. Default 0.")
flags.DEFINE_enum("mp_warmup", None, ("linear", "dense"),
                  "DCT-MP warm-up shape: linear (sparsity rising from 0 to --mp_sparsity) or "
                  "dense (unmasked). Default linear.")
MP_RESCALES = (*tf_dct.dct_mp.RESCALES, "auto")
flags.DEFINE_enum("mp_rescale", None, MP_RESCALES,
                  "DCT-MP: l1 scales each row's kept entries and their gradient by the row's "
                  "L1 norm over theirs, l1_backward the gradient only (nothing more crosses); "
                  "none is Algorithm 2. Default auto: l1_backward with --optimizer=sgd, "
                  "momentum or adagrad, none with adam and adamw.")
flags.DEFINE_string("mp_splits", None,
                    "Comma list of the model's split points to insert a DCTSplit at, 'paper' "
                    "(dlrm: bottom_1,top_1; transformer: encoder_ffn_4) or 'none'. Default: "
                    "dlrm 'paper', others none.")
flags.DEFINE_integer("batch_size", None, "Global batch size (all replicas). Default: per model.")
flags.DEFINE_integer("steps", None, "Training steps in total, resumed ones included. "
                     "Default: per model.")
flags.DEFINE_integer("eval_every", None, "Evaluate (and checkpoint) every N steps; 0: only at "
                     "the end. Default 0.")
flags.DEFINE_integer("log_every", None, "Steps between progress lines. Default 50 (local 10).")
flags.DEFINE_integer("summary_every", None,
                     "Steps between the compressor's per-variable TensorBoard scalars "
                     "(density, threshold, counters of every variable); 0 (never) or a "
                     "multiple of --log_every. Default: 10 x --log_every.")
flags.DEFINE_string("model_dir", "", "Checkpoints and TensorBoard summaries; empty: neither.")
flags.DEFINE_enum("loop", "custom", LOOPS,
                  "custom: Replicator.run(step_fn, input_fn); fit: Keras model.fit.")
flags.DEFINE_enum("optimizer", None, OPTIMIZERS,
                  "Optimizer: sgd, momentum (SGD with momentum 0.9), adam, adamw (Adam "
                  f"with decoupled weight decay {ADAMW_WEIGHT_DECAY}), adagrad. Default: "
                  "per model.")
flags.DEFINE_float("learning_rate", None,
                   "Learning rate. Default: per model and --optimizer (a table in "
                   "launch/registry.py, one per preset).")
flags.DEFINE_integer("seed", 0, "Seed of model initialisation and data.")
flags.DEFINE_enum("keras", "auto", KERAS_CHOICES,
                  "Keras flavour: 2 (tf-keras), 3 (Keras 3; not for dlrm and ncf, whose "
                  "TensorFlow Recommenders needs tf-keras), auto (TF_USE_LEGACY_KERAS "
                  "if set, else tf-keras). Read before TensorFlow is imported.")

FLAGS = flags.FLAGS

# Launcher settings resolved per model/preset (flags defaulting to None).
SETTINGS = (*registry.COMMON_DEFAULTS, "learning_rate")
# Flags that are fields of the config, under the same name.
CONFIG_FLAGS = (*configs.LAUNCHER_DEFAULTS, *SETTINGS)
# The config's sections -> their key in the resolved configuration.
SECTION_KEYS = {"model": "model_kwargs", "data": "data", "eval": "eval", "split": "split"}
CONFIG_FILE = "config.json"


def _given(name: str) -> bool:
  flag = FLAGS[name]
  return flag.present or not flag.using_default_value


def _plain(value):
  """A flag's or config's value in the config's form (lists as tuples)."""
  if isinstance(value, (list, tuple)):
    return tuple(_plain(v) for v in value)
  return value


def load_config(value: str | None, model: str) -> ml_collections.ConfigDict:
  """The config `--config=value` names (None: the default preset of `model`).

  `value` is a preset name of `model` (`default`, `local`), a saved
  `config.json`, or a Python file defining `get_config(arg)`, with the
  argument after a colon (`launch/configs/ncf.py:local`). Raises FlagError.
  """
  try:
    if not value or value in CONFIGS:
      return configs.get(model, value or "default")
    if value.endswith(".json"):
      with tf.io.gfile.GFile(value) as f:
        return configs.from_json(f.read())
    filename, colon, arg = value.partition(":")
    if not os.path.isfile(filename):
      raise FlagError(f"--config: {filename!r} is neither a preset ({', '.join(CONFIGS)}) "
                      "nor a config file")
    spec = importlib.util.spec_from_file_location("launch_train_config", filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*([arg] if colon else []))
  except (ValueError, KeyError, OSError) as e:
    if isinstance(e, FlagError):
      raise
    raise FlagError(f"--config={value}: {e}") from None


def resolve(config: ml_collections.ConfigDict, given: dict | None = None,
            overridden: dict | None = None, *, model_dir: str = "",
            mode: str = MODES[0]) -> dict:
  """The launcher configuration of `config` with flag values on top, validated.

  Precedence: a flag given explicitly > the config (its file, with the
  `--config.<field>` overrides applied). A flag and an override of the same
  field with different values are an error.

  Args:
    config: a config of `launch/configs` (`load_config`).
    given: {flag name: value} of the flags given explicitly.
    overridden: {field path: value} of the `--config.<field>` overrides.
    model_dir: the --model_dir value.
    mode: the --mode value.

  Returns:
    A flat dict: one key per flag, the config's sections (`model_kwargs`,
    `data`, `eval`, `split`), `learning_rates`, `compression_settings`, and `explicit`, the settings
    given by a flag, an override or a config file that differs from the
    model's own.

  Raises:
    FlagError: a conflict or a bad value.
  """
  given = {k: _plain(v) for k, v in (given or {}).items() if v is not None}
  overridden = {k: _plain(v) for k, v in (overridden or {}).items()}
  if mode not in MODES:
    raise FlagError(f"--mode: unknown mode {mode!r}; expected one of {MODES}")
  model = config.get("model_name")
  if model not in registry.SPECS:
    raise FlagError(f"--config: model_name {model!r} is not a model; expected one of {MODELS}")
  if given.get("model", model) != model:
    raise FlagError(f"--model={given['model']} but the --config file is a config of "
                    f"{model!r}; drop --model or give the config of {given['model']!r}")
  preset = config.get("preset")
  preset = preset if preset in CONFIGS else "default"
  # The model's own config under the preset: what `explicit` compares with,
  # and the value of a field the given config lacks.
  builtin = load_config(preset, model)
  cfg = {"model": model, "config": preset, "model_dir": model_dir, "mode": mode}
  explicit = {"model"} & set(given)
  for name in CONFIG_FLAGS:
    value = _plain(config.get(name, builtin[name]))
    if name in given:
      if name in overridden and overridden[name] != given[name]:
        raise FlagError(f"--{name}={given[name]} and --config.{name}={overridden[name]} "
                        "disagree; give one of them")
      value = given[name]
      explicit.add(name)
    elif name in overridden or value != _plain(builtin[name]):
      explicit.add(name)
    cfg[name] = value
  for section, key in SECTION_KEYS.items():
    cfg[key] = config.get(section, builtin[section]).to_dict()
  cfg["learning_rates"] = config.get("learning_rates", builtin.learning_rates).to_dict()
  if cfg["learning_rate"] is None and cfg["optimizer"] in OPTIMIZERS:
    # The rate follows the optimizer actually used, given or preset.
    if cfg["optimizer"] not in cfg["learning_rates"]:
      raise FlagError(f"--optimizer={cfg['optimizer']}: no learning rate for it in the "
                      f"config's learning_rates ({', '.join(cfg['learning_rates'])}); give "
                      "--learning_rate")
    cfg["learning_rate"] = cfg["learning_rates"][cfg["optimizer"]]
  cfg["compression_settings"] = config.get("compression_settings",
                                          builtin.compression_settings).to_dict()
  preset = cfg["compression_settings"].get(cfg.get("compression"))
  for name, value in (preset if isinstance(preset, dict) else {}).items():
    if cfg.get(name) is None:  # the model's setting for this sparsifier
      cfg[name] = value
  cfg["explicit"] = frozenset(explicit)
  validate(cfg)
  return cfg


def saved_config(mode: str | None, model_dir: str | None) -> str | None:
  """With --mode=eval and no --config: the `config.json` of --model_dir, if any."""
  if mode != "eval" or not model_dir:
    return None
  path = os.path.join(model_dir, CONFIG_FILE)
  return path if tf.io.gfile.exists(path) else None


def resolved_config() -> dict:
  """The flags and the `--config` config merged (`resolve`), validated.

  `--config` may hold the parsed config (command line) or, set from Python
  (`flagsaver`), a string `load_config` reads. Raises FlagError.
  """
  value, overridden = FLAGS.config, {}
  if value is None:
    value = saved_config(FLAGS.mode, FLAGS.model_dir)
  if value is None or isinstance(value, str):
    config = load_config(value, FLAGS.model)
  else:
    config = value
    try:
      overridden = dict(FLAGS["config"].override_values)
    except config_flags.UnparsedFlagError:
      pass
  given = {name: FLAGS[name].value for name in ("model", *CONFIG_FLAGS) if _given(name)}
  return resolve(config, given, overridden, model_dir=FLAGS.model_dir, mode=FLAGS.mode)


def config_of(cfg: dict) -> ml_collections.ConfigDict:
  """The resolved configuration `cfg` as a config of `launch/configs` (what
  `<model_dir>/config.json` holds; `--config=<that file>` runs it again)."""
  config = ml_collections.ConfigDict()
  config.model_name, config.preset = cfg["model"], cfg["config"]
  for name in CONFIG_FLAGS:
    config[name] = _plain(cfg[name])
  schedule = cfg.get("sparsity_schedule") or ()
  config.sparsity_schedule = tuple(item if isinstance(item, str) else f"{item[0]}:{item[1]}"
                                   for item in schedule)
  config.compression_exclude = tuple(cfg.get("compression_exclude") or ())
  for section, key in SECTION_KEYS.items():
    config[section] = dict(cfg[key])
  config.learning_rates = dict(cfg["learning_rates"])
  config.compression_settings = {name: dict(settings) for name, settings
                                 in (cfg.get("compression_settings") or {}).items()}
  return config


def write_config(cfg: dict) -> str:
  """Writes `config_of(cfg)` as JSON to `<model_dir>/config.json`; returns the path."""
  path = os.path.join(cfg["model_dir"], CONFIG_FILE)
  tf.io.gfile.makedirs(cfg["model_dir"])
  with tf.io.gfile.GFile(path + ".tmp", "w") as f:
    f.write(json.dumps(config_of(cfg).to_dict(), indent=1, sort_keys=True) + "\n")
  tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
  return path


def _check_section(section: str, values: dict) -> None:
  """Numbers of a config section: counts >= 1, dropout in [0, 1)."""
  for key, value in values.items():
    where = f"--config.{section}.{key}"
    if isinstance(value, bool) or value is None or isinstance(value, str):
      continue
    if isinstance(value, float):
      if "dropout" in key and not 0 <= value < 1:
        raise FlagError(f"{where} must be in [0, 1), got {value}")
      continue
    many = isinstance(value, (tuple, list))
    items = value if many else (value,)
    if not items or not all(isinstance(v, int) and v >= 1 for v in items):
      raise FlagError(f"{where} must be {'a non-empty list of ' if many else 'an '}"
                      f"integer{'s' if many else ''} >= 1, got {value}")


def _in_range(cfg, name, lo, hi, lo_open, hi_open):
  check_range(name, cfg[name], lo, hi, lo_open, hi_open)


def _parse_splits(cfg: dict, spec) -> list[str]:
  text = (cfg["mp_splits"] or "").strip()
  if text in ("", "none"):
    return []
  points = spec.split_points(cfg)
  if not points:
    raise FlagError(f"--mp_splits={text}: --model={spec.name} has no split points "
                    "(DCT-MP split points exist for: "
                    f"{', '.join(n for n, s in registry.SPECS.items() if s.has_splits)})")
  if text == "paper":
    names = list(spec.paper_splits)
    missing = [n for n in names if n not in points]
    if missing:
      raise FlagError(f"--mp_splits=paper means {','.join(names)} for --model={spec.name}, "
                      f"but this configuration has only {','.join(points)}; name the "
                      "points explicitly")
    return names
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in points]
  if unknown:
    raise FlagError(f"--mp_splits: unknown split point(s) {','.join(unknown)} of "
                    f"--model={spec.name}; available: {','.join(points)} (or 'paper')")
  if len(set(names)) != len(names):
    raise FlagError(f"--mp_splits lists a point twice: {text}")
  return [p for p in points if p in names]  # forward order


def validate(cfg: dict) -> None:
  """Every check that needs no TensorFlow device; raises FlagError."""
  spec = registry.get(cfg["model"])
  if not LEGACY and cfg["model"] in TF_KERAS_MODELS:
    raise FlagError(
        f"--model={cfg['model']} needs tf-keras (TensorFlow Recommenders needs "
        "tf.keras to be Keras 2), but this run uses Keras 3 (--keras=3, or "
        "TF_USE_LEGACY_KERAS=0 with --keras=auto); pass --keras=2")
  if not LEGACY and cfg["loop"] == "fit" and cfg["replicator"] == "multi_worker":
    raise FlagError(
        "--loop=fit with --replicator=multi_worker needs tf-keras: Keras 3 model.fit "
        "does not support MultiWorkerMirroredStrategy (upstream keras#20585); use "
        "--loop=custom or --keras=2")
  for section in ("model", "data", "eval"):
    _check_section(section, cfg.get(SECTION_KEYS[section]) or {})
  if cfg.get("mode") == "eval" and not cfg["model_dir"]:
    raise FlagError("--mode=eval evaluates the latest checkpoint of --model_dir; give "
                    "--model_dir")
  for name in ("steps", "batch_size", "log_every", "num_replicas", "num_devices_per_replica",
               "threshold_life"):
    if cfg[name] is None or cfg[name] < 1:
      raise FlagError(f"--{name} must be >= 1, got {cfg[name]}")
  for name in ("eval_every", "warmup_steps", "min_size"):
    if cfg[name] < 0:
      raise FlagError(f"--{name} must be >= 0, got {cfg[name]}")
  try:
    cfg["summary_every"] = summaries.resolve_summary_every(cfg)
  except ValueError as e:
    raise FlagError(str(e)) from None
  if cfg["optimizer"] not in OPTIMIZERS:
    raise FlagError(f"--optimizer: unknown optimizer {cfg['optimizer']!r}; expected one "
                    f"of {OPTIMIZERS}")
  _in_range(cfg, "learning_rate", 0, None, True, True)
  comp = cfg["compression"]
  cfg["sparsity_schedule"] = parse_schedule(cfg.get("sparsity_schedule") or (), comp)
  if cfg.get("sparse_gradients") is None and comp != "none":
    # The compressor's own default (DEFT sends embedding rows as TF does).
    cls = getattr(tf_dct.compression, COMPRESSOR_CLASSES[comp], None)
    if cls is not None:
      cfg["sparse_gradients"] = (
          inspect.signature(cls).parameters["sparse_gradients"].default)
  _check_compression_settings(cfg.get("compression_settings") or {})
  for name in ("min_count", "whole_below"):
    if comp not in SPARSIFIERS and name not in cfg.get("explicit", ()):
      cfg[name] = None  # a model's preset setting applies to the sparsifiers only
  corrected = cfg.get("momentum_correction", True)
  masks = cfg["optimizer"] == "momentum" and comp in SPARSIFIERS and corrected
  if "momentum_masking" in cfg.get("explicit", ()) and not masks:
    raise FlagError("--momentum_masking applies to --optimizer=momentum with "
                    f"--compression={'/'.join(SPARSIFIERS)} and --momentum_correction on; "
                    f"this run has --optimizer={cfg['optimizer']} --compression={comp} "
                    f"--momentum_correction={str(corrected).lower()}")
  if not masks:
    cfg["momentum_masking"] = None  # a model's preset masking needs momentum correction
  min_count = cfg.get("min_count")
  if min_count is not None:
    if comp not in SPARSIFIERS:
      raise FlagError(f"--min_count is for --compression={'/'.join(SPARSIFIERS)}, not "
                      f"--compression={comp}")
    if min_count < 0:
      raise FlagError(f"--min_count must be >= 0, got {min_count}")
  _check_whole_below(cfg)
  if "momentum_correction" in cfg.get("explicit", ()) and not (
      cfg["optimizer"] == "momentum" and comp in SPARSIFIERS):
    raise FlagError("--momentum_correction applies to --optimizer=momentum with "
                    f"--compression={'/'.join(SPARSIFIERS)}; this run has "
                    f"--optimizer={cfg['optimizer']} --compression={comp}")
  if "adam_correction" in cfg.get("explicit", ()) and not (
      cfg["optimizer"] in ADAM_OPTIMIZERS and comp in SPARSIFIERS):
    raise FlagError("--adam_correction applies to --optimizer=adam/adamw with "
                    f"--compression={'/'.join(SPARSIFIERS)}; this run has "
                    f"--optimizer={cfg['optimizer']} --compression={comp}")
  corrected = comp in SPARSIFIERS and adam_correction(cfg)  # Adam correction applies
  if "adam_residual_decay" in cfg.get("explicit", ()) and not corrected:
    raise FlagError(f"--adam_residual_decay applies to --compression={'/'.join(SPARSIFIERS)} with "
                    "--optimizer=adam/adamw and --adam_correction on; this run has "
                    f"--optimizer={cfg['optimizer']} --compression={comp} "
                    f"--adam_correction={str(adam_correction(cfg)).lower()}")
  if not corrected:
    cfg["adam_residual_decay"] = None  # a model's preset decay needs Adam correction
  if cfg.get("adam_residual_decay") is not None:
    _in_range(cfg, "adam_residual_decay", 0, 1, True, False)
  if cfg.get("adam_second_moment", "factored") != "factored" and not corrected:
    raise FlagError("--adam_second_moment applies to --optimizer=adam/adamw with "
                    f"--compression={'/'.join(SPARSIFIERS)} and Adam correction on; this run "
                    f"has --optimizer={cfg['optimizer']} --compression={comp} "
                    f"--adam_correction={str(adam_correction(cfg)).lower()}")
  if cfg.get("deft_budget", "size") != "size" and comp != "deft":
    raise FlagError(f"--deft_budget applies to --compression=deft; this run has "
                    f"--compression={comp}")
  if cfg.get("value_dtype", "auto") != "auto" and comp not in VALUE_WORDS:
    raise FlagError(f"--value_dtype is for --compression={'/'.join(VALUE_WORDS)}, not "
                    f"--compression={comp}")
  exclude = cfg.get("compression_exclude") or []
  if exclude and comp == "none":
    raise FlagError("--compression_exclude needs a compressor; --compression=none "
                    "compresses nothing")
  for pattern in exclude:
    try:
      re.compile(pattern)
    except re.error as e:
      raise FlagError(f"--compression_exclude: {pattern!r} is not a valid regular "
                      f"expression: {e}") from None
  if comp == "dct":
    _in_range(cfg, "sparsity", 0, 1, True, True)
  if comp in ("deft", "topk", "cltk") or (comp == "threshold" and "density" in cfg["explicit"]):
    _in_range(cfg, "density", 0, 1, True, False)
  if comp == "threshold":
    _in_range(cfg, "threshold", 0, None, False, True)
  model_dir = cfg["model_dir"]
  if model_dir and tf.io.gfile.exists(model_dir) and not tf.io.gfile.isdir(model_dir):
    raise FlagError(f"--model_dir {model_dir!r} is a file; give a directory (created "
                    "if missing)")
  try:
    registry.check_data_dir(spec, cfg["data_dir"])
  except ValueError as e:
    raise FlagError(str(e)) from None
  splits = _parse_splits(cfg, spec)
  cfg["splits"] = tuple(splits)
  if splits:
    _in_range(cfg, "mp_sparsity", 0, 1, False, True)
    if cfg["mp_warmup_steps"] is None or cfg["mp_warmup_steps"] < 0:
      raise FlagError(f"--mp_warmup_steps must be >= 0, got {cfg['mp_warmup_steps']}")
    if cfg["mp_rescale"] not in MP_RESCALES:
      raise FlagError(f"--mp_rescale must be one of {', '.join(MP_RESCALES)}, got "
                      f"{cfg['mp_rescale']!r}")
  if cfg["mp_rescale"] == "auto":
    # The split's masked gradient slows the layers before it over a long run
    # under SGD, momentum and Adagrad; Adam's normaliser hides it.
    cfg["mp_rescale"] = "none" if cfg["optimizer"] in ADAM_OPTIMIZERS else "l1_backward"
  kind = cfg["replicator"]
  if kind in ("multi_worker", "tpu"):
    for name in ("num_replicas", "num_devices_per_replica"):
      if name in cfg["explicit"] and not (name == "num_devices_per_replica" and cfg[name] == 1):
        raise FlagError(f"--{name} is for --replicator=cpu/gpu; --replicator={kind} uses "
                        "every device it is given, one replica per device")
    cfg["num_replicas"] = None          # taken from the cluster
    cfg["num_devices_per_replica"] = 1  # no model parallelism across hosts here
  if kind == "tpu" and not cfg["tpu"]:
    cfg["tpu"] = "local"
  if cfg["tpu"] and kind != "tpu":
    raise FlagError(f"--tpu={cfg['tpu']} needs --replicator=tpu")
  if cfg["num_devices_per_replica"] > 1 and splits and not spec.top_level_splits:
    raise FlagError(
        f"--num_devices_per_replica={cfg['num_devices_per_replica']} with --mp_splits: the "
        f"split points of --model={spec.name} sit inside its layers, so the launcher "
        "cannot place the layers after them on another device; use "
        "--num_devices_per_replica=1 (mask-only DCT-MP) or --model=dlrm")
  if cfg["num_replicas"] is not None and cfg["batch_size"] % cfg["num_replicas"]:
    raise FlagError(f"--batch_size ({cfg['batch_size']}) must be divisible by the number "
                    f"of replicas ({cfg['num_replicas']})")
  cls = COMPRESSOR_CLASSES[comp]
  if not hasattr(tf_dct.compression, cls):
    raise FlagError(f"--compression={comp}: tf_dct.compression.{cls} is not available in "
                    "this checkout yet")


def _check_whole_below(cfg: dict) -> None:
  """Raises FlagError for a bad --whole_below; drops a preset's value where
  it cannot apply (--dense_gradients=compress)."""
  whole_below, comp = cfg.get("whole_below"), cfg["compression"]
  if whole_below is None:
    return
  if comp not in SPARSIFIERS:
    raise FlagError(f"--whole_below is for --compression={'/'.join(SPARSIFIERS)}, not "
                    f"--compression={comp}")
  if whole_below < 0:
    raise FlagError(f"--whole_below must be >= 0, got {whole_below}")
  dense_gradients = cfg.get("dense_gradients", "auto")
  if dense_gradients != "auto":
    if "whole_below" in cfg.get("explicit", ()):
      raise FlagError("--whole_below applies with --dense_gradients=auto; this run has "
                      f"--dense_gradients={dense_gradients}, which compresses every "
                      "variable")
    cfg["whole_below"] = None


def _check_compression_settings(table: dict) -> None:
  """Raises FlagError unless `table` is {sparsifier: {setting: value}} with
  the settings and types of `registry.OPTIONAL_SETTINGS`."""
  allowed = registry.OPTIONAL_SETTINGS
  for name, settings in table.items():
    where = f"--config.compression_settings.{name}"
    if name not in SPARSIFIERS:
      raise FlagError(f"{where}: {name!r} is not a sparsifier; expected one of "
                      f"{'/'.join(SPARSIFIERS)}")
    if not isinstance(settings, dict):
      raise FlagError(f"{where} must be a table of settings ({', '.join(allowed)}), "
                      f"got {settings!r}")
    for key, value in settings.items():
      if key not in allowed:
        raise FlagError(f"{where}.{key}: not a setting a preset may give; expected one "
                        f"of {', '.join(allowed)}")
      if allowed[key] is bool and not isinstance(value, bool):
        raise FlagError(f"{where}.{key} must be true or false, got {value!r}")
      if allowed[key] is int and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
        raise FlagError(f"{where}.{key} must be an int >= 0, got {value!r}")
      if allowed[key] is float and (isinstance(value, bool)
                                    or not isinstance(value, (int, float))
                                    or not 0 < value <= 1):
        raise FlagError(f"{where}.{key} must be a number in (0, 1], got {value!r}")


def make_compressor(cfg: dict, cls: type | None = None):
  """The `tf_dct.compression` object of `--compression` (None for 'none').

  Args:
    cfg: the launcher configuration.
    cls: a subclass of the class `--compression` names (`Dense` for
      'none'), built with the arguments the flags give instead (e.g. one
      that also records what it is handed); None: that class.

  Raises:
    TypeError: `cls` is not such a subclass.
  """
  comp = cfg["compression"]
  base = getattr(tf_dct.compression, COMPRESSOR_CLASSES[comp])
  if cls is not None and not (isinstance(cls, type) and issubclass(cls, base)):
    raise TypeError(f"make_compressor: cls must be a subclass of "
                    f"tf_dct.compression.{base.__name__} (--compression={comp}), got {cls!r}")
  if comp == "none":
    return None if cls is None else cls()
  return (cls or base)(**compressor_arguments(cfg))


def compressor_arguments(cfg: dict) -> dict:
  """The constructor keywords the flags give `--compression`'s class ({} for
  'none'): what `make_compressor` builds, for callers that add their own."""
  comp = cfg["compression"]
  if comp == "none":
    return {}
  common = {"min_size": cfg["min_size"], "warmup_steps": cfg["warmup_steps"],
            "exclude": tuple(cfg.get("compression_exclude") or ()),
            "dense_gradients": cfg.get("dense_gradients", "auto")}
  if cfg.get("value_dtype", "auto") != "auto":
    common["value_dtype"] = VALUE_DTYPES[cfg["value_dtype"]]
  if cfg.get("sparse_gradients") is not None:  # None: the compressor's own
    common["sparse_gradients"] = cfg["sparse_gradients"]
  if comp in SPARSIFIERS:
    if cfg.get("min_count") is not None:
      common["min_count"] = cfg["min_count"]
    if cfg.get("whole_below") is not None:
      common["whole_below"] = cfg["whole_below"]
    if cfg["optimizer"] == "momentum":
      # The Keras adapter then applies the compressed variables' aggregate as
      # plain SGD; variables left dense (excluded, below --min_size) keep the
      # optimizer's momentum.
      common["momentum"] = MOMENTUM if cfg.get("momentum_correction", True) else 0.0
      if cfg.get("momentum_masking") is not None and common["momentum"]:
        common["momentum_masking"] = cfg["momentum_masking"]
    if cfg["optimizer"] in ADAM_OPTIMIZERS:
      # None: the compressor takes Adam's hyper-parameters from the optimizer.
      corrected = adam_correction(cfg)
      common["adam"] = None if corrected else False
      if corrected:
        common["adam_second_moment"] = cfg.get("adam_second_moment", "factored")
        if cfg.get("adam_residual_decay") is not None:
          common["residual_decay"] = cfg["adam_residual_decay"]
  if comp == "deft":
    common["budget"] = cfg.get("deft_budget", "size")
  if comp == "dct":
    return dict(sparsity=cfg["sparsity"], threshold_life=cfg["threshold_life"],
                sparsity_schedule=cfg.get("sparsity_schedule") or (), **common)
  if comp == "threshold":
    extra = ({"capacity_density": cfg["density"]} if "density" in cfg["explicit"] else {})
    return dict(threshold=cfg["threshold"], **extra, **common)
  return dict(density=cfg["density"], **common)


def make_optimizer(cfg: dict):
  """The Keras optimizer of `--optimizer` at `--learning_rate`."""
  lr = cfg["learning_rate"]
  name = cfg["optimizer"]
  if name == "sgd":
    return keras.optimizers.SGD(lr)
  if name == "momentum":
    return keras.optimizers.SGD(lr, momentum=MOMENTUM)
  if name == "adam":
    return keras.optimizers.Adam(lr)
  if name == "adamw":
    return keras.optimizers.AdamW(lr, weight_decay=ADAMW_WEIGHT_DECAY)
  if name == "adagrad":
    return keras.optimizers.Adagrad(lr)
  raise FlagError(f"--optimizer: unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def adam_correction(cfg: dict) -> bool:
  """Whether the compressor runs Adam itself: --adam_correction if given, else
  the compressors' default (on)."""
  if cfg["optimizer"] not in ADAM_OPTIMIZERS or cfg["compression"] not in SPARSIFIERS:
    return False
  return bool(cfg.get("adam_correction", True))


# --- the settings a checkpoint was made with ------------------------------------

SETTINGS_FILE = "settings.json"
# The settings that shape what a checkpoint holds, each with the function of
# its value that must not change on resume (None: the value itself).
STATE_SETTINGS = {
    "model": None, "config": None,  # the variables and their sizes
    "model_kwargs": None, "data": None,  # the model's dimensions, its vocabulary
    "data_dir": bool,  # real or synthetic data: table sizes follow the data
    "mp_splits": None,  # DCT-MP split layers and their counters
    "mp_warmup_steps": lambda n: n > 0,  # the splits' step counters
    # One copy of the compressor state per replica; multi_worker keeps one
    # directory per worker.
    "replicator": lambda kind: kind if kind in ("multi_worker", "tpu") else "cpu/gpu",
    "num_replicas": None, "workers": None,
    "optimizer": None,  # its slots
    # Which variables keep compressor state, and what state.
    "compression": None, "min_size": None, "compression_exclude": None,
    "momentum_correction": None, "adam_correction": None,
    # The accounting keeps totals per phase (dense warm-up, schedule stages).
    "warmup_steps": lambda n: n > 0, "sparsity_schedule": len,
    # tf-keras and Keras 3 name and lay out the variables differently.
    "keras": None,
}


def state_settings(cfg: dict) -> dict:
  """The `STATE_SETTINGS` of `cfg`, as written to `SETTINGS_FILE`."""
  out = {name: cfg.get(name) for name in STATE_SETTINGS}
  # As JSON has them (tuples as lists), to compare with a saved file.
  out.update(model_kwargs=json.loads(json.dumps(cfg.get("model_kwargs"))),
             data=json.loads(json.dumps(cfg.get("data"))))
  out.update(
      mp_splits=",".join(cfg["splits"]),
      compression_exclude=list(cfg.get("compression_exclude") or ()),
      sparsity_schedule=[f"{n}:{x}" for n, x in cfg.get("sparsity_schedule") or ()],
      momentum_correction=bool(cfg.get("momentum_correction", True)),
      adam_correction=adam_correction(cfg), workers=None, keras="2" if LEGACY else "3")
  if cfg["replicator"] == "multi_worker":
    try:
      cluster = (tf_dct.distribute.multi_worker.validate_tf_config() or {}).get("cluster", {})
      out["workers"] = len(cluster.get("chief", ())) + len(cluster.get("worker", ()))
    except ValueError:
      pass  # creating the replicator reports it
  return out


def check_settings(cfg: dict) -> None:
  """Raises FlagError if --model_dir holds a run whose `STATE_SETTINGS`
  differ from `cfg`'s, naming each (old -> new); reads `SETTINGS_FILE`.

  A restart with such a change would restore a checkpoint into differently
  shaped state (TensorFlow's errors, or state silently left fresh). Every
  other flag leaves the state as it is and may change: --steps, --log_every,
  --eval_every, --loop, --batch_size, --seed, --learning_rate, the
  compressors' rates and thresholds (--sparsity, --density, --threshold,
  --threshold_life, --min_count), --sparse_gradients, --dense_gradients,
  --whole_below, --mp_sparsity, --num_devices_per_replica, --tpu and the
  --data_dir path.
  """
  path = os.path.join(cfg["model_dir"], SETTINGS_FILE) if cfg["model_dir"] else ""
  if not path or not tf.io.gfile.exists(path):
    return
  try:
    with tf.io.gfile.GFile(path) as f:
      saved = json.load(f)
  except ValueError:  # not JSON
    saved = None
  if not isinstance(saved, dict):
    raise FlagError(f"--model_dir: {path} is not a JSON object of settings; restore it "
                    "or use a new --model_dir")
  current = state_settings(cfg)
  show = lambda v: ",".join(map(str, v)) if isinstance(v, list) else v
  differ = []
  for name, key in STATE_SETTINGS.items():
    key = key or (lambda v: v)
    if name in saved and key(saved[name]) != key(current[name]):
      flag = {"workers": "workers in TF_CONFIG", "model_kwargs": "--config.model",
              "data": "--config.data"}.get(name, f"--{name}")
      differ.append(f"{flag} {show(saved[name])!r} -> {show(current[name])!r}")
  if differ:
    raise FlagError(f"--model_dir {cfg['model_dir']} holds a run with other settings "
                    f"({', '.join(differ)}); resume it with the same flags, or use a new "
                    "--model_dir")


def write_settings(cfg: dict) -> None:
  """Records `cfg`'s `STATE_SETTINGS` in --model_dir, once."""
  path = os.path.join(cfg["model_dir"], SETTINGS_FILE)
  if tf.io.gfile.exists(path):
    return
  with tf.io.gfile.GFile(path + ".tmp", "w") as f:
    json.dump(state_settings(cfg), f, indent=1, sort_keys=True)
  tf.io.gfile.rename(path + ".tmp", path, overwrite=True)


# --- the job ---------------------------------------------------------------------


def steady_state(steps: int, seconds: float, batch_size: int, remaining: int) -> dict | None:
  """Throughput of the steady state and the time the remaining steps need.

  The first step of a run traces (and compiles) the training step and can
  take a minute; timing only the steps after it gives the rate the rest of
  the run will go at.

  Args:
    steps: steps timed (after the first step of the run).
    seconds: the time they took.
    batch_size: examples per step (the global batch).
    remaining: steps still to run.

  Returns:
    `steps_per_sec`, `examples_per_sec` and `eta_seconds`, or None before any
    step has been timed.
  """
  if steps <= 0 or seconds <= 0:
    return None
  rate = steps / seconds
  return {"steps_per_sec": rate, "examples_per_sec": rate * batch_size,
          "eta_seconds": remaining / rate}


def duration(seconds: float) -> str:
  """`seconds` for a progress line: "42 s", "3m05s", "2h07m"."""
  seconds = round(seconds)
  if seconds < 60:
    return f"{seconds} s"
  minutes, secs = divmod(seconds, 60)
  if minutes < 60:
    return f"{minutes}m{secs:02d}s"
  return f"{minutes // 60}h{minutes % 60:02d}m"


def _mb(x: float) -> str:
  return f"{x / 1e6:,.2f} MB"


class TrainingDiverged(FloatingPointError):
  """The training loss became NaN or infinite: the learning rate is too high.

  Attributes:
    loss: the loss value (nan or +-inf).
    step: the step whose loss it is.
  """

  def __init__(self, message: str, loss: float = math.nan, step: int = -1):
    super().__init__(message)
    self.loss, self.step = loss, step

  def __reduce__(self):
    return type(self), (str(self), self.loss, self.step)

  @classmethod
  def at(cls, loss: float, step: int, cfg: dict) -> "TrainingDiverged":
    """The error for `loss` at `step`, naming the learning rate of `cfg`."""
    if "learning_rate" in cfg.get("explicit", ()):
      where = f"--optimizer={cfg['optimizer']}"
    else:
      where = (f"the default for --model={cfg['model']} --config={cfg['config']} "
               f"--optimizer={cfg['optimizer']}")
    return cls(f"loss is {loss} at step {step}: training diverged; lower --learning_rate "
               f"(now {cfg['learning_rate']:g}, {where})", loss, step)


class Job:
  """One training run. `setup()` builds and restores; `run()` trains.

  Splitting the two lets a caller look at the restored state (step counter,
  compressor residuals) before training continues.

  Args:
    cfg: the launcher configuration (`resolved_config()`, validated).
    compressor: a `tf_dct.compression.Compressor` to use instead of the one
      `cfg["compression"]` and its options describe (e.g. a compressor with
      settings the flags do not offer); None builds it from `cfg`.
  """

  def __init__(self, cfg: dict, compressor=None):
    if compressor is not None and not isinstance(
        compressor, tf_dct.compression.Compressor):
      raise TypeError("Job: compressor must be a tf_dct.compression.Compressor "
                      f"or None, got {type(compressor).__name__}")
    self.cfg = cfg
    self.spec = registry.get(cfg["model"])
    self._given_compressor = compressor
    self.repl = self.model = self.optimizer = self.compressor = None
    self.split_layers: list = []
    self.placement: dict[str, int] = {}
    self.manager = self.summaries = None
    self.restored_from = None
    self.input_restored = False  # the checkpoint holds the input's position

  # -- setup ------------------------------------------------------------------

  def _create_replicator(self):
    cfg = self.cfg
    kind = cfg["replicator"]
    kwargs = {}
    if kind in ("cpu", "gpu"):
      kwargs["num_replicas"] = cfg["num_replicas"]
    try:
      return tf_dct.create_replicator(kind, num_devices_per_replica=cfg["num_devices_per_replica"],
                                      tpu=cfg["tpu"] if kind == "tpu" else None, **kwargs)
    except (RuntimeError, ValueError) as e:
      raise FlagError(f"--replicator={kind}: {e}") from e

  def _model_dir(self) -> str:
    d = self.cfg["model_dir"]
    if d and self.cfg["replicator"] == "multi_worker":
      # Every worker saves its own replicas' state: one directory per worker.
      d = os.path.join(d, f"worker_{self.repl.cluster_resolver.task_id}")
    return d

  def _summary_dir(self) -> str:
    """Where the TensorBoard summaries go: --model_dir itself (its `train`,
    `eval` runs) on the chief; nowhere on the other workers of a
    multi_worker run, as with Keras' TensorBoard callback and the Model
    Garden (their scalars would repeat the chief's). Empty: none written."""
    if not self.cfg["model_dir"] or not getattr(self.repl, "is_chief", True):
      return ""
    return self.cfg["model_dir"]

  def setup(self) -> "Job":
    cfg, spec = self.cfg, self.spec
    check_settings(cfg)
    if (cfg.get("mode") == "eval" and cfg["replicator"] != "multi_worker"
        and not tf.train.latest_checkpoint(cfg["model_dir"])):
      raise FlagError(f"--mode=eval: --model_dir {cfg['model_dir']} holds no checkpoint to "
                      "evaluate")
    self.repl = repl = self._create_replicator()
    if cfg["batch_size"] % repl.num_replicas:
      raise FlagError(f"--batch_size ({cfg['batch_size']}) must be divisible by the "
                      f"number of replicas ({repl.num_replicas})")
    self.num_workers = max(1, repl.num_replicas // len(repl.replica_devices))
    k = repl.num_devices_per_replica
    splits = set(cfg["splits"])
    # The config's `split` section: DCTSplit arguments (None: the layer's default).
    split_kwargs = {key: v for key, v in (cfg.get("split") or {}).items() if v is not None}

    def split_fn(point):
      if point not in splits:
        return None
      j = len(self.split_layers)
      target = (j + 1) % k if k > 1 else None
      # Outside a replica (building the functional model, evaluation) a layer
      # with a device target applies the same mask in place.
      split_cls = tf_dct.dct_mp.DCTSplit if LEGACY else tf_dct.dct_mp.Keras3DCTSplit
      layer = split_cls(
          cfg["mp_sparsity"], target_logical_device=target,
          warmup_steps=cfg["mp_warmup_steps"], warmup=cfg["mp_warmup"],
          rescale=cfg["mp_rescale"],
          name=f"dct_split_{point}", **split_kwargs)
      self.split_layers.append(layer)
      return layer

    with repl.scope():
      self.model = spec.build(cfg, split_fn if spec.has_splits else None)
      self.compressor = (self._given_compressor if self._given_compressor is not None
                         else make_compressor(cfg))
      self.optimizer = repl.wrap_optimizer(make_optimizer(cfg), compression=self.compressor)
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
      if cfg["loop"] == "fit":
        metrics = spec.fit_metrics(spec) if spec.fit_metrics else None
        self.model.compile(optimizer=self.optimizer, loss=self._keras_loss(),
                           metrics=metrics)
    if k > 1 and self.split_layers:
      self.placement = placement.place_stages(self.model, self.split_layers, k)
    # Building the wrapped optimizer creates its slots and the compressor's
    # state now, so a restore fills them at once (and the first step traces
    # once).
    self.optimizer.build(self.model.trainable_variables)
    self.ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
    model_dir = self._model_dir()
    if model_dir:
      self.manager = tf.train.CheckpointManager(self.ckpt, model_dir, max_to_keep=3)
      if cfg.get("mode") == "eval" and not self.manager.latest_checkpoint:
        raise FlagError(f"--mode=eval: --model_dir {model_dir} holds no checkpoint to "
                        "evaluate")
      if cfg.get("mode") != "eval" and getattr(repl, "is_chief", True):
        write_config(cfg)
      if self.manager.latest_checkpoint:
        self.ckpt.restore(self.manager.latest_checkpoint).assert_existing_objects_matched()
        self.restored_from = self.manager.latest_checkpoint
        self.input_restored = (cfg["loop"] == "custom" and spec.checkpoint_input and any(
            name.startswith(self._input_key() + "/")
            for name, _ in tf.train.list_variables(self.restored_from)))
        print(f"restored {self.restored_from} at step {int(self.step.numpy())}", flush=True)
    self.summaries = summaries.Summaries(cfg, self._summary_dir())
    self.summaries.gate(self.compressor)
    return self

  def _keras_loss(self):
    spec = self.spec

    def loss(y_true, y_pred):
      return spec.loss(y_true, y_pred)

    return loss

  # -- data ---------------------------------------------------------------------

  def _dataset(self, batch_size: int, ctx: tf.distribute.InputContext | None = None,
               *, resume: bool = True):
    """Global (or, with several workers, this worker's) batches, from `step` on.

    The stream starts at the batch of the current step (`ModelSpec.dataset`
    makes it there directly; no batches are made and dropped but for real
    Criteo files), so a resumed run sees the batches of an uninterrupted
    one; after a change of --batch_size, the batches of the new size from
    the step on. `resume=False`: from the first batch (for an iterator
    whose checkpointed position is restored).
    """
    cfg = dict(self.cfg, batch_size=batch_size)
    pipelines = ctx.num_input_pipelines if ctx is not None else 1
    start = int(self.step.numpy()) * pipelines if resume else 0
    ds = self.spec.dataset(cfg, start)
    if pipelines > 1:
      # Worker i takes batches i, i + n, ...: from step s on, those of
      # the global stream from s * n on.
      ds = ds.shard(pipelines, ctx.input_pipeline_id)
    return ds

  def _input(self, ctx: tf.distribute.InputContext):
    """The custom loop's input: a dataset, or a callable giving the next batch.

    For a model whose input iterator is checkpointed
    (`ModelSpec.checkpoint_input`) the iterator joins the checkpoint under
    `_input_key()`: a resume restores its position (TensorFlow restores it as
    it is attached). A checkpoint without it (another model or batch size,
    `--loop=fit`) and every other model start the stream at the step.
    """
    per_worker = self.cfg["batch_size"] // self.num_workers
    ds = self._dataset(per_worker, ctx if self.num_workers > 1 else None,
                       resume=not self.input_restored)
    if not self.spec.checkpoint_input:
      return ds
    with tf.init_scope(), tf.device("/cpu:0"):
      iterator = iter(ds)
    setattr(self.ckpt, self._input_key(), iterator)
    return lambda: next(iterator)

  def _input_key(self) -> str:
    """The input iterator's name in the checkpoint; it holds batches already
    made (prefetched), so a resume with another batch size starts the stream
    at the step instead."""
    return f"input_batch_{self.cfg['batch_size'] // self.num_workers}"

  # -- loops --------------------------------------------------------------------

  def run(self) -> dict:
    if self.repl is None:
      self.setup()
    cfg = self.cfg
    self.losses: list[float] = []
    self.evals: dict[int, dict] = {}
    self.start_step = int(self.step.numpy())
    # The first step's time (tracing included) and the time of the steps after
    # it, evaluations and checkpoints left out: the steady state.
    self.first_step_seconds = None
    self.steady_seconds = 0.0
    self.summaries.write_hparams(summaries.hparams(
        cfg, self.repl.num_replicas, sparsifier=cfg["compression"] in SPARSIFIERS,
        adam_correction=adam_correction(cfg)), self.spec.metric)
    self.start_time = self._clock = time.perf_counter()
    with self.summaries.training():
      if cfg.get("mode") == "eval":
        self._evaluate()
        self.wall = time.perf_counter() - self.start_time
        return self._summary()
      if self.start_step < cfg["steps"]:
        print("tracing the training step (first step; can take a minute) ...", flush=True)
        if cfg["loop"] == "custom":
          self._run_custom()
        else:
          self._run_fit()
      self.wall = time.perf_counter() - self.start_time
      if self._evaluates() and (self.start_step >= cfg["steps"]
                                or not self.evals.get(int(self.step.numpy()))):
        self._evaluate()
    return self._summary()

  def _run_custom(self):
    cfg, repl, model, spec = self.cfg, self.repl, self.model, self.spec
    global_batch = cfg["batch_size"]
    # The same input_fn object every step (Replicator.run caches per object).
    input_fn = self._input
    model_parallel = repl.num_devices_per_replica > 1
    variables = model.trainable_variables
    num_replicas = repl.num_replicas

    def step_fn(batch):
      x, y = batch
      with tf.GradientTape() as tape:
        out = model(x, training=True)
        loss = tf.reduce_sum(spec.loss(y, out)) / global_batch
        if model.losses:
          loss += tf.add_n(model.losses) / num_replicas
      if model_parallel:
        # Keeps each backward op beside its forward op (a tape would run them
        # all on one device and send the gradients across densely).
        grads = tf.gradients(loss, variables)
      else:
        grads = tape.gradient(loss, variables)
      self.optimizer.apply_gradients(zip(grads, variables))
      return loss

    for step in range(self.start_step, cfg["steps"]):
      self.summaries.begin_step(step + 1)
      loss = float(repl.reduce("sum", repl.run(step_fn, input_fn), axis=None))
      self.step.assign_add(1)
      self._after_step(loss)

  def _run_fit(self):
    """Keras `model.fit` in chunks that end at each evaluation point.

    Evaluation and checkpoints run between the chunks, outside fit (fit runs
    its callbacks inside the strategy scope, where the models' evaluation
    metrics would become per-replica variables). Each chunk, and a resumed
    run, starts the input at the current step (`_dataset`), so the stream
    is the same as in one long fit.
    """
    cfg, job = self.cfg, self
    steps_per_epoch = cfg["log_every"]

    class Progress(keras.callbacks.Callback):
      """Per-batch loss (from Keras' running epoch mean), steps, stop at a target."""

      def __init__(self, stop_at):
        super().__init__()
        self.stop_at = stop_at

      def on_epoch_begin(self, epoch, logs=None):
        self.prev = 0.0

      def on_train_batch_begin(self, batch, logs=None):
        job.summaries.begin_step(int(job.step.numpy()) + 1)

      def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        loss = (batch + 1) * mean - batch * self.prev
        self.prev = mean
        job.step.assign_add(1)
        job._after_step(loss, {k: float(v) for k, v in logs.items() if k != "loss"},
                        evaluate=False)
        if int(job.step.numpy()) >= self.stop_at:
          self.model.stop_training = True

    # One train function per compression phase (e.g. a dense warm-up).
    phases = tf_dct_keras.phase_callback(self.optimizer)
    while int(self.step.numpy()) < cfg["steps"]:
      step = int(self.step.numpy())
      every = cfg["eval_every"] or cfg["steps"]
      stop_at = min(cfg["steps"], (step // every + 1) * every)
      self.model.fit(self._dataset(cfg["batch_size"]), steps_per_epoch=steps_per_epoch,
                     epochs=-(-(stop_at - step) // steps_per_epoch), verbose=0,
                     callbacks=[Progress(stop_at), phases])
      self._checkpoint_and_evaluate()

  # -- per step -----------------------------------------------------------------

  def _after_step(self, loss: float, train_metrics: dict | None = None,
                  evaluate: bool = True) -> None:
    cfg = self.cfg
    step = int(self.step.numpy())
    now = time.perf_counter()
    if self.first_step_seconds is None:
      self.first_step_seconds = now - self._clock
      print(f"traced and ran the first step in {self.first_step_seconds:.1f} s", flush=True)
    else:
      self.steady_seconds += now - self._clock
    self.losses.append(loss)
    if not math.isfinite(loss):
      raise TrainingDiverged.at(loss, step, cfg)
    last = step == cfg["steps"]
    if step % cfg["log_every"] == 0 or last:
      self._log(step, loss, train_metrics or {})
    if evaluate and ((cfg["eval_every"] and step % cfg["eval_every"] == 0) or last):
      self._checkpoint_and_evaluate()
    self._clock = time.perf_counter()

  def _checkpoint_and_evaluate(self) -> None:
    if self.manager:
      self.manager.save(checkpoint_number=int(self.step.numpy()))
      if getattr(self.repl, "is_chief", True):
        write_settings(self.cfg)
    if self._evaluates():
      self._evaluate()
    self._clock = time.perf_counter()

  def _evaluates(self) -> bool:
    """Whether this run evaluates at its checkpoints (not --mode=train)."""
    return self.cfg.get("mode", MODES[0]) != "train"

  def steady(self) -> dict | None:
    """`steady_state` of this run so far: the steps after its first one."""
    step = int(self.step.numpy())
    return steady_state(step - self.start_step - 1, self.steady_seconds,
                        self.cfg["batch_size"], self.cfg["steps"] - step)

  def _log(self, step: int, loss: float, train_metrics: dict) -> None:
    self.summaries.log(
        step, loss=loss, metrics=train_metrics,
        learning_rate=float(tf.convert_to_tensor(self.optimizer.learning_rate)),
        timed_steps=step - self.start_step - 1, timed_seconds=self.steady_seconds,
        batch_size=self.cfg["batch_size"], mp=self.mp_bytes())
    line = f"step {step:>6}/{self.cfg['steps']}  loss {loss:.5f}"
    steady = self.steady()
    if steady:
      line += (f"  {steady['steps_per_sec']:.2f} steps/s  "
               f"{steady['examples_per_sec']:,.0f} examples/s  "
               f"ETA {duration(steady['eta_seconds'])}")
    comm = self.communication()
    if comm and self.cfg["compression"] != "none":
      line += (f"  sent {_mb(comm['bytes_sent'])}/replica (stock TF "
               f"{_mb(comm['stock_bytes'])}, {comm['stock_ratio']:.2f}x; densified "
               f"{comm['ratio']:.1f}x)  density {comm['last_density']:.4f}")
    print(line, flush=True)

  def _evaluate(self) -> dict:
    with self.summaries.evaluation():
      result = self.spec.evaluate(self.model, self.cfg)
    step = int(self.step.numpy())
    self.evals[step] = result
    self.summaries.eval(step, result)
    print(f"eval at step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in result.items()),
          flush=True)
    return result

  # -- accounting ---------------------------------------------------------------

  def communication(self) -> dict | None:
    """Cumulative DP bytes per replica (mean over local replicas) and ratios.

    Baselines (`tf_dct.compression.accounting`): `stock_bytes` /
    `stock_payload_bytes` price what stock TensorFlow sends (dense
    gradients all-reduced, IndexedSlices all-gathered), `dense_bytes` /
    `dense_payload_bytes` every gradient densified and all-reduced.
    `stock_ratio` and `stock_payload_ratio` are the ring and payload ratios
    against stock TF; `ratio` and `payload_ratio` against the densified
    baseline.
    """
    stats_fn = getattr(self.optimizer, "communication_stats", None)
    if stats_fn is None:
      return None
    stats = stats_fn()
    if not any(stats["steps"]):
      return None
    total, last = stats["total"], stats["last"]
    mean = lambda xs: float(np.mean(xs))
    out = {key: mean(total[key]) for key in
           ("bytes_sent", "bytes_received", "stock_bytes", "stock_payload_bytes",
            "dense_bytes", "payload_bytes", "dense_payload_bytes")}
    out["steps"] = int(np.max(stats["steps"]))
    ratio = lambda base, sent: out[base] / out[sent] if out[sent] else math.inf
    out["stock_ratio"] = ratio("stock_bytes", "bytes_sent")
    out["stock_payload_ratio"] = ratio("stock_payload_bytes", "payload_bytes")
    out["ratio"] = ratio("dense_bytes", "bytes_sent")
    out["payload_ratio"] = ratio("dense_payload_bytes", "payload_bytes")
    out["last_density"] = mean(last["density"])
    out["density"] = mean(total["density"])
    out["thresholds"] = {name: mean(v["last"]["threshold"])
                         for name, v in stats["variables"].items()
                         if any(v["last"]["threshold"])}
    # Per phase (warm-up, schedule stages) of a compressor with phases: the
    # steps run in it and its own ratios.
    out["phases"] = []
    for phase in stats.get("phases", ()):
      sums = {key: mean(phase["total"][key]) for key in
              ("bytes_sent", "stock_bytes", "dense_bytes")}
      per = lambda base: (sums[base] / sums["bytes_sent"]
                          if sums["bytes_sent"] else math.inf)
      out["phases"].append({"start": phase["start"], "dense": phase["dense"],
                            "steps": int(np.max(phase["steps"])),
                            "stock_ratio": per("stock_bytes"),
                            "ratio": per("dense_bytes")})
    return out

  def mp_bytes(self) -> dict | None:
    """DCT-MP bytes at the splits (first replica, forward + backward) vs dense."""
    if not self.split_layers:
      return None
    stats = [layer.bytes_stats() for layer in self.split_layers]
    return {"bytes": sum(s["total_forward_bytes"] + s["total_backward_bytes"] for s in stats),
            "dense_bytes": sum(s["total_dense_bytes"] for s in stats)}

  def _variables_where(self, predicate) -> list[str]:
    """Names of the model's variables for which `predicate(variable)` holds
    (False without a compressor)."""
    if self.compressor is None:
      return []
    return [v.name.split(":")[0] for v in self.model.trainable_variables if predicate(v)]

  def _summary(self) -> dict:
    cfg = self.cfg
    steps = int(self.step.numpy())
    trained = steps - self.start_step
    final_eval = self.evals.get(steps) or (self.evals[max(self.evals)] if self.evals else {})
    window = max(1, min(5, len(self.losses) // 3))
    steady = self.steady()
    summary = {
        "model": cfg["model"], "config": cfg["config"], "loop": cfg["loop"],
        "replicas": self.repl.num_replicas,
        "devices_per_replica": self.repl.num_devices_per_replica,
        "compression": cfg["compression"], "mp_splits": list(cfg["splits"]),
        "adam_correction": bool(self.compressor is not None
                                and self.compressor.corrects_adam),
        # What --value_dtype resolved to: "bfloat16" or None (the
        # variable's dtype); None without a sparse-wire compressor.
        "value_dtype": getattr(self.compressor, "value_dtype", None),
        "sparse_gradients": getattr(self.compressor, "sparse_gradients", None),
        "sent_as_rows": self._variables_where(
            lambda v: self.compressor.sends_as_is(v) and not self.compressor.is_excluded(v)),
        "sent_whole": self._variables_where(lambda v: self.compressor.sends_whole(v)),
        "start_step": self.start_step, "steps": steps, "losses": list(self.losses),
        "first_loss": self.losses[0] if self.losses else None,
        "final_loss": self.losses[-1] if self.losses else None,
        "first_loss_mean": float(np.mean(self.losses[:window])) if self.losses else None,
        "final_loss_mean": float(np.mean(self.losses[-window:])) if self.losses else None,
        "metric": self.spec.metric, "eval": final_eval,
        "wall_seconds": self.wall,
        "steps_per_sec": trained / self.wall if self.wall and trained else 0.0,
        "first_step_seconds": self.first_step_seconds,
        "steady_steps_per_sec": steady["steps_per_sec"] if steady else None,
        "steady_examples_per_sec": steady["examples_per_sec"] if steady else None,
        "communication": self.communication(), "mp": self.mp_bytes(),
        "restored_from": self.restored_from,
    }
    print_table(summary, cfg)
    return summary


def print_table(s: dict, cfg: dict) -> None:
  """The final summary table (markdown)."""
  fmt = lambda v: "-" if v is None else f"{v:.5f}"
  comp = s["compression"]
  options = []
  if comp == "dct":
    options.append(f"sparsity {cfg['sparsity']}, L={cfg['threshold_life']}")
    if cfg.get("sparsity_schedule"):
      options.append("schedule " + ",".join(f"{n}:{x}" for n, x in cfg["sparsity_schedule"]))
  elif comp in ("deft", "topk", "cltk"):
    options.append(f"density {cfg['density']}")
    if comp == "deft":
      options.append(f"budget by {cfg.get('deft_budget', 'size')}")
  elif comp == "threshold":
    options.append(f"lambda {cfg['threshold']}")
  if comp in VALUE_WORDS:
    options.append("bfloat16 values" if s.get("value_dtype") == "bfloat16"
                   else "values in the variable's dtype")
  if comp in SPARSIFIERS:
    if cfg.get("min_count") is not None:
      options.append(f"min_count {cfg['min_count']}")
    if cfg.get("whole_below") is not None:
      options.append(f"whole below {cfg['whole_below']} entries")
    if cfg["optimizer"] == "momentum":
      options.append("momentum correction" if cfg.get("momentum_correction", True)
                     else "no momentum correction")
      if cfg.get("momentum_masking"):
        options.append("momentum factor masking")
    if cfg["optimizer"] in ADAM_OPTIMIZERS:
      options.append("Adam correction" if s.get("adam_correction")
                     else "no Adam correction")
      if s.get("adam_correction") and cfg.get("adam_second_moment", "factored") != "factored":
        options.append(f"{cfg['adam_second_moment']} second moment")
      if s.get("adam_correction") and cfg.get("adam_residual_decay") not in (None, 1):
        options.append(f"residual decay {cfg['adam_residual_decay']}")
  if options:
    comp += f" ({', '.join(options)})"
  rows = [
      ("model", f"{s['model']} ({s['config']}, loop={s['loop']})"),
      ("replicas x devices", f"{s['replicas']} x {s['devices_per_replica']}"),
      ("DP compression", comp),
      ("MP splits", (f"{','.join(s['mp_splits'])} (sparsity {cfg['mp_sparsity']}, "
                     + (f"{cfg['mp_warmup']} warm-up {cfg['mp_warmup_steps']} steps, "
                        if cfg.get("mp_warmup_steps") else "")
                     + (f"{cfg['mp_rescale']} rescale, "
                        if cfg.get("mp_rescale", "none") != "none" else "")
                     + ("compact transfer across devices)" if s["devices_per_replica"] > 1
                        else "mask only, same device)")) if s["mp_splits"] else "none"),
      ("steps", f"{s['steps']} ({s['steps'] - s['start_step']} this run)"),
      ("loss first -> final", f"{fmt(s['first_loss'])} -> {fmt(s['final_loss'])}"),
  ]
  trained = s["steps"] - s["start_step"]
  if s["compression"] != "none" and trained:
    # Decided when the first step is traced: a run that trains no step
    # (--mode=eval, or a resume at --steps) has nothing to report here.
    rows.insert(3, ("embedding tables sent as rows", ", ".join(s.get("sent_as_rows", ()))
                    or f"none (sparse_gradients={s.get('sparse_gradients')})"))
    whole = s.get("sent_whole", ())
    rows.insert(4, ("small variables all-reduced whole",
                    f"{len(whole)} ({', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''})"
                    if whole else
                    f"none (--dense_gradients={cfg.get('dense_gradients', 'auto')})"))
  for name, value in s["eval"].items():
    rows.append((f"eval {name}", f"{value:.4f}"))
  c = s["communication"]
  if c:
    rows.append(("DP bytes sent / replica", _mb(c["bytes_sent"])))
    rows.append(("stock TF bytes / replica", _mb(c["stock_bytes"])))
    if comp != "none":
      rows.append(("DP ratio vs stock TF", f"{c['stock_ratio']:.2f}x (payload "
                                           f"{c['stock_payload_ratio']:.2f}x)"))
    rows.append(("densified all-reduce bytes / replica", _mb(c["dense_bytes"])))
    if comp != "none":
      rows.append(("DP ratio vs densified", f"{c['ratio']:.1f}x (payload "
                                            f"{c['payload_ratio']:.1f}x)"))
      rows.append(("achieved density (mean, last)", f"{c['density']:.4f}, "
                                                    f"{c['last_density']:.4f}"))
      phases = [p for p in c.get("phases", ()) if p["steps"]]
      if phases:
        rows.append(("DP ratio per phase vs stock TF", "; ".join(
            f"from step {p['start']}{' (dense)' if p['dense'] else ''}: "
            f"{p['stock_ratio']:.2f}x over {p['steps']} steps" for p in phases)))
  elif s["compression"] != "none":
    rows.append(("DP bytes sent / replica",
                 f"not reported (tf_dct.compression.{COMPRESSOR_CLASSES[s['compression']]} "
                 "has no communication accounting yet)"))
  m = s["mp"]
  if m:
    ratio = m["dense_bytes"] / m["bytes"] if m["bytes"] else math.inf
    rows.append(("MP bytes / replica (fwd+bwd)", f"{_mb(m['bytes'])} vs dense "
                 f"{_mb(m['dense_bytes'])} ({ratio:.1f}x)"))
  first = s.get("first_step_seconds")
  rows.append(("wall time (tracing included)",
               f"{s['wall_seconds']:.1f} s (" + (f"{s['steps_per_sec']:.2f} steps/s"
               if trained else "no training step this run")
               + (f"; first step with tracing {first:.1f} s)" if first is not None else ")")))
  if s.get("steady_steps_per_sec"):
    rows.append(("steady state (after the first step)",
                 f"{s['steady_steps_per_sec']:.2f} steps/s, "
                 f"{s['steady_examples_per_sec']:,.0f} examples/s"))
  width = max(len(k) for k, _ in rows)
  print("\n| " + "quantity".ljust(width) + " | value |")
  print("|" + "-" * (width + 2) + "|---|")
  for key, value in rows:
    print(f"| {key.ljust(width)} | {value} |")
  sys.stdout.flush()


def hide_gpus(replicator: str) -> None:
  """On a run that uses no GPU, hides the GPUs from TensorFlow.

  Sets `CUDA_VISIBLE_DEVICES=""` (unless the user has set it), so TensorFlow
  neither takes GPU memory nor places ops on a GPU, then lists the physical
  devices, dropping the `cuInit` error line that a CUDA build of TensorFlow
  logs there on every run (with or without a GPU). Must run before TensorFlow
  lists its devices; does nothing for the gpu and multi_worker replicators.

  Args:
    replicator: the --replicator value.
  """
  if replicator not in NO_GPU_REPLICATORS:
    return
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
  with without_stderr_lines((b"cuInit",)):
    tf.config.list_physical_devices()


def train(cfg: dict) -> dict:
  """Builds, restores (if --model_dir has a checkpoint), trains; returns a summary."""
  return Job(cfg).setup().run()


def main(argv):
  if len(argv) > 1:
    raise FlagError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  tf.get_logger().setLevel("ERROR")
  try:
    cfg = resolved_config()
    verb = "evaluating the latest checkpoint of" if cfg["mode"] == "eval" else "training"
    print(f"{verb} {cfg['model']} ({cfg['config']}): {cfg['steps']} steps, global batch "
          f"{cfg['batch_size']}, --replicator={cfg['replicator']}, "
          f"--compression={cfg['compression']}, {'tf-keras' if LEGACY else 'Keras 3'}; "
          "building the model ...", flush=True)
    train(cfg)
  except (FlagError, TrainingDiverged, DataError, FileNotFoundError) as e:
    # One line naming the flag or path:line, no traceback.
    print(f"launch.train: error: {e}", file=sys.stderr)
    sys.exit(1)
  except tf.errors.InvalidArgumentError as e:
    malformed = data_error_in(e)
    if malformed is None:
      raise
    print(f"launch.train: error: {malformed}", file=sys.stderr)
    sys.exit(1)


def data_error_in(error: tf.errors.OpError) -> str | None:
  """The `path:line: reason` of a reader's in-graph check in `error`
  (`models.data.errors.MALFORMED`), or None for any other error."""
  found = re.search(re.escape(MALFORMED) + r"([^\]\n]*)", error.message)
  return found.group(1).strip().strip("'\"") if found else None


_FLAG_VALUE = re.compile(r"^--?(model|config|mode|model_dir)(?:=(.*))?$")
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")


def expand_config_argv(argv: list[str]) -> list[str]:
  """`argv` with a `--config` that names a file, for ml_collections' flag.

  A preset name (`--config=local`) becomes the config file of `--model` with
  that preset, a saved `config.json` the file that reads it, and without
  `--config` the file of `--model` comes first (so `--config.<field>`
  overrides work without it). Checks that every `--config.<field>` names a
  field of that config.

  Raises:
    FlagError: an unknown field (named, with the fields there are) or a
      config that does not load.
  """
  args = list(argv)
  model, config_at, value = FLAGS["model"].default, None, None
  named = {}
  i = 1
  while i < len(args) and args[i] != "--":
    found = _FLAG_VALUE.match(args[i])
    if found:
      at, text = i, found.group(2)
      if text is None and i + 1 < len(args):
        at, text = i + 1, args[i + 1]
        i += 1
      if found.group(1) == "model":
        model = text
      elif found.group(1) == "config":
        config_at, value = at, text
      else:
        named[found.group(1)] = text
    i += 1
  if value is None:
    value = saved_config(named.get("mode"), named.get("model_dir"))
  if model not in registry.SPECS:
    return args  # absl names the bad --model
  config = load_config(value, model)
  for arg in args[1:]:
    found = _OVERRIDE.match(arg)
    if found:
      _check_field(config, found.group(1))
  if value is None or value in CONFIGS:
    text = configs.path(model) + (f":{value}" if value else "")
  elif value.endswith(".json"):
    text = f"{configs.path('saved')}:{value}"
  else:
    return args
  if config_at is None:
    args.insert(1, f"--config={text}")
  elif args[config_at].startswith("-"):
    args[config_at] = f"--config={text}"
  else:
    args[config_at] = text
  return args


def _check_field(config: ml_collections.ConfigDict, path: str) -> None:
  """Raises FlagError unless `path` ("model.d_model") is a field of `config`."""
  node, done = config, []
  for key in path.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or key not in node:
      where = f"config.{'.'.join(done)}" if done else "the config"
      fields = (", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict)
                else "none: it is a value")
      raise FlagError(f"--config.{path}: {where} of --model={config.model_name} has no "
                      f"field {key!r}; its fields: {fields}")
    node, done = node[key], done + [key]


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`expand_config_argv` first), then `hide_gpus`.

  `app.run` calls this before its after-init callbacks, one of which
  (TensorFlow's, registered on import) lists the GPUs. A bad `--config`
  stops with one line, as a bad flag does.
  """
  try:
    args = expand_config_argv(argv)
  except FlagError as e:
    print(f"launch.train: error: {e}", file=sys.stderr)
    sys.exit(1)
  # ml_collections finds the `--config.<field>` overrides in sys.argv.
  saved, sys.argv = sys.argv, args
  try:
    rest = app.parse_flags_with_usage(args)
  finally:
    sys.argv = saved
  hide_gpus(FLAGS.replicator)
  return rest


def run() -> None:
  """Entry point of the `tf-dct-train` console script."""
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
