"""What the launcher knows about each model of `models/`: one `ModelSpec` each.

A spec adapts one module of `models/` (which knows nothing about compression
or launching) to a uniform interface: build the model (optionally with a
`split_fn`), its endless training dataset, its per-example loss, its
evaluation, its split points, and the launcher defaults that suit it. The
model modules are imported lazily, so `--model=mlp` never imports TFRS or
tensorflow-text.

Launcher defaults per model (`ModelSpec.defaults`) are the training settings
of the model's config (`launch/configs/<model>.py`, which adds the model's
dimensions); `ModelSpec.local` is what the `local` preset changes on top of
them (few steps). The learning rate depends on the optimizer as well as on the
model: `ModelSpec.learning_rates` (and `local_learning_rates` for the `local`
preset) map every optimizer to a rate that trains. The hooks read the model's
dimensions and its data and evaluation settings from the resolved
configuration (`cfg["model_kwargs"]`, `cfg["data"]`, `cfg["eval"]`).
Everything is plain data, documented in docs/launch.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Callable

import tensorflow as tf

from launch import flag_checks

# The --optimizer values (launch/train.py builds them); every spec has a
# learning rate for each, in both presets.
OPTIMIZERS = flag_checks.OPTIMIZERS

# Launcher settings every model has (flag name -> value); per-model defaults
# override these, `--config=local` overrides those, explicit flags win. The
# learning rate is not among them: it comes from the spec's table for the
# optimizer in use (`learning_rate()`).
COMMON_DEFAULTS = {
    "batch_size": 256, "steps": 300, "eval_every": 0, "log_every": 50,
    "num_replicas": 4, "num_devices_per_replica": 1, "mp_splits": "",
    "optimizer": "adam",
    "sparsity": 0.99, "threshold_life": 1000, "density": 0.01,
    "threshold": 1e-3, "mp_sparsity": 0.9, "mp_warmup_steps": 0, "mp_warmup": "linear",
    "mp_rescale": "auto",
    "adam_residual_decay": None,  # None: 1, error feedback as published
    "min_count": None,  # None: the compressor's own floor
    "momentum_masking": None,  # None: the compressor's own (off)
    "whole_below": None,  # None: the compressor's own (DEFT 2048, the others 0)
}
# The type of each setting of COMMON_DEFAULTS that may be None: the
# settings a model's `compression_settings` may give a sparsifier.
OPTIONAL_SETTINGS = {"min_count": int, "momentum_masking": bool, "whole_below": int,
                     "adam_residual_decay": float}
# --config=local for every model: a smoke run (models add tiny dimensions).
# Sparsity/density are loosened because a tiny layer at 0.99 sparsity sends a
# single entry per step and a 30-step run would show no learning.
COMMON_LOCAL = {"steps": 30, "batch_size": 32, "log_every": 10, "eval_every": 0,
                "sparsity": 0.9, "density": 0.1, "threshold_life": 10,
                "threshold": 1e-3}


@dataclasses.dataclass
class ModelSpec:
  """The launcher's view of one model module.

  Attributes:
    name: the `--model` value.
    module: import path of the model module.
    defaults: launcher flag values for this model (over COMMON_DEFAULTS).
    local: launcher flag values for `--config=local` (over COMMON_LOCAL).
    learning_rates: {optimizer: learning rate} of the default preset, one
      entry per OPTIMIZERS value.
    local_learning_rates: the same for `--config=local`.
    compression_settings: {compression: {setting: value}} of the default
      preset: launcher settings of `OPTIONAL_SETTINGS` that a
      sparsifier takes when neither a flag nor `defaults` sets them; a
      sparsifier or setting not listed keeps the compressor's own.
    metric: the headline metric key of `evaluate`'s result.
    has_splits: whether `build_model` takes `split_fn` (DCT-MP split points).
    paper_splits: what `--mp_splits=paper` means (DCT §3.1 / §3.2).
    top_level_splits: split layers sit at the top level of a functional model
      (so the launcher can place the layers after them on another device).
    takes_data_dir: whether real data can be read from --data_dir.
    fit_metrics: metrics for `model.compile` in --loop=fit.
    checkpoint_input: the custom loop checkpoints the training dataset's
      iterator and restores its position on a resume (for DLRM's real
      Criteo files: no row before the position is parsed again);
      otherwise, and in `--loop=fit`, a resume starts the stream at the
      step (`dataset(cfg, start)`).
  """

  name: str
  module: str
  defaults: dict = dataclasses.field(default_factory=dict)
  local: dict = dataclasses.field(default_factory=dict)
  learning_rates: dict = dataclasses.field(default_factory=dict)
  local_learning_rates: dict = dataclasses.field(default_factory=dict)
  compression_settings: dict = dataclasses.field(default_factory=dict)
  metric: str = "loss"
  has_splits: bool = False
  paper_splits: tuple[str, ...] = ()
  top_level_splits: bool = False
  takes_data_dir: bool = True
  fit_metrics: Callable[[Any], list] | None = None
  checkpoint_input: bool = False
  # --- hooks, (spec, cfg, ...) -> ...; see the functions below -------------
  build_fn: Callable[..., Any] | None = None
  dataset_fn: Callable[..., Any] | None = None
  evaluate_fn: Callable[..., dict] | None = None
  points_fn: Callable[..., list] | None = None
  loss_fn: Callable[..., Any] | None = None
  _module: Any = dataclasses.field(default=None, repr=False)

  def load(self):
    """The model module (imported on first use, then cached: the loss is
    called while tracing, where an import would trip autograph)."""
    if self._module is None:
      self._module = importlib.import_module(self.module)
    return self._module

  def kwargs(self, cfg: dict) -> dict:
    """`build_model`'s keyword arguments: the config's `model` section."""
    return dict(cfg["model_kwargs"])

  def build(self, cfg: dict, split_fn=None):
    """The tf-keras model; `split_fn(point)` may return a layer (has_splits)."""
    return self.build_fn(self, cfg, split_fn)

  def dataset(self, cfg: dict, start: int = 0) -> tf.data.Dataset:
    """Endless global batches `(inputs, targets)` of the training split, from
    batch `start` on.

    Every model's synthetic stream, and the real data of all but DLRM, is
    a function of the batch index (`models.data.order`), so the stream from
    `start` is made directly; real Criteo files are opened at the row of
    batch `start` (`models.data.criteo.tsv_stream`), the rows before it
    passed over unparsed.
    """
    return self.dataset_fn(self, cfg, start)

  def loss(self, targets, outputs):
    """Per-example loss, shape [batch]."""
    return self.loss_fn(self, targets, outputs)

  def evaluate(self, model, cfg: dict) -> dict:
    """Held-out metrics (a dict with `self.metric`), plain floats."""
    return self.evaluate_fn(self, model, cfg)

  def split_points(self, cfg: dict) -> list[str]:
    """Names the model's `split_fn` is called with, in forward order."""
    return self.points_fn(self, cfg) if self.has_splits else []


