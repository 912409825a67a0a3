"""Tests for launch/train.py, in process, on the `local` preset (4 logical CPUs).

Tracing a replicated step with a compressor is the expensive part here, so
every run does double duty: each model runs once, each with a different
--compression value, and DLRM's run is also the checkpoint-restart test.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from unittest import mock

from absl import flags
from absl.testing import flagsaver
from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

import tf_dct
from launch import registry
from launch import summaries
from launch import train
from models.data import criteo
from tests import util

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Half the replicas to trace (the 2nd device of each replica idles): the
# compressors' per-replica graphs dominate the run time of these smoke runs.
TWO_REPLICAS = {"num_replicas": 2, "num_devices_per_replica": 2}


def setUpModule():
  util.setup_cpus()


def _cfg(**overrides):
  with flagsaver.flagsaver(**{"config": "local", **overrides}):
    return train.resolved_config()


def _assert_learns(test, summary):
  losses = summary["losses"]
  test.assertTrue(np.all(np.isfinite(losses)), losses)
  test.assertLess(summary["final_loss_mean"], summary["first_loss_mean"], losses)


class TrainTest(tf.test.TestCase):

  def test_local_config_learns_and_resumes(self):
    model_dir = self.create_tempdir().full_path
    cfg = dict(model="mlp", compression="none", steps=40, log_every=20, model_dir=model_dir,
               **TWO_REPLICAS)
    first = train.train(_cfg(**cfg))
    self.assertEqual(first["steps"], 40)
    self.assertLess(first["final_loss"], 0.6 * first["first_loss"])
    # Settings that leave the checkpointed state as it is may change.
    resumed = train.train(_cfg(**dict(cfg, steps=60, log_every=10, batch_size=64,
                                      learning_rate=0.05)))
    self.assertEqual(resumed["steps"], 60)  # 20 more steps, not 60 from scratch
    self.assertLess(resumed["first_loss"], first["first_loss"])
    # Others are refused before anything is built, each named (old -> new).
    with self.assertRaisesRegex(train.FlagError, (
        rf"^--model_dir {re.escape(model_dir)} holds a run with other settings "
        r"\(--num_replicas 2 -> 4, --optimizer 'sgd' -> 'adam', --compression 'none' -> "
        r"'dct', --compression_exclude '' -> 'bias', --adam_correction False -> True\); "
        r"resume it with the same flags, or use a new --model_dir$")):
      train.Job(_cfg(**dict(cfg, num_replicas=4, num_devices_per_replica=1, optimizer="adam",
                            compression="dct",
                            compression_exclude=["bias"]))).setup()
    settings = os.path.join(model_dir, "settings.json")
    with open(settings, encoding="utf-8") as f:
      saved = json.load(f)
    self.assertEqual(saved["keras"], "2")
    with open(settings, "w", encoding="utf-8") as f:
      json.dump(dict(saved, keras="3"), f)  # as a Keras 3 run records it
    with self.assertRaisesRegex(train.FlagError, r"\(--keras '3' -> '2'\)"):
      train.Job(_cfg(**cfg)).setup()
    with open(settings, "w", encoding="utf-8") as f:
      f.write("{")
    with self.assertRaisesRegex(train.FlagError, "settings.json is not a JSON object"):
      train.Job(_cfg(**cfg)).setup()

  def test_bad_flags(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "model"):
      flags.FLAGS["model"].parse("resnet-9000")
    with self.assertRaisesRegex(Exception, "--steps must be >= 1, got 0"):
      _cfg(model="mlp", steps=0)
    with self.assertRaisesRegex(ValueError, r"--batch_size \(30\) must be divisible by "
                                r"the number of replicas \(4\)"):
      train.train(_cfg(model="mlp", batch_size=30))


class InputResumeTest(tf.test.TestCase, parameterized.TestCase):

  def test_resume_restores_the_input_position(self):
    model_dir = self.create_tempdir().full_path
    cfg = dict(model="mlp", compression="none", steps=5, log_every=5, model_dir=model_dir,
               **TWO_REPLICAS)
    train.train(_cfg(**cfg))
    names = [n for n, _ in tf.train.list_variables(tf.train.latest_checkpoint(model_dir))]
    self.assertIn("input_batch_32/.ATTRIBUTES/ITERATOR_STATE", names)
    resumed = train.Job(_cfg(**dict(cfg, steps=8))).setup()
    self.assertTrue(resumed.input_restored)
    got = resumed._input(None)()  # pylint: disable=protected-access
    spec = registry.get("mlp")
    want = list(spec.dataset(_cfg(**cfg)).take(6))[5]  # uninterrupted: batch 6
    tf.nest.map_structure(self.assertAllEqual, got, want)
    # Another batch size cannot take the saved (prefetched) batches: the
    # stream of the new size from the step.
    other = train.Job(_cfg(**dict(cfg, steps=8, batch_size=64))).setup()
    self.assertFalse(other.input_restored)
    got = other._input(None)()  # pylint: disable=protected-access
    want = list(spec.dataset(_cfg(**dict(cfg, batch_size=64))).take(6))[5]
    tf.nest.map_structure(self.assertAllEqual, got, want)

  @parameterized.parameters("ncf", "transformer", "resnet", "lstm_lm", "dlrm", "dlrm:criteo")
  def test_resume_starts_the_stream_at_the_step(self, case):
    # A checkpoint at step 5 (no training needed to make one): the resumed
    # custom loop's and fit's input are batches 5, 6, ... of the
    # uninterrupted stream, made directly (no iterator state in the
    # checkpoint, no skipped batches).
    model, _, data = case.partition(":")
    model_dir = self.create_tempdir().full_path
    flags_ = dict(model=model, compression="none", model_dir=model_dir, **TWO_REPLICAS)
    if data:
      # Real Criteo files: 6 batches of 64 a pass and 10 rows dropped, so
      # batch 5 ends the first pass and batch 6 opens the second. Row r:
      # label r % 2, count r in I1, id r in C1 (every row differs).
      flags_["data_dir"] = self.create_tempdir().full_path
      with open(os.path.join(flags_["data_dir"], "train.txt"), "w", encoding="utf-8") as f:
        f.writelines("\t".join([str(r % 2), str(r)] + ["1"] * (criteo.NUM_DENSE - 1)
                               + [f"{r:08x}"] * criteo.NUM_SPARSE) + "\n"
                     for r in range(6 * 64 + 10))
    cfg = _cfg(**flags_)
    job = train.Job(cfg).setup()
    job.step.assign(5)
    job.manager.save(checkpoint_number=5)
    names = [n for n, _ in tf.train.list_variables(job.manager.latest_checkpoint)]
    self.assertFalse([n for n in names if "ITERATOR_STATE" in n])
    resumed = train.Job(cfg).setup()
    self.assertEqual(int(resumed.step.numpy()), 5)
    self.assertFalse(resumed.input_restored)
    spec = registry.get(model)
    want = list(spec.dataset(cfg).take(7))[5:]
    custom = resumed._input(None)  # pylint: disable=protected-access
    if callable(custom):  # a checkpointed iterator (dlrm), positioned at the step
      custom = [custom(), custom()]
    for got in (list(custom.take(2)) if not isinstance(custom, list) else custom,
                list(resumed._dataset(cfg["batch_size"]).take(2))):  # pylint: disable=protected-access
      for g, w in zip(got, want):
        tf.nest.map_structure(self.assertAllEqual, g, w)
    if model == "lstm_lm":
      # Another batch size: the batches of that size from the step on.
      other = _cfg(model=model, compression="none", model_dir=model_dir, batch_size=16,
                   **TWO_REPLICAS)
      got = next(iter(train.Job(other).setup()._dataset(16)))  # pylint: disable=protected-access
      tf.nest.map_structure(self.assertAllEqual, got, list(spec.dataset(other).take(6))[5])

  def test_fit_resume_starts_the_input_at_the_step(self):
    model_dir = self.create_tempdir().full_path
    cfg = dict(model="mlp", compression="none", loop="fit", steps=4, log_every=1,
               model_dir=model_dir, **TWO_REPLICAS)
    spec = registry.get("mlp")
    starts = []
    dataset_fn = spec.dataset_fn

    def recording(spec_, cfg_, start):
      starts.append(start)
      return dataset_fn(spec_, cfg_, start)

    job = train.Job(_cfg(**cfg)).setup()
    job.step.assign(4)
    job.manager.save(checkpoint_number=4)
    with mock.patch.object(spec, "dataset_fn", recording):
      resumed = train.train(_cfg(**dict(cfg, steps=6, eval_every=1)))
    self.assertEqual(resumed["steps"], 6)
    self.assertLen(resumed["losses"], 2)
    # The resumed fit's chunks (one per evaluation) start at steps 4 and 5.
    self.assertEqual(starts, [4, 5])


class DlrmRestartTest(tf.test.TestCase):
  """DLRM, 2 replicas x 2 devices, DCT-DP + DCT-MP at the paper's splits."""

  def test_custom_loop_restart_restores_step_and_residuals(self):
    model_dir = self.create_tempdir().full_path
    # The splits warm up over 20 of the 30 steps; their step counts resume.
    cfg = dict(model="dlrm", compression="dct", steps=30, model_dir=model_dir,
               mp_warmup_steps=20)
    job = train.Job(_cfg(**cfg)).setup()
    self.assertEqual(job.repl.num_replicas, 2)
    self.assertEqual(job.repl.num_devices_per_replica, 2)
    self.assertEqual([l.name for l in job.split_layers],
                     ["dct_split_bottom_1", "dct_split_top_1"])
    # The stages alternate devices: bottom_2.. on device 1, after top_1 on 0.
    self.assertEqual(job.placement["bottom_0"], 0)
    self.assertEqual(job.placement["bottom_2"], 1)
    self.assertEqual(job.placement["top_0"], 1)
    self.assertEqual(job.placement["top_2"], 0)
    first = job.run()
    self.assertEqual(first["steps"], 30)
    _assert_learns(self, first)
    self.assertIn("auc", first["eval"])
    comm = first["communication"]
    self.assertGreater(comm["dense_bytes"], 2 * comm["bytes_sent"])
    # Stock TF all-gathers the table's looked-up rows instead of the table:
    # on this small preset more bytes than the densified table.
    self.assertGreater(comm["stock_bytes"], comm["dense_bytes"])
    self.assertAllClose(comm["stock_ratio"], comm["stock_bytes"] / comm["bytes_sent"])
    self.assertGreater(first["mp"]["dense_bytes"], first["mp"]["bytes"])
    split_steps = lambda j: [int(l._core.step.numpy()) for l in j.split_layers]  # pylint: disable=protected-access
    self.assertEqual(split_steps(job), [30, 30])  # training calls only, not evaluation
    compressor = job.optimizer._tf_dct_compressor  # pylint: disable=protected-access
    variables = job.model.trainable_variables
    before = {v.name: compressor.state_for(v)["residual"].numpy() for v in variables}
    thresholds = {v.name: compressor.state_values(v)["threshold"] for v in variables}
    self.assertTrue(any(np.any(r != 0) for r in before.values()))
    counts = job.optimizer.communication_stats()["steps"]

    resumed = train.Job(_cfg(**dict(cfg, steps=36))).setup()
    self.assertEqual(int(resumed.step.numpy()), 30)
    self.assertIsNotNone(resumed.restored_from)
    compressor = resumed.optimizer._tf_dct_compressor  # pylint: disable=protected-access
    for v in resumed.model.trainable_variables:
      after = compressor.state_for(v)
      self.assertAllEqual(after["residual"].numpy(), before[v.name], msg=v.name)
      self.assertAllEqual(compressor.state_values(v)["threshold"],
                          thresholds[v.name], msg=v.name)
    self.assertEqual(split_steps(resumed), [30, 30])
    second = resumed.run()
    self.assertEqual(split_steps(resumed), [36, 36])
    self.assertEqual(second["steps"], 36)
    self.assertLen(second["losses"], 6)
    # TensorBoard: every training series at the logged steps of both runs
    # (the split layers' too: evaluation adds no points), per-variable
    # scalars at the last steps, evaluation in its own writer.
    events = util.events(os.path.join(model_dir, "train"))
    logged = [10, 20, 30, 36]
    self.assertEqual([s for s, _ in events["metrics/loss"]], logged)
    self.assertEqual({t.split("/")[0] for t in events},
                     {"metrics", "training", "tf_dct", "tf_dct_mp", "tf_dct_variables"})
    for tag, series in events.items():
      want = [30, 36] if tag.startswith("tf_dct_variables/") else logged
      self.assertEqual([s for s, _ in series], want, tag)
    for tag in ("tf_dct/stock_ratio", "tf_dct/compression_ratio", "tf_dct/residual_norm",
                "tf_dct_mp/dct_split_bottom_1/forward_bytes",
                "tf_dct_mp/dct_split_top_1/backward_bytes", "tf_dct_mp/compression_ratio",
                "training/examples_per_sec", "training/learning_rate"):
      self.assertIn(tag, events)
    self.assertTrue(any(t.startswith("tf_dct_variables/threshold/") for t in events))
    evals = util.events(os.path.join(model_dir, "eval"))
    self.assertEqual([s for s, _ in evals["metrics/auc"]], [30, 36])
    # The accounting state is checkpointed too: its step count continues.
    self.assertEqual(resumed.optimizer.communication_stats()["steps"],
                     [c + 6 for c in counts])


