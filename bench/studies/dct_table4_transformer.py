"""DCT Table 4: DCT-MP on a Transformer translation model, 1, 2 and 4 splits.

DCT (KDD'21) §3.2, Table 4: fairseq's IWSLT'14 De-En Transformer (6 + 6
layers, FFN 1024) with DCT-MP after the ReLU of some FFNs: one split (5th
encoder layer), two (also the 5th decoder layer), four (also the 3rd encoder
and decoder layers); eta 90 and 95%. The paper: train / test loss and BLEU stay
within about 0.1 BLEU of the baseline in every setting (35.17 baseline, 35.15
to 35.23), the worst being 95% with four splits (test loss +0.18%).

Here: `models/transformer` (pre-LN encoder-decoder, the same split points)
scaled down to run on 2 CPU cores, trained by `launch.train.Job` on one
replica with mask-only splits, on a locally generated translation task: the
sentence pairs of `models/data/text.synthetic_translation` (target = source
reversed, word by word through a fixed random dictionary) with a fraction of
the target words replaced by random ones, so that neither the loss nor BLEU
can saturate (without the noise a small Transformer reaches BLEU ~99 within a
few hundred steps and every setting ties). The pairs are written as parallel
text files and read back by the model's real-data path (WordPiece tokenizer).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile

import numpy as np

from bench.studies import common
from bench.studies import dct_table1_mp as t1

DESCRIPTION = ("DCT Table 4: DCT-MP on a Transformer (90/95%, 1/2/4 splits) on a "
               "generated translation task: loss and BLEU vs dense")

# DCT Table 4: (eta %, MP workers, train loss, test loss, BLEU).
PAPER_TABLE4 = (
    (0, None, 3.150, 3.883, 35.17),
    (90, 2, 3.159, 3.879, 35.23),
    (95, 2, 3.157, 3.882, 35.18),
    (90, 3, 3.151, 3.881, 35.22),
    (95, 3, 3.148, 3.882, 35.19),
    (90, 5, 3.157, 3.882, 35.20),
    (95, 5, 3.188, 3.890, 35.15),
)
TRAIN_PAIRS, TEST_PAIRS = 4000, 400


def define(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps per run (default 700, quick 250)")
  parser.add_argument("--sparsities", default=None,
                      help="eta values (default 0.9,0.95; quick 0.95)")
  parser.add_argument("--num_splits", default=None,
                      help="split counts (default 1,2,4; quick 4)")
  parser.add_argument("--layers", type=int, default=2,
                      help="encoder and decoder layers each")
  parser.add_argument("--d_model", type=int, default=64)
  parser.add_argument("--ffn_dim", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=60,
                      help="words per language of the generated task")
  parser.add_argument("--noise", type=float, default=0.1,
                      help="fraction of target words replaced at random")
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--learning_rate", type=float, default=1e-3, help="Adam")
  parser.add_argument("--dense_seeds", type=int, default=2,
                      help="dense runs besides the baseline, initialised from "
                           "seed+1..seed+N; their spread is the noise reference "
                           "(default 2; none in quick mode)")
  parser.add_argument("--no_reinit", action="store_true",
                      help="no dense re-init runs (no measured noise reference)")
  parser.add_argument("--seed", type=int, default=0)


def split_sets(layers: int) -> dict[int, tuple[str, ...]]:
  """Split points per split count, mirroring DCT §3.2 on `layers` + `layers`.

  The paper (6 + 6 layers) splits after the FFN ReLU of the 5th encoder layer,
  then also the 5th decoder layer, then also both 3rd layers: here the last
  layer stands for the 5th and the one before it for the 3rd.
  """
  last, before = layers - 1, max(0, layers - 2)
  one = (f"encoder_ffn_{last}",)
  two = one + (f"decoder_ffn_{last}",)
  four = {f"encoder_ffn_{before}", f"decoder_ffn_{before}", *two}
  order = [f"{part}_ffn_{i}" for part in ("encoder", "decoder") for i in range(layers)]
  return {1: one, 2: two, 4: tuple(p for p in order if p in four)}


def write_task(vocab: int, noise: float, seed: int) -> str:
  """Writes the generated parallel corpus; returns its directory.

  train / valid / test are independent streams of `synthetic_translation`
  (4-10 words); in every split each target word is replaced, with probability
  `noise`, by a target word drawn uniformly (fixed seeds).
  """
  from models.data import text  # pylint: disable=g-import-not-at-top
  key = hashlib.sha1(f"{vocab},{noise},{seed},{TRAIN_PAIRS},{TEST_PAIRS}".encode()
                     ).hexdigest()[:10]
  root = os.path.join(tempfile.gettempdir(), f"tf_dct_dct_table4_{key}")
  os.makedirs(root, exist_ok=True)
  words = sorted({w for _, t in text.synthetic_translation(4000, seed, vocab, (4, 10))
                  for w in t.split()})
  for i, (split, n) in enumerate((("train", TRAIN_PAIRS), ("valid", 200),
                                  ("test", TEST_PAIRS))):
    rng = np.random.default_rng([seed, 100 + i])
    pairs = text.synthetic_translation(n, seed, vocab, (4, 10), stream=i)
    noisy = [(s, " ".join(w if rng.random() >= noise else words[rng.integers(len(words))]
                          for w in t.split())) for s, t in pairs]
    for lang, side in (("de", 0), ("en", 1)):
      with open(os.path.join(root, f"{split}.{lang}"), "w", encoding="utf-8") as f:
        f.write("".join(p[side] + "\n" for p in noisy))
  return root


def _metrics(model, data_dir: str, max_len: int, seed: int) -> dict[str, float]:
  """Test loss and BLEU (greedy), and train loss on the first training pairs."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from models import transformer as mod  # pylint: disable=g-import-not-at-top
  test = mod.evaluate(model, batch_size=200, seed=seed, data_dir=data_dir,
                      split="test", tokenizer="wordpiece", max_len=max_len)
  source, target_in, target_out = mod.load_data(
      data_dir, seed, "wordpiece", 8000, max_len).arrays["train"]
  n = min(len(source), 2000)
  predict = tf.function(lambda x: model(x, training=False))
  total = 0.0
  for i in range(0, n, 250):
    logits = predict((source[i:i + 250], target_in[i:i + 250]))
    total += float(tf.reduce_sum(mod.loss(target_out[i:i + 250], logits)))
  return {"train_loss": total / n, "test_loss": test["loss"], "bleu": test["bleu"]}


