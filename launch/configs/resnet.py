r"""ResNet-18 for CIFAR-10 (models/resnet.py).

`tf-dct-train --config=launch/configs/resnet.py[:local]`; `--config.model.widths='(32, 64, 128, 256)'`.
"""

from launch import configs


def get_config(arg=None):
  """ResNet's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("resnet", preset)
  if preset == "default":
    config.model.widths = (64, 128, 256, 512)
    config.model.blocks_per_stage = 2
  else:
    config.model.widths = (4, 8, 8, 16)
    config.model.blocks_per_stage = 1
  return config