class SummaryDirTest(tf.test.TestCase):
  """Only the chief of a multi_worker run writes TensorBoard summaries."""

  def test_chief_writes_to_model_dir_other_workers_nothing(self):
    model_dir = self.create_tempdir().full_path
    cfg = _cfg(model="mlp", compression="none", model_dir=model_dir)
    job = train.Job(cfg)
    for is_chief, want in ((True, model_dir), (False, "")):
      job.repl = mock.Mock(is_chief=is_chief)
      self.assertEqual(job._summary_dir(), want)  # pylint: disable=protected-access
    job.repl = object()  # one process (cpu/gpu/tpu replicators): the chief
    self.assertEqual(job._summary_dir(), model_dir)  # pylint: disable=protected-access
    self.assertEqual(train.Job(_cfg(model="mlp"))._summary_dir(), "")  # pylint: disable=protected-access
    # A worker's summaries: everything a run writes goes nowhere.
    job.repl = mock.Mock(is_chief=False)
    worker = summaries.Summaries(cfg, job._summary_dir())  # pylint: disable=protected-access
    with worker.training():
      worker.begin_step(1)
      worker.log(1, loss=0.5, metrics={}, learning_rate=0.1, timed_steps=0,
                 timed_seconds=0.0, batch_size=32, mp=None)
    worker.eval(1, {"mse": 0.5})
    self.assertFalse(worker.write_hparams({"model": "mlp"}, "mse"))
    self.assertEqual(os.listdir(model_dir), [])


