"""DCT Table 3: hybrid DCT-DP + DCT-MP on DLRM (two MP splits).

DCT (KDD'21) §3.1, Table 3: W_grad of the 8 FC layers compressed with DCT-DP
across data-parallel trainers and X_act / X_grad compressed with DCT-MP at the
two splits of Fig 6, the same eta for both, eta in {75, 90, 95}%. The paper:
no loss up to 90%, +0.22% test loss at 95%.

This is the launcher's Quick-start setting (`python -m launch.train`): 2
data-parallel replicas x 2 model-parallel devices on 4 logical CPUs, the
split layers shipping their compact form between the devices
(`target_logical_device`), DCT-DP across the replicas. As in dct_table2_dp
the embedding table is all-reduced densely (only the FC layers' W_grad is
compressed).
"""

from __future__ import annotations

import argparse

from bench.studies import common
from bench.studies import dct_table1_mp as t1
from bench.studies import dct_table2_dp as t2

DESCRIPTION = ("DCT Table 3: hybrid DCT-DP + DCT-MP (2 splits) on DLRM, eta "
               "75-95%, 2 replicas x 2 devices, vs dense")

# DCT Table 3: (eta %, train loss, train acc %, test loss, test acc %).
PAPER_TABLE3 = (
    (0, 0.4477, 79.23, 0.4538, 78.78),
    (75, 0.4480, 79.23, 0.4535, 78.81),
    (90, 0.4481, 79.26, 0.4537, 78.78),
    (95, 0.4492, 79.19, 0.4548, 78.70),
)


def define(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per run (default 1000, quick 120)")
  parser.add_argument("--sparsities", default=None,
                      help="eta for DP and MP (default 0.75,0.9,0.95; quick 0.95)")
  parser.add_argument("--replicas", type=int, default=2,
                      help="data-parallel replicas, 2 devices each")
  parser.add_argument("--threshold_life", type=int, default=None,
                      help="DCT-DP threshold life L (default steps / 10)")
  t1.define_training(parser)


def run(args: argparse.Namespace) -> common.Result:
  steps = args.steps or (120 if args.quick else 1000)
  etas = common.floats(args.sparsities or ("0.95" if args.quick else "0.75,0.9,0.95"))
  life = args.threshold_life or max(1, steps // 10)
  eval_batches = args.eval_batches or (16 if args.quick else 40)
  replicas = args.replicas
  common.logical_cpus(2 * replicas, strict=True)

  def cfg(eta=None):
    return t1.job_config(
        "dlrm", config=args.model_config, num_replicas=replicas, num_devices_per_replica=2,
        mp_splits="none" if eta is None else ",".join(t1.TWO_SPLITS),
        mp_sparsity=0.9 if eta is None else eta,
        compression="none" if eta is None else "dct",
        sparsity=0.99 if eta is None else eta, threshold_life=life, steps=steps,
        batch_size=args.batch_size, learning_rate=args.learning_rate,
        optimizer="adam", log_every=steps, seed=args.seed)

  print(f"[dct_table3_hybrid] {replicas} replicas x 2 devices, {steps} steps, L={life}",
        flush=True)
  dense, reinits = t1.dense_runs(cfg(), eval_batches, t1.reinit_count(args))
  runs = {eta: t1.train_dlrm(f"DCT-DP + DCT-MP eta={eta:g}", cfg(eta), eval_batches,
                             compressor=t2.fc_only_dctdp(eta, life))
          for eta in etas}
  widths = [t1.dlrm_split_width(p, cfg()) for p in t1.TWO_SPLITS]

  headers = (["eta (DP and MP)"] + t1.DLRM_HEADERS +
             ["FC payload dense / sent", "MP bytes dense / sent (fwd+bwd)",
              "paper test loss vs dense", "wall s"])
  rows = [["0% (dense)"] + t1.dlrm_row([], dense, dense) +
          ["-", "-", "+0.00%", f"{dense['seconds']:.0f}"]]
  for reinit in reinits:
    rows.append([f"0% ({reinit['label']})"] + t1.dlrm_row([], reinit, dense) +
                ["-", "-", "-", f"{reinit['seconds']:.0f}"])
  for eta, r in runs.items():
    dp = r["dp"] or {}
    paper = t1.eta_paper_delta(PAPER_TABLE3, eta)
    mp = t1.split_ratios("dct", widths, eta)["round_trip"]
    rows.append([f"{100 * eta:g}%"] + t1.dlrm_row([], r, dense) +
                [f"{dp['payload_ratio']:.1f}x" if dp else "-", f"{mp:.1f}x",
                 "-" if paper is None else f"{paper:+.2f}%", f"{r['seconds']:.0f}"])

  def plot(fig):
    t1.eta_sweep_plot(fig, runs, dense, PAPER_TABLE3, "sparsity eta, DP and MP (%)", "DCT Table 3: test loss", steps)

  settings = t1.dlrm_settings(cfg(), eval_batches, extra=f"""
- Hybrid: {replicas} data-parallel replicas x 2 model-parallel logical CPUs
  (`tf_dct.Replicator(..., num_devices_per_replica=2)`); the launcher places the
  stages alternately on the two devices and each `DCTSplit(eta,
  target_logical_device=...)` at bottom_1 and top_1 ships k values + k indices
  forward and k values backward across the device boundary (Algorithm 2).
  Across replicas `DCTDP(eta, threshold_life={life}, density_band=None, value_dtype=None)`
  (Algorithm 1 as written, float32 values) on the FC layers' kernels and
  biases, error feedback per replica; the embedding table is all-reduced densely.
  The same eta for DP and MP, as in the paper.
- Dense baseline: the same {replicas} x 2 devices, no splits, dense all-reduce.
{t1.noise_settings(dense, reinits)}
- L = steps / 10 (the paper's L = 1000 belongs to far longer runs).
- Paper: DLRM on Criteo Kaggle, Table 3.""")
  return common.Result(
      title="DCT Table 3: hybrid DCT-DP + DCT-MP on DLRM",
      settings=settings, headers=headers, rows=rows,
      verdict=_verdict(dense, runs, reinits),
      plot=plot, extra=t1.eta_paper_table(3, PAPER_TABLE3))


def _verdict(dense: dict, runs: dict, reinits) -> str:
  lines = t1.eta_sweep_verdict(dense, runs, reinits, PAPER_TABLE3, 0.9)
  lines.append(
      "\nCaveats: synthetic data, a short run, Adam on the aggregated sparse "
      "gradient (the paper uses SGD), one data and training seed (the dense runs "
      "vary the initialisation only). Compare with dct_table1_mp (MP "
      "alone) and dct_table2_dp (DP alone) on the same data.")
  return "\n".join(lines)
