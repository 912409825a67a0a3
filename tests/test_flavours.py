"""The public API under both Keras flavours, one process per flavour.

`TF_USE_LEGACY_KERAS` is read once per process, so `setUpModule` runs
`flavour_script.py` twice at once, with `tf.keras` as tf-keras and as Keras 3
(2 logical CPU replicas each), and once as 2 local Keras 3 workers of a
`MultiWorkerReplicator`. Each test checks one scenario of one flavour against
a numpy reference, so a failure names both.
"""

from __future__ import annotations

import concurrent.futures
import pathlib

from absl.testing import parameterized
import numpy as np
import tensorflow as tf

from tests import conservation
from tests import flavour_script as fs
from tests.dct_mp import reference
from tests.distribute import multi_worker_util

SCRIPT = pathlib.Path(fs.__file__).resolve()
TIMEOUT = 400.0
LEGACY = {"tf_keras": "1", "keras3": "0"}
FLAVOURS = (("tf_keras", "tf_keras"), ("keras3", "keras3"))
COMPRESSORS = ("Dense", "DCTDP", "DEFT", "TopK", "CLTK", "HardThreshold")

_RUNS = {}  # "tf_keras" / "keras3" / "multi_worker" -> [WorkerResult]


def setUpModule():
  runs = {name: dict(num_workers=1, env={"TF_USE_LEGACY_KERAS": value})
          for name, value in LEGACY.items()}
  runs["multi_worker"] = dict(num_workers=2, args=["--multi_worker"],
                              env={"TF_USE_LEGACY_KERAS": "0"})
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    futures = {name: pool.submit(multi_worker_util.run_workers, SCRIPT,
                                 timeout=TIMEOUT, **kw)
               for name, kw in runs.items()}
    _RUNS.update({name: f.result() for name, f in futures.items()})


def f32(x):
  return np.asarray(x, np.float32)


def sgd_reference(steps=fs.STEPS, mse=False):
  """Weights and per-step per-replica losses of plain SGD on the linear model
  with the script's data (summed squared error over the global batch, or mse
  as Keras computes it)."""
  kernel, bias = (w.astype(np.float64) for w in fs.initial_weights())
  losses = []
  rows = fs.GLOBAL_BATCH // fs.NUM_REPLICAS
  for step in range(steps):
    x, y = (a.astype(np.float64) for a in fs.batch(step))
    err = x @ kernel + bias - y
    norm = fs.GLOBAL_BATCH * (fs.OUT if mse else 1)
    losses.append([np.sum(err[r * rows:(r + 1) * rows] ** 2) / norm
                   for r in range(fs.NUM_REPLICAS)])
    kernel = kernel - fs.LR * 2 * x.T @ err / norm
    bias = bias - fs.LR * 2 * err.sum(axis=0) / norm
  return [kernel, bias], np.array(losses)


