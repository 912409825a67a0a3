r"""Transformer (models/transformer), fairseq's transformer_iwslt_de_en (DCT §3.2).

`tf-dct-train --config=launch/configs/transformer.py[:local]`;
`--config.model.d_model=128 --config.model.ffn_dim=256`.
"""

from ml_collections import config_dict

from launch import configs


def get_config(arg=None):
  """The Transformer's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("transformer", preset)
  if preset == "default":
    config.model.update(d_model=512, ffn_dim=1024, num_heads=4, num_encoder_layers=6,
                        num_decoder_layers=6, dropout=0.1)
    config.data.tokenizer = "wordpiece"
    config.data.max_len = 64
    config.eval.max_examples = config_dict.placeholder(int)  # None: the whole split
  else:
    config.model.update(d_model=32, ffn_dim=64, num_heads=2, num_encoder_layers=1,
                        num_decoder_layers=1, dropout=0.0)
    config.data.tokenizer = "bytes"
    config.data.max_len = 24
    config.eval.max_examples = 16
  return config
