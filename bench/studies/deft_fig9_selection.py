"""DEFT Fig 9: speed-up of DEFT's gradient selection over whole-model top-k.

DEFT (ICPP'23) §4.4 eqs. 4-9 and §5.4 Fig 9: each of n workers runs top-k only
on the partitions it owns (Algorithm 5), so the slowest worker's selection is
at least n times faster than one top-k over the whole gradient (f(n) >=
f_trivial(n) >= n under the cost model c_x = n_g,x log k_x); on LSTM /
WikiText-2 the measured speed-up grows faster than n.

Measured here on one real gradient of the LSTM language model of
models/lstm_lm.py (DEFT's Fig 9 model, synthetic Markov text), with DEFT's own
partition, norm-based k_x and packing (tf_dct.compression.deft). Every top-k
runs in isolation on /cpu:0, one after another (control dependencies, so the
measured time is the sum over a worker's partitions, as on a worker whose
partitions are selected in turn), median of repeated calls.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from bench.studies import common

DESCRIPTION = ("DEFT Fig 9: selection speed-up of DEFT (slowest worker) over "
               "whole-model top-k vs n")

QUICK_CONFIG = {"embedding_dim": 256, "hidden_dim": 256, "num_layers": 2,
                "dropout": 0.0}


def _rounds(text: str) -> int:
  """argparse type of --rounds: an int >= 1."""
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
  return value


def define(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--n", default="2,4,8,16", help="worker counts")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed round-robin passes (default 9, quick 5)")
  parser.add_argument("--rounds", type=_rounds, default=10,
                      help="selections per timed call, run in a loop inside "
                      "the graph (1: one call per selection)")


def lstm_gradient(quick: bool):
  """Flat gradient of the LSTM LM on one synthetic batch, and variable sizes."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from models import lstm_lm  # pylint: disable=g-import-not-at-top

  config = QUICK_CONFIG if quick else {**lstm_lm.DEFAULT_CONFIG, "dropout": 0.0}
  model = lstm_lm.build_model(seed=0, **config)
  inputs, targets = next(iter(lstm_lm.make_dataset(32, seed=0)))
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(lstm_lm.loss(targets, model(inputs, training=True)))
  grads = tape.gradient(loss, model.trainable_variables)
  flat = [tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads]
  names = [v.name.split(":")[0] for v in model.trainable_variables]
  return (tf.concat(flat, 0).numpy(), [int(f.shape[0]) for f in flat], names,
          config)


def plan(g: np.ndarray, sizes: list[int], n: int, density: float):
  """DEFT's partition, k_x and bins for n workers (tf_dct's own functions)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dct.compression import deft  # pylint: disable=g-import-not-at-top

  parts = deft.partition(sizes, n)
  p_sizes = [p.size for p in parts]
  k_total = deft.total_k(sum(sizes), density)
  # Every worker would hold a similar gradient; the sum over workers of the
  # norms (what DEFT all-reduces) only scales them, and k_x uses ratios.
  norms = tf.constant([np.linalg.norm(g[p.start:p.start + p.size]) * n
                       for p in parts], tf.float32)
  k = deft.local_k(norms, p_sizes, k_total)
  bins = deft.pack(k, p_sizes, n).numpy()
  cost = deft.selection_cost(k, p_sizes).numpy()
  return parts, k.numpy(), bins, cost, k_total


def selection(gt, pieces, select=None, rounds=1):
  """A warmed-up function running top-k over `pieces` [(start, size, k)] in turn.

  With `select` (`deft.owned_top_k` or `deft.ladder_top_k`), each piece goes
  through that DEFT selection with the static bound K_x = min(size, k_total)
  given as a fourth element, and k is fed at run time (as in the compressor,
  where k_x is a tensor), so nothing is folded away at trace time.

  With `rounds` > 1 one call runs the whole selection `rounds` times in a
  `tf.while_loop`, one round after another, and returns the sum of every
  round's result: divide a call's time by `rounds` for the time of a
  selection inside a graph, where a training step runs it, without the fixed
  cost of a call from Python. The vector is a loop variable, so no round can
  be hoisted out of the loop.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
    raise ValueError(f"selection: rounds must be an int >= 1, got {rounds!r}")

  def one_round(x, ks):
    done = []
    for i, piece in enumerate(pieces):
      start, size, k = piece[:3]
      with tf.control_dependencies(done[-1:]):
        magnitude = tf.abs(x[start:start + size])
        if select is not None:
          idx = select(magnitude, ks[i], piece[3], tf.constant(True))
        else:
          idx = tf.math.top_k(magnitude, k, sorted=True).indices
      done.append(tf.reduce_sum(idx))
    return tf.add_n(done)

  @tf.function
  def run_all(ks):
    if rounds == 1:
      return one_round(gt, ks)
    _, total, _ = tf.while_loop(
        lambda r, total, x: r < rounds,
        lambda r, total, x: (r + 1, total + one_round(x, ks), tf.identity(x)),
        (tf.constant(0), tf.constant(0), gt), parallel_iterations=1)
    return total

  with tf.device("/cpu:0"):
    ks = tf.constant([p[2] for p in pieces], tf.int32)
    run_all(ks).numpy()  # trace and warm up
  return lambda: run_all(ks)