class FlavourTest(tf.test.TestCase, parameterized.TestCase):
  """One scenario of one flavour per test."""

  def record(self, flavour: str, name: str) -> dict:
    """Section `name` of `flavour`'s run (fails with its traceback)."""
    results = _RUNS[flavour]
    try:
      multi_worker_util.check_success(results)
    except multi_worker_util.WorkersFailed as e:
      self.fail(str(e))
    data = results[0].result
    if name in data["errors"]:
      self.fail(f"{flavour}: scenario {name} raised:\n{data['errors'][name]}")
    self.assertIn(name, data["sections"], f"{flavour}: {name} did not run")
    return data["sections"][name]

  @parameterized.named_parameters(*FLAVOURS)
  def test_the_flavour_is_the_one_asked_for(self, flavour):
    data = _RUNS[flavour][0].result
    self.assertIsNotNone(data, multi_worker_util.format_failure(_RUNS[flavour]))
    self.assertEqual(data["flavour"], flavour)
    self.assertTrue(data["keras_module"].startswith(
        "tf_keras." if flavour == "tf_keras" else "keras."), data["keras_module"])
    self.assertTrue(data["done"])

  @parameterized.named_parameters(*FLAVOURS)
  def test_custom_loop(self, flavour):
    s = self.record(flavour, "custom_loop")
    want, losses = sgd_reference()
    for kind in ("wrapped", "plain"):
      self.assertEqual(s[kind]["iterations"], fs.STEPS)
      for got, w in zip(s[kind]["w"], want):
        self.assertAllClose(got, w, rtol=1e-5, atol=1e-6)
      self.assertAllClose(s[kind]["losses"], losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(s["wrapped"]["w"], s["plain"]["w"]):  # bit for bit
      self.assertAllEqual(f32(a), f32(b))

  @parameterized.named_parameters(*FLAVOURS)
  def test_fit_and_evaluate(self, flavour):
    s = self.record(flavour, "fit_evaluate")
    want, losses = sgd_reference(mse=True)
    self.assertEqual(s["iterations"], fs.STEPS)
    for got, w in zip(s["w"], want):
      self.assertAllClose(got, w, rtol=1e-5, atol=1e-6)
    self.assertAllClose(s["loss"], [losses.sum(axis=1).mean()], rtol=1e-5)
    kernel, bias = (np.asarray(w, np.float64) for w in s["w"])
    mse = np.mean([np.mean((fs.batch(t)[0] @ kernel + bias - fs.batch(t)[1]) ** 2)
                   for t in range(fs.STEPS)])
    self.assertAllClose(s["evaluate"], mse, rtol=1e-5)
    # DCT-DP with a dense warm-up step, its phases driven by phase_callback.
    self.assertEqual(s["dctdp"]["steps"], [fs.STEPS] * fs.NUM_REPLICAS)
    self.assertEqual(s["dctdp"]["phases"], [
        {"dense": True, "steps": [1, 1]},
        {"dense": False, "steps": [fs.STEPS - 1] * 2}])

  @parameterized.named_parameters(*FLAVOURS)
  def test_where_gradients_are_clipped(self, flavour):
    s = self.record(flavour, "clipnorm")
    kernel, bias = (w.astype(np.float64) for w in fs.initial_weights())
    x, y = (a.astype(np.float64) for a in fs.batch(0))
    rows = fs.GLOBAL_BATCH // fs.NUM_REPLICAS
    grads = []  # each replica's (kernel, bias) gradient
    for r in range(fs.NUM_REPLICAS):
      xr, err = x[r * rows:(r + 1) * rows], (x @ kernel + bias - y)[r * rows:(r + 1) * rows]
      grads.append((2 * xr.T @ err / fs.GLOBAL_BATCH, 2 * err.sum(axis=0) / fs.GLOBAL_BATCH))

    def clip(g):
      norm = np.sqrt(sum(np.sum(a ** 2) for a in g))
      return [a * min(1.0, fs.CLIPNORM / norm) for a in g]

    if flavour == "tf_keras":  # the aggregate is clipped
      update = clip([sum(g[i] for g in grads) for i in range(2)])
    else:  # each replica's gradient is clipped, then they are summed
      clipped = [clip(g) for g in grads]
      update = [sum(g[i] for g in clipped) for i in range(2)]
    self.assertGreater(np.sqrt(sum(np.sum(a ** 2) for a in grads[0])), fs.CLIPNORM)
    for got, w0, u in zip(s["w"], (kernel, bias), update):
      self.assertAllClose(got, w0 - fs.LR * u, rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(*FLAVOURS)
  def test_every_compressor_conserves_the_gradient_mass(self, flavour):
    s = self.record(flavour, "every_compressor")
    self.assertEqual(sorted(s), sorted(COMPRESSORS))
    for name in COMPRESSORS:
      run = s[name]
      for i in range(len(run["w"])):
        conservation.assert_conserved(self, run["w0"][i], run["w"][i],
                                      run["residual"][i], run["seen"][i],
                                      f"{flavour} {name} w{i}")
      self.assertGreater(min(run["bytes_sent"]), 0, msg=name)
      held = np.abs(np.concatenate([np.ravel(r) for r in run["residual"][0]]))
      if name == "Dense":
        self.assertEqual(held.max(), 0.0)
      else:
        self.assertGreater(held.max(), 0.0, msg=f"{name} held nothing back")

  @parameterized.named_parameters(*FLAVOURS)
  def test_checkpoint_restores_residuals_and_accounting(self, flavour):
    s = self.record(flavour, "checkpoint")

    def same(a, b, msg, clock=True):
      """`clock`: also the measured selection time."""
      self.assertEqual(a["iterations"], b["iterations"], msg)
      for x, y in zip(a["w"], b["w"]):
        self.assertAllEqual(f32(x), f32(y), msg)
      skip = () if clock else ("selection_seconds",)
      self.assertEqual({k: v for k, v in a["total"].items() if k not in skip},
                       {k: v for k, v in b["total"].items() if k not in skip}, msg)
      self.assertEqual(len(a["state"]), len(b["state"]))
      for x, y in zip(a["state"], b["state"]):
        self.assertEqual(sorted(x), sorted(y), msg)
        for key in x:
          self.assertAllEqual(np.asarray(x[key]), np.asarray(y[key]),
                              f"{msg}: {key}")

    self.assertIn("residual", s["saved"]["state"][0])
    self.assertIn("velocity", s["saved"]["state"][0])
    self.assertGreater(np.abs(np.asarray(s["saved"]["state"][0]["residual"])).max(), 0)
    self.assertNotEqual(s["fresh"]["total"], s["saved"]["total"])
    same(s["restored"], s["saved"], "restored")
    same(s["resumed"], s["continued"], "resumed", clock=False)

  @parameterized.named_parameters(*FLAVOURS)
  def test_non_finite_gradient_is_rejected(self, flavour):
    s = self.record(flavour, "non_finite")
    self.assertIsNotNone(s["error"], "a NaN gradient was applied")
    self.assertIn("DCTDP: non-finite gradient", s["error"])
    before, after = s["before"], s["after"]
    self.assertEqual(after[2], before[2])  # iterations
    for got, want in zip(after[0] + after[1], before[0] + before[1]):
      self.assertAllEqual(np.asarray(got), np.asarray(want))
    self.assertEqual(s["iterations_then"], before[2] + 1)

  @parameterized.named_parameters(*FLAVOURS)
  def test_tensorboard_accounting(self, flavour):
    s = self.record(flavour, "tensorboard")
    for tag in ("tf_dct/bytes_sent", "tf_dct/stock_ratio", "tf_dct/density"):
      self.assertIn(tag, s["tags"])
    self.assertEqual([step for step, _ in s["bytes_sent"]], [0, 1])
    self.assertEqual([v for _, v in s["bytes_sent"]], [s["last"][0]] * 2)
    self.assertEqual(2 * s["last"][0], s["total"][0])

  @parameterized.named_parameters(*FLAVOURS)
  def test_loss_scale_optimizer_and_mixed_precision(self, flavour):
    s = self.record(flavour, "loss_scale")
    self.assertEqual(s["compute_dtype"], "float16")
    self.assertEqual([d.replace("<dtype: '", "").rstrip("'>")
                      for d in s["variable_dtypes"]], ["float32"] * 2)
    self.assertEqual(s["iterations"], fs.STEPS)
    self.assertEqual(s["steps"], [fs.STEPS] * fs.NUM_REPLICAS)
    want, _ = sgd_reference()
    for got, w in zip(s["w"], want):  # float16 forward and backward
      self.assertAllClose(got, w, rtol=2e-2, atol=2e-2)
    self.assertIsNotNone(s["wrap_outer_error"])
    self.assertIn("wrap the inner one", s["wrap_outer_error"])

  @parameterized.named_parameters(*FLAVOURS)
  def test_dct_split(self, flavour):
    s = self.record(flavour, "dct_split")
    module = {"tf_keras": "tf_dct.dct_mp.tf_keras_split",
              "keras3": "tf_dct.dct_mp.keras3_split"}[flavour]
    self.assertEqual(s["layer_module"], module)
    x = np.random.default_rng(3).normal(size=(4, 16)).astype(np.float32)
    dy = np.random.default_rng(4).normal(size=(4, 16)).astype(np.float32)
    mask = reference.threshold_mask(x, fs.SPLIT_SPARSITY)
    self.assertAllEqual(f32(s["y"]), np.where(mask, x, 0))
    self.assertAllEqual(f32(s["grad"]), np.where(mask, dy, 0))
    # The compact transfer: each replica's rows arrive masked, bit for bit.
    for r, got in enumerate(s["transfer"]):
      rows = x + r
      self.assertAllEqual(
          f32(got), np.where(reference.threshold_mask(rows, fs.SPLIT_SPARSITY),
                             rows, 0), f"replica {r}")
    stats = s["bytes_stats"]
    self.assertEqual(stats["dense_bytes"], 4 * 16 * 4)
    k = reference.num_kept(16, fs.SPLIT_SPARSITY)
    self.assertEqual(stats["backward_bytes"], 4 * k * 4)
    self.assertLess(stats["forward_bytes"], stats["dense_bytes"])
    self.assertEqual(s["loaded_layer"], module)  # loads as the same class
    self.assertAllEqual(f32(s["loaded_predict"]), f32(s["predict"]))


class MultiWorkerKeras3Test(tf.test.TestCase):
  """2 local workers, `tf.keras` = Keras 3, one CPU replica each."""

  def sections(self, name: str) -> list:
    results = _RUNS["multi_worker"]
    try:
      multi_worker_util.check_success(results)
    except multi_worker_util.WorkersFailed as e:
      self.fail(str(e))
    for r in results:
      self.assertEqual(r.result["flavour"], "keras3")
      if name in r.result["errors"]:
        self.fail(f"{r.name}: {name} raised:\n{r.result['errors'][name]}")
    return [r.result["sections"][name] for r in results]

  def test_custom_loop(self):
    sections = self.sections("multi_worker_custom_loop")
    want, _ = sgd_reference()
    for s in sections:
      for a, b, w in zip(s["wrapped"], s["plain"], want):
        self.assertAllEqual(f32(a), f32(b))
        self.assertAllClose(a, w, rtol=1e-5, atol=1e-6)
    for a, b in zip(sections[0]["dctdp"]["w"], sections[1]["dctdp"]["w"]):
      self.assertAllEqual(f32(a), f32(b))  # both workers applied the same
    runs = [s["dctdp"] for s in sections]
    for i in range(len(runs[0]["w"])):
      # With SGD(LR) the weights move LR times what was sent.
      conservation.assert_conserved(
          self, np.asarray(runs[0]["w0"][i]) / fs.LR,
          np.asarray(runs[0]["w"][i]) / fs.LR,
          [r for run in runs for r in run["residual"][i]],
          [g for run in runs for g in run["seen"][i]], f"DCTDP w{i}")

  def test_fit_names_the_keras_limitation_and_the_alternatives(self):
    for s in self.sections("multi_worker_fit"):
      self.assertIsNotNone(s["error"], "Keras 3 fit ran on several workers")
      for part in ("keras#20585", "custom loop", "tf-keras model.fit",
                   "TF_USE_LEGACY_KERAS=1"):
        self.assertIn(part, s["error"])
      for got, w in zip(s["w"], fs.initial_weights()):
        self.assertAllEqual(f32(got), w)  # nothing moved


if __name__ == "__main__":
  tf.test.main()
