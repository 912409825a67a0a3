"""Worker program for tests/distribute/test_multi_worker.py (run by multi_worker_util).

Every worker of a 2-worker TF_CONFIG cluster (1 CPU replica each) runs this
same program once, exercising `tf_dct.MultiWorkerReplicator` section by
section, and writes `<result_dir>/worker_<index>.json`:

    {"sections": {name: {...recorded values...}},
     "errors": {name: traceback}, "done": true, ...}

A section that raises is recorded under "errors" and the run goes on (the
test reports it). The file is rewritten after every section, so a hang still
leaves what ran before it.

The data generators at the top are plain numpy (no TensorFlow), so the test
imports this module to build its numpy references from the same definitions.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np

NUM_WORKERS = 2
STEPS = 2                 # steps of the input sections
TRAIN_STEPS = 3           # steps of the training sections
LOCAL_BATCH = 2           # examples per worker (= per replica) per step
GLOBAL_BATCH = LOCAL_BATCH * NUM_WORKERS
LR = 0.1
STATE_SHAPE = (3,)


# Steps of the conservation section (checkpoint half-way). Short: the identity
# holds at every step, the 4-replica tests in tests/compression run 200, and
# 10 + 10 steps still cross DCTDP's threshold_life (3) three times on each
# side of the checkpoint; the step counters are checked exactly. (Most of
# the section's time is tracing each compressor's step, not the steps.)
CONSERVATION_STEPS = 20


def conservation_compressors(compression) -> dict:
  """Name -> factory of every compressor the conservation section runs."""
  # The papers' counts (min_count 0 / 1) and every variable compressed: on
  # this small model the default floor would send nearly everything and
  # dense_gradients="auto" would all-reduce the variables whole.
  every = {"dense_gradients": "compress"}
  return {
      "Dense": compression.Dense,
      "DCTDP": lambda: compression.DCTDP(sparsity=0.8, threshold_life=3,
                                         capacity_factor=1.5, min_count=0,
                                         **every),
      "DEFT": lambda: compression.DEFT(density=0.2, min_count=1, **every),
      "TopK": lambda: compression.TopK(density=0.25, min_size=4, min_count=0,
                                       **every),
      "CLTK": lambda: compression.CLTK(density=0.25, **every),
      "HardThreshold": lambda: compression.HardThreshold(
          1e-3, capacity_density=0.25, **every),
  }


# --- data, shared with the test -------------------------------------------------


def per_worker_batch(pipeline_id: int, step: int) -> np.ndarray:
  """PER_WORKER input: worker `pipeline_id`'s batch at `step`, shape [2]."""
  return np.array([100 * pipeline_id + 10 * step + j for j in range(LOCAL_BATCH)],
                  np.float32)


def per_replica_element(replica_id: int, step: int) -> np.ndarray:
  """PER_REPLICA input: replica `replica_id`'s element at `step`, shape [2]."""
  return np.array([1000 + 100 * replica_id + step, -replica_id - 0.5 * step],
                  np.float32)


def replica_value(r: int) -> np.ndarray:
  """The value replica r feeds the primitives (exact in float32)."""
  return np.array([1.5 * (r + 1), r * r - 2.0 * (r + 1), 4.0 - 3 * r, 0.25 * r],
                  np.float32)


def replica_matrix(r: int) -> np.ndarray:
  """A [2, 3] per-replica value for all_gather along axis 0 and 1."""
  return (np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r)


def replica_rows(r: int) -> np.ndarray:
  """A [r + 1, 4] value: the sizes along axis 0 differ between replicas."""
  return (replica_value(r)[None, :] +
          10 * np.arange(r + 1, dtype=np.float32)[:, None])


def replica_int(r: int) -> np.ndarray:
  return np.array([7 * (r + 1), -3 + r], np.int32)


def replica_bool(r: int) -> np.ndarray:
  return np.array([r == 0, r == 1, True])


def state_input(pipeline_id: int) -> np.ndarray:
  """What the per-replica-state step adds on worker `pipeline_id`."""
  return np.array([pipeline_id + 0.5, 0.25 - pipeline_id, 2.0 * pipeline_id],
                  np.float32)


WIRE_N, WIRE_CAPACITY, WIRE_USED = 100, 32, (3, 6)


