"""The public-API scenarios of tests/test_flavours.py, run in one process per
Keras flavour.

`TF_USE_LEGACY_KERAS` decides, once per process, whether `tf.keras` is
tf-keras or Keras 3; the test runs this program twice, once with each value,
as `python flavour_script.py --result_dir DIR` and reads
`DIR/worker_0.json`:

    {"flavour": "tf_keras" | "keras3", "sections": {name: {...}},
     "errors": {name: traceback}, "done": true}

Every scenario uses `tf.keras` only, so the same code exercises the flavour the
process selected, on 2 logical CPU replicas (4 for the DCTSplit transfer). A
scenario that raises is recorded under "errors" and the run goes on. The data
at the top is plain numpy, shared with the test's references.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

import numpy as np

NUM_REPLICAS = 2
GLOBAL_BATCH = 8
STEPS = 3
LR = 0.1
IN, OUT = 4, 2
SPLIT_SPARSITY = 0.75
CLIPNORM = 0.1
# What `--multi_worker` runs (on every worker); the rest runs in one process.
MULTI_WORKER_SECTIONS = ("multi_worker_custom_loop", "multi_worker_fit")


def initial_weights():
  """Kernel [4, 2] and bias [2] of the one-layer linear model."""
  kernel = np.array([[0.5, -0.25], [0.125, 0.75], [-0.5, 0.375], [1.0, -1.0]],
                    np.float32)
  return kernel, np.array([0.25, -0.125], np.float32)


def batch(step: int):
  """Global batch (x [8, 4], y [8, 2]) of step `step`; replica r gets rows
  [4r, 4r + 4)."""
  i = np.arange(GLOBAL_BATCH * IN, dtype=np.float32).reshape(GLOBAL_BATCH, IN)
  x = np.sin(i + 0.7 * step).astype(np.float32)
  j = np.arange(GLOBAL_BATCH * OUT, dtype=np.float32).reshape(GLOBAL_BATCH, OUT)
  return x, np.cos(0.5 * j - step).astype(np.float32)


def compressors(compression) -> dict:
  """Name -> factory of every compressor, every variable compressed."""
  every = {"dense_gradients": "compress"}
  return {
      "Dense": compression.Dense,
      "DCTDP": lambda: compression.DCTDP(0.5, min_count=0, **every),
      "DEFT": lambda: compression.DEFT(density=0.25, min_count=1, **every),
      "TopK": lambda: compression.TopK(density=0.25, min_size=4, min_count=0,
                                       **every),
      "CLTK": lambda: compression.CLTK(density=0.25, **every),
      "HardThreshold": lambda: compression.HardThreshold(
          0.05, capacity_density=0.5, **every),
  }


def main() -> None:  # pylint: disable=too-many-locals,too-many-statements
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "distribute"))
  import multi_worker_util  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser()
  parser.add_argument("--multi_worker", action="store_true",
                      help="run MULTI_WORKER_SECTIONS as a worker of TF_CONFIG")
  args = multi_worker_util.parse_worker_args(parser=parser)
  index = multi_worker_util.task_index()
  out = {"sections": {}, "errors": {}, "timings": {}, "done": False,
         "task_index": index}

  def flush():
    multi_worker_util.write_result(args.result_dir, out, index)

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  from tf_dct import _private  # pylint: disable=g-import-not-at-top
  # As in tests/conftest.py: no autotune threads to wait for after a fit.
  _private.per_device_iterators_without_autotune()
  from tf_dct import compression  # pylint: disable=g-import-not-at-top
  from tf_dct import dct_mp  # pylint: disable=g-import-not-at-top

  keras = tf.keras
  legacy = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
  split_cls = dct_mp.DCTSplit if legacy else dct_mp.Keras3DCTSplit
  out["flavour"] = "tf_keras" if legacy else "keras3"
  out["keras_module"] = type(keras.layers.Dense(1)).__module__
  if args.multi_worker:  # one CPU replica per worker
    repl = tf_dct.MultiWorkerReplicator()
  else:
    tf_dct.split_cpu(4)
    repl = tf_dct.Replicator(["/cpu:0", "/cpu:1"])
  kernel0, bias0 = initial_weights()
  tmp = tempfile.mkdtemp(prefix="tf_dct_flavour_")

  section = multi_worker_util.sections(
      out, flush, include=lambda name: (
          (name in MULTI_WORKER_SECTIONS) == args.multi_worker))

  def local(value):
    return [multi_worker_util.to_json(v) for v in repl.experimental_local_results(value)]

  def linear_model():
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(
        OUT, kernel_initializer=keras.initializers.Constant(kernel0),
        bias_initializer=keras.initializers.Constant(bias0))])

  def backing(v):
    """The tf.Variable behind a model variable (Keras 3: its `value`)."""
    return v if isinstance(v, tf.Variable) else v.value

  def build(compressor=None, optimizer=None, model_fn=linear_model,
            wrap=True):
    """(model, optimizer) made in the replicator's scope, built."""
    with repl.scope():
      model = model_fn()
      opt = optimizer() if optimizer else keras.optimizers.SGD(LR)
      if wrap:
        opt = repl.wrap_optimizer(opt, compression=compressor)
      opt.build(model.trainable_variables)
    return model, opt

  def train_input(start=0, steps=STEPS, repeat=False):
    """A fresh input_fn (the replicator caches the input per input_fn)."""
    def input_fn(ctx):
      # The global batch, or on several workers this worker's rows of it.
      rows = GLOBAL_BATCH // ctx.num_input_pipelines
      part = slice(rows * ctx.input_pipeline_id, rows * (ctx.input_pipeline_id + 1))
      xs, ys = zip(*(batch(s) for s in range(start, start + steps)))
      xs, ys = [x[part] for x in xs], [y[part] for y in ys]
      data = tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys)))
      return data.repeat() if repeat else data
    return input_fn

  def step_fn(model, opt, seen=None, scale=1.0):
    variables = model.trainable_variables

    def fn(b):
      x, y = b
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        scaled = loss * scale
      grads = tape.gradient(scaled, variables)
      if seen is not None:
        for s, g in zip(seen, grads):
          s.local().assign_add(g)
      opt.apply_gradients(zip(grads, variables))
      return loss
    return fn

  def weights(model):
    return [v.numpy() for v in model.trainable_variables]

  def fit_dataset():
    xs, ys = zip(*(batch(s) for s in range(STEPS)))
    data = tf.data.Dataset.from_tensor_slices((np.concatenate(xs),
                                               np.concatenate(ys)))
    options = tf.data.Options()
    options.autotune.enabled = False  # no autotuning thread to wait for
    return data.batch(GLOBAL_BATCH).with_options(options)

  # -- training ----------------------------------------------------------------

  def step_many(pairs, seen=None, scale=1.0):
    """One step of every (model, optimizer) in `pairs` (one trace for all)."""
    fns = [step_fn(m, o, None if seen is None else seen[i], scale)
           for i, (m, o) in enumerate(pairs)]
    return lambda b: [fn(b) for fn in fns]

  @section("custom_loop")
  def _():
    pairs = [build(wrap=True), build(wrap=False)]
    fn, inputs = step_many(pairs), train_input()
    losses = [local(repl.run(fn, inputs)) for _ in range(STEPS)]
    return {kind: {"w": weights(model), "iterations": int(opt.iterations.numpy()),
                   "losses": [[replica[i] for replica in step] for step in losses]}
            for i, (kind, (model, opt)) in enumerate(zip(("wrapped", "plain"),
                                                         pairs))}

  @section("fit_evaluate")
  def _():
    with repl.scope():
      model = linear_model()
      opt = repl.wrap_optimizer(keras.optimizers.SGD(LR))
      model.compile(optimizer=opt, loss="mse")
    history = model.fit(fit_dataset(), epochs=1, verbose=0)
    results = {"w": weights(model), "loss": history.history["loss"],
               "iterations": int(opt.iterations.numpy()),
               "evaluate": model.evaluate(fit_dataset(), verbose=0)}
    # A compressor with a dense warm-up step in fit, driven by phase_callback.
    with repl.scope():
      model = linear_model()
      opt = repl.wrap_optimizer(keras.optimizers.SGD(LR), compression=(
          compression.DCTDP(0.5, min_count=0, warmup_steps=1,
                            dense_gradients="compress")))
      model.compile(optimizer=opt, loss="mse")
    model.fit(fit_dataset(), epochs=1, verbose=0,
              callbacks=[tf_dct.keras.phase_callback(opt)])
    stats = opt.communication_stats()
    results["dctdp"] = {"steps": stats["steps"],
                        "phases": [{"dense": p["dense"], "steps": p["steps"]}
                                   for p in stats["phases"]],
                        "payload": stats["total"]["payload_bytes"],
                        "dense_payload": stats["total"]["dense_payload_bytes"]}
    return results

  @section("every_compressor")
  def _():
    made = {name: make() for name, make in compressors(compression).items()}
    pairs = [build(c, lambda: keras.optimizers.SGD(1.0)) for c in made.values()]
    seen = [[repl.per_replica_state(tf.zeros_like(backing(v)), name=f"seen{i}")
             for i, v in enumerate(model.trainable_variables)]
            for model, _ in pairs]
    w0 = [weights(model) for model, _ in pairs]
    fn, inputs = step_many(pairs, seen, scale=0.1), train_input()
    for _ in range(STEPS):
      repl.run(fn, inputs)
    results = {}
    for i, (name, compressor) in enumerate(made.items()):
      model, opt = pairs[i]
      residual = []
      for v in model.trainable_variables:
        state = compressor.state_values(v)
        residual.append(list(state["residual"]) if "residual" in state
                        else [np.zeros(v.shape, np.float32)] * NUM_REPLICAS)
      results[name] = {"w0": w0[i], "w": weights(model), "residual": residual,
                       "seen": [list(s.numpy()) for s in seen[i]],
                       "bytes_sent": opt.communication_stats()["total"]["bytes_sent"]}
    return results

  @section("clipnorm")
  def _():
    # One step with global_clipnorm: where each flavour clips (docs/keras.md).
    model, opt = build(optimizer=lambda: keras.optimizers.SGD(
        LR, global_clipnorm=CLIPNORM))
    repl.run(step_fn(model, opt), train_input(steps=1))
    return {"w": weights(model)}

  @section("checkpoint")
  def _():
    # Momentum SGD: DCT-DP runs the momentum itself (a per-replica velocity).
    def make():
      return build(compression.DCTDP(0.5, min_count=0,
                                     dense_gradients="compress"),
                   lambda: keras.optimizers.SGD(LR, momentum=0.9))

    def snapshot(model, opt):
      compressor = opt._tf_dct_compressor  # pylint: disable=protected-access
      return {"w": weights(model),
              "iterations": int(opt.iterations.numpy()),
              "state": [{k: np.asarray(a) for k, a in
                         compressor.state_values(v).items()}
                        for v in model.trainable_variables],
              "total": opt.communication_stats()["total"]}

    inputs = lambda start: train_input(start, 2)
    model, opt = make()
    fn, first = step_fn(model, opt), inputs(0)
    for _ in range(2):
      repl.run(fn, first)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(os.path.join(tmp, "ckpt"))
    saved = snapshot(model, opt)
    later = inputs(2)
    for _ in range(2):
      repl.run(fn, later)
    continued = snapshot(model, opt)
    # A fresh model and optimizer restore it and train the same two steps.
    model2, opt2 = make()
    fresh = snapshot(model2, opt2)
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(
        path).assert_existing_objects_matched()
    restored = snapshot(model2, opt2)
    fn2, later2 = step_fn(model2, opt2), inputs(2)
    for _ in range(2):
      repl.run(fn2, later2)
    return {"saved": saved, "fresh": fresh, "restored": restored,
            "continued": continued, "resumed": snapshot(model2, opt2)}

  @section("non_finite")
  def _():
    model, opt = build(compression.DCTDP(0.5, min_count=0,
                                         dense_gradients="compress"))
    poison = tf.Variable(1.0)
    inner = step_fn(model, opt)

    def fn(b):
      x, y = b
      return inner((x * poison, y))

    def snapshot():
      compressor = opt._tf_dct_compressor  # pylint: disable=protected-access
      return ([v.numpy() for v in model.weights],
              [np.asarray(a) for v in model.trainable_variables
               for a in compressor.state_values(v).values()],
              int(opt.iterations.numpy()))

    data = train_input(repeat=True)
    repl.run(fn, data)
    before = snapshot()
    poison.assign(float("nan"))
    error = None
    try:
      repl.run(fn, data)
    except tf.errors.InvalidArgumentError as e:
      error = e.message
    after = snapshot()
    poison.assign(1.0)
    repl.run(fn, data)
    return {"error": error, "before": before, "after": after,
            "iterations_then": int(opt.iterations.numpy())}

  @section("tensorboard")
  def _():
    model, opt = build(compression.DCTDP(0.5, min_count=0,
                                         dense_gradients="compress"))
    logdir = os.path.join(tmp, "tb")
    writer = tf.summary.create_file_writer(logdir)
    fn, inputs = step_fn(model, opt), train_input()
    step = tf.Variable(0, dtype=tf.int64)
    with writer.as_default():
      tf.summary.experimental.set_step(step)
      for i in range(2):
        step.assign(i)
        repl.run(fn, inputs)
      tf.summary.experimental.set_step(None)
    writer.flush()
    scalars = {}
    for event_file in tf.io.gfile.glob(os.path.join(logdir, "events.*")):
      for event in tf.compat.v1.train.summary_iterator(event_file):
        for value in event.summary.value:
          scalars.setdefault(value.tag, []).append(
              (event.step, float(tf.make_ndarray(value.tensor))))
    stats = opt.communication_stats()
    return {"bytes_sent": scalars.get("tf_dct/bytes_sent"),
            "tags": sorted(scalars), "total": stats["total"]["bytes_sent"],
            "last": stats["last"]["bytes_sent"]}

  @section("loss_scale")
  def _():
    # Mixed precision: float16 compute, float32 variables; the wrapped
    # optimizer inside a LossScaleOptimizer.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
      with repl.scope():
        model = keras.Sequential([
            keras.Input((IN,)),
            keras.layers.Dense(OUT, kernel_initializer=keras.initializers.Constant(kernel0),
                               bias_initializer=keras.initializers.Constant(bias0)),
            keras.layers.Activation("linear", dtype="float32")])
        inner = repl.wrap_optimizer(keras.optimizers.SGD(LR))
        opt = keras.mixed_precision.LossScaleOptimizer(inner)
        opt.build(model.trainable_variables)
      compute_dtype = str(model.layers[0].compute_dtype)
    finally:
      keras.mixed_precision.set_global_policy("float32")
    variables = model.trainable_variables

    def fn(b):
      x, y = b
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH
        scaled = (opt.scale_loss(loss) if hasattr(opt, "scale_loss")
                  else opt.get_scaled_loss(loss))
      grads = tape.gradient(scaled, variables)
      if not hasattr(opt, "scale_loss"):  # tf-keras unscales explicitly
        grads = opt.get_unscaled_gradients(grads)
      opt.apply_gradients(zip(grads, variables))
      return loss

    inputs = train_input()
    for _ in range(STEPS):
      repl.run(fn, inputs)
    error = None
    try:
      repl.wrap_optimizer(keras.mixed_precision.LossScaleOptimizer(
          keras.optimizers.SGD(LR)))
    except TypeError as e:
      error = str(e)
    return {"w": weights(model), "compute_dtype": compute_dtype,
            "variable_dtypes": [str(v.dtype) for v in variables],
            "steps": inner.communication_stats()["steps"],
            "iterations": int(inner.iterations.numpy()),
            "wrap_outer_error": error}

  # -- DCTSplit -------------------------------------------------------------------

  @section("dct_split")
  def _():
    x = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    dy = np.random.default_rng(4).normal(size=(4, 16)).astype(np.float32)
    layer = split_cls(SPLIT_SPARSITY)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
      tape.watch(xt)
      y = layer(xt, training=True)
    grad = tape.gradient(y, xt, output_gradients=tf.constant(dy))
    # Compact transfer: 2 replicas x 2 logical devices.
    mp = tf_dct.Replicator(num_devices_per_replica=2)
    with mp.scope():
      transfer = split_cls(SPLIT_SPARSITY, target_logical_device=1)
    data = np.stack([x, x + 1.0])  # one row block per replica

    def mp_step(v):
      h = transfer(v, training=True)
      with mp.logical_device(1):
        return tf.identity(h)

    def mp_input(ctx):
      del ctx
      return tf.data.Dataset.from_tensors(data.reshape(8, 16)).repeat()

    outs = mp.run(mp_step, mp_input)
    stats = transfer.bytes_stats()
    # Save and load a model containing the layer (the flavour's .keras format).
    with repl.scope():
      inputs = keras.Input((16,))
      hidden = keras.layers.Dense(16, activation="relu")(inputs)
      model = keras.Model(inputs, keras.layers.Dense(
          1)(split_cls(SPLIT_SPARSITY, name="split")(hidden)))
    path = os.path.join(tmp, "split_model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    return {"y": y, "grad": grad,
            "transfer": [t.numpy() for t in mp.experimental_local_results(outs)],
            "bytes_stats": stats,
            "predict": model(x[:, :16], training=False),
            "loaded_predict": loaded(x[:, :16], training=False),
            "loaded_layer": type(loaded.get_layer("split")).__module__,
            "layer_module": split_cls.__module__}

  # -- several workers ----------------------------------------------------------

  @section("multi_worker_custom_loop")
  def _():
    compressor = compression.DCTDP(0.5, min_count=0, dense_gradients="compress")
    pairs = [build(wrap=True), build(wrap=False), build(compressor)]
    model, _ = pairs[2]
    seen = [repl.per_replica_state(tf.zeros_like(backing(v)), name=f"seen{i}")
            for i, v in enumerate(model.trainable_variables)]
    w0 = weights(model)
    fn, inputs = step_many(pairs, [None, None, seen]), train_input()
    for _ in range(STEPS):
      repl.run(fn, inputs)
    return {"wrapped": weights(pairs[0][0]), "plain": weights(pairs[1][0]),
            "dctdp": {"w0": w0, "w": weights(model),
                      "residual": [list(compressor.state_values(v)["residual"])
                                   for v in model.trainable_variables],
                      "seen": [list(s.numpy()) for s in seen]}}

  @section("multi_worker_fit")
  def _():
    with repl.scope():
      model = linear_model()
      model.compile(optimizer=repl.wrap_optimizer(keras.optimizers.SGD(LR)),
                    loss="mse")
    try:
      model.fit(fit_dataset(), epochs=1, verbose=0)
    except NotImplementedError as e:
      return {"error": str(e), "w": weights(model)}
    return {"error": None, "w": weights(model)}

  out["done"] = True
  flush()
  if args.multi_worker:  # leave only once no peer may be in a collective
    multi_worker_util.wait_for_peers(args.result_dir, 2)
  # Skip interpreter teardown: destroying what TensorFlow still holds
  # (distributed iterators, gRPC threads) can keep a normal exit waiting.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
