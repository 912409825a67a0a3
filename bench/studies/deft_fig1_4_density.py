"""DEFT Fig 1 / Fig 4: achieved density vs number of workers.

DEFT (ICPP'23) §1 Fig 1 and §5.2 Fig 4: with Top-k sparsification every worker
picks its own k entries, so the aggregate's support is their union and the
achieved density grows with the number of workers n ("gradient build-up": at
n = 16 the paper measures 13.6x, 14.2x and 5.3x the set density 0.01 on
ResNet-18, LSTM and NCF), while DEFT and CLT-k keep it at the set value.

Measured here with the tf_dct compressors on a small MLP trained on synthetic
teacher data: real replicas (logical CPUs of one process, the copies of the
model trained side by side on the same batches) for the smaller n, and the
numpy error-feedback simulation of bench/compression.py (`sim_density`, real
per-worker gradients of the model at frozen weights) for every n up to 16.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.studies import common

DESCRIPTION = ("DEFT Fig 1/4: achieved density vs workers, TopK build-up vs "
               "DEFT and CLT-k (real replicas + numpy simulation)")

DENSITY = 0.01                 # bench/compression.py's simulation uses 0.01
IN, WIDTHS = 32, (256, 256, 64)
MIN_SIZE = 1000                # biases and the 64 x 1 output go dense
LOCAL_BATCH = 32               # DEFT Table 2: B_l = 2^5 (CV and LM)
LR = 0.05
NAMES = ("TopK", "DEFT", "CLTK")


def define(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--real_n", default=None,
                      help="replica counts of the real runs (default 2,4; "
                           "quick 2; each n traces one replicated step, "
                           "minutes on 2 shared cores)")
  parser.add_argument("--sim_n", default="2,4,8,16",
                      help="worker counts of the numpy simulation")
  parser.add_argument("--steps", type=int, default=None,
                      help="real training steps per n (default 200, quick 30)")
  parser.add_argument("--sim_steps", type=int, default=None,
                      help="simulated steps per n (default 40, quick 10)")


# ------------------------------------------------------------ model and data

def make_data(samples: int, seed: int = 0):
  """Binary labels of a fixed random 2-layer ReLU teacher, 5% flipped."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(samples, IN)).astype(np.float32)
  w1 = rng.normal(size=(IN, 64)) / np.sqrt(IN)
  w2 = rng.normal(size=(64, 1)) / np.sqrt(64)
  logit = np.maximum(x @ w1, 0) @ w2
  y = (logit > np.median(logit)).astype(np.float32)
  flip = rng.random(samples) < 0.05
  y[flip] = 1 - y[flip]
  return x, y


def build_model(seed: int = 0):
  import tf_keras  # pylint: disable=g-import-not-at-top
  tf_keras.utils.set_random_seed(seed)
  layers = [tf_keras.Input((IN,))]
  layers += [tf_keras.layers.Dense(w, activation="relu") for w in WIDTHS]
  layers.append(tf_keras.layers.Dense(1))
  return tf_keras.Sequential(layers)


def make_compressor(name: str, density: float = DENSITY):
  from tf_dct import compression  # pylint: disable=g-import-not-at-top
  if name.startswith("DEFT"):  # the paper's budget, split by norms
    return compression.DEFT(density, min_size=MIN_SIZE, budget="norm")
  if name == "TopK":
    return compression.TopK(density, min_size=MIN_SIZE)
  if name == "CLTK":
    return compression.CLTK(density, min_size=MIN_SIZE)
  if name.startswith("DCTDP"):
    # float32 values, as TopK's
    return compression.DCTDP(1 - density, threshold_life=1, min_size=MIN_SIZE,
                             value_dtype=None)
  raise ValueError(name)


