"""The launcher's configurations: one `ml_collections.ConfigDict` file per model.

`launch/configs/<model>.py` defines `get_config(arg)`, where `arg` picks a
preset: `default` (the full-size model) or `local` (tiny dimensions and about
30 steps: a smoke run). `tf-dct-train --config=launch/configs/ncf.py:local`
loads one (big_vision's convention); `--config=local` is short for the
config of `--model` with that preset, and without `--config` the launcher
loads the default preset of `--model`. `--config.<field>=value` overrides
one field, nested ones too (`--config.model.d_model=128`).

Every config has the same fields:

* `model_name`, `preset`;
* `model`: the keyword arguments of the model's `build_model` (dimensions);
* `data`, `eval`: reader and evaluation settings of the model, if any;
* `split`: extra `tf_dct.dct_mp.DCTSplit` arguments for the `--mp_splits`
  layers (`mode`, `sketch_seed`, `feedback_rows`);
* one field per launcher flag that sets up training (`batch_size`, `steps`,
  `optimizer`, `compression`, ...; `--model_dir` and `--mode` are not part
  of it), with the model's value;
* `learning_rate` (None: `learning_rates[optimizer]`) and `learning_rates`,
  a rate that trains for every optimizer;
* `compression_settings`: {compression: {setting: value}}, what a
  sparsifier takes for `min_count`, `momentum_masking`, `whole_below` or
  `adam_residual_decay` when that field is None (default preset only; empty
  for most models).

The training settings come from the tables of `launch/registry.py`; the
model files add the dimensions.
"""

from __future__ import annotations

import importlib
import json
import os

import ml_collections
from ml_collections import config_dict

PRESETS = ("default", "local")
HERE = os.path.dirname(os.path.abspath(__file__))

# Launcher-wide values of the flags that are not per model (the per-model
# ones are registry.COMMON_DEFAULTS, the model's defaults and its presets).
LAUNCHER_DEFAULTS = {
    "data_dir": "", "replicator": "cpu", "tpu": config_dict.placeholder(str),
    "compression": "dct", "warmup_steps": 0, "sparsity_schedule": (), "min_size": 0,
    "momentum_correction": True,
    "adam_correction": True, "adam_second_moment": "factored", "deft_budget": "size",
    "compression_exclude": (),
    # None: the compressor's own (DEFT: "stock", the others: "auto").
    "sparse_gradients": config_dict.placeholder(str),
    "dense_gradients": "auto", "value_dtype": "auto",
    "loop": "custom", "seed": 0,
    "summary_every": config_dict.placeholder(int),
}
# Sub-configs every config has (filled per model).
SECTIONS = ("model", "data", "eval", "split")


def preset(arg: str | None) -> str:
  """The preset `arg` names ("" or None: default); ValueError otherwise."""
  name = arg or "default"
  if name not in PRESETS:
    raise ValueError(f"--config: unknown preset {name!r}; expected one of {PRESETS}")
  return name


def path(model: str) -> str:
  """The config file of `model`."""
  return os.path.join(HERE, f"{model}.py")


def get(model: str, preset_name: str = "default") -> ml_collections.ConfigDict:
  """The config of `model` under a preset (unlocked)."""
  from launch import registry  # pylint: disable=g-import-not-at-top
  if model not in registry.SPECS:
    raise ValueError(f"--model: unknown model {model!r}; expected one of "
                     f"{tuple(registry.SPECS)}")
  return importlib.import_module(f"launch.configs.{model}").get_config(preset_name)


def base(model: str, preset_name: str) -> ml_collections.ConfigDict:
  """The fields every config has, with `model`'s training settings.

  The model's file adds its dimensions (`config.model`) and its `data`,
  `eval` settings.
  """
  from launch import registry  # pylint: disable=g-import-not-at-top
  preset_name = preset(preset_name)
  spec = registry.SPECS[model]
  settings = registry.settings(model, preset_name)
  table = spec.local_learning_rates if preset_name == "local" else spec.learning_rates
  config = ml_collections.ConfigDict()
  config.model_name = model
  config.preset = preset_name
  for name, value in LAUNCHER_DEFAULTS.items():
    # A placeholder is a shared reference: each config needs its own, or
    # setting the field in one config would set it in every config built.
    if isinstance(value, config_dict.FieldReference):
      value = config_dict.placeholder(value.get_type())
    config[name] = value
  for name in registry.COMMON_DEFAULTS:
    value = settings[name]
    # An optional setting left unset (None) is a typed placeholder.
    config[name] = (config_dict.placeholder(registry.OPTIONAL_SETTINGS[name])
                    if value is None else value)
  config.learning_rate = config_dict.placeholder(float)
  config.learning_rates = ml_collections.ConfigDict(dict(table))
  config.compression_settings = ml_collections.ConfigDict(
      {name: dict(settings) for name, settings in spec.compression_settings.items()}
      if preset_name == "default" else {})
  for section in SECTIONS:
    config[section] = ml_collections.ConfigDict()
  config.split.mode = "dct"
  config.split.sketch_seed = 0
  config.split.feedback_rows = config_dict.placeholder(int)
  return config


def from_json(text: str) -> ml_collections.ConfigDict:
  """A config saved as JSON (`<model_dir>/config.json`), lists as tuples."""
  def tuples(value):
    if isinstance(value, dict):
      return {k: tuples(v) for k, v in value.items()}
    if isinstance(value, list):
      return tuple(tuples(v) for v in value)
    return value
  data = tuples(json.loads(text))
  model, preset_name = data.get("model_name"), data.get("preset")
  config = get(model, preset_name)  # the field types (placeholders) of the model
  for key, value in data.items():
    if isinstance(value, dict):
      for sub, v in value.items():
        config[key][sub] = v
    else:
      config[key] = value
  return config