class _Stats:
  """A stand-in optimizer with fixed `communication_stats()`."""

  def __init__(self, stats):
    self.stats = stats

  def communication_stats(self):
    return self.stats


class CommunicationSummaryTest(tf.test.TestCase):
  """`Job.communication()` and the summary table, from fixed statistics."""

  # Totals per replica over 2 steps (tests/compression/test_accounting.py's
  # model: stock 426 B ring / 160 B payload, densified 294 / 196 per step).
  TOTAL = {"bytes_sent": 200.0, "bytes_received": 200.0, "payload_bytes": 50.0,
           "stock_bytes": 852.0, "stock_payload_bytes": 320.0,
           "dense_bytes": 588.0, "dense_payload_bytes": 392.0, "density": 0.25}

  def _job(self):
    job = train.Job.__new__(train.Job)
    total = {k: [v, v] for k, v in self.TOTAL.items()}
    job.optimizer = _Stats({"steps": [2, 2], "total": total,
                            "last": {"density": [0.5, 0.5]}, "variables": {}})
    return job

  def test_ratios_vs_stock_tf_and_densified(self):
    comm = self._job().communication()
    self.assertEqual(comm["stock_bytes"], 852.0)
    self.assertEqual(comm["stock_payload_bytes"], 320.0)
    self.assertAllClose(comm["stock_ratio"], 4.26)
    self.assertAllClose(comm["stock_payload_ratio"], 6.4)
    # The densified ratios keep their keys.
    self.assertAllClose(comm["ratio"], 2.94)
    self.assertAllClose(comm["payload_ratio"], 7.84)

  def _summary(self, **changes):
    """A two-step dlrm run's summary, as `Job.run` returns it."""
    return {"model": "dlrm", "config": "local", "loop": "custom", "replicas": 2,
            "devices_per_replica": 1, "compression": "dct", "mp_splits": [],
            "steps": 2, "start_step": 0, "first_loss": 0.7, "final_loss": 0.6,
            "eval": {}, "communication": self._job().communication(), "mp": None,
            "wall_seconds": 1.0, "steps_per_sec": 2.0, **changes}

  def test_table_heads_with_stock_tf(self):
    cfg = _cfg(model="dlrm", compression="dct")
    summary = self._summary()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      train.print_table(summary, cfg)
    rows = [line.split("|")[1:3] for line in out.getvalue().splitlines()
            if line.startswith("| ")]
    rows = [(k.strip(), v.strip()) for k, v in rows]
    keys = [k for k, _ in rows]
    self.assertIn(("DP ratio vs stock TF", "4.26x (payload 6.40x)"), rows)
    self.assertIn(("DP ratio vs densified", "2.9x (payload 7.8x)"), rows)
    self.assertLess(keys.index("DP ratio vs stock TF"),
                    keys.index("DP ratio vs densified"))
    self.assertIn(("stock TF bytes / replica", "0.00 MB"), rows)
    self.assertIn(("small variables all-reduced whole", "none (--dense_gradients=auto)"), rows)
    self.assertIn(("wall time (tracing included)", "1.0 s (2.00 steps/s)"), rows)
    # A run that trains no step (--mode=eval, a resume at --steps) made no
    # per-variable decision and has no rate to report.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      train.print_table(dict(summary, start_step=2, steps_per_sec=0.0), cfg)
    self.assertNotIn("all-reduced whole", out.getvalue())
    self.assertNotIn("sent as rows", out.getvalue())
    self.assertIn("| 1.0 s (no training step this run) |", out.getvalue())

  def test_table_names_the_residual_decay_of_every_sparsifier(self):
    for comp in ("dct", "topk", "deft"):
      for correction, named in ((True, True), (False, False)):
        cfg = _cfg(model="dlrm", config="default", compression=comp,
                   adam_correction=correction)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
          train.print_table(self._summary(compression=comp, adam_correction=correction),
                            cfg)
        self.assertEqual("residual decay 0.7" in out.getvalue(), named,
                         (comp, correction))

  def test_table_names_whole_below_when_set(self):
    for comp, given in (("topk", 2048), ("dct", None)):
      cfg = _cfg(model="dlrm", compression=comp, whole_below=given)
      out = io.StringIO()
      with contextlib.redirect_stdout(out):
        train.print_table(self._summary(compression=comp), cfg)
      self.assertEqual("whole below 2048 entries" in out.getvalue(), given is not None, comp)


