r"""MLP (models/mlp.py) on its synthetic teacher-student regression.

`tf-dct-train --config=launch/configs/mlp.py[:local]`; `--config.model.hidden='(128, 64)'`.
"""

from launch import configs


def get_config(arg=None):
  """The MLP's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("mlp", preset)
  config.model.hidden = (64, 32) if preset == "default" else (32, 16)
  return config