def time_interleaved(fns: dict, repeats: int) -> dict:
  """Median seconds of each function, timed round-robin.

  The machine is shared and its speed drifts; timing every function once per
  round keeps the drift out of the ratios between them.
  """
  times = {key: [] for key in fns}
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.device("/cpu:0"):
    for _ in range(repeats):
      for key, fn in fns.items():
        t0 = time.perf_counter()
        fn().numpy()
        times[key].append(time.perf_counter() - t0)
  return {key: float(np.median(t)) for key, t in times.items()}


def run(args: argparse.Namespace) -> common.Result:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tf_dct.compression import deft  # pylint: disable=g-import-not-at-top

  repeats = args.repeats or (5 if args.quick else 9)
  ns = [int(v) for v in args.n.split(",")]
  g, sizes, names, config = lstm_gradient(args.quick)
  n_g = g.size
  with tf.device("/cpu:0"):
    gt = tf.constant(g)
  k_total = None
  results = {}
  for n in ns:
    parts, k, bins, cost, k_total = plan(g, sizes, n, args.density)
    rounds = args.rounds
    fns = {"whole": selection(gt, [(0, n_g, k_total)], rounds=rounds),
           "overhead": selection(gt, [(0, 1, 1)], rounds=rounds),
           # one call per selection, each timed on its own
           "whole_call": selection(gt, [(0, n_g, k_total)])}
    for b in range(n):
      mine = [x for x in range(len(parts)) if bins[x] == b]
      runtime_k = [(parts[x].start, parts[x].size, int(k[x]),
                    min(parts[x].size, k_total)) for x in mine]
      fns[("impl", b)] = selection(gt, runtime_k, deft.owned_top_k, rounds)
      fns[("impl_call", b)] = selection(gt, runtime_k, deft.owned_top_k)
      fns[("ladder", b)] = selection(gt, runtime_k, deft.ladder_top_k, rounds)
      fns[("bound", b)] = selection(
          gt, [(parts[x].start, parts[x].size, min(parts[x].size, k_total))
               for x in mine], rounds=rounds)
      fns[("exact", b)] = selection(
          gt, [(parts[x].start, parts[x].size, int(k[x])) for x in mine],
          rounds=rounds)
    t = time_interleaved(fns, repeats)
    t = {key: v if key == "whole_call" or key[0] == "impl_call" else v / rounds
         for key, v in t.items()}
    loads = np.zeros(n)
    for x, b in enumerate(bins):
      loads[b] += cost[x]
    log2k = math.log2(k_total)
    results[n] = dict(
        parts=len(parts), k_max=int(k.max()), k_sum=int(k.sum()),
        whole=t["whole"], overhead=t["overhead"],
        as_impl=max(t[("impl", b)] for b in range(n)),
        whole_call=t["whole_call"],
        impl_call=max(t[("impl_call", b)] for b in range(n)),
        ladder=max(t[("ladder", b)] for b in range(n)),
        bound=max(t[("bound", b)] for b in range(n)),
        exact=max(t[("exact", b)] for b in range(n)),
        per_bin=max(sum(1 for b in bins if b == i) for i in range(n)),
        f_model=n_g * log2k / (loads.max() / (1 << 23)),
        f_trivial=n * log2k / math.log2(max(2.0, k_total / n)))
  results["overhead"] = float(np.median([results[n]["overhead"] for n in ns]))

  # Calibration: the same slice (1/8 of the vector) with a small and a large k.
  eighth = n_g // 8
  calib = time_interleaved({kk: selection(gt, [(0, eighth, kk)],
                                          rounds=args.rounds)
                            for kk in (max(1, k_total // 8), k_total)}, repeats)
  calib = {kk: v / args.rounds for kk, v in calib.items()}

  whole = float(np.median([results[n]["whole"] for n in ns]))
  rows = []
  for n in ns:
    r = results[n]
    rows.append([n, r["parts"], r["per_bin"], k_total, r["k_max"],
                 f"{r['whole'] * 1e3:.1f}", f"{r['as_impl'] * 1e3:.1f}",
                 f"{r['whole'] / r['as_impl']:.2f}x", f"{r['ladder'] * 1e3:.1f}",
                 f"{r['whole'] / r['ladder']:.2f}x", f"{r['bound'] * 1e3:.1f}",
                 f"{r['whole'] / r['bound']:.2f}x", f"{r['exact'] * 1e3:.1f}",
                 f"{r['whole'] / r['exact']:.2f}x", f"{r['f_model']:.1f}x",
                 f"{r['f_trivial']:.1f}x", f"{r['whole_call'] * 1e3:.1f}",
                 f"{r['impl_call'] * 1e3:.1f}",
                 f"{r['whole_call'] / r['impl_call']:.2f}x"])
  headers = ["n", "partitions P", "max partitions per worker", "k_total",
             "max k_x", "whole-model top-k (ms)",
             "DEFT as implemented (top-k of k_x): slowest worker (ms)",
             "speed-up", "XLA path (top-k size ladder): slowest worker (ms)",
             "speed-up", "one top-k of K_x per partition: slowest worker (ms)",
             "speed-up",
             "DEFT with exact k_x: slowest worker (ms)", "speed-up",
             "cost model f(n) (eq. 6)", "f_trivial(n) (eq. 8)",
             "one call per selection: whole (ms)",
             "one call per selection: DEFT slowest worker (ms)", "speed-up"]

  def plot(fig):
    ax = fig.subplots()
    ax.plot(ns, [results[n]["whole"] / results[n]["as_impl"] for n in ns], "C0-o",
            label="measured, DEFT as implemented (top-k of k_x)")
    ax.plot(ns, [results[n]["whole"] / results[n]["ladder"] for n in ns], "C4-v",
            label="measured, XLA path (top-k size ladder)")
    ax.plot(ns, [results[n]["whole"] / results[n]["bound"] for n in ns], "C3-^",
            label="measured, one top-k of K_x = min(size, k_total)")
    ax.plot(ns, [results[n]["whole"] / results[n]["exact"] for n in ns], "C1-s",
            label="measured, exact k_x (Algorithm 5)")
    ax.plot(ns, [results[n]["f_model"] for n in ns], "C2--",
            label="cost model f(n), eq. 6")
    ax.plot(ns, ns, "k:", label="linear (n)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("workers n")
    ax.set_ylabel("selection speed-up over whole-model top-k")
    ax.set_title("DEFT selection speed-up (cf. DEFT Fig 9)")
    ax.legend()

  impl = {n: results[n]["whole"] / results[n]["as_impl"] for n in ns}
  ladder = {n: results[n]["whole"] / results[n]["ladder"] for n in ns}
  bound = {n: results[n]["whole"] / results[n]["bound"] for n in ns}
  exact = {n: results[n]["whole"] / results[n]["exact"] for n in ns}
  per_call = {n: results[n]["whole_call"] / results[n]["impl_call"] for n in ns}

  def grade(speedups):
    if all(v >= 0.9 * n for n, v in speedups.items()):
      return "reproduces"
    if all(v > 1 for v in speedups.values()):
      return "reproduces partly (faster than whole-model top-k, but below n)"
    return "does not reproduce"

  fmt = lambda d: ", ".join(f"n={n}: {v:.2f}x" for n, v in d.items())
  per_n = ", ".join(f"{exact[n] / n:.2f}" for n in ns)
  grows = all(exact[a] / a < exact[b] / b for a, b in zip(ns, ns[1:]))
  model = {n: results[n]["f_model"] for n in ns}
  near_model = all(exact[n] >= 0.8 * model[n] for n in ns)
  slower = [n for n in ns if bound[n] < 1]
  small, big = max(1, k_total // 8), k_total
  call_ms = 1e3 * float(np.median([results[n]["whole_call"] - results[n]["whole"]
                                   for n in ns]))
  verdict = f"""
**As implemented (tf_dct DEFT outside XLA: each owned partition runs one
top-k of its k_x, fed at run time): {grade(impl)}.** Speed-up of the slowest
worker over one whole-model top-k: {fmt(impl)} (paper: at least n, and
growing faster than n). These are times per selection inside a graph, as a
training step runs it ({args.rounds} selections per call, in a loop). Timing
one call from Python per selection (the last three columns) adds the fixed
cost of a call ({call_ms:.2f} ms here, the median over n of the whole-model
top-k's time per call minus its time per selection in a loop) to both sides
and gives
{fmt(per_call)}.

**XLA path (static shapes: one top-k of the smallest size of a ladder 64,
128, ... , K_x that holds k_x, so at most 2 k_x): {grade(ladder)}.**
{fmt(ladder)}.

**One top-k of the static bound K_x = min(size_x, k_total) per partition (the
simplest static-shape alternative to the ladder): {grade(bound)}.** {fmt(bound)}.

**With the exact k_x of Algorithm 5: {grade(exact)}.** {fmt(exact)}; speed-up / n
= {per_n} ({'growing' if grows else 'not growing'} with n; the paper's Fig 9 has it growing).
The paper's cost model (eqs. 3-6) gives f(n) = {', '.join(f'{model[n]:.1f}x' for n in ns)} for
these partitions; the exact-k_x timings are {'close to or above it' if near_model else 'below it'}.

Why the size of the top-k matters: k_x is at most
{max(results[n]['k_max'] for n in ns)} here, against k_total = {k_total}, and the
k-dependent part of `tf.math.top_k` is large on this machine: the same {eighth}
entries take {calib[big] * 1e3:.1f} ms with k = k_total and
{calib[small] * 1e3:.1f} ms with k = k_total / 8 (table below). With the single
static bound every owned partition pays for k_total kept-and-sorted entries
(a partition smaller than k_total is sorted whole), and a worker owning
several partitions (up to {max(results[n]['per_bin'] for n in ns)} here) pays
that several times{
    ': at n = ' + ', '.join(map(str, slower)) + ' it is slower than one whole-model top-k'
    if slower else ''}. The XLA path's ladder pays for at most 2 k_x plus a switch between
branches. A selection of 1 entry of 1 costs {results['overhead'] * 1e3:.3f} ms
per round here: the fixed cost of each partition's ops, which, multiplied by
the partitions of a worker, matters for small models (see a `--quick` run,
whose LSTM is 6x smaller).
"""
  settings = f"""
- Gradient: one real gradient of the LSTM language model (models/lstm_lm.py,
  {config}) on a batch of 32 x 35 tokens of its synthetic Markov text, at the
  initial weights; n_g = {n_g} entries in {len(sizes)} variables
  ({', '.join(f'{a} {b}' for a, b in zip(names, sizes))}).
- Density {args.density}: k_total = floor(n_g d) = {k_total}. DEFT's plan per n is
  tf_dct's own: `deft.partition` (variables larger than n_g / n cut into n
  pieces), `deft.local_k` (norm-proportional k_x), `deft.pack` (greedy bins
  by c_x = size_x log2 k_x).
- Timing: `tf.math.top_k(|g[piece]|, k, sorted=True)` in a `tf.function` on
  /cpu:0, a worker's partitions one after another (control dependencies);
  "whole" is one top-k of k_total over all n_g entries (Top-k's and CLT-k's
  selection; the paper's n = 1). For every n, the whole-model function and
  every worker's functions are timed round-robin, {repeats} passes after a
  warm-up call, median per function (so drift of the shared machine hits all
  of them alike). Each call runs its selection {args.rounds} times in a
  `tf.while_loop` (the vector is a loop variable, so nothing is hoisted out)
  and its time is divided by {args.rounds}: the time of a selection inside a
  graph, without the fixed cost of calling a `tf.function` from Python
  ({call_ms:.2f} ms here), which a training step pays once, not per selection.
  The last three columns time one call per selection instead (the whole
  model and DEFT as implemented).
  The slowest worker (bin) is reported. An empty selection (1 of 1 entry)
  costs {results['overhead'] * 1e3:.3f} ms per round (not subtracted).
- "as implemented" runs `deft.owned_top_k` on each partition, as
  tf_dct/compression/deft.py does outside XLA (a top-k of k_x, fed at run
  time); "XLA path" runs `deft.ladder_top_k` (top-k of the smallest ladder
  size >= k_x, what `owned_top_k` does under XLA), here without XLA; "one
  top-k of K_x" asks each partition for K_x = min(size_x, k_total); "exact
  k_x" asks for k_x with k_x fixed at trace time (Algorithm 5).
  Both run on one device of a shared 2-core machine, so absolute times are
  noisy; the ratios are what matters.
"""
  extra = "### Top-k cost on this machine\n\n" + common.table(
      ["slice", "k", "median ms"],
      [[f"first n_g / 8 = {eighth} entries", kk, f"{t * 1e3:.1f}"]
       for kk, t in calib.items()] +
      [[f"whole vector, {n_g} entries (median over n)", k_total,
        f"{whole * 1e3:.1f}"]])
  extra += ("\n\nThe same entries cost "
            f"{calib[k_total] / calib[max(1, k_total // 8)]:.1f}x more with "
            f"k = k_total than with k = k_total / 8: the k-dependent part of "
            "the kernel (keeping and sorting the k best) is not negligible "
            "next to the linear scan, which is what a single static bound "
            "K_x = min(size_x, k_total) would pay on every partition.")
  return common.Result(
      title="DEFT Fig 9: selection speed-up vs workers (LSTM LM gradient)",
      settings=settings, headers=headers, rows=rows, verdict=verdict, plot=plot,
      extra=extra)