class ModelsTest(tf.test.TestCase):
  """`--config=local` for every other model and loop, one compressor each."""

  def test_dlrm_fit_loop_topk_with_warmup(self):
    # Without Adam correction (on by default under DLRM's Adam), whose side
    # channel would add its all-reduce to the warm-up's stock exchange.
    cfg = _cfg(model="dlrm", loop="fit", compression="topk", warmup_steps=5,
               adam_correction=False)
    s = train.train(cfg)
    self.assertEqual(s["steps"], 30)
    _assert_learns(self, s)
    self.assertIn("auc", s["eval"])
    # fit runs the dense warm-up and the compressed steps as their own train
    # functions: traced once, every step would also all-reduce densely and
    # send more than the densified baseline.
    self.assertLess(s["communication"]["bytes_sent"],
                    0.5 * s["communication"]["dense_bytes"])
    # Each phase's own ratio: the warm-up sends what stock TF sends for the
    # MLPs (all-reduced) and fewer bytes for the tables: their rows
    # all-gathered with each replica's duplicate rows summed (the batches
    # repeat rows).
    warm, compressed = s["communication"]["phases"]
    self.assertEqual((warm["start"], warm["dense"], warm["steps"]), (0, True, 5))
    self.assertEqual((compressed["start"], compressed["dense"],
                      compressed["steps"]), (5, False, 25))
    self.assertGreater(warm["stock_ratio"], 1.0)
    self.assertGreater(compressed["ratio"], 2.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      train.print_table(s, cfg)
    rows = [[c.strip() for c in line.split("|")[1:3]]
            for line in out.getvalue().splitlines() if line.startswith("| ")]
    self.assertIn(["DP ratio per phase vs stock TF",
                   f"from step 0 (dense): {warm['stock_ratio']:.2f}x over 5 "
                   f"steps; from step 5: {compressed['stock_ratio']:.2f}x over "
                   "25 steps"], rows)

  def test_ncf_deft(self):
    s = train.train(_cfg(model="ncf", compression="deft", **TWO_REPLICAS))
    _assert_learns(self, s)
    self.assertIn("hr@10", s["eval"])
    self.assertIn("ndcg@10", s["eval"])
    self.assertLessEqual(s["eval"]["ndcg@10"], s["eval"]["hr@10"])
    self.assertIn("loss", s["eval"])

  def test_lstm_lm_cltk(self):
    s = train.train(_cfg(model="lstm_lm", compression="cltk", **TWO_REPLICAS))
    _assert_learns(self, s)
    self.assertIn("perplexity", s["eval"])

  def test_mlp_threshold(self):
    s = train.train(_cfg(model="mlp", compression="threshold", threshold=0.01,
                         **TWO_REPLICAS))
    _assert_learns(self, s)

  def test_resnet(self):
    # Many small variables make a compressed step slow to trace (minutes on
    # this 2-core machine): dense here.
    s = train.train(_cfg(model="resnet", compression="none", **TWO_REPLICAS))
    _assert_learns(self, s)
    self.assertIn("accuracy", s["eval"])

  @pytest.mark.slow(seconds=25)
  def test_transformer_mask_only_split(self):
    s = train.train(_cfg(model="transformer", compression="none", mp_splits="encoder_ffn_0",
                         steps=20))
    _assert_learns(self, s)
    self.assertIn("bleu", s["eval"])
    self.assertEqual(s["mp_splits"], ["encoder_ffn_0"])
    self.assertGreater(s["mp"]["dense_bytes"], s["mp"]["bytes"])


class CompressionExcludeTest(tf.test.TestCase, parameterized.TestCase):

  def test_exclude_reaches_the_compressor(self):
    cfg = _cfg(model="dlrm", compression="deft", compression_exclude=["embedding", "bias$"])
    compressor = train.make_compressor(cfg)
    self.assertEqual(compressor.exclude, ("embedding", "bias$"))
    self.assertEqual(train.make_compressor(_cfg(model="dlrm")).exclude, ())

  def test_compressor_arguments_are_what_make_compressor_builds(self):
    self.assertEqual(train.compressor_arguments(_cfg(model="dlrm", compression="none")), {})
    for comp in ("dct", "deft", "topk", "cltk", "threshold"):
      cfg = _cfg(model="dlrm", compression=comp)
      arguments = train.compressor_arguments(cfg)
      compressor = train.make_compressor(cfg)
      self.assertIn("min_size", arguments)
      for key, value in arguments.items():
        self.assertEqual(getattr(compressor, key), value, f"{comp}: {key}")
    arguments = train.compressor_arguments(_cfg(model="dlrm", compression="dct"))
    self.assertEqual((arguments["sparsity"], arguments["threshold_life"]), (0.9, 10))

  def test_sparsity_schedule_reaches_the_compressor(self):
    compressor = train.make_compressor(_cfg(model="dlrm",
                                            sparsity_schedule=["13:0.75", "13:0.9375"]))
    self.assertEqual(compressor.sparsity_schedule, ((13, 0.75), (13, 0.9375)))
    self.assertEqual(compressor.phase_starts(), (0, 13, 26))
    self.assertEqual(train.make_compressor(_cfg(model="dlrm")).sparsity_schedule, ())

  def test_sparse_gradients_reaches_the_compressor(self):
    # Unset: each compressor's own (DEFT's tables as rows), resolved into cfg.
    for comp in ("dct", "deft", "topk", "cltk", "threshold"):
      cfg = _cfg(model="dlrm", compression=comp)
      want = "stock" if comp == "deft" else "auto"
      self.assertEqual(cfg["sparse_gradients"], want, comp)
      self.assertEqual(train.make_compressor(cfg).sparse_gradients, want, comp)
    self.assertIsNone(_cfg(model="dlrm", compression="none")["sparse_gradients"])
    for choice in ("auto", "stock", "compress"):
      for comp in ("dct", "deft", "topk", "cltk", "threshold"):
        compressor = train.make_compressor(_cfg(model="dlrm", compression=comp,
                                                sparse_gradients=choice))
        self.assertEqual(compressor.sparse_gradients, choice, comp)

  def test_dense_gradients_reaches_the_compressor(self):
    self.assertEqual(train.make_compressor(_cfg(model="dlrm")).dense_gradients, "auto")
    for comp in ("dct", "deft", "topk", "cltk", "threshold"):
      compressor = train.make_compressor(_cfg(model="dlrm", compression=comp,
                                              dense_gradients="compress"))
      self.assertEqual(compressor.dense_gradients, "compress", comp)

  def test_value_dtype_reaches_the_compressor(self):
    # auto: the compressor's default (dct bfloat16, topk and threshold the
    # variable's dtype); float32 is value_dtype=None.
    want = {("dct", "auto"): "bfloat16", ("topk", "auto"): None,
            ("threshold", "auto"): None}
    for comp in ("dct", "topk", "threshold"):
      for choice in ("auto", "float32", "bfloat16"):
        compressor = train.make_compressor(_cfg(model="dlrm", compression=comp,
                                                value_dtype=choice))
        self.assertEqual(compressor.value_dtype,
                         want.get((comp, choice), train.VALUE_DTYPES.get(choice)),
                         (comp, choice))
    for comp in ("none", "deft", "cltk"):
      self.assertIsNone(getattr(train.make_compressor(_cfg(model="dlrm", compression=comp)),
                                "value_dtype", None), comp)
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--value_dtype is for --compression=dct/topk/threshold, "
                                  f"not --compression={comp}$"):
        _cfg(model="dlrm", compression=comp, value_dtype="float32")

  def test_adam_second_moment_reaches_the_compressor_under_adam_correction(self):
    for comp in ("dct", "topk"):
      self.assertEqual(train.make_compressor(_cfg(
          model="mlp", optimizer="adam", compression=comp,
          adam_second_moment="sketched")).adam_second_moment, "sketched")
    self.assertEqual(train.make_compressor(_cfg(
        model="mlp", optimizer="adam")).adam_second_moment, "factored")
    for extra in ({"optimizer": "sgd"}, {"compression": "none"},
                  {"adam_correction": False}):
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--adam_second_moment applies to --optimizer=adam/adamw "):
        _cfg(model="mlp", **{"optimizer": "adam", "adam_second_moment": "sketched", **extra})

  def test_deft_budget_reaches_deft(self):
    self.assertEqual(train.make_compressor(_cfg(model="mlp", compression="deft")).budget,
                     "size")
    self.assertEqual(train.make_compressor(_cfg(
        model="mlp", compression="deft", deft_budget="norm")).budget, "norm")
    with self.assertRaisesRegex(train.FlagError, r"^--deft_budget applies to "
                                r"--compression=deft; this run has --compression=topk$"):
      _cfg(model="mlp", compression="topk", deft_budget="norm")

  def test_mp_rescale_auto_scales_the_gradient_but_under_adam(self):
    for optimizer, want in (("sgd", "l1_backward"), ("momentum", "l1_backward"),
                            ("adagrad", "l1_backward"), ("adam", "none"), ("adamw", "none")):
      self.assertEqual(_cfg(model="dlrm", optimizer=optimizer)["mp_rescale"], want, optimizer)
    # Given explicitly, any value stands.
    self.assertEqual(_cfg(model="dlrm", optimizer="sgd", mp_rescale="none")["mp_rescale"],
                     "none")
    self.assertEqual(_cfg(model="dlrm", optimizer="adam", mp_rescale="l1_backward")[
        "mp_rescale"], "l1_backward")

  @parameterized.parameters("dct", "topk", "deft")
  def test_adam_residual_decay_reaches_the_sparsifiers_under_adam_correction(self, comp):
    # dlrm's default decays the residuals by 0.7 under Adam correction; the
    # other models keep the published error feedback (1).
    def decay(**kwargs):
      return train.make_compressor(_cfg(model="dlrm", compression=comp,
                                        **kwargs)).residual_decay
    self.assertEqual(decay(config="default"), 0.7)
    self.assertEqual(decay(config="default", adam_residual_decay=0.8), 0.8)
    cfg = _cfg(model="dlrm", config="default", compression=comp)
    self.assertEqual(summaries.hparams(cfg, 4, sparsifier=True, adam_correction=True)[
        "adam_residual_decay"], 0.7)
    self.assertEqual(summaries.hparams(_cfg(model="dlrm", compression=comp), 4,
                                       sparsifier=True, adam_correction=True)[
        "adam_residual_decay"], 1.0)
    self.assertEqual(decay(), 1.0)  # the local preset has no compression settings
    self.assertEqual(train.make_compressor(_cfg(
        model="mlp", optimizer="adam", compression=comp)).residual_decay, 1.0)
    self.assertEqual(train.make_compressor(_cfg(
        model="mlp", optimizer="adam", compression=comp,
        adam_residual_decay=0.8)).residual_decay, 0.8)
    # Not under Adam correction: the model's default is not applied.
    for extra in ({"optimizer": "momentum"}, {"adam_correction": False}):
      self.assertEqual(decay(config="default", **extra), 1.0, extra)
      self.assertIsNone(_cfg(model="dlrm", config="default", compression=comp,
                             **extra)["adam_residual_decay"], extra)
    for extra in ({"optimizer": "momentum"}, {"adam_correction": False},
                  {"compression": "cltk"}, {"compression": "none"}):
      extra = {"compression": comp, **extra}
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--adam_residual_decay applies to --compression=dct/deft/topk "
                                  r"with --optimizer=adam/adamw and --adam_correction on"):
        _cfg(model="dlrm", adam_residual_decay=0.5, **extra)
    for bad in (0.0, 1.5, float("nan")):
      with self.assertRaisesRegex(train.FlagError,
                                  r"^--adam_residual_decay must be in \(0, 1\], got"):
        _cfg(model="dlrm", compression=comp, adam_residual_decay=bad)


