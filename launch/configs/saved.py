r"""A config saved by the launcher: `--config=launch/configs/saved.py:<model_dir>/config.json`.

`tf-dct-train --config=<model_dir>/config.json` is short for it.
"""

from launch import configs


def get_config(arg):
  """The config in the JSON file `arg` (a `<model_dir>/config.json`)."""
  with open(arg, encoding="utf-8") as f:
    return configs.from_json(f.read())