def train_real(n: int, compressors: dict, steps: int, data,
               residuals: bool = False) -> dict:
  """Trains one model copy per compressor on n replicas, side by side.

  The copies share initial weights and batches (global batch LOCAL_BATCH * n)
  and run in one replicated step. Per step and copy it records the density
  nnz(aggregate) / N over the compressed variables, the loss and, if
  `residuals`, the error norm ||e_t|| = mean over replicas of the L2 norm of
  the replica's whole residual (DEFT eq. 2).

  Returns:
    {name: {"density": [steps], "loss": [steps], "error": [steps] or None,
    "n_g": compressed entries}}.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top

  devices = common.logical_cpus(n)
  repl = tf_dct.Replicator(devices[:n])
  models, opts = {}, {}
  with repl.scope():
    for name, comp in compressors.items():
      models[name] = build_model()
      opts[name] = repl.wrap_optimizer(tf_keras.optimizers.SGD(LR),
                                       compression=comp)
  x, y = data
  gb = LOCAL_BATCH * n

  def input_fn(ctx):
    del ctx
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        len(x), seed=0).repeat().batch(gb, drop_remainder=True)

  def step_fn(batch):
    xb, yb = batch
    out = {}
    for name, model in models.items():
      with tf.GradientTape() as tape:
        logits = model(xb, training=True)
        loss = tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=yb, logits=logits)) / gb
      variables = model.trainable_variables
      opts[name].apply_gradients(zip(tape.gradient(loss, variables), variables))
      out[name] = loss
    return out

  compressed = {name: [v for v in m.trainable_variables
                       if v.shape.num_elements() >= MIN_SIZE]
                for name, m in models.items()}
  log = {name: {"density": [], "loss": [], "error": [] if residuals else None,
                "n_g": sum(v.shape.num_elements() for v in compressed[name])}
         for name in compressors}
  start = time.time()
  for step in range(steps):
    out = repl.run(step_fn, input_fn)
    if step in (0, steps - 1):
      print(f"[deft real n={n}] step {step} done after "
            f"{time.time() - start:.0f}s", flush=True)
    for name, comp in compressors.items():
      entry = log[name]
      entry["loss"].append(float(sum(
          v.numpy() for v in repl.experimental_local_results(out[name]))))
      stats = comp.communication_stats()["variables"].values()
      nnz = sum(v["last"]["nnz"][0] for v in stats
                if v["size"] and v["size"] >= MIN_SIZE)
      entry["density"].append(nnz / entry["n_g"])
      if residuals:
        per_replica = [0.0] * n
        for var in compressed[name]:
          for r, e in enumerate(comp.state_for(var)["residual"].numpy()):
            per_replica[r] += float(np.sum(np.square(e, dtype=np.float64)))
        entry["error"].append(float(np.mean(np.sqrt(per_replica))))
  return {name: {k: (np.array(v) if isinstance(v, list) else v)
                 for k, v in entry.items()} for name, entry in log.items()}


# ---------------------------------------------------------------- simulation

def simulate(ns, steps: int, data) -> tuple[dict, list[int]]:
  """bench/compression.py's `sim_density` on this model's gradients.

  Returns ({n: {algorithm: mean density}}, compressed variable sizes).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # Imported here, not at module level: bench/compression.py defines absl
  # flags at import, which `reproduce.py list` does not need.
  from bench import compression as bench_compression  # pylint: disable=g-import-not-at-top

  if bench_compression.DENSITY != DENSITY:
    raise RuntimeError("bench/compression.py simulates another density")
  model = build_model()
  variables = [v for v in model.trainable_variables
               if v.shape.num_elements() >= MIN_SIZE]
  sizes = [v.shape.num_elements() for v in variables]
  x, y = data

  @tf.function
  def grad(xb, yb):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
          labels=yb, logits=model(xb)))
    return tf.concat([tf.reshape(g, [-1])
                      for g in tape.gradient(loss, variables)], 0)

  def stream(t, r):
    # A distinct batch of LOCAL_BATCH rows per (step, worker), weights frozen.
    i = ((t * 16 + r) * LOCAL_BATCH) % (len(x) - LOCAL_BATCH)
    return grad(x[i:i + LOCAL_BATCH], y[i:i + LOCAL_BATCH]).numpy()

  lam = float(np.quantile(np.abs(stream(0, 0)), 1 - DENSITY))
  start, out = time.time(), {}
  for n in ns:
    out[n] = bench_compression.sim_density(stream, n, steps, lam, sizes)
    print(f"[deft sim] n={n} done after {time.time() - start:.0f}s", flush=True)
  return out, sizes


