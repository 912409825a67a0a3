r"""Quality of compressed training against dense training, with curves.

Every run is one `launch.train.Job` in this process (4 logical CPUs, 4
data-parallel replicas), configured by the launcher exactly as
`python -m launch.train --model=M --optimizer=O --seed=S ...` would be: the
launcher's per-model and per-optimizer defaults (learning rate included)
apply. Only the gradient compressor is built here, from a spec string
(`COMPRESSORS` below: a launcher compressor class plus constructor keyword
arguments; "dense" is the launcher's `--compression=none`): the arguments
the launcher would pass (`launch.train.compressor_arguments`) with the
spec's keywords on top, at the default preset's sparsity, density and
threshold life on local presets too (`RATES`). It is given to the
job with `Job(cfg, compressor=...)`. Every (model, optimizer, compressor)
runs once per seed; each run evaluates the model's headline metric
`--evals` times at equal step intervals (the launcher's `eval_every`).

Reported per (model, optimizer, compressor), means over the seeds:

  final     the metric after the last step.
  vs dense  (final - dense final) / dense final; the sign is the metric's
            (for perplexity and loss, + is worse).
  s.e.      the standard error of "vs dense" (`relative_se`): from the
            per-seed gaps when dense ran the same seeds, else from the two
            sets' sample variances.
  dense spread  (max - min) / mean of dense's finals over the seeds.
  verdict   "within" when the compressed mean lies inside dense's seed range
            [min, max]; otherwise "better" or "worse" (the metric's
            direction).
  worst point   the most adverse relative gap to dense at any evaluation
            point: lag in the curve shows here even when the end point
            catches up.
  payload   dense bytes / sent bytes of what a replica contributes per step
            (`Job.communication()["payload_ratio"]`: values, indices and
            padding counted; sparse payloads at exact sizes, as they cross
            a network), whole model; and the same over the dense
            (non-embedding) layers only: the variables whose name does not
            contain "embedding", from `communication_stats()["variables"]`.

and a table of the metric at every evaluation point (the curves), plus a PNG
of them with `--png` (each compressor's seed range shaded).

Models (`MODELS`): dlrm (DCT section 3.1 dimensions, embedded synthetic
Criteo-shaped data, 4 replicas, no model-parallel splits), ncf (trains on a
MovieLens-format ratings file: a synthetic one this script writes with
`models.data.movielens`, fixed across seeds, or a real one with
`--data_dir`), lstm_lm and transformer (the launcher's local sizes). The
transformer's headline is the evaluation loss: its BLEU stays 0 at these
sizes.

Compressors are built with the launcher's defaults ("dct", "topk", "deft":
the library's, plus per-model settings such as DLRM's residual decay under
Adam) and with the papers' settings ("*_paper": no per-variable floor on the
entries sent, min_count=0, no momentum correction, momentum=0.0, and no
Adam correction, adam=False). A
keyword the installed constructor does not accept is dropped and the run is
marked with a note. A spec may add keywords: "dct+sparsity=0.9+min_count=0".
`--metric=dlrm:loss` reports another evaluation key of a model instead of its
headline metric (a key the model does not evaluate stops the benchmark after
that model's first run, naming the keys it does evaluate).

Usage:
  python bench/quality.py                 # full run (see docs/quality.md for its time)
  python bench/quality.py --quick         # smoke run: ncf, local sizes, 2 seeds, ~1.5 min
  python bench/quality.py --models=ncf --optimizers=adam,momentum \
      --compressors=dense,dct,dct_paper --seeds=0,1 --png=/tmp/q.png
  python bench/quality.py ... --write_docs    # rewrite docs/quality.md's results
  python bench/quality.py --models=ncf --json=/tmp/ncf.json      # run in parts ...
  python bench/quality.py --models=dlrm --json=/tmp/dlrm.json
  python bench/quality.py --plot_json=/tmp/ncf.json,/tmp/dlrm.json --png=/tmp/q.png
      # ... and assemble them: no training; the same report, docs section and PNG

`--json` keeps every run's record (curve, final, payload ratios, settings);
`--plot_json` merges such files (see `merge`): parts whose runs are not
comparable (another preset, --evals or ratings data; another step count,
launcher preset, metric or learning rate for the same model and optimizer)
are refused, naming the file, and so is a run (model, optimizer, compressor,
seed) found in two files with other results: no part silently wins (the
dense reference every part runs, repeated with the same results, is kept
once).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import ast  # pylint: disable=g-import-not-at-top,wrong-import-position
import contextlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import gc  # pylint: disable=g-import-not-at-top,wrong-import-position
import inspect  # pylint: disable=g-import-not-at-top,wrong-import-position
import io  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import math  # pylint: disable=g-import-not-at-top,wrong-import-position
import shlex  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics  # pylint: disable=g-import-not-at-top,wrong-import-position
import tempfile  # pylint: disable=g-import-not-at-top,wrong-import-position
import time  # pylint: disable=g-import-not-at-top,wrong-import-position
from typing import Callable, Sequence  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_CPUS = 4
DOC_PATH = os.path.join(REPO_ROOT, "docs", "quality.md")
DOC_BEGIN = "<!-- results: written by bench/quality.py --write_docs -->"
DOC_END = "<!-- end of results -->"

# Compressor specs: name -> (launcher --compression value, constructor kwargs).
# "paper": the published algorithms (no per-variable floor on the entries
# sent, no momentum or Adam correction, every variable compressed; for DCT-DP
# no density guard either, so a threshold lives its full L steps as in
# Algorithm 1, and float32 values, not DCT-DP's default bfloat16 value
# words; for DEFT the budget split by partition norms, Algorithm 3). A new
# option is one more line here.
PAPER = {"min_count": 0, "momentum": 0.0, "adam": False, "dense_gradients": "compress"}
COMPRESSORS: dict[str, tuple[str, dict]] = {
    "dense": ("none", {}),
    "dct": ("dct", {}),
    "dct_paper": ("dct", {**PAPER, "density_band": None, "value_dtype": None}),
    "topk": ("topk", {}),
    "topk_paper": ("topk", PAPER),
    "deft": ("deft", {}),
    "deft_paper": ("deft", {**PAPER, "budget": "norm"}),
}


@dataclasses.dataclass(frozen=True)
class ModelPlan:
  """How one model runs here: a launcher preset and the settings changed on it.

  Attributes:
    config: the launcher's --config ("default" or "local").
    steps: training steps of a full run.
    quick_steps: steps of a --quick run (always on the local preset).
    optimizer_steps: steps of a full run under the optimizers named here
      instead of `steps` (one that needs longer before dense trains).
    settings: launcher settings set for every run of the model.
    metric: the headline evaluation key; None: the launcher's `spec.metric`.
    ratings: (users, items, ratings per user) of the synthetic MovieLens
      file (ncf only), full and quick.
  """
  config: str
  steps: int
  quick_steps: int
  optimizer_steps: dict = dataclasses.field(default_factory=dict)
  settings: dict = dataclasses.field(default_factory=dict)
  metric: str | None = None
  ratings: tuple | None = None
  quick_ratings: tuple | None = None


# 4 data-parallel replicas of one device each for every model (DLRM's launcher
# default is 2 x 2 with model-parallel splits; here only DP compression is
# measured).
DP_ONLY = {"num_replicas": NUM_CPUS, "num_devices_per_replica": 1, "mp_splits": "none"}
MODELS: dict[str, ModelPlan] = {
    # Under momentum SGD and Adagrad dense DLRM is still on its initial
    # plateau at 240 steps (seeds 0 and 1 end 6-9% apart); at 960 it trains.
    "dlrm": ModelPlan("default", steps=240, quick_steps=40,
                      optimizer_steps={"momentum": 960, "adagrad": 960}, settings=DP_ONLY),
    # The launcher's local NCF (MF 8, MLP 16-8, batch 256): the default size
    # needs ~4x the time per step. 943 users and 1682 items as MovieLens-100K,
    # 20 ratings each: ~350 steps per epoch; a model ranking by popularity alone
    # scores HR@10 0.32 here, the hidden teacher itself 0.72.
    "ncf": ModelPlan("local", steps=1000, quick_steps=40, ratings=(943, 1682, 20),
                     quick_ratings=(400, 300, 20)),
    "lstm_lm": ModelPlan("local", steps=400, quick_steps=40),
    "transformer": ModelPlan("local", steps=200, quick_steps=40, metric="loss"),
}
# Settings every run of a local preset takes from the default preset
# (launch/registry.py COMMON_DEFAULTS): the local preset loosens them so that
# a 30-step smoke run learns, and the benchmark measures what a full run sends.
RATES = ("sparsity", "density", "threshold_life")
DEFAULT_MODELS = ("dlrm", "ncf", "lstm_lm", "transformer")
DEFAULT_OPTIMIZERS = ("momentum", "adam", "adagrad")
DEFAULT_COMPRESSORS = ("dense", "dct", "dct_paper")
QUICK = {"models": ("ncf",), "optimizers": ("adam",),
         "compressors": ("dense", "dct", "dct_paper")}
LOWER_IS_BETTER = ("loss", "perplexity", "mse")
DATA_SEED = 0  # the synthetic ratings file: the same data for every seed


class FlagError(ValueError):
  """A bad flag value, reported before any training starts."""


def plan_settings(plan: ModelPlan, config: str) -> dict:
  """Launcher settings of every run of `plan` under the preset `config`."""
  from launch import registry  # pylint: disable=g-import-not-at-top
  rates = ({k: registry.COMMON_DEFAULTS[k] for k in RATES} if config == "local" else {})
  return {**rates, **plan.settings}


def plan_steps(plan: ModelPlan, optimizer: str, quick: bool = False) -> int:
  """Training steps of every run of `plan` under `optimizer`."""
  if quick:
    return plan.quick_steps
  return plan.optimizer_steps.get(optimizer, plan.steps)


# --- compressors -----------------------------------------------------------------


def parse_compressor(spec: str) -> tuple[str, dict]:
  """'dct_paper+sparsity=0.9' -> ('dct', {min_count: 0, momentum: 0.0, sparsity: 0.9})."""
  name, *extras = spec.split("+")
  if name not in COMPRESSORS:
    raise FlagError(f"--compressors: unknown {name!r}; allowed: {','.join(COMPRESSORS)} "
                    "(optionally followed by +keyword=value)")
  compression, kwargs = COMPRESSORS[name]
  kwargs = dict(kwargs)
  for extra in extras:
    key, eq, text = extra.partition("=")
    if not eq or not key.isidentifier():
      raise FlagError(f"--compressors: {spec!r}: expected +keyword=value, got {extra!r}")
    try:
      kwargs[key] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise FlagError(f"--compressors: {spec!r}: {text!r} is not a Python literal") from None
  if compression == "none" and kwargs:
    raise FlagError(f"--compressors: {spec!r}: dense takes no options")
  return compression, kwargs


def build_compressor(spec: str, cfg: dict):
  """(compressor or None for dense, notes) of `spec` in the run of `cfg`.

  The compressor gets what the launcher would give it for `cfg` (its
  per-model and per-optimizer settings: `launch.train.compressor_arguments`)
  with the spec's keywords on top. A spec that turns Adam correction off
  (`adam=False`) runs as `--adam_correction=false` would, so the launcher's
  Adam-only settings (residual decay) are not passed either. Keywords the
  installed constructor does not take are dropped; each one dropped is
  named in the notes.
  """
  from launch import train  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  compression, kwargs = parse_compressor(spec)
  if compression == "none":
    return None, []
  if kwargs.get("adam") is False and cfg["optimizer"] in train.ADAM_OPTIMIZERS:
    cfg = {**cfg, "adam_correction": False}
  cls = getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[compression])
  accepted = inspect.signature(cls).parameters
  notes = [f"{cls.__name__} takes no {key}= here: {spec} runs without it"
           for key in kwargs if key not in accepted]
  arguments = {**train.compressor_arguments(cfg), **kwargs}
  compressor = cls(**{k: v for k, v in arguments.items() if k in accepted})
  if compressor.exchanges_sparse_wire:
    # The replicas share one machine here, where sparse payloads default to
    # the fixed capacity; report the exact sizes that would cross a network.
    compressor.exact_sizes = True
  return compressor, notes


# --- one run ---------------------------------------------------------------------


def write_ratings(directory: str, users: int, items: int, per_user: int) -> str:
  """A synthetic MovieLens `ratings.csv` in `directory`; returns the directory."""
  from models.data import movielens  # pylint: disable=g-import-not-at-top
  ratings = movielens.synthetic_ratings(DATA_SEED, num_users=users, num_items=items,
                                        per_user=per_user)
  movielens.write_ratings_csv(os.path.join(directory, "ratings.csv"), ratings)
  return directory


def launcher_config(model: str, optimizer: str, seed: int, compression: str, *,
                    config: str, steps: int, evals: int, data_dir: str = "",
                    settings: dict | None = None) -> dict:
  """The launcher's cfg of one run, resolved and validated by `launch.train`."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from absl.testing import flagsaver  # pylint: disable=g-import-not-at-top
  from launch import train  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  every = max(1, steps // evals)
  overrides = dict(model=model, config=config, optimizer=optimizer, seed=seed,
                   compression=compression, steps=steps, eval_every=every,
                   log_every=steps, data_dir=data_dir, model_dir="", loop="custom",
                   **(settings or {}))
  with flagsaver.flagsaver(**overrides):
    return train.resolved_config()


def layer_payload_ratio(variables: dict, exclude: str = "embedding") -> float | None:
  """Dense payload / sent payload over the variables whose name lacks `exclude`.

  `variables`: `communication_stats()["variables"]`, whose `total` holds
  per-replica lists of `payload_bytes` and `dense_payload_bytes`. The ratio
  of the sums (replicas and variables), None without such variables, inf
  when nothing was sent.
  """
  dense = sent = 0.0
  found = False
  for name, var in variables.items():
    if exclude in name:
      continue
    found = True
    dense += sum(var["total"]["dense_payload_bytes"])
    sent += sum(var["total"]["payload_bytes"])
  if not found:
    return None
  return dense / sent if sent else math.inf


def run_one(model: str, optimizer: str, compressor: str, seed: int, *, config: str,
            steps: int, evals: int, data_dir: str = "", settings: dict | None = None,
            metric: str | None = None, verbose: bool = False) -> dict:
  """Trains one (model, optimizer, compressor, seed); returns its record."""
  import tf_keras  # pylint: disable=g-import-not-at-top
  from launch import registry  # pylint: disable=g-import-not-at-top
  from launch import train  # pylint: disable=g-import-not-at-top
  compression, _ = parse_compressor(compressor)
  cfg = launcher_config(model, optimizer, seed, compression, config=config, steps=steps,
                        evals=evals, data_dir=data_dir, settings=settings)
  comp, notes = build_compressor(compressor, cfg)
  metric = metric or registry.get(model).metric
  record = {"model": model, "optimizer": optimizer, "compressor": compressor, "seed": seed,
            "metric": metric, "learning_rate": cfg["learning_rate"], "steps": steps,
            "config": config, "notes": notes, "diverged": None}
  job = train.Job(cfg, compressor=comp)
  out = sys.stdout if verbose else io.StringIO()
  start = time.perf_counter()
  try:
    with contextlib.redirect_stdout(out):
      job.setup()
      job.run()
  except FloatingPointError as e:  # the launcher's TrainingDiverged
    record["diverged"] = str(e)
  record["wall_seconds"] = time.perf_counter() - start
  keys = sorted({k for result in job.evals.values() for k in result})
  if keys and metric not in keys:
    raise FlagError(f"--metric: {model} evaluates {','.join(keys)}, not {metric!r}")
  record["curves"] = {key: {step: float(result[key]) for step, result in sorted(job.evals.items())
                            if key in result} for key in keys}
  record["curve"] = dict(record["curves"].get(metric, {}))
  record["final"] = (record["curve"][max(record["curve"])]
                     if record["curve"] and not record["diverged"] else math.nan)
  comm = job.communication()
  record["payload_ratio"] = comm["payload_ratio"] if comm else None
  record["stock_payload_ratio"] = comm.get("stock_payload_ratio") if comm else None
  stats_fn = getattr(job.optimizer, "communication_stats", None)
  record["layer_payload_ratio"] = (layer_payload_ratio(stats_fn()["variables"])
                                   if stats_fn is not None and comm else None)
  del job
  tf_keras.backend.clear_session()
  gc.collect()
  return record


# --- summary ---------------------------------------------------------------------


def _mean(xs):
  return sum(xs) / len(xs) if xs else math.nan


def relative_se(finals: Sequence[float], dense_finals: Sequence[float],
                seeds: Sequence[int] | None = None,
                dense_seeds: Sequence[int] | None = None) -> float:
  """The standard error of `relative(mean(finals), mean(dense_finals))`.

  Paired when both ran the same seeds, once each (a seed fixes the initial
  weights, the data order and the evaluation data of both runs): the
  per-seed gaps (final - dense final) / |dense mean| have that relative gap
  as their mean, and its standard error is their sample deviation over
  sqrt(n). Otherwise the two sets are independent: sqrt(s_c^2 / n_c +
  s_d^2 / n_d) / |dense mean| from their sample variances (dense's mean
  taken as exact in the denominator). nan with fewer than two finals on
  either side.
  """
  dense_mean = _mean(dense_finals)
  if len(finals) < 2 or len(dense_finals) < 2 or not dense_mean or math.isnan(dense_mean):
    return math.nan
  if (seeds is not None and dense_seeds is not None and len(seeds) == len(finals)
      and len(dense_seeds) == len(dense_finals) and len(set(seeds)) == len(seeds)
      and sorted(seeds) == sorted(dense_seeds)):
    dense_of = dict(zip(dense_seeds, dense_finals))
    gaps = [(f - dense_of[s]) / abs(dense_mean) for s, f in zip(seeds, finals)]
    return math.sqrt(statistics.variance(gaps) / len(gaps))
  return math.sqrt(statistics.variance(finals) / len(finals)
                   + statistics.variance(dense_finals) / len(dense_finals)) / abs(dense_mean)


def relative(value: float, reference: float) -> float:
  """(value - reference) / |reference| (nan when either is nan or reference is 0)."""
  if math.isnan(value) or math.isnan(reference) or reference == 0:
    return math.nan
  return (value - reference) / abs(reference)


def summarize(records: Sequence[dict]) -> list[dict]:
  """One row per (model, metric, optimizer, compressor), grouped by model,
  metric and optimizer; models, metrics, optimizers and compressors each in
  the order first seen in `records`.

  Each row: model, optimizer, compressor, metric, lower_is_better, seeds,
  finals (per seed), final (mean), rel (vs dense's mean), rel_se (its
  standard error, `relative_se`; nan for dense), dense_spread
  ((max - min) / mean of dense's finals), within (inside dense's [min, max]),
  verdict, curve {step: mean}, curve_rel {step: rel vs dense at that step},
  worst_rel (the most adverse of curve_rel), payload_ratio and
  layer_payload_ratio (means), learning_rate, diverged (count), notes.
  A group without a dense run gets nan relative figures.
  """
  groups: dict[tuple, list[dict]] = {}
  for r in records:
    groups.setdefault((r["model"], r["metric"], r["optimizer"], r["compressor"]), []).append(r)
  rows = []
  for (model, metric, optimizer, compressor), runs in groups.items():
    lower = metric in LOWER_IS_BETTER
    finals = [r["final"] for r in runs]
    ok = [f for f in finals if not math.isnan(f)]
    final = _mean(ok) if len(ok) == len(finals) else math.nan
    steps = sorted({s for r in runs for s in r["curve"]})
    curve = {s: _mean([r["curve"][s] for r in runs if s in r["curve"]]) for s in steps}
    dense = groups.get((model, metric, optimizer, "dense"))
    dense_finals = [r["final"] for r in dense] if dense else []
    if dense_finals and not any(math.isnan(f) for f in dense_finals):
      dense_mean = _mean(dense_finals)
      lo, hi = min(dense_finals), max(dense_finals)
      spread = (hi - lo) / abs(dense_mean) if dense_mean else math.nan
    else:
      dense_mean = lo = hi = spread = math.nan
    rel = relative(final, dense_mean)
    rel_se = (relative_se(finals, dense_finals, [r["seed"] for r in runs],
                          [r["seed"] for r in dense])
              if compressor != "dense" and not math.isnan(rel) else math.nan)
    if math.isnan(final) or math.isnan(dense_mean):
      within, verdict = None, "diverged" if math.isnan(final) else "-"
    else:
      tol = 1e-12 * max(1.0, abs(dense_mean))
      within = lo - tol <= final <= hi + tol
      if within:
        verdict = "within"
      else:
        verdict = "worse" if (final > hi) == lower else "better"
    dense_curve = ({s: _mean([r["curve"][s] for r in dense if s in r["curve"]])
                    for s in steps} if dense else {})
    curve_rel = {s: relative(curve[s], dense_curve.get(s, math.nan)) for s in steps}
    rels = [v for v in curve_rel.values() if not math.isnan(v)]
    worst = (max(rels) if lower else min(rels)) if rels else math.nan
    ratios = [r["payload_ratio"] for r in runs if r.get("payload_ratio") is not None]
    stock = [r["stock_payload_ratio"] for r in runs
             if r.get("stock_payload_ratio") is not None]
    layer = [r["layer_payload_ratio"] for r in runs
             if r.get("layer_payload_ratio") is not None]
    rows.append({
        "model": model, "optimizer": optimizer, "compressor": compressor,
        "metric": metric, "lower_is_better": lower, "seeds": [r["seed"] for r in runs],
        "finals": finals, "final": final, "rel": rel, "rel_se": rel_se,
        "dense_spread": spread,
        "within": within, "verdict": verdict, "curve": curve, "curve_rel": curve_rel,
        "worst_rel": worst, "payload_ratio": _mean(ratios) if ratios else None,
        "stock_payload_ratio": _mean(stock) if stock else None,
        "layer_payload_ratio": _mean(layer) if layer else None,
        "learning_rate": runs[0]["learning_rate"],
        "diverged": sum(1 for r in runs if r.get("diverged")),
        "notes": sorted({n for r in runs for n in r.get("notes", ())}),
    })
  # Merged parts may hold one compressor's runs after the others'.
  keys = lambda r: (("model", r["model"]), ("metric", r["model"], r["metric"]),
                    ("optimizer", r["optimizer"]), ("compressor", r["compressor"]))
  order = {}
  for r in records:
    for key in keys(r):
      order.setdefault(key, len(order))
  return sorted(rows, key=lambda row: tuple(order[k] for k in keys(row)))


# --- tables ----------------------------------------------------------------------


def _num(x: float | None, digits: int = 4) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
  if x is None or math.isnan(x):
    return "-"
  digits = 1 if abs(x) >= 0.01 or x == 0 else 2
  return f"{100 * x:+.{digits}f}%"


def _ratio(x: float | None) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return "inf" if math.isinf(x) else f"{x:.1f}x"


def results_table(rows: Sequence[dict]) -> str:
  """The main markdown table (one line per row of `summarize`)."""
  lines = ["| model | metric | optimizer (lr) | compressor | seeds | final (mean) | "
           "vs dense | s.e. | dense spread | verdict | worst point | payload vs stock TF | "
           "payload vs densified | dense layers |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    dense = r["compressor"] == "dense"
    direction = "lower better" if r["lower_is_better"] else "higher better"
    lines.append(
        f"| {r['model']} | {r['metric']} ({direction}) | {r['optimizer']} "
        f"({r['learning_rate']:g}) | {r['compressor']} | {len(r['seeds'])} | "
        f"{_num(r['final'])} | {'-' if dense else _pct(r['rel'])} | "
        f"{'-' if dense else _pct(r['rel_se']).lstrip('+')} | "
        f"{_pct(r['dense_spread'])[1:]} | "
        f"{'-' if dense else r['verdict']} | {'-' if dense else _pct(r['worst_rel'])} | "
        f"{_ratio(r.get('stock_payload_ratio'))} | {_ratio(r['payload_ratio'])} | "
        f"{_ratio(r['layer_payload_ratio'])} |")
  return "\n".join(lines)


def curves_table(rows: Sequence[dict]) -> str:
  """The metric at each evaluation point; compressed runs with their gap to dense."""
  out = []
  by_group: dict[tuple, list[dict]] = {}
  for r in rows:
    by_group.setdefault((r["model"], r["metric"], r["optimizer"]), []).append(r)
  for (model, _, optimizer), group in by_group.items():
    steps = sorted({s for r in group for s in r["curve"]})
    out.append(f"{model}, {optimizer}: {group[0]['metric']} at step")
    out.append("")
    out.append("| compressor | " + " | ".join(str(s) for s in steps) + " |")
    out.append("|---|" + "---|" * len(steps))
    for r in group:
      cells = []
      for s in steps:
        value = r["curve"].get(s, math.nan)
        cell = _num(value)
        if r["compressor"] != "dense" and not math.isnan(r["curve_rel"].get(s, math.nan)):
          cell += f" ({_pct(r['curve_rel'][s])})"
        cells.append(cell)
      out.append(f"| {r['compressor']} | " + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out).rstrip() + "\n"


def notes_lines(rows: Sequence[dict]) -> list[str]:
  lines = []
  for r in rows:
    if r["diverged"]:
      lines.append(f"- {r['model']} / {r['optimizer']} / {r['compressor']}: "
                   f"{r['diverged']} of {len(r['seeds'])} seeds diverged (no final value)")
  for note in sorted({n for r in rows for n in r["notes"]}):
    lines.append(f"- {note}")
  return lines


def report(rows: Sequence[dict], command: str | Sequence[str], wall: float,
           metric: str = "") -> str:
  """The whole markdown report: command, main table, curves, notes.

  `command`: the command that ran the records, or the commands of the parts
  merged with --plot_json (`wall`: their times added up); `metric`: the
  --metric given with --plot_json, which the report names.
  """
  commands = [command] if isinstance(command, str) else list(command)
  if len(commands) == 1:
    origin = f"Produced by `{commands[0]}` ({wall / 60:.1f} min on the machine that ran it, "
  else:
    origin = ("Produced in " + str(len(commands)) + " parts, " +
              ", ".join(f"`{c}`" for c in commands) + ", merged from their --json files "
              f"({wall / 60:.1f} min in all on the machine that ran them, ")
  reported = f" Reported with `--metric={metric}`." if metric else ""
  parts = [origin + f"its CPU split into {NUM_CPUS} logical devices).{reported}", "",
           "Finals are means over the seeds; \"vs dense\" and \"worst point\" are relative "
           "to dense's mean at the same step (the metric's sign); \"s.e.\" is the "
           "standard error of \"vs dense\", from the per-seed gaps where dense ran the "
           "same seeds (a seed fixes both runs' initial weights and data), else from "
           "the two sets' sample variances: a gap of less than about two of them is "
           "not told apart from seed noise; \"payload\" is what "
           "one replica would send without tf-dct / what it sends per step: \"vs stock "
           "TF\" prices dense gradients all-reduced and embedding gradients as TF's "
           "IndexedSlices all-gather, \"vs densified\" every gradient all-reduced whole; "
           "\"dense layers\" is the densified ratio over the non-embedding variables.",
           "", results_table(rows), "", "Curves (mean over seeds; gap to dense in "
           "parentheses):", "", curves_table(rows)]
  notes = notes_lines(rows)
  if notes:
    parts += ["Notes:", "", *notes, ""]
  return "\n".join(parts)


def plot(rows: Sequence[dict], records: Sequence[dict], path: str) -> None:
  """One panel per (model, metric, optimizer): per compressor the mean curve over the
  seeds and the seeds' range as a band of the line's colour (dense in black).

  Markers, line styles, font sizes and legend placement: bench/plotting.py.
  """
  from bench import plotting  # pylint: disable=g-import-not-at-top
  plt = plotting.pyplot()
  groups = list(dict.fromkeys((r["model"], r["metric"], r["optimizer"]) for r in rows))
  cols = min(3, len(groups))
  nrows = -(-len(groups) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.9 * nrows + 0.4),
                           squeeze=False, layout="constrained")  # room for the legends below
  for ax, (model, metric, optimizer) in zip(axes.flat, groups):
    group = [r for r in rows if (r["model"], r["metric"], r["optimizer"])
             == (model, metric, optimizer)]
    for row in group:
      runs = [r for r in records if (r["model"], r["metric"], r["optimizer"], r["compressor"])
              == (model, metric, optimizer, row["compressor"])]
      steps = sorted(row["curve"])
      (line,) = ax.plot(steps, [row["curve"][s] for s in steps], label=row["compressor"],
                        color="black" if row["compressor"] == "dense" else None)
      per_step = [[r["curve"][s] for r in runs if s in r["curve"]] for s in steps]
      ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step],
                      color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_title(f"{model}, {optimizer}")
    ax.set_xlabel("step")
    ax.set_ylabel(group[0]["metric"])
    ax.legend()
  for ax in list(axes.flat)[len(groups):]:
    ax.axis("off")
  fig.suptitle("lines: mean over the seeds; bands: the seeds' range")
  plotting.save(fig, path)