def _data_dir(cfg):
  return cfg["data_dir"] or None


# --- mlp ---------------------------------------------------------------------


def _mlp_build(spec, cfg, split_fn):
  del split_fn
  return spec.load().build_model(seed=cfg["seed"], **spec.kwargs(cfg))


def _mlp_dataset(spec, cfg, start):
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"], start=start)


def _mse(spec, targets, outputs):
  del spec
  return tf.reduce_mean(tf.square(outputs - targets), axis=-1)


def _mlp_evaluate(spec, model, cfg):
  # models/mlp has no held-out split (its teacher is fixed by the seed, as is
  # the stream): the mse of the first 8 batches of the training stream.
  data = spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"]).take(8)
  total = count = 0.0
  for x, y in data:
    total += float(tf.reduce_sum(_mse(spec, y, model(x, training=False))))
    count += int(y.shape[0])
  return {"mse": total / count}


# --- dlrm --------------------------------------------------------------------

def _dlrm_build(spec, cfg, split_fn):
  return spec.load().build_model(seed=cfg["seed"], data_dir=_data_dir(cfg),
                                 split_fn=split_fn, **spec.kwargs(cfg))


def _dlrm_dataset(spec, cfg, start):
  vocab = spec.kwargs(cfg).get("vocab_sizes")
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"], data_dir=_data_dir(cfg),
                                  vocab_sizes=vocab, start=start, repeat=True)


