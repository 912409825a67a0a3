r"""Gradient compression benchmark: bytes, density, selection, step time.

One process, the CPU split into 4 logical devices. The model is DLRM's dense
part with DCT §3.1's shapes (embedding dim 16): a bottom MLP 13 -> 512 -> 256
-> 64 -> 16 and a top MLP 367 -> 512 -> 256 -> 128 -> 1, where 367 = 16 (the
bottom output) + 351 pairwise dot products of 27 16-dim vectors (26 sparse
features + the bottom output). The embedding tables and the interaction are
not modelled: the 351 interaction features come from the synthetic data. It is
a real tf-keras model (ReLU, sigmoid cross-entropy, SGD(0.01)) trained on
synthetic teacher-labelled data with `Replicator.run(step_fn, input_fn)` and
`repl.wrap_optimizer(opt, compression=...)`. All kernels and biases go through
the compressor (min_size = 0).

Prints:

(a) bytes ratio stock TF / compressor at n = 4 from `communication_stats()`
    totals (every replica, every step): ring (stock_bytes / bytes_sent, the
    ring all-reduce / all-gather model) and payload (stock_payload_bytes /
    payload_bytes, what a replica contributes, DCT's parameter-server view),
    then the same against the densified baseline (dense_bytes,
    dense_payload_bytes). This model has no embedding, so stock TF
    all-reduces every gradient and the two baselines agree. Values,
    indices, counts, norms and padding are all counted. The compressors on
    `sparse_wire` (DCT-DP, TopK, HardThreshold) are run twice: with exact
    sizes forced (`exact_sizes=True`, each replica's used slots: what
    crosses a network, their default across workers; these fill the
    ratio columns) and as on one machine by default (every slot of the
    fixed capacity; the last payload column). Then, for the
    compressors on `sparse_wire`, the index bits per sent entry of the last
    step under "auto" (as run), the best of int32 / chunk16 / chunk8, "ef",
    and the floor log2(N/k) + 1.44, and the value bits per sent entry
    (16 for DCT-DP's default `value_dtype="auto"`, bfloat16, and the "bf16"
    names; 32 for the "fp32" name and the other compressors' default).
(b) achieved density nnz(aggregate) / N per compressor: real replicas at
    n = 2 and 4 (the same training runs), and a numpy simulation at n = 2, 4,
    8, 16 of each algorithm with error feedback on real per-replica gradients
    of the model at its initial weights (different batches per replica and
    step, weights frozen; DEFT's partition / k / packing from
    tests/compression/reference_deft.py).
(c) selection time per replica: `tf.math.top_k` over the whole concatenated
    model gradient (k = 1%) vs DEFT's per-replica selection (`deft.owned_top_k`
    over the partitions the replica owns: outside XLA a top-k of k_x; also
    `deft.ladder_top_k`, the XLA path: top-k of the smallest static ladder
    size >= k_x), each timed in isolation on one device, a replica's
    partitions one after another, per selection inside a graph (10
    selections per call in a loop, so the ~1 ms cost of a call from Python is
    not counted once per selection; one call per selection is printed too),
    median of round-robin passes, the slowest replica reported; plus the
    in-run selection_seconds of DEFT and TopK for context.
(d) step time of DCTDP(L=1000), DCTDP(L=1) (and the others) relative to
    Dense, n = 4, no network (logical CPUs share memory): interleaved timed
    blocks, median. The compressors are timed as a one-machine user runs
    them (the sparse wire at its fixed capacity); with --step_time_only
    each one on `sparse_wire` is also timed with exact sizes forced
    ("[exact sizes]"), and both payload ratios are printed: with exact sizes
    (what crosses a network) and at the fixed capacity. DCT-DP runs its
    native kernels where they build
    (tf_dct.compression.native); `--compressors='DCTDP(L=1000,stock)'` adds the
    same compressor on stock TensorFlow ops, for an A/B in one run, and
    `--compressors='DCTDP(L=1000,warmup phase)'` DCT-DP in its dense warm-up
    phase (each phase is its own traced step). `DCTDP(L=1000,band=1.25)`
    and the `gain=` names run DCT-DP with a density band of (0.5, 1.25)
    and/or `threshold_gain`; the run prints each one's payload ratio and
    share of recomputed thresholds beside the default's.

Usage:
  python bench/compression.py            # full
  python bench/compression.py --quick    # n = 4 only, 6 steps; ~4 min on 2 idle cores
  python bench/compression.py --selection_only   # (c) alone, ~25 s
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import math  # pylint: disable=g-import-not-at-top,wrong-import-position
import time  # pylint: disable=g-import-not-at-top,wrong-import-position

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "smoke run (n = 4 only, few steps)")
flags.DEFINE_integer("steps", None, "training steps per compressor and n "
                     "(default 40, quick 6)", lower_bound=1)
flags.DEFINE_integer("sim_steps", None, "numpy simulation steps (default 12, "
                     "quick 2)", lower_bound=1)
flags.DEFINE_integer("repeats", None, "timed blocks per side (default 7, quick 2)",
                     lower_bound=1)
flags.DEFINE_integer("block", None, "steps per timed block (default 20, quick 5)",
                     lower_bound=1)
flags.DEFINE_integer("batch_size", 256, "global batch, a multiple of 4 (one "
                     "share per replica)", lower_bound=4)
flags.DEFINE_list("real_n", None, "replica counts of the real runs "
                  "(default 2,4; quick 4: each run traces a 16-variable step)")
flags.DEFINE_bool("step_time_only", False, "run part (d) alone: train each of "
                  "--compressors for --steps steps on 4 replicas, then time them")
flags.DEFINE_multi_string("compressors", None, "with --step_time_only: a "
                          "compressor to time, repeatable (Dense is always "
                          "timed, as the reference); default all")
flags.DEFINE_bool("selection_only", False, "run part (c) alone: DEFT's "
                  "per-replica selection time vs whole-model top-k")

NUM_CPUS = 4
DENSITY = 0.01
BOTTOM = [512, 256, 64, 16]
TOP = [512, 256, 128, 1]
DENSE_IN, INTER = 13, 351          # 16 + 351 = 367 top-MLP input
NAMES = ["Dense", "DCTDP(L=1000)", "DCTDP(L=1000,fp32)", "DCTDP(L=1000,cf=1)",
         "DCTDP(L=1000,min=1024)", "DCTDP(L=1)", "DEFT", "TopK", "TopK(bf16)",
         "CLTK", "HardThreshold"]
# Timed only when asked for (--step_time_only --compressors=...): DCT-DP with
# stock TensorFlow ops instead of the native kernels, for an A/B in one run;
# DCT-DP held in its dense warm-up phase (a warm-up longer than any run),
# the step time of that phase beside Dense and the compressed phase.
# DCT-DP with the density guard's band narrowed from the default (0.5, 2) to
# (0.5, 1.25), and with `threshold_gain` (either band): bytes and how often
# tau is recomputed (the printed share) against the default.
EXTRA = ["DCTDP(L=1000,stock)", "DCTDP(L=1000,warmup phase)",
         "DCTDP(L=1000,band=1.25)", "DCTDP(L=1000,gain=0.5)",
         "DCTDP(L=1000,band=1.25,gain=0.1)", "DCTDP(L=1000,band=1.25,gain=0.5)"]

flags.register_validator(
    "batch_size", lambda b: b % NUM_CPUS == 0,
    message=f"--batch_size must be a multiple of {NUM_CPUS}")
flags.register_validator(
    "compressors",
    lambda names: names is None or set(names) <= set(NAMES + EXTRA),
    message=f"--compressors: each must be one of {NAMES + EXTRA}")

if __name__ == "__main__":
  # A bad flag is refused here, before TensorFlow loads (seconds earlier);
  # app.run parses the flags again.
  app.define_help_flags()
  app.parse_flags_with_usage(sys.argv)
  FLAGS.unparse_flags()

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position
import tf_keras  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_dct  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct import compression  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.compression import dct_dp  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.compression import deft  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.compression import sparse_wire  # pylint: disable=g-import-not-at-top,wrong-import-position
from tf_dct.compression import topk  # pylint: disable=g-import-not-at-top,wrong-import-position
from bench.studies import deft_fig9_selection as fig9  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.compression import reference_deft  # pylint: disable=g-import-not-at-top,wrong-import-position


def make_compressor(name, lam):
  return {"Dense": lambda: compression.Dense(),
          "DCTDP(L=1000)": lambda: compression.DCTDP(0.99, threshold_life=1000),
          "DCTDP(L=1000,stock)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, native=False),
          "DCTDP(L=1000,warmup phase)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, warmup_steps=10**9),
          "DCTDP(L=1000,band=1.25)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, density_band=(0.5, 1.25)),
          "DCTDP(L=1000,gain=0.5)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, threshold_gain=0.5),
          "DCTDP(L=1000,band=1.25,gain=0.1)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, density_band=(0.5, 1.25),
              threshold_gain=0.1),
          "DCTDP(L=1000,band=1.25,gain=0.5)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, density_band=(0.5, 1.25),
              threshold_gain=0.5),
          # capacity_factor=1: wire slots = k exactly; what a reused tau
          # selects beyond k stays in the residual (counted as overflow).
          "DCTDP(L=1000,cf=1)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, capacity_factor=1.0),
          # min_size=1024: the biases and the 128-entry last kernel (2.4k of
          # 509k entries) are all-reduced densely and skip the per-variable
          # selection ops, whose fixed cost dominates for small variables.
          "DCTDP(L=1000,min=1024)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, min_size=1024),
          "DCTDP(L=1)": lambda: compression.DCTDP(0.99, threshold_life=1),
          # fp32: values travel as float32 (`value_dtype=None`); DCT-DP's
          # default sends them as bfloat16, two to a word, the rounding error
          # kept in the residual. TopK(bf16) is TopK with DCT-DP's default.
          "DCTDP(L=1000,fp32)": lambda: compression.DCTDP(
              0.99, threshold_life=1000, value_dtype=None),
          "TopK(bf16)": lambda: compression.TopK(DENSITY,
                                                 value_dtype="bfloat16"),
          # The paper's norm-proportional budget (Algorithm 3), as the
          # density simulation and the selection timing below.
          "DEFT": lambda: compression.DEFT(DENSITY, budget="norm"),
          "TopK": lambda: compression.TopK(DENSITY),
          "CLTK": lambda: compression.CLTK(DENSITY),
          "HardThreshold": lambda: compression.HardThreshold(lam)}[name]()


def build_model():
  tf_keras.utils.set_random_seed(0)
  dense_in = tf_keras.Input((DENSE_IN,))
  inter = tf_keras.Input((INTER,))
  h = dense_in
  for width in BOTTOM:
    h = tf_keras.layers.Dense(width, activation="relu")(h)
  h = tf_keras.layers.Concatenate()([h, inter])
  for width in TOP[:-1]:
    h = tf_keras.layers.Dense(width, activation="relu")(h)
  out = tf_keras.layers.Dense(TOP[-1])(h)
  return tf_keras.Model([dense_in, inter], out)


def make_data(samples):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(samples, DENSE_IN)).astype(np.float32)
  z = rng.normal(size=(samples, INTER)).astype(np.float32)
  logit = x @ rng.normal(size=(DENSE_IN,)) + 0.2 * z @ rng.normal(size=(INTER,))
  y = (logit > 0).astype(np.float32)[:, None]
  return x, z, y


def loss_fn(model, x, z, y, global_batch):
  logits = model([x, z], training=True)
  per = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits)
  return tf.reduce_sum(per) / global_batch


EXACT = " [exact sizes]"   # label suffix of a run with exact sizes forced


def exchanges_sparse_wire(name) -> bool:
  """Whether compressor `name` sends packed buffers (`exact_sizes` applies)."""
  return make_compressor(name, 1.0).exchanges_sparse_wire


class Run:
  """One model + wrapped optimizer + compressor on n replicas.

  `exact`: the compressor sends its used wire slots only (`exact_sizes=True`),
  as it does by default when the replicas span several workers; otherwise
  its default on this one machine, the fixed capacity.
  """

  def __init__(self, name, n, lam, data, weights, exact=False):
    self.name, self.n = name, n
    self.repl = tf_dct.Replicator([f"/cpu:{i}" for i in range(n)])
    self.compressor = make_compressor(name, lam)
    if exact:
      self.compressor.exact_sizes = True
    gb = FLAGS.batch_size
    with self.repl.scope():
      self.model = build_model()
      self.model.set_weights(weights)
      self.opt = self.repl.wrap_optimizer(tf_keras.optimizers.SGD(0.01),
                                          compression=self.compressor)
    x, z, y = data
    model, opt = self.model, self.opt

    def input_fn(ctx):
      del ctx
      return tf.data.Dataset.from_tensor_slices((x, z, y)).batch(
          gb, drop_remainder=True).repeat().prefetch(2)

    def step_fn(batch):
      xb, zb, yb = batch
      with tf.GradientTape() as tape:
        loss = loss_fn(model, xb, zb, yb, gb)
      grads = tape.gradient(loss, model.trainable_variables)
      opt.apply_gradients(zip(grads, model.trainable_variables))
      return loss

    self.input_fn, self.step_fn = input_fn, step_fn

  def steps(self, k):
    out = None
    for _ in range(k):
      out = self.repl.run(self.step_fn, self.input_fn)
    for v in self.repl.experimental_local_results(out):
      v.numpy()

  def stats(self):
    s = self.compressor.communication_stats()
    tot = s["total"]
    f = lambda key: float(sum(tot[key]))
    ratio = lambda base, sent: f(base) / f(sent) if f(sent) else float("nan")
    return {
        "stock_ring": ratio("stock_bytes", "bytes_sent"),
        "stock_payload": ratio("stock_payload_bytes", "payload_bytes"),
        "ring": ratio("dense_bytes", "bytes_sent"),
        "payload": ratio("dense_payload_bytes", "payload_bytes"),
        "density": float(np.mean(tot["density"])),
        "sel_ms": 1e3 * f("selection_seconds") / max(1, sum(s["steps"])),
        "steps": s["steps"][0],
        # entries that reached the threshold but did not fit the wire
        # capacity (kept in the residual), per replica and step
        "overflow": sum(sum(v.get("counters", {}).get("overflow", [0]))
                        for v in s["variables"].values())
                    / max(1, sum(s["steps"])),
    }


# ---------------------------------------------------------------- simulation

def sim_density(grad_stream, n, steps, lam, sizes):
  """Numpy error-feedback simulation of each algorithm; mean union density."""
  bounds = np.cumsum([0] + sizes)
  n_g = int(bounds[-1])
  algos = ["DCTDP(L=1000)", "DCTDP(L=1)", "DEFT", "TopK", "CLTK",
           "HardThreshold"]
  res = {a: [np.zeros(n_g, np.float32) for _ in range(n)] for a in algos}
  taus = {a: [[None] * len(sizes) for _ in range(n)] for a in algos}
  dens = {a: [] for a in algos}
  parts = reference_deft.partition(sizes, n)
  p_sizes = [p[2] for p in parts]
  k_total = reference_deft.total_k(n_g, DENSITY)
  ks = [max(1, math.ceil(s * DENSITY - 1e-9)) for s in sizes]   # ceil(n d)

  def top(a, k):
    if k >= a.size:
      return np.arange(a.size)
    return np.argpartition(-np.abs(a), k - 1)[:k]

  for t in range(steps):
    g = [grad_stream(t, r) for r in range(n)]
    for a in algos:
      acc = [g[r] + res[a][r] for r in range(n)]
      union = np.zeros(n_g, bool)
      if a == "DEFT":
        norms = np.zeros(len(parts), np.float32)
        for r in range(n):
          for x, (_, st, sz) in enumerate(parts):
            norms[x] += np.float32(np.linalg.norm(acc[r][st:st + sz]))
        k = reference_deft.local_k(norms, p_sizes, k_total)
        own = reference_deft.owners(reference_deft.pack(k, p_sizes, n), t, n)
        for x, (_, st, sz) in enumerate(parts):
          union[st + top(acc[own[x]][st:st + sz], k[x])] = True
      elif a == "CLTK":
        leader = t % n
        for v, kv in enumerate(ks):
          lo, hi = bounds[v], bounds[v + 1]
          union[lo + top(acc[leader][lo:hi], kv)] = True
      else:
        for r in range(n):
          for v, kv in enumerate(ks):
            lo, hi = bounds[v], bounds[v + 1]
            piece = np.abs(acc[r][lo:hi])
            if a == "TopK":
              mask = np.zeros(hi - lo, bool)
              mask[top(piece, kv)] = True
            else:
              if a == "HardThreshold":
                tau, cap = lam, math.ceil(0.05 * (hi - lo))
              else:
                life = 1000 if a == "DCTDP(L=1000)" else 1
                if t % life == 0:
                  taus[a][r][v] = (np.partition(piece, piece.size - kv)
                                   [piece.size - kv])
                tau, cap = taus[a][r][v], min(hi - lo, math.ceil(2 * kv))
              mask = piece >= tau
              mask &= (np.cumsum(mask) - mask) < cap
            union[lo:hi] |= mask
      for r in range(n):
        res[a][r] = np.where(union, 0, acc[r]).astype(np.float32)
      dens[a].append(union.mean())
  return {a: float(np.mean(d)) for a, d in dens.items()}


def gradient_stream(model, data, sizes):
  """grad(t, r): flat gradient of a per-replica batch (frozen weights)."""
  x, z, y = data
  per = FLAGS.batch_size // NUM_CPUS
  cache = {}

  @tf.function
  def grad(xb, zb, yb):
    with tf.GradientTape() as tape:
      loss = loss_fn(model, xb, zb, yb, FLAGS.batch_size)
    gs = tape.gradient(loss, model.trainable_variables)
    return tf.concat([tf.reshape(g, [-1]) for g in gs], 0)

  def fn(t, r):
    key = (t, r)
    if key not in cache:
      i = ((t * 16 + r) * per) % (len(x) - per)
      cache.clear()
      cache[key] = grad(x[i:i + per], z[i:i + per], y[i:i + per]).numpy()
    return cache[key]
  del sizes
  return fn


# ----------------------------------------------------------------- selection

def selection_times(flat, n, repeats, rounds=10):
  """Median seconds: whole-model top-k, and each DEFT replica's selection.

  Returns a dict: "whole", "impl" (per replica, as implemented), "ladder"
  (per replica, the XLA path's ladder), "empty" (a selection of 1 of 1
  entry), all per selection inside a graph (`rounds` selections per call,
  in a loop, the call's time divided by `rounds`); "whole_call" and
  "impl_call", the same timed one call per selection; "k_total" and
  "parts". Timed as in the Fig 9 study (`bench/studies/deft_fig9_selection.py`,
  whose helpers this uses): a replica's partitions one after another, every
  function round-robin.
  """
  sizes = flat["sizes"]
  g = flat["g"]
  n_g = g.size
  k_total = reference_deft.total_k(n_g, DENSITY)
  parts = reference_deft.partition(sizes, n)
  p_sizes = [p[2] for p in parts]
  norms = [np.float32(np.linalg.norm(g[s:s + z])) * n for _, s, z in parts]
  k = reference_deft.local_k(norms, p_sizes, k_total)
  bins = reference_deft.pack(k, p_sizes, n)
  with tf.device("/cpu:0"):
    gt = tf.constant(g)
  fns = {"whole": fig9.selection(gt, [(0, n_g, k_total)], rounds=rounds),
         "empty": fig9.selection(gt, [(0, 1, 1)], rounds=rounds),
         "whole_call": fig9.selection(gt, [(0, n_g, k_total)])}
  for b in range(n):
    # (start, size, k_x, bound); k_x is fed at run time, as in the compressor.
    mine = [(s, z, int(k[x]), min(z, k_total))
            for x, (_, s, z) in enumerate(parts) if bins[x] == b]
    fns[("impl", b)] = fig9.selection(gt, mine, deft.owned_top_k, rounds)
    fns[("ladder", b)] = fig9.selection(gt, mine, deft.ladder_top_k, rounds)
    fns[("impl_call", b)] = fig9.selection(gt, mine, deft.owned_top_k)
  med = fig9.time_interleaved(fns, repeats)
  out = {"whole": med["whole"] / rounds, "empty": med["empty"] / rounds,
         "whole_call": med["whole_call"], "k_total": k_total,
         "parts": len(parts), "rounds": rounds}
  out["impl"] = [med[("impl", b)] / rounds for b in range(n)]
  out["ladder"] = [med[("ladder", b)] / rounds for b in range(n)]
  out["impl_call"] = [med[("impl_call", b)] for b in range(n)]
  return out


def step_times(runs, names, repeats, block, trained):
  """(d): median step time of each run in interleaved blocks, vs Dense."""
  for run in runs.values():
    run.steps(2)
  times = {name: [] for name in names}
  for rep in range(repeats):
    order = names[rep % len(names):] + names[:rep % len(names)]
    for name in order:
      t0 = time.perf_counter()
      runs[name].steps(block)
      times[name].append((time.perf_counter() - t0) / block)
  base = np.median(times["Dense"])
  print(f"\n(d) step time, n = 4, global batch {FLAGS.batch_size}, no network, "
        f"after {trained} + 2 steps, median of {repeats} interleaved blocks of "
        f"{block} steps")
  print("| compressor | median ms/step | ratio to Dense |")
  print("|---|---|---|")
  for name in names:
    m = np.median(times[name])
    print(f"| {name} | {m * 1e3:.2f} | {m / base:.3f} |")


def wire_capacity(compressor, n):
  """Wire slots of an n-entry variable exchanged by `compressor`."""
  if isinstance(compressor, compression.DCTDP):
    return dct_dp.capacity(n, compressor.sparsity, compressor.capacity_factor,
                           compressor.min_count)
  if isinstance(compressor, compression.TopK):
    return topk.slots(n, topk.selected_count(n, compressor.density,
                                             compressor.min_count),
                      compressor.capacity_factor)
  if isinstance(compressor, compression.HardThreshold):
    return compressor.capacity(n)
  return None


def index_bits(run):
  """Index bits per sent entry on the last step, over every exchanged
  variable and replica (exact sizes: the index words that carry more than
  padding): "auto" as run, the best of int32 / chunk16 / chunk8 (auto
  without "ef"), "ef", and the floor sum c (log2(N / c) + 1.44) / sum c;
  and "value", the value bits per sent entry (bfloat16: two to a word, an
  odd count's filler included)."""
  comp = run.compressor
  stats = comp.communication_stats()["variables"]
  bits = {"auto": 0, "legacy": 0, "ef": 0, "value": 0}
  floor, entries = 0.0, 0
  for v in run.model.trainable_variables:
    n = v.shape.num_elements()
    cap = wire_capacity(comp, n)
    name = next((k for k in stats if k == v.name or k == v.name.split(":")[0]),
                None)
    if cap is None or name is None or comp.sends_whole(v):
      continue
    encs = {"auto": sparse_wire.make_encoding("auto", n, cap),
            "legacy": min((sparse_wire.make_encoding(e, n, cap)
                           for e in ("int32", "chunk16", "chunk8")),
                          key=lambda e: e.words),
            "ef": sparse_wire.make_encoding("ef", n, cap)}
    for c in stats[name]["last"]["sent"]:
      c = int(c)
      for key, enc in encs.items():
        bits[key] += 32 * sparse_wire.sent_index_words(enc, c)
      bits["value"] += 8 * sparse_wire.value_bytes(
          c, sparse_wire.wire_dtype(v.dtype, comp.value_dtype))
      if c:
        floor += c * (math.log2(n / c) + 1.44)
      entries += c
  per = lambda x: x / entries if entries else float("nan")
  return {**{k: per(b) for k, b in bits.items()}, "floor": per(floor),
          "entries": entries}


def index_bits_report(runs):
  """Index bits per entry of the compressors that use `sparse_wire`."""
  print("\nindex bits per sent entry, last step, n = 4 (exact sizes; floor "
        "log2(N/k) + 1.44 per variable, weighted by entries)")
  print("| compressor | entries / replica | auto (as run) | int32/chunk16/chunk8 "
        "(auto without ef) | ef | floor | value bits |")
  print("|---|---|---|---|---|---|---|")
  for name, run in runs.items():
    if wire_capacity(run.compressor, 1000) is None:
      continue
    b = index_bits(run)
    print(f"| {name} | {b['entries'] / run.n:.0f} | {b['auto']:.2f} | "
          f"{b['legacy']:.2f} | {b['ef']:.2f} | {b['floor']:.2f} | "
          f"{b['value']:.2f} |")


def selection_report(g0, sizes, sel_rep):
  """(c): prints DEFT's per-replica selection time vs whole-model top-k."""
  sel = selection_times({"g": g0, "sizes": sizes}, 4, sel_rep)
  t_whole, t_rep, t_ladder = sel["whole"], sel["impl"], sel["ladder"]
  slow, slow_ladder = max(t_rep), max(t_ladder)
  print(f"\n(c) selection, n = 4, n_g = {g0.size}, k_total = {sel['k_total']}, "
        f"{sel['parts']} DEFT partitions; isolated on /cpu:0, a replica's "
        f"partitions in turn, per selection inside a graph ({sel['rounds']} "
        f"per call, in a loop), median of {sel_rep} round-robin passes")
  print(f"whole-model tf.math.top_k: {t_whole * 1e3:.2f} ms")
  print("DEFT per replica (top-k of k_x, as run outside XLA): "
        + ", ".join(f"{t * 1e3:.2f}" for t in t_rep)
        + f" ms; slowest {slow * 1e3:.2f} ms -> speed-up {t_whole / slow:.2f}x "
        f"(goal >= 4x)")
  print("DEFT per replica with the XLA path's top-k size ladder: "
        + ", ".join(f"{t * 1e3:.2f}" for t in t_ladder)
        + f" ms; slowest {slow_ladder * 1e3:.2f} ms -> speed-up "
        f"{t_whole / slow_ladder:.2f}x")
  print(f"a selection of 1 of 1 entry takes {sel['empty'] * 1e3:.3f} ms")
  print(f"one call per selection (a fixed ~1 ms per call from Python on both "
        f"sides): whole {sel['whole_call'] * 1e3:.2f} ms, DEFT slowest "
        f"{max(sel['impl_call']) * 1e3:.2f} ms -> "
        f"{sel['whole_call'] / max(sel['impl_call']):.2f}x")


# ---------------------------------------------------------------------- main

def main(argv):
  del argv
  quick = FLAGS.quick
  steps = FLAGS.steps or (6 if quick else 40)
  sim_steps = FLAGS.sim_steps or (2 if quick else 12)
  repeats = FLAGS.repeats or (2 if quick else 7)
  block = FLAGS.block or (5 if quick else 20)
  start = time.time()
  tf_dct.split_cpu(NUM_CPUS)
  print(f"TensorFlow {tf.__version__}, {os.cpu_count()} cores, "
        f"{NUM_CPUS} logical CPUs; quick={quick} steps={steps} "
        f"sim_steps={sim_steps} repeats={repeats}x{block}")

  data = make_data(FLAGS.batch_size * 16)
  model = build_model()
  weights = model.get_weights()
  sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
  n_g = sum(sizes)
  print(f"variables {len(sizes)}, n_g = {n_g}, kernels "
        f"{[tuple(v.shape) for v in model.trainable_variables if v.shape.rank == 2]}")
  stream = gradient_stream(model, data, sizes)
  g0 = stream(0, 0)
  # lambda for HardThreshold: the 99th percentile of |g| of one replica's
  # first gradient (whole model), i.e. ~1% on step 0 before any build-up.
  lam = float(np.quantile(np.abs(g0), 1 - DENSITY))
  print(f"HardThreshold lambda = {lam:.3e} (99th percentile of |g| at init)")

  if FLAGS.selection_only:
    selection_report(g0, sizes, FLAGS.repeats or (15 if quick else 31))
    print(f"\ntotal runtime {time.time() - start:.0f}s")
    return

  if FLAGS.step_time_only:
    names = ["Dense"] + [c for c in FLAGS.compressors or NAMES if c != "Dense"]
    # Each compressor as a one-machine user runs it (the fixed capacity) and,
    # where it applies, with exact sizes forced: the bytes that would cross
    # a network, and the step time they cost here.
    labels = [label for name in names for label in
              [name] + ([name + EXACT] if exchanges_sparse_wire(name) else [])]
    runs = {}
    for label in labels:
      name = label.removesuffix(EXACT)
      runs[label] = Run(name, 4, lam, data, weights, exact=label != name)
      runs[label].steps(steps)
      print(f"[{time.time() - start:.0f}s] {label}: {steps} steps", flush=True)
    step_times(runs, labels, repeats, block, steps)
    for name in names:  # how often DCT-DP recomputed tau, the costly part
      counters = [v.get("counters", {}) for v in
                  runs[name].compressor.communication_stats()["variables"].values()]
      done = sum(sum(c["refreshes"]) for c in counters if "refreshes" in c)
      early = sum(sum(c.get("early_refreshes", [0])) for c in counters)
      slots = (runs[name].n * runs[name].stats()["steps"]
               * sum(1 for c in counters if "refreshes" in c))
      if done:
        print(f"{name}: tau recomputed on {done} of {slots} variable-replica-steps "
              f"({done / slots:.1%}; density guard: {early})")
    for name in names:
      s = runs[name].stats()
      if name + EXACT in runs:
        e = runs[name + EXACT].stats()
        print(f"{name}: bytes ratio stock TF / compressor with exact sizes "
              f"(what crosses a network) {e['stock_payload']:.2f}x payload, "
              f"{e['stock_ring']:.2f}x ring; at the fixed capacity (one "
              f"machine's default) {s['stock_payload']:.2f}x payload, "
              f"{s['stock_ring']:.2f}x ring; density {s['density']:.4f}")
        continue
      print(f"{name}: bytes ratio stock TF / compressor {s['stock_payload']:.2f}x "
            f"payload, {s['stock_ring']:.2f}x ring (densified: {s['payload']:.2f}x, "
            f"{s['ring']:.2f}x); density {s['density']:.4f}")
    print(f"\ntotal runtime {time.time() - start:.0f}s")
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access

  # (a), (b) real replicas, (d) timing.
  runs = {}
  real = {}
  real_n = [int(v) for v in (FLAGS.real_n or (["4"] if quick else ["2", "4"]))]
  exact = {}  # name -> stats at n = 4 with exact sizes forced
  for n in sorted(set(real_n) | {4}):
    for name in NAMES:
      run = Run(name, n, lam, data, weights)
      run.steps(steps)
      real[(name, n)] = run.stats()
      print(f"[{time.time() - start:.0f}s] {name} n={n}: {real[(name, n)]}",
            flush=True)
      if n == 4:
        runs[name] = run
        if exchanges_sparse_wire(name):
          twin = Run(name, n, lam, data, weights, exact=True)
          twin.steps(steps)
          exact[name] = twin.stats()
          print(f"[{time.time() - start:.0f}s] {name}{EXACT} n={n}: "
                f"{exact[name]}", flush=True)
  print(f"[{time.time() - start:.0f}s] training runs done")

  print("\n(a) bytes ratio stock TF / compressor, n = 4, "
        f"totals over {steps} steps, all metadata counted; the sparse wire "
        "with exact sizes (what crosses a network: the default across "
        "workers), and at the fixed capacity (the default on one machine)")
  print("| compressor | ring vs stock TF (stock_bytes / bytes_sent) | payload vs "
        "stock TF (stock_payload_bytes / payload_bytes) | ring vs densified | "
        "payload vs densified | payload vs densified, fixed capacity | "
        "density | overflow / replica-step |")
  print("|---|---|---|---|---|---|---|---|")
  for name in NAMES:
    fixed = real[(name, 4)]
    s = exact.get(name, fixed)
    print(f"| {name} | {s['stock_ring']:.2f}x | {s['stock_payload']:.2f}x | "
          f"{s['ring']:.2f}x | {s['payload']:.2f}x | "
          f"{fixed['payload']:.2f}x | "
          f"{s['density']:.4f} | {s['overflow']:.1f} |")

  index_bits_report(runs)

  print(f"\n[{time.time() - start:.0f}s] (b) simulation ...")
  sim = {n: sim_density(stream, n, sim_steps, lam, sizes) for n in (2, 4, 8, 16)}
  print(f"\n(b) achieved density nnz(aggregate) / N (set density 0.01); real = "
        f"tf_dct replicas over {steps} training steps, sim = numpy over "
        f"{sim_steps} steps on frozen-weight gradients")
  print("| compressor | real n=2 | real n=4 | sim n=2 | sim n=4 | sim n=8 | "
        "sim n=16 |")
  print("|---|---|---|---|---|---|---|")
  for name in NAMES:
    row = [f"{real[(name, n)]['density']:.4f}" if (name, n) in real else "-"
           for n in (2, 4)]
    row += ["1 (dense)" if name == "Dense" else
            f"{sim[n][name]:.4f}" if name in sim[n] else "-"
            for n in (2, 4, 8, 16)]
    print(f"| {name} | " + " | ".join(row) + " |")

  print(f"\n[{time.time() - start:.0f}s] (c) selection ...")
  selection_report(g0, sizes, 15 if quick else 31)
  print(f"in-run selection_seconds per replica-step (4 replicas sharing 2 cores): "
        f"DEFT {real[('DEFT', 4)]['sel_ms']:.2f} ms, "
        f"TopK (per-layer) {real[('TopK', 4)]['sel_ms']:.2f} ms, "
        f"DCTDP(L=1000) {real[('DCTDP(L=1000)', 4)]['sel_ms']:.2f} ms, "
        f"DCTDP(L=1) {real[('DCTDP(L=1)', 4)]['sel_ms']:.2f} ms")

  print(f"\n[{time.time() - start:.0f}s] (d) step time ...")
  step_times(runs, NAMES, repeats, block, steps)
  print(f"\ntotal runtime {time.time() - start:.0f}s")
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main)