class FlagErrorsTest(tf.test.TestCase):

  def assertFlagError(self, regex, **overrides):
    with self.assertRaisesRegex(train.FlagError, regex):
      _cfg(**overrides)

  def test_errors_before_training(self):
    self.assertFlagError(r"--sparsity must be in \(0, 1\), got 1.5", sparsity=1.5)
    self.assertFlagError(r"--sparsity must be in \(0, 1\), got 0.0", sparsity=0.0)
    self.assertFlagError(r"--density must be in \(0, 1\], got 0.0", compression="topk",
                         density=0.0)
    self.assertFlagError(r"--threshold must be in \[0, inf\), got -1.0",
                         compression="threshold", threshold=-1.0)
    self.assertFlagError(r"--mp_sparsity must be in \[0, 1\), got 1.0", mp_sparsity=1.0)
    self.assertFlagError(r"--mp_warmup_steps must be >= 0, got -1", mp_warmup_steps=-1)
    self.assertFlagError(r"--mp_rescale must be one of none, l1, l1_backward, auto, got 'l2'", mp_rescale="l2")
    self.assertFlagError(r"--threshold_life must be >= 1, got 0", threshold_life=0)
    for bad in ("13", "x:0.5", "0:0.5", "5:1.0", "5:0"):
      self.assertFlagError(r"--sparsity_schedule: each item must be steps:sparsity with "
                           r"steps >= 1 and sparsity in \(0, 1\), got " + repr(bad),
                           sparsity_schedule=[bad])
    self.assertFlagError(r"--sparsity_schedule is for --compression=dct, not "
                         r"--compression=topk", compression="topk",
                         sparsity_schedule=["5:0.5"])
    self.assertFlagError(r"--data_dir '/no/such/dir' does not exist",
                         data_dir="/no/such/dir")
    self.assertFlagError(r"--model=mlp has synthetic data only", model="mlp",
                         data_dir=HERE)
    self.assertFlagError(r"--batch_size \(30\) must be divisible by the number of "
                         r"replicas \(4\)", model="ncf", batch_size=30)
    self.assertFlagError(r"--batch_size \(63\) must be divisible by the number of "
                         r"replicas \(2\)", model="dlrm", batch_size=63)
    self.assertFlagError(r"--mp_splits=paper: --model=resnet has no split points",
                         model="resnet", mp_splits="paper")
    self.assertFlagError(r"unknown split point\(s\) top_9 of --model=dlrm; available: "
                         r"bottom_0,bottom_1,bottom_2,top_0,top_1", mp_splits="top_9")
    self.assertFlagError(r"--mp_splits=paper means encoder_ffn_4 for --model=transformer",
                         model="transformer", mp_splits="paper")
    self.assertFlagError(r"split points of --model=transformer sit inside its layers",
                         model="transformer", mp_splits="encoder_ffn_0", num_replicas=2,
                         num_devices_per_replica=2)
    self.assertFlagError(r"--num_replicas is for --replicator=cpu/gpu",
                         replicator="multi_worker", num_replicas=2)
    self.assertFlagError(r"--tpu=x needs --replicator=tpu", tpu="x")
    self.assertFlagError(r"--compression_exclude: '\(' is not a valid regular expression",
                         compression_exclude=["("])
    self.assertFlagError(r"--compression_exclude needs a compressor",
                         compression="none", compression_exclude=["embedding"])
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "compression"):
      flags.FLAGS["compression"].parse("gzip")
    with self.assertRaisesRegex(flags.IllegalFlagValueError, "loop"):
      flags.FLAGS["loop"].parse("while")
    with self.assertRaisesRegex(ValueError, "unknown model 'resnet-9000'"):
      registry.get("resnet-9000")

  def test_job_takes_a_given_compressor(self):
    given = tf_dct.compression.TopK(0.25)
    job = train.Job(_cfg(model="mlp", compression="dct", steps=2),
                    compressor=given).setup()
    self.assertIs(job.compressor, given)
    self.assertIs(job.optimizer._tf_dct_compressor, given)  # pylint: disable=protected-access
    job.run()
    self.assertEqual(given.communication_stats()["steps"][0], 2)
    with self.assertRaisesRegex(TypeError, "Job: compressor must be a "
                                "tf_dct.compression.Compressor or None, got str"):
      train.Job(_cfg(model="mlp"), compressor="topk")

  def test_tpu_without_tpu(self):
    cfg = _cfg(model="mlp", replicator="tpu")
    self.assertEqual(cfg["tpu"], "local")
    with self.assertRaisesRegex(train.FlagError, r"--replicator=tpu: .*tpu"):
      train.Job(cfg).setup()

  def test_topology_that_does_not_fit_the_cpus(self):
    # 3 x 1 needs 3 logical CPUs; this process already has 4.
    with self.assertRaisesRegex(train.FlagError, r"--replicator=cpu: need 3 logical CPU"):
      train.Job(_cfg(model="mlp", num_replicas=3, batch_size=3)).setup()

  def _printed_error(self, **overrides):
    """What `main` prints to stderr for flags that must fail."""
    err = io.StringIO()
    with flagsaver.flagsaver(config="local", **overrides), \
         contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
      train.main(["train"])
    return err.getvalue().splitlines()

  def test_data_and_model_dir_errors_print_one_line(self):
    data_dir = self.create_tempdir().full_path
    with open(os.path.join(data_dir, "u.data"), "w", encoding="utf-8") as f:
      f.write("1\t2\t3\t4\n1 2 3 4\n")
    self.assertEqual(self._printed_error(model="ncf", data_dir=data_dir), [
        f"launch.train: error: {data_dir}/u.data:2: expected 4 fields separated "
        "by '\\t', got 1: '1 2 3 4'"])
    path = self.create_tempfile().full_path
    self.assertEqual(self._printed_error(model="mlp", model_dir=path), [
        f"launch.train: error: --model_dir {path!r} is a file; give a directory "
        "(created if missing)"])

  def test_data_error_in_reads_the_in_graph_check(self):
    error = tf.errors.InvalidArgumentError(
        None, None, "Error in user-defined function: assertion failed: "
        "[malformed data: /d/train.txt:7: label must be 0 or 1, got `x`]\n\t [[{{node A}}]]")
    self.assertEqual(train.data_error_in(error),
                     "/d/train.txt:7: label must be 0 or 1, got `x`")
    self.assertIsNone(train.data_error_in(tf.errors.InvalidArgumentError(
        None, None, "StringToNumberOp could not correctly convert string: x")))

  def test_every_compression_class_is_known(self):
    for name, cls in train.COMPRESSOR_CLASSES.items():
      self.assertTrue(hasattr(tf_dct.compression, cls), (name, cls))