# --- records as JSON, and parts merged ----------------------------------------------

JSON_FORMAT = "bench/quality.py records"
JSON_VERSION = 1
# Settings of a whole run (--json's "settings") that every merged part shares.
SHARED_SETTINGS = ("quick", "evals", "data_dir", "num_cpus")
# Record keys every run of one (model, optimizer) shares across the parts.
CELL_SETTINGS = ("steps", "config", "metric", "learning_rate")


def json_data(records: Sequence[dict], *, command: str, wall: float,
              settings: dict) -> dict:
  """A run as a JSON-ready dict: its command, time, settings and records (each
  curve as [[step, metric], ...]); `settings` holds `SHARED_SETTINGS` at least.
  Written with `bench.plotting.save_json` (nan and inf as Python's json
  writes them)."""
  missing = [k for k in SHARED_SETTINGS if k not in settings]
  if missing:
    raise ValueError(f"json_data: settings lack {','.join(missing)}")
  pairs = lambda curve: [[s, v] for s, v in sorted(curve.items())]
  return {"format": JSON_FORMAT, "version": JSON_VERSION, "command": command,
          "wall_seconds": wall, "settings": dict(settings),
          "records": [{**r, "curve": pairs(r["curve"]),
                       **({"curves": {k: pairs(c) for k, c in r["curves"].items()}}
                          if "curves" in r else {})}
                      for r in records]}