def run(args: argparse.Namespace) -> common.Result:
  steps = args.steps or (250 if args.quick else 700)
  etas = common.floats(args.sparsities or ("0.95" if args.quick else "0.9,0.95"))
  counts = [int(c) for c in (args.num_splits or ("4" if args.quick else "1,2,4")).split(",")]
  sets = split_sets(args.layers)
  n_reinits = 0 if args.quick else t1.reinit_count(args)
  max_len = 12  # 4-10 words, one WordPiece token each, + START / END
  model_kwargs = {"d_model": args.d_model, "ffn_dim": args.ffn_dim, "num_heads": 4,
                  "num_encoder_layers": args.layers, "num_decoder_layers": args.layers,
                  "dropout": 0.1}
  common.logical_cpus(1, strict=True)
  data_dir = write_task(args.vocab, args.noise, args.seed)
  from launch import registry  # pylint: disable=g-import-not-at-top
  spec = registry.get("transformer")

  def cfg(splits=(), eta=0.9):
    # The smaller model on the generated corpus; --mode=train: the study
    # evaluates by itself.
    return t1.job_config("transformer", mode="train", data_dir=data_dir,
                         sections={"model": model_kwargs,
                                   "data": {"tokenizer": "wordpiece", "max_len": max_len}},
                         num_replicas=1, num_devices_per_replica=1,
                         compression="none", mp_splits=",".join(splits) or "none",
                         mp_sparsity=eta, steps=steps, batch_size=args.batch_size,
                         learning_rate=args.learning_rate, optimizer="adam",
                         log_every=steps, seed=args.seed)

  def train(label, c, job_spec=spec):
    job, summary = t1.run_job(label, c, spec=job_spec)
    out = _metrics(job.model, data_dir, max_len, args.seed)
    out.update(seconds=summary["seconds"], curve=list(summary["losses"]))
    print(f"    -> {out['train_loss']:.4f} / {out['test_loss']:.4f} / BLEU "
          f"{out['bleu']:.2f}", flush=True)
    return out

  print(f"[dct_table4_transformer] {steps} steps per run, {args.layers}+{args.layers} "
        f"layers", flush=True)
  dense = train("dense", cfg())
  reinits = [dict(train(f"dense, init seed +{i}", cfg(),
                        t1.with_init_seed(spec, args.seed + i)), label=f"dense, init seed +{i}")
             for i in range(1, n_reinits + 1)]
  loss_band, bleu_band = _spreads(dense, reinits)
  runs = {(n, eta): train(f"DCT-MP eta={eta:g}, {n} split(s)", cfg(sets[n], eta))
          for n in counts for eta in etas}

  def rel(r, key):
    return t1.delta(r[key], dense[key])

  headers = ["eta", "MP workers", "splits", "train loss", "test loss", "BLEU",
             "test loss vs dense", "BLEU vs dense", "MP bytes dense / sent (fwd+bwd)",
             "paper test loss / BLEU vs dense", "wall s"]

  def row(label, workers, splits, r, ratio="-", paper="-"):
    return [label, workers, splits, f"{r['train_loss']:.4f}", f"{r['test_loss']:.4f}",
            f"{r['bleu']:.2f}", f"{rel(r, 'test_loss'):+.2f}%",
            f"{r['bleu'] - dense['bleu']:+.2f}", ratio, paper, f"{r['seconds']:.0f}"]

  rows = [row("0% (dense)", "-", "none", dense, paper="+0.00% / +0.00")]
  for reinit in reinits:
    rows.append(row(f"0% ({reinit['label']})", "-", "none", reinit))
  for (n, eta), r in runs.items():
    ratio = t1.split_ratios("dct", [args.ffn_dim] * len(sets[n]), eta)["round_trip"]
    p = _paper(eta, n + 1)
    rows.append(row(f"{100 * eta:g}%", n + 1, ",".join(sets[n]), r, f"{ratio:.1f}x",
                    "-" if p is None else f"{p[0]:+.2f}% / {p[1]:+.2f}"))

  def plot(fig):
    ax1, ax2 = fig.subplots(1, 2)
    for i, eta in enumerate(etas):
      ns = [n for n in counts if (n, eta) in runs]
      ax1.plot(ns, [rel(runs[(n, eta)], "test_loss") for n in ns], "o-", color=f"C{i}",
               label=f"ours, eta={eta:g}")
      ax2.plot(ns, [runs[(n, eta)]["bleu"] - dense["bleu"] for n in ns], "o-",
               color=f"C{i}", label=f"ours, eta={eta:g}")
      pts = [(n, _paper(eta, n + 1)) for n in (1, 2, 4)]
      ax1.plot([n for n, _ in pts], [p[0] for _, p in pts], "s--", color=f"C{i}",
               alpha=0.5, label=f"paper, eta={eta:g}")
      ax2.plot([n for n, _ in pts], [p[1] for _, p in pts], "s--", color=f"C{i}",
               alpha=0.5, label=f"paper, eta={eta:g}")
    for ax, band in ((ax1, loss_band), (ax2, bleu_band)):
      if reinits:
        ax.axhspan(-band, band, color="grey", alpha=0.2, label="dense re-init spread")
      ax.axhline(0, color="k", lw=0.5)
      ax.set_xlabel("MP splits")
      ax.set_xticks([1, 2, 4])
      ax.legend()
    ax1.set_ylabel("test loss vs dense (%)")
    ax2.set_ylabel("BLEU - dense BLEU")
    ax1.set_title("DCT Table 4: test loss")
    ax2.set_title("DCT Table 4: BLEU")

  settings = f"""
- Task: `models.data.text.synthetic_translation` pairs (4-10 words, {args.vocab}
  words per language, target = source reversed and translated word by word by a
  fixed random dictionary), {TRAIN_PAIRS} training / {TEST_PAIRS} test pairs, independent
  streams; in every split {100 * args.noise:g}% of the target words are replaced by random
  target words (fixed seed {args.seed}). Written as `train.de` / `train.en` ... and read by
  `models/transformer`'s real-data path: WordPiece vocabulary learned from the
  training text, sequences padded to {max_len}.
- Model: `models/transformer` (pre-LN encoder-decoder, sinusoidal positions),
  {args.layers} + {args.layers} layers, d_model {args.d_model}, FFN {args.ffn_dim}, 4 heads,
  dropout 0.1 (the paper: 6 + 6, 512, 1024); scaled down to fit 2 CPU cores.
- DCT-MP: `DCTSplit(eta)` after the FFN ReLU ([batch, time, {args.ffn_dim}] rows) at
  {'; '.join(f'{n} split(s): ' + ', '.join(sets[n]) for n in counts)}
  (the paper: 5th encoder, + 5th decoder, + both 3rd layers of 6; here the last
  layer stands for the 5th and the one before it for the 3rd). One replica,
  mask-only (values identical to a compact transfer); the mask is also applied
  at inference (the layer's default), as an MP-served model would.
- Training: `launch.train.Job`, {steps} steps, batch {args.batch_size},
  adam({args.learning_rate:g}), seeds fixed, the same batches for every run.
- Metrics: test loss (teacher-forced token cross-entropy) and corpus BLEU-4 of
  greedy decodes (`models/transformer/bleu.py`) on the {TEST_PAIRS} test pairs; train
  loss: teacher-forced, inference mode, on the first 2000 training pairs.
- Noise reference: {f"{len(reinits)} more dense run(s) whose only difference is the initialisation seed (seed + 1 .. seed + {len(reinits)}); the spread of the {len(reinits) + 1} dense runs, {loss_band:.2f}% test loss and {bleu_band:.2f} BLEU here, bounds what counts as no change" if reinits else "not measured (quick mode or `--no_reinit`)"}.
- Paper: IWSLT'14 De-En, fairseq, 50 epochs, Table 4."""
  return common.Result(
      title="DCT Table 4: DCT-MP on a Transformer translation model",
      settings=settings, headers=headers, rows=rows,
      verdict=_verdict(dense, reinits, runs, etas, counts), plot=plot,
      extra=_paper_table())


