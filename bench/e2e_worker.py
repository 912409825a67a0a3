r"""One worker of `bench/e2e_link.py`: DLRM under MultiWorkerReplicator, timed.

Started by the driver inside a network namespace (`ip netns exec`), with
TF_CONFIG naming both workers' veth addresses. It trains with
`launch.train.Job` (the launcher's own setup and training loop) and adds only
what the benchmark needs, in `TimedJob._after_step`:

* a file handshake with the driver around the timed window. After step
  `--warmup_steps` the worker writes `ready_start_<i>` and waits for
  `go_start`; after the last step it writes `ready_end_<i>` and waits for
  `go_end`. The driver reads the veth byte counters when both workers are
  ready, i.e. when every collective of the step before has completed on both
  sides, so the counter window is exactly the timed steps;
* per-step wall times inside the window (`float(loss)` in the loop waits for
  each step, so a step's time includes its collectives), and the worker's
  CPU time (all threads) over the window;
* the DP accounting (`optimizer.communication_stats()`) and the DCT-MP split
  accounting (`DCTSplit.bytes_stats()`) at both ends of the window. They are
  read outside the counter window (before `ready_start`, after `go_end`).

Then the launcher evaluates on the fixed eval split and the worker writes
`result_<i>.json` and leaves with `os._exit` (TensorFlow can take minutes to
tear down collective executors at interpreter exit).

The "dense" configuration all-reduces the embedding gradient densified (the
whole table, 4 bytes per entry: the DCT paper's dense baseline and what the
accounting's `dense_bytes` prices). The launcher's own --compression=none
(`tf_dct.compression.Dense`) hands the IndexedSlices to the collective, which
all-gathers the looked-up rows instead, as stock TensorFlow does (what the
accounting's `stock_bytes` prices); that is configuration "native" here.

Not meant to be run by hand; see bench/e2e_link.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top,wrong-import-position

import tf_dct  # pylint: disable=g-import-not-at-top,wrong-import-position
from launch import configs  # pylint: disable=g-import-not-at-top,wrong-import-position
from launch import registry  # pylint: disable=g-import-not-at-top,wrong-import-position
from launch import train  # pylint: disable=g-import-not-at-top,wrong-import-position

# bench config -> launcher --compression (and DCT-MP on/off).
COMPRESSION = {"dense": "none", "native": "none", "dctdp": "dct", "dctdp_mp": "dct",
               "dctdp_fc": "dct",
               "deft": "deft", "topk": "topk"}
POLL_SECONDS = 0.001


class DensifiedDense(tf_dct.compression.Dense):
  """`Dense` with IndexedSlices gradients densified before the all-reduce.

  The ring all-reduce then moves the whole embedding-table gradient, which is
  what `Dense` records (4 bytes per entry) and what the DCT paper's dense
  baseline sends.
  """

  def reduce(self, ctx, grads, variables, states):
    return super().reduce(ctx, [tf.convert_to_tensor(g) for g in grads], variables, states)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", required=True, choices=sorted(COMPRESSION))
  p.add_argument("--handshake_dir", required=True)
  p.add_argument("--vocab_size", type=int, required=True)
  p.add_argument("--batch_size", type=int, required=True, help="global batch")
  p.add_argument("--steps", type=int, required=True, help="training steps in all")
  p.add_argument("--warmup_steps", type=int, required=True, help="untimed first steps")
  p.add_argument("--eval_steps", type=int, required=True)
  p.add_argument("--learning_rate", type=float, required=True)
  p.add_argument("--optimizer", default="adam", choices=registry.OPTIMIZERS)
  p.add_argument("--sparsity", type=float, required=True)
  p.add_argument("--threshold_life", type=int, required=True)
  p.add_argument("--mp_sparsity", type=float, required=True)
  p.add_argument("--mp_rescale", default="none", help="dctdp_mp: DCT-MP's rescale")
  p.add_argument("--density", type=float, required=True)
  p.add_argument("--compression_warmup", type=int, default=0,
                 help="dense steps at the start (the compressor's warmup_steps)")
  p.add_argument("--min_count", type=int, default=None,
                 help="the compressors' min_count (default: theirs)")
  p.add_argument("--sparsity_schedule", default=None,
                 help="DCT-DP's stages, steps:sparsity comma list, or 'none' "
                 "(default: the launcher's)")
  p.add_argument("--compressor_options", default="{}",
                 help="JSON object of extra keyword arguments for the compressor "
                 "of every compressing configuration (e.g. {\"adam_select\": \"raw\"})")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timeout", type=float, default=3600.0,
                 help="seconds to wait for the driver at a handshake")
  return p.parse_args(argv)


def launcher_config(args: argparse.Namespace) -> dict:
  """The `launch.train` cfg dict of this run: the launcher's DLRM config with
  `--vocab_size` rows per table and `--eval_steps` eval batches, resolved and
  validated by the launcher."""
  config = configs.get("dlrm", "default")
  config.model.vocab_sizes = args.vocab_size
  config.eval.steps = args.eval_steps
  flags = dict(
      replicator="multi_worker", compression=COMPRESSION[args.config],
      warmup_steps=args.compression_warmup, seed=args.seed, batch_size=args.batch_size,
      steps=args.steps, eval_every=0, log_every=10**9, optimizer=args.optimizer,
      learning_rate=args.learning_rate, sparsity=args.sparsity,
      threshold_life=args.threshold_life, density=args.density, mp_sparsity=args.mp_sparsity,
      mp_splits="paper" if args.config == "dctdp_mp" else "none",
      compression_exclude=["embeddings"] if args.config == "dctdp_fc" else [])
  if args.config == "dctdp_mp":
    flags["mp_rescale"] = args.mp_rescale
  if args.min_count is not None and flags["compression"] in train.SPARSIFIERS:
    flags["min_count"] = args.min_count
  if args.sparsity_schedule is not None and flags["compression"] == "dct":
    flags["sparsity_schedule"] = ([] if args.sparsity_schedule == "none"
                                  else args.sparsity_schedule.split(","))
  return train.resolve(config, flags)


class Handshake:
  """The worker's side of the file handshake with the driver."""

  def __init__(self, directory: str, index: int, timeout: float):
    self.dir, self.index, self.timeout = directory, index, timeout

  def _write(self, name: str, data: dict) -> None:
    tmp = os.path.join(self.dir, f".{name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f)
    os.replace(tmp, os.path.join(self.dir, name))

  def signal_and_wait(self, phase: str, data: dict | None = None) -> None:
    """Writes `ready_<phase>_<i>` and returns once the driver wrote `go_<phase>`."""
    self._write(f"ready_{phase}_{self.index}", data or {})
    go = os.path.join(self.dir, f"go_{phase}")
    deadline = time.monotonic() + self.timeout
    while not os.path.exists(go):
      if time.monotonic() > deadline:
        raise TimeoutError(f"worker {self.index}: no {go} within {self.timeout:g} s")
      time.sleep(POLL_SECONDS)

  def result(self, data: dict) -> None:
    self._write(f"result_{self.index}.json", data)


class TimedJob(train.Job):
  """`launch.train.Job` plus the timed window and its handshakes."""

  def __init__(self, cfg: dict, handshake: Handshake, warmup_steps: int,
               compressor=None):
    super().__init__(cfg, compressor=compressor)
    self.handshake = handshake
    self.warmup = warmup_steps
    self.step_times: list[float] = []
    self.window: dict = {}
    self._t_prev = None

  def _snapshot(self) -> dict:
    comm = self.communication() or {}
    mp = self.mp_bytes() or {}
    return {"dp_bytes_sent": comm.get("bytes_sent", 0.0),
            "dp_bytes_received": comm.get("bytes_received", 0.0),
            "dp_stock_bytes": comm.get("stock_bytes", 0.0),
            "dp_dense_bytes": comm.get("dense_bytes", 0.0),
            "dp_payload_bytes": comm.get("payload_bytes", 0.0),
            "density": comm.get("last_density"),
            "mp_bytes": mp.get("bytes", 0), "mp_dense_bytes": mp.get("dense_bytes", 0)}

  def _after_step(self, loss, train_metrics=None, evaluate=True):
    step = int(self.step.numpy())
    now = time.perf_counter()
    if step == self.warmup:
      super()._after_step(loss, train_metrics, evaluate)
      self.window["start"] = self._snapshot()
      self.handshake.signal_and_wait("start")
      self.window["cpu0"] = time.process_time()
      self._t_prev = self.window["t0"] = time.perf_counter()
      return
    if step > self.warmup:
      self.step_times.append(now - self._t_prev)
      self._t_prev = now
    if step == self.cfg["steps"]:
      self.window["t1"] = now
      self.window["cpu1"] = time.process_time()
      self.handshake.signal_and_wait("end", {"seconds": now - self.window["t0"]})
      self.window["end"] = self._snapshot()
    super()._after_step(loss, train_metrics, evaluate)


def recording(cls: type, types: dict[str, str], options: dict | None = None) -> type:
  """`cls` (a `tf_dct.compression.Compressor` class) whose `aggregate` also
  records {variable name: type of its gradient} into `types` when the step is
  traced (e.g. the embedding table's: IndexedSlices or Tensor), built with
  the keyword arguments `options` on top of the launcher's."""

  class Recording(cls):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **{**kwargs, **(options or {})})

    def aggregate(self, grads_and_vars):
      grads_and_vars = list(grads_and_vars)
      for g, v in grads_and_vars:
        types[v.name.split(":")[0]] = type(g).__name__
      return super().aggregate(grads_and_vars)

  Recording.__name__ = f"Recording{cls.__name__}"
  return Recording