def load_json(path: str) -> dict:
  """Reads a --json file; curves back to {step: metric}. Raises FlagError
  naming the file when it is not one."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise FlagError(f"--plot_json: cannot read {path}: {e}") from None
  if not isinstance(data, dict) or data.get("format") != JSON_FORMAT:
    raise FlagError(f"--plot_json: {path} is not a bench/quality.py --json file")
  missing = [k for k in ("command", "wall_seconds", "settings", "records") if k not in data]
  if missing:
    raise FlagError(f"--plot_json: {path} lacks {','.join(missing)}")
  if data.get("version") != JSON_VERSION:
    raise FlagError(f"--plot_json: {path} has version {data.get('version')!r}; this "
                    f"script reads version {JSON_VERSION}")
  curve = lambda pairs: {int(s): float(v) for s, v in pairs}
  data["records"] = [{**r, "curve": curve(r["curve"]),
                      **({"curves": {k: curve(c) for k, c in r["curves"].items()}}
                         if "curves" in r else {})}
                     for r in data["records"]]
  return data


def expand_metrics(records: Sequence[dict], metrics: dict) -> list[dict]:
  """`records` reported by the evaluation keys of `metrics` ({model: [key,
  ...]}): one copy of each record of such a model per key, its curve and
  final taken from the curves every record keeps, grouped by key; other
  models' records as they are. Raises FlagError naming the run when a record
  lacks a key."""
  out = []
  for model in dict.fromkeys(r["model"] for r in records):
    runs = [r for r in records if r["model"] == model]
    for key in metrics.get(model) or [None]:
      for r in runs:
        if key is not None and key != r["metric"]:
          curves = r.get("curves") or {}
          if key not in curves:
            kept = ",".join(sorted(curves)) or "no evaluation keys"
            raise FlagError(f"--metric: the run {model} / {r['optimizer']} / "
                            f"{r['compressor']} seed {r['seed']} kept {kept}, not {key!r}")
          curve = curves[key]
          final = curve[max(curve)] if curve and not r["diverged"] else math.nan
          r = {**r, "metric": key, "curve": dict(curve), "final": final}
        out.append(r)
  return out


def _same_run(a: dict, b: dict) -> bool:
  """Whether two records are one run repeated: equal in every key both have
  but their time (runs are deterministic, so each part's dense reference
  repeats the other parts'; a record without "curves" is compared on the
  rest). NaN finals of diverged runs compare equal."""
  common = (set(a) & set(b)) - {"wall_seconds"}
  strip = lambda r: json.dumps({k: r[k] for k in common}, sort_keys=True, default=str)
  return strip(a) == strip(b)


def merge(parts: Sequence[tuple[str, dict]]) -> tuple[list[dict], list[str], float]:
  """(records, commands, seconds) of the (path, `load_json` dict) parts, in order.

  Raises FlagError naming the file when a part's runs are not comparable
  with an earlier part's: another value of a `SHARED_SETTINGS` key, or of a
  `CELL_SETTINGS` key for the same (model, optimizer); or when a run (model,
  optimizer, compressor, seed) is twice in one file, or in two files with
  other results (none of them wins: drop it from one part). A run in two
  files with the same results (each part's dense reference) is kept once.
  """
  records, first, cells, seen = [], None, {}, {}
  for path, data in parts:
    settings = {k: data["settings"].get(k) for k in SHARED_SETTINGS}
    if first is None:
      first = (path, settings)
    for key in SHARED_SETTINGS:
      if settings[key] != first[1][key]:
        raise FlagError(f"--plot_json: {path} ran with {key}={settings[key]!r}, {first[0]} "
                        f"with {key}={first[1][key]!r}: their runs are not comparable")
    for r in data["records"]:
      cell = (r["model"], r["optimizer"])
      values = {k: r.get(k) for k in CELL_SETTINGS}
      earlier = cells.setdefault(cell, (path, values))
      for key in CELL_SETTINGS:
        if values[key] != earlier[1][key]:
          raise FlagError(
              f"--plot_json: {path} ran {r['model']} / {r['optimizer']} with "
              f"{key}={values[key]!r}, {earlier[0]} with {key}={earlier[1][key]!r}: "
              "their runs are not comparable")
      run = (*cell, r["compressor"], r["seed"])
      if run in seen:
        earlier_path, earlier_record = seen[run]
        if earlier_path != path and _same_run(earlier_record, r):
          continue  # the same run repeated by another part (every part runs dense)
        where = (f"twice in {path}" if earlier_path == path
                 else f"in {earlier_path} and in {path} with other results")
        raise FlagError(f"--plot_json: {' / '.join(str(x) for x in run[:3])} seed {run[3]} "
                        f"is {where}; keep it in one file only")
      seen[run] = (path, r)
      records.append(r)
  commands = [data["command"] for _, data in parts]
  return records, commands, sum(data["wall_seconds"] for _, data in parts)


def write_docs(markdown: str, png: str | None, path: str = DOC_PATH) -> None:
  """Replaces the results section of docs/quality.md (between its markers)."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if DOC_BEGIN not in text or DOC_END not in text:
    raise FlagError(f"--write_docs: {path} lacks the markers {DOC_BEGIN!r} ... {DOC_END!r}")
  body = markdown
  if png:
    rel = os.path.relpath(os.path.abspath(png), os.path.dirname(os.path.abspath(path)))
    body += f"\n![metric curves]({rel})\n"
  head, rest = text.split(DOC_BEGIN, 1)
  _, tail = rest.split(DOC_END, 1)
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"{head}{DOC_BEGIN}\n\n{body.strip()}\n\n{DOC_END}{tail}")