def _paper(eta: float, workers: int) -> tuple[float, float] | None:
  base = PAPER_TABLE4[0]
  for r in PAPER_TABLE4:
    if r[0] == round(100 * eta) and r[1] == workers:
      return t1.delta(r[3], base[3]), r[4] - base[4]
  return None


def _paper_table() -> str:
  rows = [[f"{r[0]}%" if r[0] else "baseline", r[1] or "-", r[2], r[3], r[4],
           f"{t1.delta(r[3], PAPER_TABLE4[0][3]):+.2f}%", f"{r[4] - PAPER_TABLE4[0][4]:+.2f}"]
          for r in PAPER_TABLE4]
  return ("## The paper's Table 4 (for comparison)\n\n" + common.table(
      ["eta", "MP workers", "train loss", "test loss", "BLEU", "test loss vs dense",
       "BLEU vs dense"], rows))


def _spreads(dense: dict, reinits: list[dict]) -> tuple[float, float]:
  """Spread of the dense runs (`dense` and `reinits`, which differ only in the
  initialisation seed): (max - min) test loss in % of dense, (max - min) BLEU."""
  runs = [dense, *reinits]
  losses = [r["test_loss"] for r in runs]
  bleus = [r["bleu"] for r in runs]
  return (100.0 * (max(losses) - min(losses)) / dense["test_loss"],
          max(bleus) - min(bleus))