class ProgressTest(tf.test.TestCase):
  """The start line, the tracing notice, steady-state throughput and ETA."""

  def test_steady_state_and_eta(self):
    self.assertEqual(train.steady_state(10, 4.0, 32, 25),
                     {"steps_per_sec": 2.5, "examples_per_sec": 80.0, "eta_seconds": 10.0})
    self.assertEqual(train.steady_state(3, 1.5, 8, 0)["eta_seconds"], 0.0)
    self.assertIsNone(train.steady_state(0, 0.0, 32, 25))  # only the first step so far
    self.assertEqual([train.duration(s) for s in (0.2, 42.4, 59.6, 185, 7620)],
                     ["0 s", "42 s", "1m00s", "3m05s", "2h07m"])

  def test_run_prints_tracing_notice_and_steady_state(self):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      summary = train.train(_cfg(model="mlp", compression="none", steps=3, log_every=1))
    lines = out.getvalue().splitlines()
    self.assertEqual(lines[0], "tracing the training step (first step; can take a minute) ...")
    self.assertRegex(lines[1], r"^traced and ran the first step in \d+\.\d s$")
    self.assertRegex(lines[2], r"^step +1/3  loss [\d.]+$")  # nothing timed yet
    self.assertRegex(lines[4], r"^step +3/3  loss [\d.]+  [\d.]+ steps/s  [\d,]+ examples/s"
                     r"  ETA 0 s$")
    self.assertGreater(summary["steady_steps_per_sec"], 0)
    self.assertAllClose(summary["steady_examples_per_sec"],
                        32 * summary["steady_steps_per_sec"])
    self.assertGreater(summary["first_step_seconds"], 0)
    self.assertIn("steps_per_sec", summary)  # wall-clock rate, tracing included
    rows = [line.split("|")[1].strip() for line in lines if line.startswith("| ")]
    self.assertIn("wall time (tracing included)", rows)
    self.assertIn("steady state (after the first step)", rows)

  def test_hide_gpus_only_where_unset_and_no_gpu_is_asked_for(self):
    with mock.patch.dict("os.environ"):
      os.environ.pop("CUDA_VISIBLE_DEVICES", None)
      train.hide_gpus("gpu")
      self.assertNotIn("CUDA_VISIBLE_DEVICES", os.environ)
      train.hide_gpus("cpu")
      self.assertEqual(os.environ["CUDA_VISIBLE_DEVICES"], "")
      os.environ["CUDA_VISIBLE_DEVICES"] = "1"
      train.hide_gpus("tpu")
      self.assertEqual(os.environ["CUDA_VISIBLE_DEVICES"], "1")

  def test_launcher_prints_at_once_and_no_cuinit_line(self):
    # Under Keras 3 (the in-process tests run tf-keras): --keras=3 overrides
    # the TF_USE_LEGACY_KERAS=1 this process inherits.
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "TF_CPP_MIN_LOG_LEVEL")}
    env["PYTHONPATH"] = REPO
    out = subprocess.run([sys.executable, "-m", "launch.train", "--model=mlp",
                          "--config=local", "--compression=none", "--steps=2",
                          "--keras=3"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                         check=False)
    self.assertEqual(out.returncode, 0, out.stderr)
    # A notice before the imports, then the run's first line.
    self.assertEqual(out.stdout.splitlines()[:2],
                     ["loading TensorFlow ...",
                      "training mlp (local): 2 steps, global batch 32, --replicator=cpu, "
                      "--compression=none, Keras 3; building the model ..."])
    self.assertNotIn("cuInit", out.stderr)
    # TensorFlow's import-time lines of a CUDA build on a machine without one.
    self.assertNotIn("cudart_stub", out.stderr)
    self.assertNotIn("absl::InitializeLog", out.stderr)

  def test_only_a_program_run_announces_the_imports(self):
    self.assertTrue(train.runs_as_program("__main__", "/x/launch/train.py"))
    self.assertTrue(train.runs_as_program("launch.train", "/venv/bin/tf-dct-train"))
    self.assertFalse(train.runs_as_program("launch.train", "/venv/bin/pytest"))

  def test_import_noise_is_dropped_only_on_runs_without_gpus(self):
    self.assertTrue(train.uses_no_gpu([]))
    self.assertTrue(train.uses_no_gpu(["--model=mlp", "--replicator", "tpu"]))
    self.assertFalse(train.uses_no_gpu(["--replicator=gpu"]))
    self.assertFalse(train.uses_no_gpu(["--replicator=multi_worker"]))
    lines = [b"WARNING: All log messages before absl::InitializeLog() is called are "
             b"written to STDERR\n",
             b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine\n",
             b"WARNING: All log messages before absl::InitializeLog() is called are "
             b"written to STDERR\n",
             b"I0000 port.cc:153] oneDNN custom operations are on. You may see slightly "
             b"different numerical results\n",
             b"WARNING: All log messages before absl::InitializeLog() is called are "
             b"written to STDERR\n",
             b"E0000 cuda_platform.cc:52] failed call to cuInit\n",
             b"a line of the user's\n"]
    self.assertEqual(train.dropped_lines(lines, train.IMPORT_NOISE), lines[4:])


class EarlyFlagTest(parameterized.TestCase):
  """`early_flag` reads a flag before absl parses argv, as absl will."""

  @parameterized.named_parameters(
      ("absent", [], "auto"),
      ("equals", ["--keras=3"], "3"),
      ("next_argument", ["--model=mlp", "--keras", "2"], "2"),
      ("single_dash", ["-keras=3"], "3"),
      ("last_wins", ["--keras=2", "--keras", "3"], "3"),
      ("other_flag_alike", ["--keras_x=3", "--kerasy", "3"], "auto"),
      ("after_double_dash", ["--keras=2", "--", "--keras=3"], "2"),
      ("no_value_left", ["--keras"], "auto"),
      ("empty_value", ["--keras="], ""))
  def test_string_flag(self, argv, want):
    self.assertEqual(train.early_flag(argv, "keras", "auto"), want)

  @parameterized.named_parameters(
      ("absent_default_false", [], False, False),
      ("absent_default_true", [], True, True),
      ("bare", ["--verbose"], False, True),
      ("negated", ["--noverbose"], True, False),
      ("negated_single_dash", ["-noverbose"], True, False),
      ("equals_true", ["--verbose=True"], False, True),
      ("equals_t", ["--verbose=t"], False, True),
      ("equals_1", ["--verbose=1"], False, True),
      ("equals_false", ["--verbose=FALSE"], True, False),
      ("equals_0", ["--verbose=0"], True, False),
      # absl rejects the value when it parses: the earlier one stands here.
      ("bad_value", ["--verbose", "--verbose=maybe"], False, True),
      # a boolean takes no next argument: "false" is a positional argument
      ("next_argument_not_taken", ["--verbose", "false"], False, True),
      ("last_wins", ["--verbose", "--noverbose"], False, False),
      ("after_double_dash", ["--", "--verbose"], False, False),
      ("negated_with_value_ignored", ["--noverbose=1"], True, True))
  def test_boolean_flag(self, argv, default, want):
    self.assertIs(train.early_flag(argv, "verbose", default), want)

  def test_agrees_with_absl(self):
    # The same argv through absl's own parser gives the same values.
    values = flags.FlagValues()
    flags.DEFINE_string("kind", "cpu", "", flag_values=values)
    flags.DEFINE_boolean("fast", False, "", flag_values=values)
    for argv in (["--kind", "tpu", "--fast"], ["-kind=gpu", "--nofast"],
                 ["--fast=true", "--kind=a", "--kind=b"], ["--fast", "--", "--nofast"]):
      values.unparse_flags()
      values(["prog"] + argv)
      self.assertEqual(train.early_flag(argv, "kind", "cpu"), values.kind, argv)
      self.assertIs(train.early_flag(argv, "fast", False), values.fast, argv)


class KerasFlavourTest(tf.test.TestCase):

  def test_keras_flag_sets_the_flavour_before_tensorflow(self):
    for argv, env, want in (
        (["--keras=3"], {"TF_USE_LEGACY_KERAS": "1"}, "0"),
        (["--model=mlp", "--keras", "2"], {"TF_USE_LEGACY_KERAS": "0"}, "1"),
        (["--keras=auto"], {"TF_USE_LEGACY_KERAS": "0"}, "0"),
        ([], {}, "1")):  # default: tf-keras, which DLRM and NCF need
      with mock.patch.dict(os.environ, env, clear=True):
        train.select_keras(argv)
        self.assertEqual(os.environ["TF_USE_LEGACY_KERAS"], want, argv)

  def test_models_on_recommenders_refuse_keras3(self):
    with mock.patch.object(train, "LEGACY", False):
      for model in ("dlrm", "ncf"):
        with self.assertRaisesRegex(
            train.FlagError, rf"^--model={model} needs tf-keras .*; pass --keras=2$"):
          _cfg(model=model)
      self.assertEqual(_cfg(model="mlp")["model"], "mlp")
      with self.assertRaisesRegex(
          train.FlagError, r"^--loop=fit with --replicator=multi_worker needs "
          r"tf-keras: .*keras#20585.*; use --loop=custom or --keras=2$"):
        _cfg(model="mlp", loop="fit", replicator="multi_worker")


class MultiWorkerScriptTest(tf.test.TestCase):

  def _script(self, *args):
    return subprocess.run(["bash", os.path.join(REPO, "launch", "multi_worker.sh"), *args],
                          capture_output=True, text=True, timeout=120, check=False)

  def test_dry_run_prints_one_tf_config_per_worker(self):
    out = self._script("--dry-run", "3", "--model=mlp", "--config=local")
    self.assertEqual(out.returncode, 0, out.stderr)
    lines = out.stdout.strip().splitlines()
    self.assertLen(lines, 3)
    ports = set()
    for i, line in enumerate(lines):
      self.assertIn(f'"task":{{"type":"worker","index":{i}}}', line)
      self.assertIn("-m launch.train --replicator=multi_worker --model=mlp --config=local",
                    line)
      ports.update(p for p in line.split('"') if p.startswith("localhost:"))
    self.assertLen(ports, 3)

  def test_bad_arguments(self):
    self.assertEqual(self._script().returncode, 2)
    out = self._script("zero")
    self.assertEqual(out.returncode, 2)
    self.assertIn("N must be an integer >= 1, got 'zero'", out.stderr)
    out = self._script("2", "--replicator=cpu")
    self.assertEqual(out.returncode, 2)
    self.assertIn("do not pass --replicator", out.stderr)
    out = self._script("--help")
    self.assertEqual(out.returncode, 0)
    self.assertIn("TF_CONFIG", out.stdout)


if __name__ == "__main__":
  tf.test.main()
