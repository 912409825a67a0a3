"""Chief program for tests/distribute/test_async_replicator.py (run by multi_worker_util).

Runs in the chief task of a local cluster of 1 chief, 2 workers and 1 ps
(`multi_worker_util.run_cluster`), drives `tf_dct.AsyncReplicator` section by
section and writes `<result_dir>/chief_0.json`:

    {"sections": {name: {...}}, "errors": {name: traceback}, "done": true,
     "progress": {...}}

A failing section is recorded and the run goes on. The file is rewritten
after every section (and as `progress` while the fault section trains), so a
test can follow the run. The training sections run first, then the
worker-restart and checkpoint-restart section ("fault"), then the section
whose closure fails; `--mode=train` or `--mode=fault` runs only those.

The regression data and the numpy reference live at the top (no TensorFlow),
so the test imports them too.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

D_IN, D_OUT = 64, 8          # y = x W + b: W has 512 entries, b 8
NUM_EXAMPLES = 8192
NOISE = 0.1
BATCH = 64                   # per worker and step
ASYNC_STEPS = 1000           # DCTDP steps scheduled (over both workers)
LR = 0.03
DENSE_STEPS = 500            # dense pushes converge in half the steps at
DENSE_LR = 0.06              # twice the rate (DCTDP(0.99) does not: ~7 entries a push)
SPARSITY = 0.99
BAND = (0.5, 2.0)            # DCTDP density band (see the test's docstring)
CONSERVE_STEPS = 50          # per conservation run (the identity holds at every step)
DRAIN_EVERY = 5              # the drain run's drain_every: 10 drains expected
FAULT_STEPS = 50             # phase 1 and phase 3 of the fault section
CHUNK = 25                   # fault phase 2 trains (and reports progress) in chunks
AFTER_RESTART = 100          # phase-2 steps once the restarted worker is back
RESTARTED = "worker_1_restarted"   # the test's marker file in the result dir


def regression_data():
  """x [8192, 64], y [8192, 8] of a noisy linear teacher (noise floor 0.01)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(NUM_EXAMPLES, D_IN)).astype(np.float32)
  w = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
  y = (x @ w + NOISE * rng.normal(size=(NUM_EXAMPLES, D_OUT))).astype(np.float32)
  return x, y


def full_loss(x, y, w, b) -> float:
  return float(np.mean(np.square(x @ np.asarray(w, np.float64) + b - y)))


def sync_reference(num_workers: int = 2, steps: int = ASYNC_STEPS // 2,
                   seed: int = 1, lr: float = LR) -> float:
  """Synchronous data parallelism on the same data: its final full-data loss.

  The same per-worker step as the async run (mean loss over the worker's
  BATCH examples, SGD with rate `lr`), made synchronous: every step each of the
  `num_workers` workers computes its gradient at the same weights and the
  model takes the SUM of those gradients (what MultiWorkerReplicator's dense
  SUM aggregation applies). `steps` = ASYNC_STEPS / num_workers steps read as
  many examples as the async run's ASYNC_STEPS pushes.
  """
  x, y = regression_data()
  rng = np.random.default_rng(seed)
  w = np.zeros((D_IN, D_OUT))
  b = np.zeros(D_OUT)
  for _ in range(steps):
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for _ in range(num_workers):
      idx = rng.integers(0, NUM_EXAMPLES, BATCH)
      err = (x[idx] @ w + b - y[idx]) * (2.0 / (BATCH * D_OUT))
      gw += x[idx].T @ err
      gb += err.sum(0)
    w -= lr * gw
    b -= lr * gb
  return full_loss(x, y, w, b)


def optimum_loss() -> float:
  """The least-squares optimum's full-data loss (the noise floor, ~0.0099)."""
  x, y = regression_data()
  a = np.c_[x, np.ones(len(x))]
  sol = np.linalg.lstsq(a, y, rcond=None)[0]
  return full_loss(x, y, sol[:-1], sol[-1])


