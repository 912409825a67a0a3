r"""LSTM language model (models/lstm_lm.py), PyTorch word_language_model's medium size.

`tf-dct-train --config=launch/configs/lstm_lm.py[:local]`; `--config.model.hidden_dim=256`.
"""

from launch import configs


def get_config(arg=None):
  """The LSTM LM's config; `arg` is the preset: "default" or "local"."""
  preset = configs.preset(arg)
  config = configs.base("lstm_lm", preset)
  if preset == "default":
    config.model.update(embedding_dim=650, hidden_dim=650, num_layers=2, dropout=0.5)
    config.data.seq_len = 35
  else:
    config.model.update(embedding_dim=16, hidden_dim=32, num_layers=1, dropout=0.0)
    config.data.seq_len = 20
  return config