# ----------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> common.Result:
  real_n = [int(v) for v in (args.real_n or ("2" if args.quick else "2,4"))
            .split(",")]
  sim_n = [int(v) for v in args.sim_n.split(",")]
  steps = args.steps or (30 if args.quick else 200)
  sim_steps = args.sim_steps or (10 if args.quick else 40)
  data = make_data(16384)
  have = len(common.logical_cpus(max(real_n)))
  skipped = [n for n in real_n if n > have]
  real_n = [n for n in real_n if n <= have]

  real = {}
  for n in real_n:
    real[n] = train_real(n, {name: make_compressor(name) for name in NAMES},
                         steps, data)
  sim, sizes = simulate(sim_n, sim_steps, data)
  n_g = sum(sizes)
  warm = min(10, steps // 4)  # TopK's union grows over the first steps

  def real_density(n, name):
    return float(np.mean(real[n][name]["density"][warm:]))

  rows = []
  for name in NAMES:
    row = [name]
    for n in real_n:
      d = real_density(n, name)
      row.append(f"{d:.4f} ({d / DENSITY:.1f}x)")
    for n in sim_n:
      d = sim[n][name]
      row.append(f"{d:.4f} ({d / DENSITY:.1f}x)")
    rows.append(row)
  for name in ("DCTDP(L=1)",):  # the same per-worker selection as TopK
    rows.append([f"{name} (sim only, eta = 0.99)"] + ["-"] * len(real_n) +
                [f"{sim[n][name]:.4f} ({sim[n][name] / DENSITY:.1f}x)"
                 for n in sim_n])
  headers = (["compressor"] + [f"real n={n}" for n in real_n] +
             [f"sim n={n}" for n in sim_n])

  def plot(fig):
    ax1, ax2 = fig.subplots(1, 2)
    widths = {"DEFT": 4}  # drawn under CLTK where both sit at d
    for i, name in enumerate(NAMES):
      lw = widths.get(name, 1.5)
      ax1.plot(sim_n, [sim[n][name] for n in sim_n], f"C{i}--o", ms=3, lw=lw,
               alpha=0.6 if lw > 2 else 1, label=f"{name} (sim)")
      if real_n:
        ax1.plot(real_n, [real_density(n, name) for n in real_n], f"C{i}-s",
                 ms=2 * lw + 2, lw=lw, alpha=0.6 if lw > 2 else 1,
                 label=f"{name} (real)")
    ax1.plot(sim_n, [DENSITY * n for n in sim_n], "k:", lw=0.8,
             label="n x set density")
    ax1.axhline(DENSITY, color="k", lw=0.5)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("workers n")
    ax1.set_ylabel("achieved density nnz / n_g")
    ax1.set_title("density vs workers (cf. DEFT Fig 1)")
    ax1.legend()
    if real_n:
      big = max(real_n)
      for i, name in enumerate(NAMES):
        ax2.plot(real[big][name]["density"], f"C{i}-",
                 lw=3 if name == "DEFT" else 0.8, label=name)
      ax2.axhline(DENSITY, color="k", lw=0.5)
      ax2.set_yscale("log")
      ax2.set_xlabel("iteration")
      ax2.set_ylabel("achieved density")
      ax2.set_title(f"over iterations, real n={big} (cf. DEFT Fig 4)")
      ax2.legend()

  top_sim = {n: sim[n]["TopK"] / DENSITY for n in sim_n}
  deft_max = max([sim[n]["DEFT"] for n in sim_n] +
                 [real_density(n, "DEFT") for n in real_n]) / DENSITY
  cltk_max = max([sim[n]["CLTK"] for n in sim_n] +
                 [real_density(n, "CLTK") for n in real_n]) / DENSITY
  real_top = ", ".join(f"n={n}: {real_density(n, 'TopK') / DENSITY:.2f}x"
                       for n in real_n)
  biggest = max(sim_n)
  grows = all(top_sim[a] < top_sim[b] for a, b in zip(sim_n, sim_n[1:]))
  build = ("reproduces" if grows and top_sim[biggest] >= 2 else
           "reproduces partly" if top_sim[biggest] > 1.2 else
           "does not reproduce")
  held = lambda v: "reproduces" if v <= 1.2 else "does not reproduce"
  verdict = f"""
**Build-up: {build}.** TopK's achieved density by n: simulated
{', '.join(f'n={n}: {v:.2f}x' for n, v in top_sim.items())} the set density
{DENSITY}; real replicas {real_top or '(none run)'}. The paper reports 13.6x / 14.2x /
5.3x at n = 16 on its three applications; here n = {biggest} gives
{top_sim[biggest]:.1f}x (the upper bound is n x = {biggest}x when the workers'
choices never overlap).

**DEFT holds the set density: {held(deft_max)}; CLT-k: {held(cltk_max)}.** The
largest density seen
over every n, real or simulated, is {deft_max:.2f}x for DEFT and {cltk_max:.2f}x for
CLT-k. (DEFT can exceed 1x slightly: every partition selects at least one entry,
so sum k_x <= k_total + P - 1; CLT-k's per-variable k = ceil(N d) rounds up.)
"""
  if skipped:
    verdict += (f"\nReal runs for n = {skipped} were skipped: this process has "
                f"only {have} logical CPUs.\n")
  settings = f"""
- Model: MLP {IN} -> {' -> '.join(map(str, WIDTHS))} (ReLU) -> 1, sigmoid
  cross-entropy on 16384 synthetic samples labelled by a fixed random 2-layer
  ReLU teacher (5% flipped). Compressed: the {len(sizes)} kernels with >= {MIN_SIZE}
  entries ({', '.join(map(str, sizes))}; n_g = {n_g}); biases and the 64 x 1
  output kernel are all-reduced densely and not counted. Set density d = {DENSITY}.
- Compressors (tf_dct.compression, `min_size={MIN_SIZE}`): `TopK(d)` (per-variable
  top-k per worker, union of the workers' choices; DEFT's Top-k baseline selects
  over the whole model, the build-up mechanism is the same), `DEFT(d)`
  (whole-model budget split over partitions by norm, each partition selected by
  one worker), `CLTK(d)` (one leader per step selects for everyone).
- Real: `tf_dct.Replicator` over n logical CPUs of one process, n = {real_n};
  local batch {LOCAL_BATCH} (global {LOCAL_BATCH} n), SGD({LR}), {steps} steps; the three
  copies of the model train side by side on the same batches. Density = nnz of
  the aggregated update over the compressed variables / n_g, from
  `communication_stats()`, averaged over steps {warm}..{steps}.
- Sim: `bench/compression.py` `sim_density` (numpy, error feedback, DEFT's
  partition / k / packing from tests/compression/reference_deft.py) on real
  gradients of the same model at its initial weights (frozen), a distinct batch
  of {LOCAL_BATCH} rows per worker and step, {sim_steps} steps, n = {sim_n}. Larger n
  are simulated only: tracing one replicated step of the three copies takes
  minutes on 2 shared cores already at n = 4 (`--real_n 2,4,8` runs n = 8).
"""
  return common.Result(
      title="DEFT Fig 1/4: achieved density vs workers (TopK build-up vs DEFT, CLT-k)",
      settings=settings, headers=headers, rows=rows, verdict=verdict, plot=plot)