def main() -> None:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import multi_worker_util  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser()
  parser.add_argument("--mode", default="all", choices=["all", "train", "fault"])
  parser.add_argument("--max_phase2_steps", type=int, default=1000)
  args = multi_worker_util.parse_worker_args(parser=parser)
  out = {"sections": {}, "errors": {}, "timings": {}, "done": False,
         "progress": {}}

  def flush():
    multi_worker_util.write_result(args.result_dir, out)

  t0 = time.monotonic()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  from tf_dct.distribute.async_replicator import AsyncReplicator  # pylint: disable=g-import-not-at-top
  from tf_dct.compression import DCTDP  # pylint: disable=g-import-not-at-top
  from tf_dct.compression.async_push import AsyncPush  # pylint: disable=g-import-not-at-top
  out["timings"]["import"] = time.monotonic() - t0
  t0 = time.monotonic()
  repl = AsyncReplicator()
  out["timings"]["connect"] = time.monotonic() - t0
  flush()

  section = multi_worker_util.sections(out, flush, label="[chief] ")

  x_all, y_all = regression_data()

  def input_fn(ctx):
    del ctx  # every worker reads its own shuffle of the same examples
    return (tf.data.Dataset.from_tensor_slices((x_all, y_all))
            .shuffle(NUM_EXAMPLES).repeat().batch(BATCH, drop_remainder=True))

  def make_model():
    with repl.scope():
      w = tf.Variable(tf.zeros([D_IN, D_OUT]), name="w")
      b = tf.Variable(tf.zeros([D_OUT]), name="b")
    return w, b

  def loss_and_grads(batch, w, b):
    x, y = batch
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(tf.matmul(x, w) + b - y))
    return loss, tape.gradient(loss, [w, b])

  def train(push, w, b, steps, return_grads=False):
    def step_fn(batch):
      loss, grads = loss_and_grads(batch, w, b)
      stats = push(grads, [w, b])
      out_ = {"loss": loss, "stats": stats}
      if return_grads:
        out_["grads"] = grads
      return out_
    scheduled = []
    for _ in range(steps):
      scheduled.append(repl.run(step_fn, input_fn))
    repl.join()
    return [r.fetch() for r in scheduled]

  if args.mode in ("train", "all"):

    @section("meta")
    def _():
      w, _ = make_model()
      return {"num_workers": repl.num_workers, "num_ps": repl.num_ps,
              "num_replicas_in_sync": repl.num_replicas_in_sync,
              "is_pss": isinstance(repl, tf.distribute.experimental.ParameterServerStrategy),
              "variable_device": w.device}

    @section("unsupported")
    def _():
      messages = {}
      x = tf.constant(1.0)
      calls = {
          "all_reduce": lambda: repl.all_reduce(x), "all_sum": lambda: repl.all_sum(x),
          "all_gather": lambda: repl.all_gather(x), "broadcast": lambda: repl.broadcast(x),
          "map_reduce": lambda: repl.map_reduce(tf.identity, x),
          "map_gather": lambda: repl.map_gather(tf.identity, x),
          "logical_device": lambda: repl.logical_device(0),
          "per_replica_state": lambda: repl.per_replica_state(0.0),
          "wrap_optimizer": lambda: repl.wrap_optimizer(
              tf_keras.optimizers.SGD(0.1), compression=DCTDP()),
      }
      for name, call in calls.items():
        try:
          call()
          messages[name] = None
        except NotImplementedError as e:
          messages[name] = str(e)
      # Inside a scheduled step the same error reaches the chief.
      def step_fn(batch):
        return repl.all_sum(batch[0])
      try:
        repl.run(step_fn, input_fn).fetch()
        repl.join()
        messages["in_step"] = None
      except Exception as e:  # pylint: disable=broad-except
        messages["in_step"] = f"{type(e).__name__}: {e}"
      return messages

    @section("dense_async")
    def _():
      w, b = make_model()
      push = AsyncPush(repl, None, learning_rate=DENSE_LR, variables=[w, b])
      t = time.monotonic()
      results = train(push, w, b, DENSE_STEPS)
      seconds = time.monotonic() - t
      stats = push.stats()
      return {"loss": full_loss(x_all, y_all, w.numpy(), b.numpy()),
              "seconds": seconds, "steps_per_worker": stats["per_worker"]["steps"],
              "bytes_per_step": [float(r["stats"]["bytes_pushed"]) for r in results[-5:]],
              "first_losses": [float(r["loss"]) for r in results[:3]]}

    @section("dctdp_async")
    def _():
      w, b = make_model()
      push = AsyncPush(repl, DCTDP(SPARSITY, threshold_life=1000, density_band=BAND,
                                     min_count=0),
                       learning_rate=LR, variables=[w, b])
      t = time.monotonic()
      results = train(push, w, b, ASYNC_STEPS)
      seconds = time.monotonic() - t
      stats = push.stats()
      residual_norm = float(sum(np.abs(r).sum() for r in push.residuals(w)))
      loss = full_loss(x_all, y_all, w.numpy(), b.numpy())
      push.drain()
      return {"loss": loss, "loss_after_drain": full_loss(x_all, y_all, w.numpy(), b.numpy()),
              "seconds": seconds, "stats": {k: v for k, v in stats.items()},
              "step_bytes": [int(r["stats"]["bytes_pushed"]) for r in results],
              "step_entries": [int(r["stats"]["entries_pushed"]) for r in results],
              "step_dense_bytes": [int(r["stats"]["dense_bytes"]) for r in results],
              "residual_l1_w": residual_norm}

    @section("conservation")
    def _():
      record = {}
      for label, drain_every in (("plain", None), ("drain", DRAIN_EVERY)):
        w, b = make_model()
        push = AsyncPush(repl, DCTDP(0.9, threshold_life=7), learning_rate=LR,
                         drain_every=drain_every, seed=3, variables=[w, b])
        results = train(push, w, b, CONSERVE_STEPS, return_grads=True)
        g_sum = [np.sum([np.asarray(r["grads"][i], np.float64) for r in results], 0)
                 for i in range(2)]
        record[label] = {
            "w": w.numpy(), "b": b.numpy(), "grad_sum_w": g_sum[0], "grad_sum_b": g_sum[1],
            "residual_w": np.sum(push.residuals(w), 0), "residual_b": np.sum(push.residuals(b), 0),
            "stats": push.stats()}
        push.drain()
        record[label]["w_drained"] = w.numpy()
        record[label]["residual_w_drained"] = np.sum(push.residuals(w), 0)
      return record

    @section("keras_fit")
    def _():
      with repl.scope():
        model = tf_keras.Sequential([tf_keras.Input((D_IN,)), tf_keras.layers.Dense(D_OUT)])
        model.compile(tf_keras.optimizers.SGD(LR), loss="mse", steps_per_execution=10)
      creator = tf_keras.utils.experimental.DatasetCreator(
          lambda ctx: input_fn(ctx))
      history = model.fit(creator, epochs=2, steps_per_epoch=30, verbose=0)
      kernel, bias = model.get_weights()
      return {"loss_history": history.history["loss"],
              "loss": full_loss(x_all, y_all, kernel, bias)}

    @section("keras3_fit")
    def _():
      import keras  # pylint: disable=g-import-not-at-top
      try:
        with repl.scope():
          model = keras.Sequential([keras.Input((D_IN,)), keras.layers.Dense(D_OUT)])
          model.compile(keras.optimizers.SGD(LR), loss="mse")
        model.fit(input_fn(None), epochs=1, steps_per_epoch=5, verbose=0)
        return {"error": None}
      except Exception as e:  # pylint: disable=broad-except
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}

  if args.mode in ("fault", "all"):
    # A worker is killed and restarted during "worker_restart".

    ckpt_dir = os.path.join(args.result_dir, "ckpt")

    @section("worker_restart")
    def _():
      w, b = make_model()
      push = AsyncPush(repl, DCTDP(SPARSITY, threshold_life=1000, density_band=BAND,
                                     min_count=0),
                       learning_rate=LR, variables=[w, b])
      ckpt = tf.train.Checkpoint(w=w, b=b)
      # Phase 1: healthy; drain + save.
      phase1 = train(push, w, b, FAULT_STEPS, return_grads=True)
      g1 = [np.sum([np.asarray(r["grads"][i], np.float64) for r in phase1], 0)
            for i in range(2)]
      path = push.save(ckpt, os.path.join(ckpt_dir, "ckpt"))
      w_saved = w.numpy()
      phase1_steps = push.stats()["per_worker"]["steps"]
      # Phase 2: the test kills worker 1 after a chunk, restarts it a second
      # later and writes the RESTARTED marker. Chunks go on (on worker 0 alone
      # until worker 1 is back); once the marker is there, wait for worker 1,
      # then AFTER_RESTART more steps on both workers.
      marker = pathlib.Path(args.result_dir) / RESTARTED
      t = time.monotonic()
      phase2 = []
      before_wait = None
      while len(phase2) < args.max_phase2_steps:
        phase2 += train(push, w, b, CHUNK)
        out["progress"] = {"completed": len(phase2), "time": time.time()}
        flush()
        if before_wait is None and marker.exists():
          before_wait = len(phase2)
          repl.wait_for_workers()
        elif before_wait is not None and len(phase2) >= before_wait + AFTER_RESTART:
          break
      seconds = time.monotonic() - t
      # Per-worker variables: a restarted worker's counters start from 0.
      stats = push.stats()
      loss2 = full_loss(x_all, y_all, w.numpy(), b.numpy())
      # Phase 3: restart from the last checkpoint (as after a crash), go on.
      push.restore(ckpt, path)
      restored = w.numpy()
      residual_after_restore = float(np.abs(np.sum(push.residuals(w), 0)).sum())
      phase3 = train(push, w, b, FAULT_STEPS, return_grads=True)
      g3 = [np.sum([np.asarray(r["grads"][i], np.float64) for r in phase3], 0)
            for i in range(2)]
      return {
          "phase2_steps_completed": len(phase2), "phase2_seconds": seconds,
          "phase2_steps_before_wait": before_wait,
          "phase2_loss": loss2, "steps_per_worker": stats["per_worker"]["steps"],
          "phase1_steps_per_worker": phase1_steps,
          "restored_equals_saved": bool(np.array_equal(restored, w_saved)),
          "residual_after_restore": residual_after_restore,
          "grad_sum_w": g1[0] + g3[0], "grad_sum_b": g1[1] + g3[1],
          "w": w.numpy(), "b": b.numpy(),
          "residual_w": np.sum(push.residuals(w), 0),
          "residual_b": np.sum(push.residuals(b), 0),
          "final_loss": full_loss(x_all, y_all, w.numpy(), b.numpy())}

  if args.mode in ("train", "all"):

    # Last: a failed closure must not disturb the sections before it.
    @section("non_finite")
    def _():
      w, b = make_model()
      push = AsyncPush(repl, DCTDP(0.9, threshold_life=7), learning_rate=LR,
                       variables=[w, b])
      train(push, w, b, 10)
      before = {"w": w.numpy(), "residual_w": np.sum(push.residuals(w), 0)}

      def bad_step_fn(batch):
        _, grads = loss_and_grads(batch, w, b)
        return push([grads[0], grads[1] * np.inf], [w, b])["entries_pushed"]
      try:
        repl.run(bad_step_fn, input_fn).fetch()
        repl.join()
        error = None
      except Exception as e:  # pylint: disable=broad-except
        error = f"{type(e).__name__}: {e}"
      return {"error": error, "w_moved": float(np.abs(w.numpy() - before["w"]).max()),
              "residual_moved": float(np.abs(
                  np.sum(push.residuals(w), 0) - before["residual_w"]).max())}

  out["done"] = True
  flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # the coordinator's threads would keep a normal exit waiting


if __name__ == "__main__":
  main()