# --- the benchmark ---------------------------------------------------------------


def run(models: Sequence[str], optimizers: Sequence[str], compressors: Sequence[str],
        seeds: Sequence[int], *, quick: bool = False, steps: int | None = None,
        evals: int = 4, data_dir: str = "", settings: dict | None = None,
        metrics: dict | None = None, verbose: bool = False,
        log: Callable[[str], None] = print) -> list[dict]:
  """Trains every combination; returns the per-run records (see `run_one`).

  `settings` are launcher settings applied to every run on top of each
  model's (e.g. {"num_replicas": 2, "num_devices_per_replica": 2}).
  `metrics` maps a model to the evaluation key reported instead of its
  headline metric (e.g. {"dlrm": "loss"}).
  """
  import tf_dct  # pylint: disable=g-import-not-at-top
  tf_dct.split_cpu(NUM_CPUS)
  records = []
  with tempfile.TemporaryDirectory(prefix="quality_") as tmp:
    for model in models:
      plan = MODELS[model]
      config = "local" if quick else plan.config
      model_data = ""
      if model == "ncf":
        if data_dir:
          model_data = data_dir
        else:
          model_data = os.path.join(tmp, "ncf")
          os.makedirs(model_data, exist_ok=True)
          write_ratings(model_data, *(plan.quick_ratings if quick else plan.ratings))
      for optimizer in optimizers:
        model_steps = steps or plan_steps(plan, optimizer, quick)
        for compressor in compressors:
          for seed in seeds:
            r = run_one(model, optimizer, compressor, seed, config=config,
                        steps=model_steps, evals=evals, data_dir=model_data,
                        settings={**plan_settings(plan, config), **(settings or {})},
                        metric=(metrics or {}).get(model) or plan.metric,
                        verbose=verbose)
            records.append(r)
            status = f"diverged: {r['diverged']}" if r["diverged"] else (
                f"{r['metric']} {r['final']:.4f}")
            log(f"quality: {model} {optimizer} {compressor} seed {seed}: {status}, payload "
                f"{_ratio(r.get('stock_payload_ratio'))} vs stock TF, "
                f"{_ratio(r['payload_ratio'])} vs densified ({r['wall_seconds']:.0f} s)")
  return records