def _dlrm_evaluate(spec, model, cfg):
  vocab = spec.kwargs(cfg).get("vocab_sizes")
  return spec.load().evaluate(model, cfg["batch_size"], seed=cfg["seed"],
                              data_dir=_data_dir(cfg), steps=cfg["eval"]["steps"],
                              vocab_sizes=vocab)


def _dlrm_points(spec, cfg):
  kw = spec.kwargs(cfg)
  mod = spec.load()
  return mod.split_points(kw.get("bottom_mlp", mod.BOTTOM_MLP), kw.get("top_mlp", mod.TOP_MLP))


def _module_loss(spec, targets, outputs):
  return spec.load().loss(targets, outputs)


def _dlrm_metrics(spec):
  return spec.load().metrics()


# --- ncf ---------------------------------------------------------------------


def _ncf_build(spec, cfg, split_fn):
  del split_fn
  return spec.load().build_model(seed=cfg["seed"], data_dir=_data_dir(cfg), **spec.kwargs(cfg))


def _ncf_dataset(spec, cfg, start):
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"], data_dir=_data_dir(cfg),
                                  start=start)


def _ncf_evaluate(spec, model, cfg):
  return spec.load().evaluate(model, seed=cfg["seed"], data_dir=_data_dir(cfg))


def _ncf_metrics(spec):
  return spec.load().metrics()


# --- transformer -------------------------------------------------------------


def _tr_data(cfg):
  return {"tokenizer": cfg["data"]["tokenizer"], "max_len": cfg["data"]["max_len"]}


def _tr_build(spec, cfg, split_fn):
  return spec.load().build_model(seed=cfg["seed"], data_dir=_data_dir(cfg), split_fn=split_fn,
                                 **_tr_data(cfg), **spec.kwargs(cfg))


def _tr_dataset(spec, cfg, start):
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"],
                                  data_dir=_data_dir(cfg), start=start, **_tr_data(cfg))


def _tr_evaluate(spec, model, cfg):
  examples = cfg["eval"]["max_examples"]
  return spec.load().evaluate(model, batch_size=64, seed=cfg["seed"], data_dir=_data_dir(cfg),
                              max_examples=examples, **_tr_data(cfg))


def _tr_points(spec, cfg):
  kw = {**spec.load().DEFAULT_CONFIG, **spec.kwargs(cfg)}
  return spec.load().split_points(kw["num_encoder_layers"], kw["num_decoder_layers"])


# --- resnet ------------------------------------------------------------------


def _resnet_build(spec, cfg, split_fn):
  del split_fn
  return spec.load().build_model(seed=cfg["seed"], data_dir=_data_dir(cfg), **spec.kwargs(cfg))


def _resnet_dataset(spec, cfg, start):
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"], data_dir=_data_dir(cfg),
                                  start=start)


def _resnet_loss(spec, targets, outputs):
  return spec.load().loss(targets, outputs)


def _resnet_evaluate(spec, model, cfg):
  return spec.load().evaluate(model, batch_size=256, seed=cfg["seed"], data_dir=_data_dir(cfg))


# --- lstm_lm -----------------------------------------------------------------

def _lstm_build(spec, cfg, split_fn):
  del split_fn
  return spec.load().build_model(seed=cfg["seed"], data_dir=_data_dir(cfg), **spec.kwargs(cfg))


def _lstm_dataset(spec, cfg, start):
  return spec.load().make_dataset(cfg["batch_size"], seed=cfg["seed"], data_dir=_data_dir(cfg),
                                  seq_len=cfg["data"]["seq_len"], start=start)


