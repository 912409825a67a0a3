r"""NCF / NeuMF (models/ncf.py), MLPerf sizes.

`tf-dct-train --config=launch/configs/ncf.py[:local]`; `--config.model.mf_dim=32`.
"""

from launch import configs


def get_config(arg=None):
  """NCF's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("ncf", preset)
  if preset == "default":
    config.model.mf_dim = 64
    config.model.mlp_layers = (256, 256, 128, 64)
  else:
    config.model.mf_dim = 8
    config.model.mlp_layers = (16, 8)
  return config