def parse_metrics(text: str, models: Sequence[str]) -> dict:
  """--metric's {model: [key, ...]} in the order given; every model must be
  in `models`."""
  metric_map = {}
  for item in _split(text):
    model, colon, key = item.partition(":")
    if not colon or not model or not key:
      raise FlagError(f"--metric: expected model:key, got {item!r}")
    if model not in models:
      raise FlagError(f"--metric: {model} is not in --models ({','.join(models)})")
    if key in metric_map.get(model, ()):
      raise FlagError(f"--metric lists {model}:{key} twice")
    metric_map.setdefault(model, []).append(key)
  return metric_map


def _split(text: str) -> list[str]:
  """Comma-separated items; commas inside brackets or quotes stay (a spec's
  value may be a tuple, e.g. `dct+sparsity_schedule=((50,0.75),(50,0.9))`)."""
  items, depth, quote, current = [], 0, None, []
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      items.append("".join(current))
      current = []
      continue
    current.append(ch)
  items.append("".join(current))
  return [t.strip() for t in items if t.strip()]


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="bench/quality.py", description=__doc__.split("\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help=f"smoke run: --config=local, {MODELS['ncf'].quick_steps} steps, "
                 f"models {','.join(QUICK['models'])}, optimizer "
                 f"{','.join(QUICK['optimizers'])}, compressors "
                 f"{','.join(QUICK['compressors'])} (unless given)")
  p.add_argument("--models", default=None,
                 help=f"comma list of {','.join(MODELS)}; default {','.join(DEFAULT_MODELS)}")
  p.add_argument("--optimizers", default=None,
                 help="comma list of the launcher's --optimizer values; default "
                 f"{','.join(DEFAULT_OPTIMIZERS)} (those the launcher offers)")
  p.add_argument("--compressors", default=None,
                 help=f"comma list of {','.join(COMPRESSORS)} or 'all', each optionally "
                 "with +keyword=value; dense is always run (the reference); default "
                 f"{','.join(DEFAULT_COMPRESSORS)}")
  p.add_argument("--seeds", default=None, help="comma list of >= 2 seeds; default 0,1")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps of every run; default per model and optimizer (MODELS)")
  p.add_argument("--learning_rate", type=float, default=None,
                 help="learning rate of every run; default the launcher's per model, "
                 "preset and optimizer")
  p.add_argument("--metric", default="",
                 help="comma list of model:key, the evaluation key reported for that "
                 "model instead of its headline metric (e.g. dlrm:loss); a model listed "
                 "with several keys is reported once per key (dlrm:auc,dlrm:loss). With "
                 "--plot_json: taken from the curves the runs kept. Default none")
  p.add_argument("--evals", type=int, default=None,
                 help="evaluation points per run (every steps/evals steps); default 4")
  p.add_argument("--data_dir", default="",
                 help="a MovieLens directory (ratings.csv or u.data) for ncf; default: a "
                 "synthetic ratings file written to a temporary directory")
  p.add_argument("--out", default="", help="also write the markdown report to this file")
  p.add_argument("--png", default="", help="write the curves to this PNG")
  p.add_argument("--json", default="",
                 help="also write every run's record (curve, final, payload ratios) and "
                 "the run's settings to this file, for --plot_json")
  p.add_argument("--plot_json", default="",
                 help="comma list of earlier --json files: train nothing, merge them and "
                 "print the report (with --out, --png, --write_docs as after a run); "
                 "refused with the training flags")
  p.add_argument("--write_docs", action="store_true",
                 help=f"rewrite the results section of {os.path.relpath(DOC_PATH, REPO_ROOT)}")
  p.add_argument("--verbose", action="store_true",
                 help="show the launcher's progress lines and summary tables")
  return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and validates; fills --quick / full defaults. Raises FlagError."""
  args = build_parser().parse_args(argv)
  args.plot_list = [f.strip() for f in args.plot_json.split(",") if f.strip()]
  if args.plot_json and not args.plot_list:
    raise FlagError("--plot_json: give a comma list of --json files")
  if args.plot_list:
    for f in args.plot_list:
      if not os.path.isfile(f):
        raise FlagError(f"--plot_json: no such file {f!r}")
    if len(set(args.plot_list)) != len(args.plot_list):
      raise FlagError(f"--plot_json lists a file twice: {args.plot_json}")
    given = [name for name in TRAINING_FLAGS if getattr(args, name) not in (None, False, "")]
    if given:
      raise FlagError(f"--plot_json trains nothing: drop --{', --'.join(given)} (the "
                      "files hold their runs' settings)")
    if args.write_docs and not os.path.isfile(DOC_PATH):
      raise FlagError(f"--write_docs: {DOC_PATH} not found")
    args.metric_map = parse_metrics(args.metric, MODELS)
    return args
  if args.seeds is None:
    args.seeds = "0,1"
  if args.evals is None:
    args.evals = 4
  from launch import registry  # pylint: disable=g-import-not-at-top
  from launch import train  # pylint: disable=g-import-not-at-top
  preset = QUICK if args.quick else {"models": DEFAULT_MODELS, "optimizers": None,
                                     "compressors": DEFAULT_COMPRESSORS}
  models = _split(args.models) if args.models is not None else list(preset["models"])
  unknown = [m for m in models if m not in MODELS or m not in registry.SPECS]
  if not models or unknown:
    raise FlagError(f"--models: unknown {','.join(unknown) or '(none given)'}; allowed: "
                    f"{','.join(MODELS)}")
  if args.optimizers is not None:
    optimizers = _split(args.optimizers)
    unknown = [o for o in optimizers if o not in train.OPTIMIZERS]
    if not optimizers or unknown:
      raise FlagError(f"--optimizers: unknown {','.join(unknown) or '(none given)'}; the "
                      f"launcher offers {','.join(train.OPTIMIZERS)}")
  elif preset["optimizers"]:
    optimizers = list(preset["optimizers"])
  else:
    optimizers = [o for o in DEFAULT_OPTIMIZERS if o in train.OPTIMIZERS]
  if args.compressors is not None:
    text = args.compressors.strip()
    compressors = list(COMPRESSORS) if text == "all" else _split(text)
  else:
    compressors = list(preset["compressors"])
  for spec in compressors:
    compression, _ = parse_compressor(spec)
    for model in models:  # a bad keyword value fails here, before any training
      plan = MODELS[model]
      config = "local" if args.quick else plan.config
      for optimizer in optimizers:
        cfg = launcher_config(model, optimizer, 0, compression, config=config, steps=1,
                              evals=1, settings=plan_settings(plan, config))
        try:
          build_compressor(spec, cfg)
        except (TypeError, ValueError) as e:
          raise FlagError(f"--compressors: {spec}: {e}") from None
  if "dense" not in compressors:
    compressors.insert(0, "dense")
  for name, values in (("models", models), ("optimizers", optimizers),
                       ("compressors", compressors)):
    if len(set(values)) != len(values):
      raise FlagError(f"--{name} lists a value twice: {','.join(values)}")
  try:
    seeds = [int(s) for s in _split(args.seeds)]
  except ValueError:
    raise FlagError(f"--seeds: expected a comma list of integers, got {args.seeds!r}") from None
  if len(set(seeds)) < 2 or len(set(seeds)) != len(seeds):
    raise FlagError(f"--seeds: give at least 2 distinct seeds (the dense spread needs "
                    f"them), got {args.seeds!r}")
  if args.steps is not None and args.steps < 1:
    raise FlagError(f"--steps must be >= 1, got {args.steps}")
  if args.evals < 1:
    raise FlagError(f"--evals must be >= 1, got {args.evals}")
  if args.learning_rate is not None and not (math.isfinite(args.learning_rate)
                                             and args.learning_rate > 0):
    raise FlagError(f"--learning_rate must be a finite number > 0, got {args.learning_rate}")
  if args.steps is not None and args.steps < args.evals:
    raise FlagError(f"--steps ({args.steps}) must be >= --evals ({args.evals})")
  if args.data_dir and not os.path.isdir(args.data_dir):
    raise FlagError(f"--data_dir {args.data_dir!r} does not exist or is not a directory")
  if args.data_dir and "ncf" not in models:
    raise FlagError("--data_dir is the ncf ratings directory, but --models has no ncf")
  if args.write_docs and not os.path.isfile(DOC_PATH):
    raise FlagError(f"--write_docs: {DOC_PATH} not found")
  metric_map = parse_metrics(args.metric, models)
  args.metric_map = metric_map
  args.model_list, args.optimizer_list = models, optimizers
  args.compressor_list, args.seed_list = compressors, seeds
  return args


# Flags --plot_json refuses: they choose what to train.
TRAINING_FLAGS = ("quick", "models", "optimizers", "compressors", "seeds", "steps",
                  "learning_rate", "evals", "data_dir", "verbose", "json")
OUTPUT_FLAGS = ("--out", "--png", "--json", "--write_docs", "--verbose")


def command_line(argv: Sequence[str]) -> str:
  """The command that reproduces the figures: `argv` without the output flags."""
  kept, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a in ("--out", "--png", "--json"):
      skip = True  # its value follows
      continue
    if a.split("=", 1)[0] in OUTPUT_FLAGS:
      continue
    kept.append(shlex.quote(a))
  return " ".join(["python bench/quality.py", *kept])


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  try:
    args = parse_args(argv)
  except FlagError as e:
    print(f"quality: error: {e}", file=sys.stderr)
    return 2
  if args.plot_list:
    try:
      records, command, wall = merge([(f, load_json(f)) for f in args.plot_list])
      records = expand_metrics(records, args.metric_map)
    except FlagError as e:
      print(f"quality: error: {e}", file=sys.stderr)
      return 2
  else:
    records, command, wall = train_all(args, argv)
    records = expand_metrics(records, args.metric_map)
  rows = summarize(records)
  markdown = report(rows, command, wall, args.metric if args.plot_list else "")
  print("\n" + markdown, flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(markdown)
  if args.png:
    plot(rows, records, args.png)
  if args.write_docs:
    write_docs(markdown, args.png or None)
  return 0


def train_all(args: argparse.Namespace, argv: Sequence[str]) -> tuple[list[dict], str, float]:
  """Runs what `args` ask for; (records, command, seconds). Writes --json."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  tf.get_logger().setLevel("ERROR")
  start = time.perf_counter()
  records = run(args.model_list, args.optimizer_list, args.compressor_list, args.seed_list,
                quick=args.quick, steps=args.steps, evals=args.evals,
                data_dir=args.data_dir,
                settings=({"learning_rate": args.learning_rate}
                          if args.learning_rate is not None else None),
                metrics={model: keys[0] for model, keys in args.metric_map.items()},
                verbose=args.verbose,
                log=lambda line: print(line, flush=True))
  wall = time.perf_counter() - start
  command = command_line(argv)
  if args.json:
    from bench import plotting  # pylint: disable=g-import-not-at-top
    data = json_data(records, command=command, wall=wall, settings=run_settings(args))
    plotting.save_json(data, args.json)
  return records, command, wall


def run_settings(args: argparse.Namespace) -> dict:
  """The settings a --json file keeps: `SHARED_SETTINGS` and what was asked for."""
  return {"quick": args.quick, "evals": args.evals, "data_dir": args.data_dir,
          "num_cpus": NUM_CPUS, "models": args.model_list, "optimizers": args.optimizer_list,
          "compressors": args.compressor_list, "seeds": args.seed_list,
          "steps": args.steps, "metric": args.metric_map}


if __name__ == "__main__":
  sys.exit(main())