def wire_buffer(r: int):
  """Replica r's packed buffer: WIRE_USED[r] increasing positions, padding n."""
  used = WIRE_USED[r]
  idx = np.full(WIRE_CAPACITY, WIRE_N, np.int32)
  idx[:used] = np.arange(used) * 7 + r
  val = np.zeros(WIRE_CAPACITY, np.float32)
  val[:used] = np.arange(1, used + 1) * (r + 1)
  return idx, val


def initial_weights():
  """Kernel [4, 2] and bias [2] of the tiny Dense model."""
  kernel = np.array([[0.5, -0.25], [0.125, 0.75], [-0.5, 0.375], [1.0, -1.0]],
                    np.float32)
  bias = np.array([0.25, -0.125], np.float32)
  return kernel, bias


def train_batch(step: int):
  """The global batch (x [4, 4], y [4, 2]) of training step `step`.

  Worker w's share is rows [2w, 2w + 2).
  """
  i = np.arange(GLOBAL_BATCH * 4, dtype=np.float32).reshape(GLOBAL_BATCH, 4)
  x = np.sin(i + 0.7 * step).astype(np.float32)
  j = np.arange(GLOBAL_BATCH * 2, dtype=np.float32).reshape(GLOBAL_BATCH, 2)
  y = np.cos(0.5 * j - step).astype(np.float32)
  return x, y


def worker_train_batch(worker: int, step: int):
  x, y = train_batch(step)
  rows = slice(LOCAL_BATCH * worker, LOCAL_BATCH * (worker + 1))
  return x[rows], y[rows]


# --- the worker program -----------------------------------------------------------