def make_compressor(config: str, cfg: dict, types: dict[str, str],
                    options: dict | None = None):
  """The compressor of bench config `config` (launcher settings `cfg`), as
  the launcher builds it, recording gradient types into `types`: "dense"
  uses the densifying Dense (see the module docstring). `options`: extra
  keyword arguments of a compressing configuration's compressor."""
  cls = (DensifiedDense if config == "dense" else
         getattr(tf_dct.compression, train.COMPRESSOR_CLASSES[cfg["compression"]]))
  if cfg["compression"] == "none":
    options = None
  return train.make_compressor(cfg, cls=recording(cls, types, options))


def main(argv=None) -> None:
  args = parse_args(argv)
  index = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
  tf.get_logger().setLevel("ERROR")
  tf.keras.utils.set_random_seed(args.seed)
  cfg = launcher_config(args)
  handshake = Handshake(args.handshake_dir, index, args.timeout)
  grad_types: dict[str, str] = {}
  job = TimedJob(cfg, handshake, args.warmup_steps,
                 compressor=make_compressor(args.config, cfg, grad_types,
                                            json.loads(args.compressor_options)))
  job.setup()
  table = job.model.get_layer("embeddings").embeddings
  summary = job.run()
  start, end = job.window["start"], job.window["end"]
  timed = args.steps - args.warmup_steps
  per_step = {k: (end[k] - start[k]) / timed for k in start
              if k != "density" and start[k] is not None}
  result = {
      "config": args.config, "index": index, "timed_steps": timed,
      "window_seconds": job.window["t1"] - job.window["t0"],
      # CPU seconds of every thread of this worker in the window: the compute
      # cost, much less sensitive than wall time to other load on the machine.
      "cpu_seconds": job.window["cpu1"] - job.window["cpu0"],
      "step_times": job.step_times,
      "per_step": per_step, "last_density": end["density"],
      "eval": summary["eval"], "losses": summary["losses"],
      "num_parameters": int(sum(np.prod(v.shape) for v in job.model.trainable_variables)),
      "table_entries": int(np.prod(table.shape)),
      "embedding_grad_type": grad_types.get(table.name.split(":")[0], "?"),
  }
  handshake.result(result)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