def _lstm_evaluate(spec, model, cfg):
  return spec.load().evaluate(model, batch_size=64, seed=cfg["seed"], data_dir=_data_dir(cfg),
                              seq_len=cfg["data"]["seq_len"])


SPECS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        "mlp", "models.mlp",
        defaults={"optimizer": "sgd", "batch_size": 256, "steps": 300},
        local={"optimizer": "sgd"},
        learning_rates={"sgd": 0.05, "momentum": 0.02, "adam": 3e-3, "adamw": 3e-3,
                        "adagrad": 0.1},
        local_learning_rates={"sgd": 0.05, "momentum": 0.02, "adam": 1e-2, "adamw": 1e-2,
                              "adagrad": 0.1},
        metric="mse", takes_data_dir=False, checkpoint_input=True,
        build_fn=_mlp_build, dataset_fn=_mlp_dataset, evaluate_fn=_mlp_evaluate,
        loss_fn=_mse),
    "dlrm": ModelSpec(
        "dlrm", "models.dlrm",
        # The Quick-start main job: DCT §3.1 dims, DCT-DP across 2 replicas,
        # DCT-MP at the paper's two splits across 2 devices per replica.
        defaults={"num_replicas": 2, "num_devices_per_replica": 2, "mp_splits": "paper",
                  "optimizer": "adam", "batch_size": 256,
                  "steps": 300, "log_every": 50, "eval_every": 0},
        local={"batch_size": 64},
        learning_rates={"sgd": 0.5, "momentum": 0.2, "adam": 1e-3, "adamw": 1e-3,
                        "adagrad": 0.2},
        local_learning_rates={"sgd": 0.5, "momentum": 0.05, "adam": 0.02, "adamw": 0.02,
                              "adagrad": 0.1},
        # Under Adam correction the residuals decay by 0.7 a step: on DLRM
        # that removes most of the early lag behind dense and stock TF. TopK
        # with DCT-DP's floor of 64 entries per variable and step: under
        # momentum SGD its evaluation loss ends closer to dense's than with
        # TopK's own 8; DEFT ends further behind with 64. DEFT with DGC's
        # momentum factor masking: under momentum SGD it ends level with
        # dense instead of 5% behind (docs/quality.md).
        compression_settings={"dct": {"adam_residual_decay": 0.7},
                              "topk": {"min_count": 64, "adam_residual_decay": 0.7},
                              "deft": {"momentum_masking": True,
                                       "adam_residual_decay": 0.7}},
        metric="auc", has_splits=True, paper_splits=("bottom_1", "top_1"),
        top_level_splits=True, fit_metrics=_dlrm_metrics, checkpoint_input=True,
        build_fn=_dlrm_build, dataset_fn=_dlrm_dataset, evaluate_fn=_dlrm_evaluate,
        points_fn=_dlrm_points, loss_fn=_module_loss),
    "ncf": ModelSpec(
        "ncf", "models.ncf",
        # A floor of 8 entries per variable and step for every sparsifier
        # (DCT-DP's own is 64): under Adam at these sizes 64 ended HR@10 9.7%
        # behind dense and 8 level with it (docs/quality.md). The local preset
        # keeps each compressor's own.
        defaults={"optimizer": "adam", "batch_size": 1024, "steps": 1000,
                  "min_count": 8},
        local={"batch_size": 256, "min_count": None},
        learning_rates={"sgd": 1.0, "momentum": 0.3, "adam": 1e-3, "adamw": 1e-3,
                        "adagrad": 0.2},
        local_learning_rates={"sgd": 1.0, "momentum": 0.1, "adam": 0.01, "adamw": 0.01,
                              "adagrad": 0.2},
        metric="hr@10", fit_metrics=_ncf_metrics,
        build_fn=_ncf_build, dataset_fn=_ncf_dataset, evaluate_fn=_ncf_evaluate,
        loss_fn=_module_loss),
    "transformer": ModelSpec(
        "transformer", "models.transformer",
        defaults={"optimizer": "adam", "batch_size": 64, "steps": 2000},
        local={"batch_size": 32},
        learning_rates={"sgd": 0.1, "momentum": 0.01, "adam": 5e-4, "adamw": 5e-4,
                        "adagrad": 0.05},
        local_learning_rates={"sgd": 0.3, "momentum": 0.1, "adam": 3e-3, "adamw": 3e-3,
                              "adagrad": 0.2},
        # DCT §3.2: one split after the FFN ReLU of the fifth encoder layer.
        metric="bleu", has_splits=True, paper_splits=("encoder_ffn_4",),
        build_fn=_tr_build, dataset_fn=_tr_dataset, evaluate_fn=_tr_evaluate,
        points_fn=_tr_points, loss_fn=_module_loss),
    "resnet": ModelSpec(
        "resnet", "models.resnet",
        defaults={"optimizer": "momentum", "batch_size": 128, "steps": 2000},
        local={"optimizer": "adam", "batch_size": 32},
        learning_rates={"sgd": 0.5, "momentum": 0.05, "adam": 1e-3, "adamw": 1e-3,
                        "adagrad": 0.05},
        local_learning_rates={"sgd": 1.0, "momentum": 0.1, "adam": 1e-2, "adamw": 1e-2,
                              "adagrad": 0.2},
        metric="accuracy",
        build_fn=_resnet_build, dataset_fn=_resnet_dataset, evaluate_fn=_resnet_evaluate,
        loss_fn=_resnet_loss),
    "lstm_lm": ModelSpec(
        "lstm_lm", "models.lstm_lm",
        defaults={"optimizer": "sgd", "batch_size": 64, "steps": 2000},
        local={"optimizer": "adam", "batch_size": 32},
        learning_rates={"sgd": 1.0, "momentum": 0.1, "adam": 1e-3, "adamw": 1e-3,
                        "adagrad": 0.1},
        local_learning_rates={"sgd": 3.0, "momentum": 2.0, "adam": 3e-2, "adamw": 3e-2,
                              "adagrad": 3.0},
        metric="perplexity",
        build_fn=_lstm_build, dataset_fn=_lstm_dataset, evaluate_fn=_lstm_evaluate,
        loss_fn=_module_loss),
}


