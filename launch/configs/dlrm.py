r"""DLRM (models/dlrm.py): the Quick-start job, DCT §3.1 dimensions.

`tf-dct-train --config=launch/configs/dlrm.py[:local]`;
`--config.model.embedding_dim=32 --config.model.bottom_mlp='(512, 256, 32)'`.
"""

from ml_collections import config_dict

from launch import configs


def get_config(arg=None):
  """DLRM's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("dlrm", preset)
  if preset == "default":
    # None: the data's own table sizes (models.dlrm.default_vocab_sizes).
    config.model.vocab_sizes = config_dict.placeholder(int)
    config.model.embedding_dim = 16
    config.model.bottom_mlp = (512, 256, 64, 16)
    config.model.top_mlp = (512, 256, 128, 1)
  else:
    config.model.vocab_sizes = 20
    config.model.embedding_dim = 4
    config.model.bottom_mlp = (8, 6, 4)
    config.model.top_mlp = (8, 6, 1)
  config.eval.steps = 20 if preset == "default" else 4  # batches evaluated
  return config