def main() -> None:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import multi_worker_util  # pylint: disable=g-import-not-at-top

  args = multi_worker_util.parse_worker_args()
  index = multi_worker_util.task_index()
  out = {"sections": {}, "errors": {}, "timings": {}, "done": False,
         "task_index": index}

  def flush():
    multi_worker_util.write_result(args.result_dir, out, index)

  t0 = time.monotonic()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_keras  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  from tf_dct import _private  # pylint: disable=g-import-not-at-top
  # As in tests/conftest.py: no autotune threads to wait for after a fit.
  _private.per_device_iterators_without_autotune()
  out["timings"]["import"] = time.monotonic() - t0

  t0 = time.monotonic()
  repl = tf_dct.MultiWorkerReplicator()
  out["timings"]["create"] = time.monotonic() - t0

  section = multi_worker_util.sections(out, flush, label=f"[worker {index}] ")

  def local(value):
    return [multi_worker_util.to_json(v) for v in repl.experimental_local_results(value)]

  def static_replica_id():
    ctx = tf.distribute.get_replica_context()
    return int(tf.get_static_value(ctx.replica_id_in_sync_group))

  def dummy_input(ctx):
    del ctx
    return tf.data.Dataset.from_tensors(tf.zeros([1])).repeat()

  @section("meta")
  def _():
    return {
        "num_replicas": repl.num_replicas,
        "num_replicas_in_sync": repl.num_replicas_in_sync,
        "worker_index": repl.worker_index,
        "is_chief": bool(repl.is_chief),
        "first_local_replica_id": repl.first_local_replica_id,
        "replica_devices": repl.replica_devices,
        "is_mwms": isinstance(repl, tf.distribute.MultiWorkerMirroredStrategy),
    }

  # -- input: PER_WORKER ------------------------------------------------------

  @section("per_worker_input")
  def _():
    contexts = []

    def input_fn(ctx):
      contexts.append({"num_input_pipelines": ctx.num_input_pipelines,
                       "input_pipeline_id": ctx.input_pipeline_id,
                       "num_replicas_in_sync": ctx.num_replicas_in_sync})
      batches = np.stack([per_worker_batch(ctx.input_pipeline_id, s)
                          for s in range(STEPS + 2)])
      return tf.data.Dataset.from_tensor_slices(batches)

    def step_fn(x):
      ctx = tf.distribute.get_replica_context()
      return {"replica_id": ctx.replica_id_in_sync_group, "x": x}

    steps = [local(repl.run(step_fn, input_fn)) for _ in range(STEPS)]
    return {"contexts": contexts, "steps": steps}

  # -- primitives ---------------------------------------------------------------

  @section("reduce")
  def _():
    def step_fn(_):
      r = static_replica_id()
      x = tf.constant(replica_value(r))
      return {
          "replica_id": r,
          "sum": repl.all_reduce(x, "sum"),
          "mean": repl.all_reduce(x, "mean"),
          "max": repl.all_reduce(x, "max"),
          "min": repl.all_reduce(x, "min"),
          "reduce_op_sum": repl.all_reduce(x, tf.distribute.ReduceOp.SUM),
          "all_sum": repl.all_sum(x),
          "all_sum_nested": repl.all_sum({"a": x, "b": [2.0 * x, x[:2]]}),
          "max_nested": repl.all_reduce((x, -x), "max"),
      }
    return local(repl.run(step_fn, dummy_input))

  @section("gather")
  def _():
    def step_fn(_):
      r = static_replica_id()
      m = tf.constant(replica_matrix(r))
      return {
          "replica_id": r,
          "axis0": repl.all_gather(m, axis=0),
          "axis1": repl.all_gather(m, axis=1),
          "axis_neg1": repl.all_gather(m, axis=-1),
          "vector": repl.all_gather(tf.constant(replica_value(r))),
          "nested": repl.all_gather({"m": m, "v": tf.constant(replica_value(r))}),
      }
    return local(repl.run(step_fn, dummy_input))

  @section("broadcast")
  def _():
    def step_fn(_):
      r = static_replica_id()
      x = tf.constant(replica_value(r))
      return {
          "replica_id": r,
          "float_from_1": repl.broadcast(x, source_replica=1),
          "float_from_0": repl.broadcast(x, source_replica=0),
          "int_from_1": repl.broadcast(tf.constant(replica_int(r)), 1),
          "bool_from_1": repl.broadcast(tf.constant(replica_bool(r)), 1),
          "nested_from_1": repl.broadcast({"x": x, "m": tf.constant(replica_matrix(r))}, 1),
      }
    return local(repl.run(step_fn, dummy_input))

  @section("map")
  def _():
    def step_fn(_):
      r = static_replica_id()
      x = tf.constant(replica_value(r))
      return {
          "replica_id": r,
          "map_reduce_sum_square": repl.map_reduce(tf.square, x, "sum"),
          "map_reduce_max_abs": repl.map_reduce(tf.abs, x, "max"),
          "map_reduce_mean_cumsum": repl.map_reduce(tf.cumsum, x, "mean"),
          "map_reduce_min_sum": repl.map_reduce(tf.reduce_sum, x, "min"),
          "map_gather_sum": repl.map_gather(tf.reduce_sum, x),
          "map_gather_double": repl.map_gather(lambda t: 2.0 * t, x),
      }
    return local(repl.run(step_fn, dummy_input))

  # -- optimizers ---------------------------------------------------------------

  kernel0, bias0 = initial_weights()

  def train_input_fn():
    """A fresh input_fn object (the input is cached per input_fn)."""
    def input_fn(ctx):
      xs, ys = zip(*(worker_train_batch(ctx.input_pipeline_id, s)
                     for s in range(TRAIN_STEPS)))
      return tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)))
    return input_fn

  def custom_loop(model, optimizer):
    variables = model.trainable_variables

    def step_fn(batch):
      x, y = batch
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
      grads = tape.gradient(loss, variables)
      optimizer.apply_gradients(zip(grads, variables))
      return loss

    input_fn = train_input_fn()
    losses = [local(repl.run(step_fn, input_fn)) for _ in range(TRAIN_STEPS)]
    return {"kernel": model.layers[-1].kernel.numpy(),
            "bias": model.layers[-1].bias.numpy(), "losses": losses}

  def count_reduce_calls(optimizer):
    """Counts (at trace time) the wrapped optimizer's compressor.reduce calls."""
    from tf_dct import keras as keras_adapters  # pylint: disable=g-import-not-at-top
    compressor = optimizer._tf_dct_compressor  # pylint: disable=protected-access
    calls = []
    original = compressor.reduce

    def reduce(ctx, grads, variables, states):
      calls.append(len(grads))
      return original(ctx, grads, variables, states)

    compressor.reduce = reduce
    return {"calls": calls, "is_wrapped": keras_adapters.is_wrapped(optimizer),
            "compressor": type(compressor).__name__}

  def tf_keras_model():
    return tf_keras.Sequential([tf_keras.layers.Dense(
        2, input_shape=(4,),
        kernel_initializer=tf_keras.initializers.Constant(kernel0),
        bias_initializer=tf_keras.initializers.Constant(bias0))])

  @section("tf_keras_custom_loop")
  def _():
    results = {}
    for wrapped in (True, False):
      with repl.scope():
        model = tf_keras_model()
        optimizer = tf_keras.optimizers.SGD(LR)
        if wrapped:
          optimizer = repl.wrap_optimizer(optimizer)
          results["hook"] = count_reduce_calls(optimizer)
      results["wrapped" if wrapped else "plain"] = custom_loop(model, optimizer)
      results[("wrapped" if wrapped else "plain") + "_class"] = (
          type(optimizer).__name__)
    return results

  @section("keras3_custom_loop")
  def _():
    import keras  # pylint: disable=g-import-not-at-top
    results = {"keras_version": keras.__version__}
    for wrapped in (True, False):
      with repl.scope():
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(
                2, kernel_initializer=keras.initializers.Constant(kernel0),
                bias_initializer=keras.initializers.Constant(bias0))])
        optimizer = keras.optimizers.SGD(LR)
        if wrapped:
          optimizer = repl.wrap_optimizer(optimizer)
          results["hook"] = count_reduce_calls(optimizer)
        optimizer.build(model.trainable_variables)
      results["wrapped" if wrapped else "plain"] = custom_loop(model, optimizer)
    return results

  @section("tf_keras_fit")
  def _():
    xs, ys = zip(*(train_batch(s) for s in range(TRAIN_STEPS)))
    x_all, y_all = np.concatenate(xs), np.concatenate(ys)
    results = {}
    for wrapped in (True, False):
      with repl.scope():
        model = tf_keras_model()
        optimizer = tf_keras.optimizers.SGD(LR)
        if wrapped:
          optimizer = repl.wrap_optimizer(optimizer)
          results["hook"] = count_reduce_calls(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
      dataset = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(
          GLOBAL_BATCH)
      history = model.fit(dataset, epochs=1, verbose=0)
      results["wrapped" if wrapped else "plain"] = {
          "kernel": model.layers[-1].kernel.numpy(),
          "bias": model.layers[-1].bias.numpy(),
          "loss": history.history["loss"],
          "iterations": int(optimizer.iterations.numpy())}
    return results

  # -- per-replica state and checkpoints -----------------------------------------

  @section("per_replica_state")
  def _():
    st = repl.per_replica_state(lambda rid: tf.fill([3], float(rid) + 1.),
                                name="res")
    initial = st.numpy()

    def input_fn(ctx):
      return tf.data.Dataset.from_tensors(state_input(ctx.input_pipeline_id)).repeat()

    def step_fn(x):
      v = st.local()
      v.assign(v * 10.0 + x)
      return {"replica_id": tf.distribute.get_replica_context().replica_id_in_sync_group,
              "value": v.read_value()}

    step_out = local(repl.run(step_fn, input_fn))
    after_step = st.numpy()
    ckpt = tf.train.Checkpoint(st=st)
    ckpt_dir = pathlib.Path(args.result_dir) / f"worker_{repl.worker_index}"
    path = ckpt.save(str(ckpt_dir / "ckpt"))  # every worker saves (own dir)
    keys = sorted(name for name, _ in tf.train.list_variables(path))
    st.assign_all([np.full(STATE_SHAPE, -7.0, np.float32)
                   for _ in st.variables_per_replica])
    overwritten = st.numpy()
    status = tf.train.Checkpoint(st=st).restore(path)
    status.assert_existing_objects_matched()
    restored = st.numpy()
    # The restored variables still drive the step.
    step_after_restore = local(repl.run(step_fn, input_fn))
    return {"initial": initial, "step": step_out, "after_step": after_step,
            "overwritten": overwritten, "restored": restored,
            "step_after_restore": step_after_restore,
            "checkpoint_keys": keys,
            "checkpoint_in_own_dir": pathlib.Path(path).parent == ckpt_dir}

  # -- risky collectives last: unequal all_gather sizes ---------------------------

  @section("gather_unequal")
  def _():
    def step_fn(_):
      r = static_replica_id()
      rows = tf.constant(replica_rows(r))
      return {"replica_id": r, "axis0": repl.all_gather(rows, axis=0)}
    return local(repl.run(step_fn, dummy_input))

  # Across workers the sparse wire sends exact sizes by default (one buffer of
  # WIRE_CAPACITY slots, replica r using WIRE_USED[r]).
  @section("sparse_wire_default")
  def _():
    from tf_dct.compression import sparse_wire  # pylint: disable=g-import-not-at-top

    def step_fn(_):
      r = static_replica_id()
      idx, val = wire_buffer(r)
      ctx = tf.distribute.get_replica_context()
      sums, sent = sparse_wire.exchange_many(
          ctx, [(tf.constant(idx), tf.constant(val), WIRE_N)], presorted=True,
          payload=True)
      return {"replica_id": r, "sum": sums[0], "sent": sent[0]}
    return local(repl.run(step_fn, dummy_input))

  # -- input: PER_REPLICA (a second replicator in the same process) ---------------

  @section("per_replica_input")
  def _():
    repl2 = tf_dct.MultiWorkerReplicator(input_replication=tf_dct.PER_REPLICA)
    ids = []

    def input_fn(replica_id):
      ids.append(replica_id)
      elements = np.stack([per_replica_element(replica_id, s)
                           for s in range(STEPS + 2)])
      return tf.data.Dataset.from_tensor_slices(elements)

    def step_fn(x):
      ctx = tf.distribute.get_replica_context()
      return {"replica_id": ctx.replica_id_in_sync_group, "x": x,
              "sum": ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)}

    steps = [[multi_worker_util.to_json(v) for v in repl2.experimental_local_results(
        repl2.run(step_fn, input_fn))] for _ in range(STEPS)]
    return {"input_fn_ids": ids, "steps": steps,
            "first_local_replica_id": repl2.first_local_replica_id}

  # -- conservation with a checkpoint, every compressor (PER_REPLICA input) -------

  @section("conservation")
  def _():
    from tests import conservation  # pylint: disable=g-import-not-at-top
    from tf_dct import compression  # pylint: disable=g-import-not-at-top
    repl3 = tf_dct.MultiWorkerReplicator(input_replication=tf_dct.PER_REPLICA)
    results = {}
    for name, make in conservation_compressors(compression).items():
      prefix = pathlib.Path(args.result_dir) / f"ckpt_{name}_{index}" / "ckpt"
      results[name] = conservation.run(repl3, make(), CONSERVATION_STEPS,
                                       str(prefix))
    return results

  # -- workers set up differently fail fast, each naming what differs --------
  # Last: the replicator that fails here must not disturb the sections above.

  @section("mixed_config")
  def _():
    from tf_dct import compression  # pylint: disable=g-import-not-at-top
    record = {}
    try:  # worker 1 compiles with XLA, worker 0 does not
      tf_dct.MultiWorkerReplicator(jit_compile=(index == 1))
      record["replicator"] = None
    except ValueError as e:
      record["replicator"] = str(e)
    repl4 = tf_dct.MultiWorkerReplicator()
    with repl4.scope():
      opt = tf_keras.optimizers.SGD(0.1)
      try:
        repl4.wrap_optimizer(opt, compression=compression.DCTDP(
            sparsity=0.9 if index == 0 else 0.99))
        record["wrap"] = None
      except ValueError as e:
        record["wrap"] = str(e)
      record["left_unwrapped"] = not hasattr(opt, "_tf_dct_compressor")
      same = tf_keras.optimizers.SGD(0.1)
      # A tuple-valued setting comes back from JSON as a list: still alike.
      repl4.wrap_optimizer(same, compression=compression.DCTDP(
          sparsity=0.9, sparsity_schedule=((5, 0.5),)))
      record["same_wrapped"] = hasattr(same, "_tf_dct_compressor")
    return record

  out["done"] = True
  flush()
  # Leave only when every peer is done too (no one is left in a collective).
  multi_worker_util.wait_for_peers(args.result_dir,
                                   multi_worker_util.cluster_size(), timeout=60)
  # Skip interpreter teardown: TF's gRPC threads can make a clean exit slow.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