def get(name: str) -> ModelSpec:
  """The spec of `--model=name` (ValueError listing the known names)."""
  if name not in SPECS:
    raise ValueError(f"unknown model {name!r}; expected one of {sorted(SPECS)}")
  return SPECS[name]


def learning_rate(name: str, config: str, optimizer: str) -> float:
  """The learning rate of `--model=name` under a preset with `optimizer`."""
  spec = SPECS[name]
  table = spec.local_learning_rates if config == "local" else spec.learning_rates
  if optimizer not in table:
    raise ValueError(f"--optimizer={optimizer}: no learning rate for --model={name} "
                     f"(--config={config}); expected one of {sorted(table)}")
  return table[optimizer]


def settings(name: str, config: str) -> dict:
  """Launcher settings of a model under a preset: COMMON < model < local.

  `learning_rate` is the preset's rate for the preset's optimizer; with
  another optimizer, `learning_rate()` gives the rate.
  """
  spec = SPECS[name]
  out = {**COMMON_DEFAULTS, **spec.defaults}
  if config == "local":
    out.update(COMMON_LOCAL)
    out.update(spec.local)
  out["learning_rate"] = learning_rate(name, config, out["optimizer"])
  return out


def check_data_dir(spec: ModelSpec, data_dir: str) -> None:
  """Raises ValueError naming `data_dir` when it cannot be used."""
  if not data_dir:
    return
  if not spec.takes_data_dir:
    raise ValueError(f"--model={spec.name} has synthetic data only; drop --data_dir")
  if not os.path.isdir(data_dir):
    raise ValueError(f"--data_dir {data_dir!r} does not exist or is not a directory")
