"""DCT Fig 2: the DCT-DP threshold tau of each layer over a real training run.

DCT (KDD'21) §2.1, Fig 2 and Algorithm 1: for a fixed sparsity eta the top-K
threshold tau of a layer's error-corrected gradient hardly moves across
iterations (at eta = 0.95 it stays within 26% of its running mean), so DCT-DP
recomputes it only every L (~1000) iterations.

Here copies of a small DLRM (models/dlrm.py, synthetic Criteo-shaped data)
train side by side in one replicated step, with the same initial weights and
batches; each copy's optimizer is wrapped with its own DCTDP. The copies with
L = 1 record tau of every compressed layer at every step; the L = 1000 copies
show what reusing one tau does to the number of entries it selects.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import time

import numpy as np

from bench.studies import common

DESCRIPTION = ("DCT Fig 2: per-layer DCT-DP tau over a DLRM run (L=1), and "
               "what a reused tau (L=1000) selects")

VOCAB = 100                  # rows per categorical feature (synthetic data)
BOTTOM, TOP = (64, 16), (64, 32, 1)
MIN_SIZE = 1000              # smaller variables (biases, bottom_0) go dense
BAND = (0.5, 2.0)            # density guard of the "L=1000 + guard" copy
PLOT_LAYER = "top_0/kernel"  # the largest FC layer (367 x 64)


def define(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (default 2000, quick 300)")
  parser.add_argument("--replicas", type=int, default=None,
                      help="replicas on logical CPUs (default 2; tau is per "
                           "replica, more replicas only cost trace time)")
  parser.add_argument("--sparsities", default=None,
                      help="eta of the L=1 copies (default 0.9,0.95,0.99; "
                           "quick 0.95)")
  parser.add_argument("--reuse_sparsity", type=float, default=0.95,
                      help="eta of the two L=1000 copies (DCT Fig 7a uses 0.95)")
  parser.add_argument("--batch_size", type=int, default=256, help="global batch")
  parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
  parser.add_argument("--raw", default=None,
                      help="pickle of the per-step logs: written after "
                           "training, or read instead of training if it "
                           "exists (re-analysis without re-training)")


def warmup(sparsity: float) -> int:
  """Steps excluded from the statistics: 3 / (1 - eta).

  With error feedback an entry waits about 1 / (1 - eta) steps between sends,
  so the residual, and tau with it, needs a few such periods to settle.
  """
  return math.ceil(3 / (1 - sparsity) - 1e-9)


def _configs(args):
  """name -> (sparsity, threshold_life, density_band) of each copy."""
  r = args.reuse_sparsity
  every = sorted(set(args.sparsities) | {r})  # L=1 at r: the reference
  out = {f"L=1, eta={s:g}": (s, 1, None) for s in every}
  out[f"L=1000, eta={r:g}"] = (r, 1000, None)
  out[f"L=1000 + guard {BAND}, eta={r:g}"] = (r, 1000, BAND)
  return out


def train(args, configs):
  """Trains every copy; returns the per-step logs and the layer sizes.

  Returns:
    (log, sizes, losses): log[copy][layer] = (tau [steps, replicas],
    selected [steps, replicas], sent [steps, replicas]); sizes[layer] = N;
    losses[copy] = per-step global loss.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  from models import dlrm  # pylint: disable=g-import-not-at-top

  devices = common.logical_cpus(args.replicas)
  if len(devices) < args.replicas:
    raise RuntimeError(f"need {args.replicas} logical CPUs, have {len(devices)}")
  repl = tf_dct.Replicator(devices[:args.replicas])
  models, opts, comps = {}, {}, {}
  with repl.scope():
    for name, (sparsity, life, band) in configs.items():
      models[name] = dlrm.build_model(seed=0, vocab_sizes=VOCAB,
                                      bottom_mlp=BOTTOM, top_mlp=TOP)
      # float32 values, as in the paper (not DCTDP's default bfloat16)
      comps[name] = tf_dct.compression.DCTDP(
          sparsity, threshold_life=life, min_size=MIN_SIZE, density_band=band,
          value_dtype=None)
      opts[name] = repl.wrap_optimizer(tf_keras.optimizers.SGD(args.lr),
                                       compression=comps[name])
  gb = args.batch_size

  def input_fn(ctx):
    del ctx
    return dlrm.make_dataset(gb, seed=0, vocab_sizes=VOCAB)

  def step_fn(batch):
    features, labels = batch
    losses = {}
    for name, model in models.items():
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dlrm.loss(labels, model(features, training=True))) / gb
      variables = model.trainable_variables
      opts[name].apply_gradients(zip(tape.gradient(loss, variables), variables))
      losses[name] = loss
    return losses

  layers = {}
  for name, model in models.items():
    layers[name] = {v.name.split(":")[0]: v
                    for v in model.trainable_variables
                    if v.shape.num_elements() >= MIN_SIZE}
  sizes = {v.name.split(":")[0]: v.shape.num_elements()
           for v in next(iter(models.values())).trainable_variables
           if v.shape.num_elements() >= MIN_SIZE}
  raw = {name: {layer: ([], [], []) for layer in layers[name]} for name in models}
  losses = {name: [] for name in models}
  start = time.time()
  for step in range(args.steps):
    out = repl.run(step_fn, input_fn)
    if step in (0, args.steps // 2):
      print(f"[dct_fig2_tau] step {step} done after {time.time() - start:.0f}s",
            flush=True)
    for name in models:
      losses[name].append(float(sum(
          v.numpy() for v in repl.experimental_local_results(out[name]))))
      for layer, var in layers[name].items():
        tau, sel, sent = raw[name][layer]
        st = comps[name].state_values(var)
        tau.append(st["threshold"])
        s = np.asarray(st["sent"])
        sent.append(s)
        sel.append(s + np.asarray(st["overflow"]))
  log = {name: {layer: tuple(np.array(x) for x in v) for layer, v in d.items()}
         for name, d in raw.items()}
  return log, sizes, {k: np.array(v) for k, v in losses.items()}


def tau_stats(tau: np.ndarray) -> dict[str, float]:
  """Stability of a tau series [steps, replicas] (worst replica reported).

  range_lo / range_hi: 5th / 95th percentile over the median; running: the
  largest |tau / running mean - 1| (the paper's measure); drift: median of
  the last quarter over the median of the first quarter.
  """
  worst = {"range_lo": 1.0, "range_hi": 1.0, "running": 0.0, "drift": 1.0}
  for r in range(tau.shape[1]):
    t = tau[:, r]
    med = float(np.median(t))
    running = np.cumsum(t) / np.arange(1, t.size + 1)
    q = max(1, t.size // 4)
    drift = float(np.median(t[-q:]) / np.median(t[:q]))
    worst["range_lo"] = min(worst["range_lo"], float(np.percentile(t, 5)) / med)
    worst["range_hi"] = max(worst["range_hi"], float(np.percentile(t, 95)) / med)
    worst["running"] = max(worst["running"], float(np.max(np.abs(t / running - 1))))
    if abs(math.log(drift)) > abs(math.log(worst["drift"])):
      worst["drift"] = drift
  worst["median"] = float(np.median(tau))
  return worst


def _train_or_load(args, configs):
  """`train`, or its cached result from `--raw` (written after training)."""
  key = {"steps": args.steps, "replicas": args.replicas, "lr": args.lr,
         "batch_size": args.batch_size, "configs": sorted(configs)}
  if args.raw and os.path.exists(args.raw):
    with open(args.raw, "rb") as f:
      saved_key, result = pickle.load(f)
    if saved_key != key:
      raise ValueError(f"{args.raw} holds another run: {saved_key}")
    return result
  result = train(args, configs)
  if args.raw:
    with open(args.raw, "wb") as f:
      pickle.dump((key, result), f)
  return result


def run(args: argparse.Namespace) -> common.Result:
  from tf_dct.compression import dct_dp  # pylint: disable=g-import-not-at-top

  args.steps = args.steps or (300 if args.quick else 2000)
  args.replicas = args.replicas or 2
  args.sparsities = [float(s) for s in (
      args.sparsities or ("0.95" if args.quick else "0.9,0.95,0.99")).split(",")]
  configs = _configs(args)
  log, sizes, losses = _train_or_load(args, configs)
  steps = args.steps
  late = steps // 2          # the late window: the second half of the run
  life = 1000

  summary = {}
  for name, (sparsity, threshold_life, _) in configs.items():
    w = min(warmup(sparsity), steps - 10)
    lo = max(w, late)
    for layer, (tau, sel, sent) in log[name].items():
      k = dct_dp.expected_count(sizes[layer], sparsity)
      st = tau_stats(tau[lo:])
      whole = tau_stats(tau[w:])
      cold = slice(w, min(life, steps))      # before the k = L refresh
      warm = slice(life, steps) if steps > life else None
      summary[(name, layer)] = dict(
          st, k=k, warm=w, life=threshold_life, tau0=float(tau[0].mean()),
          whole_running=whole["running"], whole_drift=whole["drift"],
          changes_late=int(np.count_nonzero(
              np.diff(tau[lo - 1:], axis=0), axis=0).max()),
          changes_post=int(np.count_nonzero(
              np.diff(tau[w - 1:], axis=0), axis=0).max()),
          sel_cold=float((sel[cold] / k).mean()),
          sent_cold=float((sent[cold] / k).mean()),
          sel_warm=float((sel[warm] / k).mean()) if warm else float("nan"),
          tau_at_life=float(tau[life].mean()) if steps > life else float("nan"),
          sel_late=float((sel[lo:] / k).mean()))

  reuse = args.reuse_sparsity
  plain = f"L=1000, eta={reuse:g}"
  guard = f"L=1000 + guard {BAND}, eta={reuse:g}"
  every = f"L=1, eta={reuse:g}"

  rows = []
  for (name, layer), s in summary.items():
    if s["life"] == 1:
      selected = "1 (fresh tau)"
    elif name == plain:
      selected = (f"steps {s['warm']}-{min(life, steps)}: {s['sel_cold']:.2f} "
                  f"(sent {s['sent_cold']:.2f})")
      if steps > life:
        selected += f"; steps {life}-{steps}: {s['sel_warm']:.2f}"
    else:
      selected = f"{s['sel_late']:.2f}"
    rows.append([name, layer, sizes[layer], s["k"], f"{s['median']:.3g}",
                 f"{s['median'] / s['tau0']:.1f}x",
                 f"{s['range_lo']:.2f}-{s['range_hi']:.2f}",
                 f"{100 * s['running']:.0f}% ({100 * s['whole_running']:.0f}%)",
                 f"{s['drift']:.2f} ({s['whole_drift']:.2f})", selected,
                 f"{s['changes_late']} ({s['changes_post']})"])
  headers = [
      "copy", "layer", "N", "K", f"median tau, steps {late}-{steps}",
      "that / tau(step 0)", f"tau p5-p95 / median, steps {late}-{steps}",
      f"max dev. from running mean, steps {late}-{steps} (from warm-up end)",
      f"drift, steps {late}-{steps} (from warm-up end)",
      "entries reaching tau / K", f"tau changes, steps {late}-{steps} "
      "(from warm-up end)"]

  def plot(fig):
    ax1, ax2 = fig.subplots(1, 2)
    x = np.arange(steps)
    for name in configs:
      if name.startswith("L=1,"):
        ax1.plot(x, log[name][PLOT_LAYER][0][:, 0], lw=0.7, label=name)
    ax1.plot(x, log[plain][PLOT_LAYER][0][:, 0], "k--", lw=1,
             label=f"tau used, {plain}")
    ax1.plot(x, log[guard][PLOT_LAYER][0][:, 0], "k:", lw=1,
             label="tau used, + guard")
    ax1.axvline(late, color="grey", lw=0.5)
    ax1.set_yscale("log")
    ax1.set_xlabel("iteration")
    ax1.set_ylabel(f"tau of {PLOT_LAYER} (replica 0)")
    ax1.set_title("tau per iteration (cf. DCT Fig 2)")
    ax1.legend()
    k = summary[(plain, PLOT_LAYER)]["k"]
    for name, style in ((plain, "C3-"), (guard, "C2-")):
      ax2.plot(x, log[name][PLOT_LAYER][1][:, 0] / k, style, lw=0.7,
               label=name)
    ax2.axhspan(*BAND, color="C2", alpha=0.15, label="guard band")
    ax2.axhline(1, color="k", lw=0.5)
    ax2.set_yscale("log")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("entries reaching tau / K (replica 0)")
    ax2.set_title(f"what a reused tau selects, {PLOT_LAYER}")
    ax2.legend()

  # Headline numbers for the verdict.
  fig2 = summary[(every, PLOT_LAYER)]
  paper_band = 0.30  # the paper's "at most 26%" at eta = 0.95, plus 15%
  l1 = {(name, layer): s for (name, layer), s in summary.items()
        if s["life"] == 1}
  fmt = lambda name, layer, v: f"{layer} at {name[5:]} ({100 * v:.0f}%)"
  stable = sorted(fmt(n, l, s["running"]) for (n, l), s in l1.items()
                  if s["running"] <= paper_band)
  unstable = sorted(fmt(n, l, s["running"]) for (n, l), s in l1.items()
                    if s["running"] > paper_band)
  status = ("reproduces" if not unstable else
            "does not reproduce" if not stable else "reproduces partly")
  whole_drifts = [s["whole_drift"] for s in l1.values()]
  rises = [s["median"] / s["tau0"] for s in l1.values()]
  p_cold = {layer: summary[(plain, layer)] for layer in sizes}
  ratio = [summary[(guard, layer)]["median"] / summary[(every, layer)]["median"]
           for layer in sizes]
  loss_txt = "; ".join(f"{name}: {l[:20].mean():.4f} -> {l[-50:].mean():.4f}"
                       for name, l in losses.items())
  cold_txt = ", ".join(f"{layer} {s['sel_cold']:.1f}x (sent {s['sent_cold']:.2f}x)"
                       for layer, s in p_cold.items())
  verdict = f"""
**tau stability with L = 1, late window (steps {late}-{steps}; paper: at most 26%
from the running mean at eta = 0.95): {status}.** Counted as stable: at most
{100 * paper_band:.0f}% deviation from the running mean. Stable: {', '.join(stable) or 'none'}.
Not stable: {', '.join(unstable) or 'none'}. The largest FC layer, {PLOT_LAYER} at
eta = {reuse:g} (the plot), stays within {fig2['range_lo']:.2f}-{fig2['range_hi']:.2f} x its median
(5th-95th percentile) and at most {100 * fig2['running']:.0f}% from its running mean, drift
{fig2['drift']:.2f}.

**Not in the early phase.** From the end of the warm-up to the end of the run
tau drifts by {min(whole_drifts):.2f}-{max(whole_drifts):.2f}x (last over first quarter) while
the model leaves its initial plateau (loss, first 20 -> last 50 steps:
{loss_txt}); the paper's Fig 2 reads as the steady phase of a long run.

**Cold start of L = 1000 (Algorithm 1 as written: L divides k = 0).** With
error feedback, tau of the accumulator g + E ends up {min(rises):.1f}-{max(rises):.1f}x the tau
of step 0 (L = 1 copies). The step-0 tau, reused until k = {life}, selects per step
(mean over steps {p_cold[PLOT_LAYER]['warm']}-{min(life, steps)}, in units of K): {cold_txt}.
The wire carries at most 2K (capacity_factor 2), filled in flat position
order (DCTDP's capacity rule), so entries late in a layer that reach tau are
not sent while the overflow lasts, and their residual keeps growing.
"""
  if steps > life:
    warm_txt = ", ".join(
        f"{layer} {s['sel_warm']:.2f}x (tau {s['tau_at_life'] / summary[(every, layer)]['median']:.1f}x "
        f"the L=1 median)" for layer, s in p_cold.items())
    verdict += f"""At the refresh k = {life} tau is taken from that inflated
accumulator, and for steps {life}-{steps} it selects (units of K): {warm_txt}.
"""
  verdict += f"""
**A reused tau with the density guard (beyond the paper: refresh early when
the selection leaves [{BAND[0]}K, {BAND[1]}K]).** tau changes per layer in steps {late}-{steps}
(worst replica): {', '.join(f"{layer} {summary[(guard, layer)]['changes_late']}" for layer in sizes)}
of {steps - late} steps; the tau it held was {min(ratio):.2f}-{max(ratio):.2f} x the per-step median
tau of the L = 1 copy (same eta, per layer).
"""
  settings = f"""
- Model: DLRM (models/dlrm.py) with bottom MLP 13-{'-'.join(map(str, BOTTOM))}, top MLP
  367-{'-'.join(map(str, TOP))}, embedding dim 16, {VOCAB} rows per categorical
  feature (26 tables stacked in one variable). Synthetic Criteo-shaped data
  (`dlrm.make_dataset`, labels drawn from a fixed random teacher), global batch
  {args.batch_size}, SGD({args.lr}), binary cross-entropy, {steps} steps on
  {args.replicas} replicas (logical CPUs of one process, `tf_dct.Replicator`).
- Copies trained side by side in one step (same initial weights, same batches),
  each with `repl.wrap_optimizer(SGD, compression=DCTDP(eta, threshold_life=L,
  min_size={MIN_SIZE}, value_dtype=None))`: {'; '.join(configs)}. Compressed layers (N >= {MIN_SIZE}):
  {', '.join(f'{k} ({v})' for k, v in sizes.items())}; the rest are all-reduced densely.
- tau is DCTDP's per-replica `threshold` state after each step (the K-th largest
  |g + E|, K = N - floor(N eta), on refresh steps); "entries reaching tau" =
  sent + overflow on that replica. Statistics report the worst replica over the
  late window (second half of the run) and, in brackets, from the end of a
  warm-up of 3 / (1 - eta) steps (the residual needs ~1 / (1 - eta) steps per
  entry to build up): 5th-95th percentile of tau over its median, the largest
  deviation from the running mean (the paper's measure: 26% at eta = 0.95),
  drift = median of the last quarter / median of the first quarter.
"""
  return common.Result(
      title="DCT Fig 2: tau of DCT-DP over iterations (DLRM, synthetic data)",
      settings=settings, headers=headers, rows=rows, verdict=verdict, plot=plot)