def _verdict(dense, reinits, runs, etas, counts) -> str:
  loss_spread, bleu_spread = _spreads(dense, reinits)
  loss_tol = 0.5 if not reinits else max(0.1, loss_spread)
  bleu_tol = 0.5 if not reinits else max(0.2, bleu_spread)
  lines = [f"Tolerance: test loss at most {loss_tol:.2f}% above dense and BLEU at most "
           f"{bleu_tol:.2f} below ("
           + (f"the spread of {len(reinits) + 1} dense runs that differ only in the "
              "initialisation seed, with floors 0.1% / 0.2 BLEU)." if reinits
              else "defaults; no re-init run in quick mode or with `--no_reinit`).")]
  held = []
  for (n, eta), r in runs.items():
    dl = t1.delta(r["test_loss"], dense["test_loss"])
    db = r["bleu"] - dense["bleu"]
    ok = dl <= loss_tol and db >= -bleu_tol
    held.append(ok)
    p = _paper(eta, n + 1)
    lines.append(f"- eta {100 * eta:g}%, {n} split(s): test loss {dl:+.2f}%, BLEU {db:+.2f} "
                 f"-> {'same as dense' if ok else 'worse than dense'} (paper: "
                 f"{p[0]:+.2f}%, {p[1]:+.2f} BLEU).")
  status = ("reproduced" if all(held) else "not reproduced" if not any(held)
            else f"partly reproduced ({sum(held)}/{len(held)} settings)")
  lines.insert(1, f"- **DCT-MP at 90-95% with 1, 2 and 4 splits keeps test loss and "
                  f"BLEU of the dense model: {status}.**")
  worst = max(runs, key=lambda k: t1.delta(runs[k]["test_loss"], dense["test_loss"]))
  lines.append(f"- Worst setting here: eta {100 * worst[1]:g}% with {worst[0]} split(s) "
               f"(the paper's worst: 95% with 4 splits).")
  lines.append(
      "\nCaveats: a generated word-reordering task with label noise instead of "
      "IWSLT'14, a 2+2-layer model 8x narrower than the paper's, a few hundred "
      "steps instead of 50 epochs, Adam without warm-up or label smoothing, one "
      "data and training seed (the dense runs vary the initialisation only). With few layers the 4-split setting compresses every FFN (the "
      "paper's 4 of 12), a harsher test than the paper's.")
  return "\n".join(lines)
