"""bench/quality.py: its summary math, tables, flags and one tiny run in process."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from unittest import mock

from absl.testing import parameterized
import numpy as np
import pytest
import tensorflow as tf

from bench import plotting
from bench import quality
from tests import util

# Half the replicas to trace (the second device of each idles), as in
# tests/launch/test_train.py; the 4 logical CPUs stay split the same way.
TWO_BY_TWO = {"num_replicas": 2, "num_devices_per_replica": 2}


def setUpModule():
  util.setup_cpus()


def _record(compressor, seed, final, curve=None, *, metric="hr@10", optimizer="adam",
            payload=None, layer=None, model="ncf", stock=None, steps=None):
  curve = dict(curve or {100: final})
  return {"model": model, "optimizer": optimizer, "compressor": compressor, "seed": seed,
          "metric": metric, "learning_rate": 1e-3, "steps": steps or max(curve), "config": "local",
          "final": final, "curve": curve,
          "payload_ratio": payload, "layer_payload_ratio": layer,
          "stock_payload_ratio": stock, "notes": [],
          "diverged": "loss is nan" if math.isnan(final) else None}


def _rows(records):
  return {(r["optimizer"], r["compressor"]): r for r in quality.summarize(records)}


class SummaryTest(tf.test.TestCase):
  """`summarize` on hand-made records: every figure computed by hand."""

  def test_higher_is_better(self):
    rows = _rows([
        _record("dense", 0, 0.50, {10: 0.40, 20: 0.50}, payload=1.0, layer=1.0),
        _record("dense", 1, 0.60, {10: 0.50, 20: 0.60}, payload=1.0, layer=1.0),
        _record("dct", 0, 0.52, {10: 0.30, 20: 0.52}, payload=30.0, layer=4.0),
        _record("dct", 1, 0.56, {10: 0.40, 20: 0.56}, payload=40.0, layer=6.0),
        _record("dct_paper", 0, 0.40, {10: 0.40, 20: 0.40}),
        _record("dct_paper", 1, 0.42, {10: 0.50, 20: 0.42}),
        _record("topk", 0, 0.64), _record("topk", 1, 0.66),
    ])
    dense, dct = rows["adam", "dense"], rows["adam", "dct"]
    self.assertAlmostEqual(dense["final"], 0.55, places=12)
    self.assertAlmostEqual(dense["rel"], 0.0, places=12)
    self.assertAlmostEqual(dense["dense_spread"], 0.10 / 0.55, places=12)
    self.assertAlmostEqual(dct["final"], 0.54, places=12)
    self.assertAlmostEqual(dct["rel"], -0.01 / 0.55, places=12)
    self.assertAlmostEqual(dct["dense_spread"], 0.10 / 0.55, places=12)
    self.assertTrue(dct["within"])
    self.assertEqual(dct["verdict"], "within")
    self.assertEqual(sorted(dct["curve"]), [10, 20])
    self.assertAlmostEqual(dct["curve"][10], 0.35, places=12)
    self.assertAlmostEqual(dct["curve_rel"][10], (0.35 - 0.45) / 0.45, places=12)
    self.assertAlmostEqual(dct["curve_rel"][20], -0.01 / 0.55, places=12)
    self.assertAlmostEqual(dct["worst_rel"], (0.35 - 0.45) / 0.45, places=12)
    self.assertAlmostEqual(dct["payload_ratio"], 35.0, places=12)
    self.assertAlmostEqual(dct["layer_payload_ratio"], 5.0, places=12)
    self.assertEqual(dct["seeds"], [0, 1])
    # Paired by seed: gaps +0.02 and -0.04 (over 0.55), deviations 0.03.
    self.assertAlmostEqual(dct["rel_se"], 0.03 / 0.55, places=12)
    self.assertTrue(math.isnan(dense["rel_se"]))
    paper = rows["adam", "dct_paper"]
    self.assertAlmostEqual(paper["rel"], (0.41 - 0.55) / 0.55, places=12)
    self.assertFalse(paper["within"])
    self.assertEqual(paper["verdict"], "worse")
    self.assertAlmostEqual(paper["curve_rel"][10], 0.0, places=12)  # (0.45 - 0.45)
    self.assertAlmostEqual(paper["worst_rel"], (0.41 - 0.55) / 0.55, places=12)
    topk = rows["adam", "topk"]
    self.assertAlmostEqual(topk["rel"], 0.10 / 0.55, places=12)
    self.assertEqual(topk["verdict"], "better")
    self.assertIsNone(topk["payload_ratio"])

  def test_lower_is_better_and_the_spread_edges(self):
    rows = _rows([
        _record("dense", 0, 100.0, metric="perplexity"),
        _record("dense", 1, 110.0, metric="perplexity"),
        _record("dct", 0, 120.0, metric="perplexity"),
        _record("dct", 1, 120.0, metric="perplexity"),
        _record("topk", 0, 90.0, metric="perplexity"),
        _record("topk", 1, 94.0, metric="perplexity"),
        _record("deft", 0, 100.0, metric="perplexity"),  # mean 110: dense's max
        _record("deft", 1, 120.0, metric="perplexity"),
    ])
    self.assertTrue(rows["adam", "dense"]["lower_is_better"])
    self.assertAlmostEqual(rows["adam", "dense"]["dense_spread"], 10 / 105, places=12)
    dct = rows["adam", "dct"]
    self.assertAlmostEqual(dct["rel"], 15 / 105, places=12)
    self.assertEqual(dct["verdict"], "worse")
    self.assertAlmostEqual(dct["worst_rel"], 15 / 105, places=12)
    topk = rows["adam", "topk"]
    self.assertAlmostEqual(topk["rel"], -13 / 105, places=12)
    self.assertEqual(topk["verdict"], "better")
    self.assertAlmostEqual(topk["worst_rel"], -13 / 105, places=12)
    self.assertEqual(rows["adam", "deft"]["verdict"], "within")  # the range is closed

  def test_groups_are_per_optimizer_and_divergence_is_reported(self):
    rows = _rows([
        _record("dense", 0, 0.5), _record("dense", 1, 0.7),
        _record("dense", 0, 0.2, optimizer="momentum"),
        _record("dense", 1, 0.4, optimizer="momentum"),
        _record("dct", 0, 0.3, optimizer="momentum"),
        _record("dct", 1, math.nan, optimizer="momentum"),
    ])
    self.assertAlmostEqual(rows["adam", "dense"]["final"], 0.6, places=12)
    self.assertAlmostEqual(rows["momentum", "dense"]["final"], 0.3, places=12)
    self.assertAlmostEqual(rows["momentum", "dense"]["dense_spread"], 0.2 / 0.3, places=12)
    dct = rows["momentum", "dct"]
    self.assertTrue(math.isnan(dct["final"]))
    self.assertTrue(math.isnan(dct["rel"]))
    self.assertEqual(dct["verdict"], "diverged")
    self.assertEqual(dct["diverged"], 1)
    self.assertIn("1 of 2 seeds diverged", "\n".join(quality.notes_lines(list(rows.values()))))

  def test_without_dense_runs_the_relative_figures_are_nan(self):
    (row,) = quality.summarize([_record("dct", 0, 0.5), _record("dct", 1, 0.7)])
    self.assertAlmostEqual(row["final"], 0.6, places=12)
    self.assertTrue(math.isnan(row["rel"]))
    self.assertTrue(math.isnan(row["dense_spread"]))
    self.assertIsNone(row["within"])

  def test_standard_error_is_paired_by_seed_against_numpy(self):
    dense, dct = [0.50, 0.49, 0.53, 0.52], [0.52, 0.50, 0.53, 0.55]
    order = [2, 0, 3, 1]  # the compressed runs listed in another order
    rows = _rows([_record("dense", i, f, metric="loss") for i, f in enumerate(dense)]
                 + [_record("dct", i, dct[i], metric="loss") for i in order])
    gaps = (np.array(dct) - np.array(dense)) / np.mean(dense)
    self.assertAlmostEqual(rows["adam", "dct"]["rel"], float(np.mean(gaps)), places=12)
    self.assertAlmostEqual(rows["adam", "dct"]["rel_se"],
                           float(np.std(gaps, ddof=1) / np.sqrt(4)), places=12)

  def test_standard_error_of_unpaired_seeds_against_numpy(self):
    dense, topk = [0.50, 0.49, 0.53], [0.51, 0.55]
    rows = _rows([_record("dense", i, f, metric="loss") for i, f in enumerate(dense)]
                 + [_record("topk", i, f, metric="loss") for i, f in enumerate(topk)])
    want = np.sqrt(np.var(topk, ddof=1) / 2 + np.var(dense, ddof=1) / 3) / np.mean(dense)
    self.assertAlmostEqual(rows["adam", "topk"]["rel_se"], float(want), places=12)
    self.assertEqual(rows["adam", "topk"]["seeds"], [0, 1])
    # One seed on a side leaves no variance to estimate.
    self.assertTrue(math.isnan(quality.relative_se([0.5], dense)))
    self.assertTrue(math.isnan(quality.relative_se(topk, [0.5])))

  def test_relative(self):
    self.assertEqual(quality.relative(0.75, 0.5), 0.5)
    self.assertEqual(quality.relative(-0.75, -0.5), -0.5)  # relative to |reference|
    self.assertTrue(math.isnan(quality.relative(1.0, 0.0)))
    self.assertTrue(math.isnan(quality.relative(math.nan, 1.0)))


class LayerPayloadTest(tf.test.TestCase):

  def test_ratio_over_the_variables_without_embedding_in_their_name(self):
    def var(dense, sent):
      return {"total": {"dense_payload_bytes": dense, "payload_bytes": sent}}
    variables = {
        "mf_user/embeddings": var([4000.0, 4000.0], [10.0, 10.0]),
        "mlp_0/kernel": var([800.0, 800.0], [40.0, 60.0]),
        "mlp_0/bias": var([40.0, 40.0], [20.0, 20.0]),
    }
    self.assertAlmostEqual(quality.layer_payload_ratio(variables), 1680 / 140, places=12)
    self.assertIsNone(quality.layer_payload_ratio(
        {"embedding": variables["mf_user/embeddings"]}))
    self.assertEqual(quality.layer_payload_ratio({"b": var([8.0], [0.0])}), math.inf)


class TablesTest(tf.test.TestCase):

  def _rows(self):
    return quality.summarize([
        _record("dense", 0, 0.5, {5: 0.4, 10: 0.5}, payload=2.0, layer=1.0, stock=1.0),
        _record("dense", 1, 0.7, {5: 0.6, 10: 0.7}, payload=2.0, layer=1.0, stock=1.0),
        _record("dct", 0, 0.4, {5: 0.3, 10: 0.4}, payload=36.0, layer=8.0, stock=18.0),
        _record("dct", 1, 0.5, {5: 0.4, 10: 0.5}, payload=38.0, layer=10.0, stock=20.0),
    ])

  def test_results_table(self):
    lines = quality.results_table(self._rows()).splitlines()
    self.assertLen(lines, 4)
    self.assertEqual(lines[0].count("|"), 15)
    self.assertEqual(lines[2], "| ncf | hr@10 (higher better) | adam (0.001) | dense | 2 | 0.6000 "
                               "| - | - | 33.3% | - | - | 1.0x | 2.0x | 1.0x |")
    # s.e., paired by seed: gaps -0.1 and -0.2 (over 0.6), deviations 0.05: 8.3%.
    self.assertEqual(lines[3], "| ncf | hr@10 (higher better) | adam (0.001) | dct | 2 | 0.4500 | "
                               "-25.0% | 8.3% | 33.3% | worse | -30.0% | 19.0x | 37.0x | 9.0x |")

  def test_curves_table_and_report(self):
    curves = quality.curves_table(self._rows())
    self.assertIn("| compressor | 5 | 10 |", curves)
    self.assertIn("| dense | 0.5000 | 0.6000 |", curves)
    self.assertIn("| dct | 0.3500 (-30.0%) | 0.4500 (-25.0%) |", curves)
    text = quality.report(self._rows(), "python bench/quality.py --quick", 90.0)
    self.assertIn("Produced by `python bench/quality.py --quick` (1.5 min", text)

  def test_write_docs_replaces_only_the_marked_section(self):
    path = os.path.join(self.create_tempdir().full_path, "quality.md")
    with open(path, "w", encoding="utf-8") as f:
      f.write(f"# Title\n\nintro\n\n{quality.DOC_BEGIN}\nold table\n{quality.DOC_END}\n\nend\n")
    quality.write_docs("new table", None, path)
    with open(path, encoding="utf-8") as f:
      text = f.read()
    self.assertEqual(text, f"# Title\n\nintro\n\n{quality.DOC_BEGIN}\n\nnew table\n\n"
                           f"{quality.DOC_END}\n\nend\n")
    with open(path, "w", encoding="utf-8") as f:
      f.write("no markers\n")
    with self.assertRaisesRegex(quality.FlagError, "lacks the markers"):
      quality.write_docs("x", None, path)

  def test_command_line_drops_the_output_flags(self):
    self.assertEqual(
        quality.command_line(["--models=ncf", "--png", "/tmp/a.png", "--out=/tmp/a.md",
                              "--write_docs", "--json", "/tmp/a.json", "--seeds=0,1",
                              "--json=/tmp/b.json"]),
        "python bench/quality.py --models=ncf --seeds=0,1")


class FlagsTest(parameterized.TestCase):

  @parameterized.parameters(
      (["--models=ncf,foo"], "--models: unknown foo"),
      (["--optimizers=rmsprop"], "--optimizers: unknown rmsprop"),
      (["--compressors=dct,zip"], "--compressors: unknown 'zip'"),
      (["--compressors=dct+oops"], "expected +keyword=value"),
      (["--compressors=dct+sparsity=2"], "sparsity must be"),
      (["--compressors=dense+min_count=0"], "dense takes no options"),
      (["--compressors=dct,dct"], "lists a value twice"),
      (["--seeds=0"], "at least 2 distinct seeds"),
      (["--seeds=0,x"], "comma list of integers"),
      (["--steps=0"], "--steps must be >= 1"),
      (["--evals=0"], "--evals must be >= 1"),
      (["--learning_rate=0"], "--learning_rate must be a finite number > 0, got 0.0"),
      (["--learning_rate=nan"], "--learning_rate must be a finite number > 0, got nan"),
      (["--plot_json=" + __file__, "--learning_rate=0.1"],
       "--plot_json trains nothing: drop --learning_rate"),
      (["--steps=2", "--evals=3"], "must be >= --evals"),
      (["--models=dlrm", "--data_dir=/"], "has no ncf"),
      (["--metric=dlrm"], "--metric: expected model:key, got 'dlrm'"),
      (["--metric=dlrm:"], "--metric: expected model:key"),
      (["--models=ncf", "--metric=dlrm:loss"], "--metric: dlrm is not in --models (ncf)"),
      (["--metric=dlrm:loss,dlrm:loss"], "--metric lists dlrm:loss twice"),
      (["--plot_json=/nonexistent.json"], "--plot_json: no such file '/nonexistent.json'"),
      (["--plot_json=,"], "--plot_json: give a comma list of --json files"),
  )
  def test_bad_flags_are_refused_by_name(self, argv, message):
    with self.assertRaisesRegex(quality.FlagError, re.escape(message)):
      quality.parse_args(argv)

  def test_defaults_and_quick(self):
    args = quality.parse_args([])
    self.assertEqual(args.model_list, ["dlrm", "ncf", "lstm_lm", "transformer"])
    self.assertEqual(args.compressor_list, ["dense", "dct", "dct_paper"])
    self.assertEqual(args.seed_list, [0, 1])
    quick = quality.parse_args(["--quick", "--compressors=dct"])
    self.assertEqual(quick.model_list, ["ncf"])
    self.assertEqual(quick.compressor_list, ["dense", "dct"])  # dense always runs

  def test_learning_rate_reaches_every_run(self):
    seen = []

    def fake_run_one(model, optimizer, compressor, seed, **kwargs):
      seen.append((model, optimizer, kwargs["steps"], kwargs["settings"].get("learning_rate")))
      return {"metric": "auc", "final": 0.5, "diverged": None, "payload_ratio": 1.0,
              "wall_seconds": 0.0}

    args = quality.parse_args(["--models=dlrm", "--optimizers=momentum,adam",
                               "--compressors=dense", "--learning_rate=0.05"])
    with mock.patch.object(quality, "run_one", fake_run_one):
      quality.train_all(args, [])
    self.assertEqual(seen, [("dlrm", "momentum", 960, 0.05)] * 2
                     + [("dlrm", "adam", 240, 0.05)] * 2)
    seen.clear()
    args = quality.parse_args(["--models=dlrm", "--optimizers=momentum", "--compressors=dense"])
    with mock.patch.object(quality, "run_one", fake_run_one):
      quality.train_all(args, [])
    self.assertEqual(seen, [("dlrm", "momentum", 960, None)] * 2)  # the launcher's own

  def test_metric_overrides_the_headline_metric_of_its_model(self):
    self.assertEqual(quality.parse_args([]).metric_map, {})
    args = quality.parse_args(["--models=dlrm,ncf", "--metric=dlrm:loss"])
    self.assertEqual(args.metric_map, {"dlrm": ["loss"]})
    args = quality.parse_args(["--models=dlrm,ncf", "--metric=dlrm:auc,dlrm:loss"])
    self.assertEqual(args.metric_map, {"dlrm": ["auc", "loss"]})
    calls = []

    def fake_run_one(model, optimizer, compressor, seed, **kwargs):
      calls.append((model, kwargs["metric"]))
      return {"metric": kwargs["metric"], "final": 0.5, "diverged": None,
              "payload_ratio": 1.0, "wall_seconds": 0.0}

    with mock.patch.object(quality, "run_one", fake_run_one), \
        mock.patch.object(quality, "write_ratings"):
      quality.run(["dlrm", "transformer", "ncf"], ["adam"], ["dense"], [0], steps=2,
                  metrics={"dlrm": "loss"}, log=lambda line: None)
    # dlrm as asked; the others keep MODELS' metric (None: the launcher's).
    self.assertEqual(calls, [("dlrm", "loss"), ("transformer", "loss"), ("ncf", None)])

  def test_an_evaluation_key_the_model_lacks_is_refused_by_name(self):

    class FakeJob:
      optimizer = None

      def __init__(self, cfg, compressor=None):
        del cfg, compressor
        self.evals = {1: {"hr@10": 0.25, "ndcg@10": 0.125}}

      def setup(self):
        pass

      def run(self):
        pass

      def communication(self):
        return None

    with mock.patch("launch.train.Job", FakeJob):
      record = quality.run_one("ncf", "adam", "dense", 0, config="local", steps=1,
                               evals=1, metric="ndcg@10")
      self.assertEqual((record["curve"], record["final"]), ({1: 0.125}, 0.125))
      # Every evaluation key's curve is kept, for --metric at --plot_json time.
      self.assertEqual(record["curves"], {"hr@10": {1: 0.25}, "ndcg@10": {1: 0.125}})
      with self.assertRaisesRegex(quality.FlagError,
                                  re.escape("--metric: ncf evaluates hr@10,ndcg@10, not 'auc'")):
        quality.run_one("ncf", "adam", "dense", 0, config="local", steps=1, evals=1,
                        metric="auc")

  def _build(self, spec, model="ncf", optimizer="adam"):
    plan = quality.MODELS[model]
    cfg = quality.launcher_config(model, optimizer, 0, quality.parse_compressor(spec)[0],
                                  config=plan.config, steps=4, evals=1,
                                  settings=quality.plan_settings(plan, plan.config))
    return quality.build_compressor(spec, cfg)

  def test_spec_values_may_hold_commas(self):
    args = quality.parse_args(
        ["--compressors=dct+sparsity_schedule=((5,0.75),(5,0.9)),topk"])
    self.assertEqual(args.compressor_list,
                     ["dense", "dct+sparsity_schedule=((5,0.75),(5,0.9))", "topk"])
    comp, _ = self._build(args.compressor_list[1])
    self.assertEqual(comp.sparsity_schedule, ((5, 0.75), (5, 0.9)))

  def test_paper_specs_and_extra_keywords(self):
    self.assertEqual(quality.parse_compressor("dct_paper+sparsity=0.9"),
                     ("dct", {**quality.PAPER, "density_band": None, "value_dtype": None,
                              "sparsity": 0.9}))
    # Algorithm 1: no guard, float32 values
    comp, notes = self._build("dct_paper")
    self.assertEqual((type(comp).__name__, comp.density_band, comp.min_count,
                      comp.value_dtype, comp.adam, notes), ("DCTDP", None, 0, None, False, []))
    comp, _ = self._build("dct")  # the default: bfloat16 values
    self.assertEqual(comp.value_dtype, "bfloat16")
    self.assertIs(comp.exact_sizes, True)  # payloads priced as across a network
    comp, notes = self._build("topk+density=0.05")
    self.assertEqual((type(comp).__name__, comp.density), ("TopK", 0.05))
    self.assertEqual(notes, [])
    comp, notes = self._build("deft+not_an_option=1")
    self.assertEqual(type(comp).__name__, "DEFT")
    self.assertEqual(notes, ["DEFT takes no not_an_option= here: deft+not_an_option=1 runs "
                             "without it"])
    self.assertEqual(self._build("dense"), (None, []))

  def test_compressors_get_the_launchers_settings_at_the_default_rates(self):
    self.assertEqual(quality.plan_settings(quality.MODELS["ncf"], "local"),
                     {"sparsity": 0.99, "density": 0.01, "threshold_life": 1000})
    self.assertEqual(quality.plan_settings(quality.MODELS["dlrm"], "default"),
                     quality.DP_ONLY)
    # A local preset (NCF) runs at the default preset's rates, not the local
    # smoke run's 0.9 / 0.1 / 10.
    comp, _ = self._build("dct")
    self.assertEqual((comp.sparsity, comp.threshold_life, comp.min_count), (0.99, 1000, 64))
    self.assertEqual(self._build("topk")[0].density, 0.01)
    # DLRM under Adam: the launcher's residual decay (0.7) for every
    # sparsifier with Adam correction; the papers' settings and `adam=False`
    # run without it.
    for spec in ("dct", "topk", "deft"):
      self.assertEqual(self._build(spec, "dlrm")[0].residual_decay, 0.7)
      self.assertEqual(self._build(spec, "dlrm", "momentum")[0].residual_decay, 1.0)
      self.assertEqual(self._build(spec, "ncf")[0].residual_decay, 1.0)
      self.assertEqual(self._build(spec + "_paper", "dlrm")[0].residual_decay, 1.0)
      self.assertEqual(self._build(spec + "+adam=False", "dlrm")[0].residual_decay, 1.0)
    self.assertEqual(self._build("topk+residual_decay=0.8", "dlrm")[0].residual_decay, 0.8)
    self.assertEqual(self._build("topk", "dlrm", "momentum")[0].momentum, 0.9)

  def test_steps_per_optimizer(self):
    dlrm = quality.MODELS["dlrm"]
    self.assertEqual(quality.plan_steps(dlrm, "adam"), dlrm.steps)
    self.assertEqual(quality.plan_steps(dlrm, "momentum"), 960)
    self.assertEqual(quality.plan_steps(dlrm, "adagrad"), 960)
    self.assertEqual(quality.plan_steps(dlrm, "momentum", quick=True), dlrm.quick_steps)
    self.assertEqual(quality.plan_steps(quality.MODELS["ncf"], "momentum"),
                     quality.MODELS["ncf"].steps)


SETTINGS = {"quick": False, "evals": 2, "data_dir": "", "num_cpus": quality.NUM_CPUS}


class DocsResultsTest(tf.test.TestCase):
  """docs/quality.md's results are the rendering of the runs kept beside them."""

  def test_results_section_renders_from_the_kept_runs(self):
    runs = os.path.join(quality.REPO_ROOT, "docs", "quality_runs")
    files = sorted(os.path.join(runs, f) for f in os.listdir(runs) if f.endswith(".json"))
    self.assertNotEmpty(files)
    out = os.path.join(self.create_tempdir().full_path, "report.md")
    # The command docs/quality.md gives, with --out instead of --write_docs.
    with contextlib.redirect_stdout(io.StringIO()):
      code = quality.main([f"--plot_json={','.join(files)}", "--metric=dlrm:loss,dlrm:auc",
                           f"--out={out}"])
    self.assertEqual(code, 0)
    with open(out, encoding="utf-8") as f:
      markdown = f.read()
    with open(quality.DOC_PATH, encoding="utf-8") as f:
      text = f.read()
    section = text.split(quality.DOC_BEGIN, 1)[1].split(quality.DOC_END, 1)[0]
    section = section.replace("![metric curves](quality.png)", "")
    self.assertEqual(section.strip(), markdown.strip())


class JsonTest(tf.test.TestCase):
  """--json files and --plot_json on hand-made records: no training."""

  def _part(self, name, records, command="python bench/quality.py --models=ncf", wall=60.0,
            **settings):
    path = os.path.join(self.create_tempdir().full_path, name)
    plotting.save_json(quality.json_data(records, command=command, wall=wall,
                                        settings={**SETTINGS, **settings}), path)
    return path

  def _main(self, argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
      code = quality.main(argv)
    return code, err.getvalue()

  def _records(self, model="ncf", compressors=("dense", "dct"), optimizer="adam"):
    return [_record(c, seed, 0.5 + 0.1 * seed + 0.01 * k,
                    {5: 0.3 + 0.1 * seed, 10: 0.5 + 0.1 * seed + 0.01 * k}, model=model,
                    optimizer=optimizer, payload=2.0 + 30 * k, layer=1.0 + k,
                    stock=1.0 + 10 * k)
            for k, c in enumerate(compressors) for seed in (0, 1)]

  def test_round_trip_renders_the_identical_report(self):
    records = self._records()
    records.append(_record("topk", 0, math.nan, {5: 0.2}, payload=math.inf, steps=10))
    records.append(_record("topk", 1, 0.45, {5: 0.25, 10: 0.45}, payload=40.0))
    want = quality.report(quality.summarize(records), "python bench/quality.py --models=ncf",
                          95.0)
    path = self._part("run.json", records, wall=95.0)
    out = os.path.join(self.create_tempdir().full_path, "report.md")
    self.assertEqual(self._main([f"--plot_json={path}", f"--out={out}"]), (0, ""))
    with open(out, encoding="utf-8") as f:
      self.assertEqual(f.read(), want)
    self.assertEqual(quality.load_json(path)["records"][0]["curve"], {5: 0.3, 10: 0.5})

  def test_two_parts_merge_into_one_report(self):
    dense, dct = self._records(compressors=("dense",)), self._records(compressors=("dct",))
    for r in dct:
      r["compressor"] = "dct"
    lstm = self._records(model="lstm_lm")
    a = self._part("a.json", dense + lstm, "python bench/quality.py --compressors=dense", 60.0)
    b = self._part("b.json", dct, "python bench/quality.py --compressors=dct", 120.0)
    records, commands, wall = quality.merge([(f, quality.load_json(f)) for f in (a, b)])
    self.assertEqual((len(records), wall), (8, 180.0))
    rows = quality.summarize(records)
    # Grouped by model: ncf's dct (from the second part) beside its dense.
    self.assertEqual([(r["model"], r["compressor"]) for r in rows],
                     [("ncf", "dense"), ("ncf", "dct"), ("lstm_lm", "dense"),
                      ("lstm_lm", "dct")])
    self.assertEqual(rows, quality.summarize(dense + lstm + dct))  # dct vs dense across parts
    text = quality.report(rows, commands, wall)
    self.assertStartsWith(text, "Produced in 2 parts, `python bench/quality.py "
                          "--compressors=dense`, `python bench/quality.py --compressors=dct`, "
                          "merged from their --json files (3.0 min in all on the machine")

  def test_a_run_repeated_with_its_results_is_kept_once(self):
    # Every part runs dense: the same records in two files merge as one.
    dense = self._records(compressors=("dense",))
    dct = self._records(compressors=("dense", "dct"))
    a = self._part("a.json", dense, wall=60.0)
    b = self._part("b.json", dct, wall=90.0)
    records, _, wall = quality.merge([(f, quality.load_json(f)) for f in (a, b)])
    self.assertEqual((len(records), wall), (4, 150.0))
    self.assertEqual(quality.summarize(records), quality.summarize(dct))
    # A repeat whose time alone differs is the same run; one whose result
    # differs is refused.
    timed = self._part("timed.json", [dict(r, wall_seconds=99.0) for r in dense])
    self.assertLen(quality.merge([(f, quality.load_json(f)) for f in (a, timed)])[0], 2)
    # A record without the curves of every key matches one with them.
    curved = self._part("curved.json", [dict(r, curves={"hr@10": r["curve"]}) for r in dense])
    self.assertLen(quality.merge([(f, quality.load_json(f)) for f in (a, curved)])[0], 2)
    self.assertNotIn("curves", quality.load_json(a)["records"][0])
    other = self._part("other.json", [dict(r, final=r["final"] + 1e-9) for r in dense])
    with self.assertRaisesRegex(quality.FlagError, "with other results"):
      quality.merge([(f, quality.load_json(f)) for f in (a, other)])

  def test_incomparable_or_repeated_parts_are_refused_naming_the_file(self):
    a = self._part("a.json", self._records())
    cases = [
        (self._part("quick.json", self._records("lstm_lm"), quick=True),
         "quick.json ran with quick=True, {a} with quick=False: their runs are not comparable"),
        (self._part("evals.json", self._records("lstm_lm"), evals=4), "with evals=4"),
        (self._part("steps.json", [_record("topk", 0, 0.5, {20: 0.5})]),
         "steps.json ran ncf / adam with steps=20, {a} with steps=10: their runs are not "
         "comparable"),
        (self._part("twice.json", self._records(compressors=("dct",))),
         "ncf / adam / dct seed 0 is in {a} and in {twice} with other results; keep it "
         "in one file only"),
        (self._part("again.json", self._records(compressors=("topk", "topk"))),
         "ncf / adam / topk seed 0 is twice in {twice}; keep it in one file only"),
    ]
    for path, message in cases:
      message = message.format(a=a, twice=path)
      with self.assertRaisesRegex(quality.FlagError, re.escape(message)):
        quality.merge([(f, quality.load_json(f)) for f in (a, path)])
      code, err = self._main([f"--plot_json={a},{path}"])
      self.assertEqual(code, 2)
      self.assertIn(os.path.basename(path), err)
    bad = self._part("bad.json", [])
    with open(bad, "w", encoding="utf-8") as f:
      f.write("{}")
    self.assertEqual(self._main([f"--plot_json={bad}"]),
                     (2, f"quality: error: --plot_json: {bad} is not a bench/quality.py "
                         "--json file\n"))

  def test_plot_json_reports_each_metric_the_runs_kept(self):
    records = []
    for k, c in enumerate(("dense", "dct")):
      for seed in (0, 1):
        auc = {5: 0.6 + 0.01 * seed, 10: 0.7 + 0.01 * seed - 0.02 * k}
        loss = {5: 0.6 - 0.01 * seed, 10: 0.5 - 0.01 * seed + 0.01 * k}
        r = _record(c, seed, auc[10], auc, model="dlrm", metric="auc")
        r["curves"] = {"auc": auc, "loss": loss}
        records.append(r)
    path = self._part("dlrm.json", records)
    out = os.path.join(self.create_tempdir().full_path, "report.md")
    self.assertEqual(self._main([f"--plot_json={path}", "--metric=dlrm:auc,dlrm:loss",
                                 f"--out={out}"]), (0, ""))
    rows = quality.summarize(quality.expand_metrics(records, {"dlrm": ["auc", "loss"]}))
    self.assertEqual([(r["metric"], r["compressor"]) for r in rows],
                     [("auc", "dense"), ("auc", "dct"), ("loss", "dense"), ("loss", "dct")])
    self.assertAllClose(rows[3]["final"], 0.505)
    self.assertAllClose(rows[3]["rel"], 0.01 / 0.495)  # against dense's loss, not its AUC
    self.assertAllClose(rows[1]["rel"], -0.02 / 0.705)
    with open(out, encoding="utf-8") as f:
      text = f.read()
    self.assertIn("| dlrm | loss (lower better) | adam (0.001) | dct | 2 | 0.5050 | +2.0% | 0.0% |",
                  text)
    self.assertIn("Reported with `--metric=dlrm:auc,dlrm:loss`.", text)
    self.assertIn("| dlrm | auc (higher better) | adam (0.001) | dct | 2 | 0.6850 | -2.8% | 0.0% |",
                  text)
    code, err = self._main([f"--plot_json={path}", "--metric=dlrm:ndcg@10"])
    self.assertEqual(code, 2)
    self.assertIn("--metric: the run dlrm / adam / dense seed 0 kept auc,loss, not 'ndcg@10'",
                  err)

  def test_plot_json_refuses_the_training_flags(self):
    a = self._part("a.json", self._records())
    for flag in ("--models=ncf", "--seeds=0,1", "--evals=4", "--quick", "--json=/tmp/x.json"):
      message = f"--plot_json trains nothing: drop {flag.split('=')[0]}"
      with self.assertRaisesRegex(quality.FlagError, re.escape(message)):
        quality.parse_args([f"--plot_json={a}", flag])
    with self.assertRaisesRegex(quality.FlagError, "lists a file twice"):
      quality.parse_args([f"--plot_json={a},{a}"])

  def test_png_is_written_at_150_dpi(self):
    records = self._records() + self._records(optimizer="momentum")
    a = self._part("a.json", records)
    png = os.path.join(self.create_tempdir().full_path, "q.png")
    self.assertEqual(self._main([f"--plot_json={a}", f"--png={png}"]), (0, ""))
    with open(png, "rb") as f:
      head = f.read(24)
    self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
    width = int.from_bytes(head[16:20], "big")
    self.assertEqual(width, round(2 * 4.6 * 150))  # two panels at 150 dpi

  def test_panels_band_the_seed_range_with_distinct_styles(self):
    records = self._records(compressors=("dense", "dct", "dct_paper"))
    rows = quality.summarize(records)
    path = os.path.join(self.create_tempdir().full_path, "q.png")
    figs = []
    with mock.patch.object(plotting, "save", lambda fig, p: (plotting.finish(fig),
                                                           figs.append(fig))):
      quality.plot(rows, records, path)
    (ax,) = figs[0].axes
    self.assertLen(set(plotting.series_styles(figs[0])[0]), 3)
    self.assertEqual([ln.get_label() for ln in ax.get_lines()], ["dense", "dct", "dct_paper"])
    self.assertEqual(list(ax.get_lines()[0].get_ydata()), [0.35, 0.55])  # the seeds' mean
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    self.assertAllClose(sorted(set(band.round(12))), [0.3, 0.4, 0.5, 0.6])  # min..max per step
    plotting.pyplot().close(figs[0])


@pytest.mark.slow(seconds=17)  # one tiny training run per optimizer
class TinyRunTest(tf.test.TestCase):
  """The benchmark's core on ncf (local preset), 4 steps, dense and DCT-DP, 2 seeds."""

  def test_records_and_table(self):
    lines = []
    # NCF's local layers are a few hundred entries: DCT-DP's default floor of
    # 64 entries would send them whole, so the run compresses with 8.
    dct = "dct+min_count=8"
    records = quality.run(["ncf"], ["adam"], ["dense", dct], [0, 1], quick=True, steps=4,
                          evals=2, settings=TWO_BY_TWO, log=lines.append)
    self.assertLen(records, 4)
    self.assertLen(lines, 4)
    for r in records:
      self.assertIsNone(r["diverged"])
      self.assertEqual(r["metric"], "hr@10")
      self.assertEqual(sorted(r["curve"]), [2, 4])
      self.assertEqual(r["final"], r["curve"][4])
      self.assertBetween(r["final"], 0.0, 1.0)
    by = {(r["compressor"], r["seed"]): r for r in records}
    self.assertGreater(by[dct, 0]["payload_ratio"], 5 * by["dense", 0]["payload_ratio"])
    self.assertAlmostEqual(by["dense", 0]["stock_payload_ratio"], 1.0, places=6)
    self.assertGreater(by[dct, 0]["stock_payload_ratio"], 1.0)
    self.assertGreater(by[dct, 0]["layer_payload_ratio"], 1.0)
    rows = quality.summarize(records)
    self.assertEqual([r["compressor"] for r in rows], ["dense", dct])
    dense_mean = (by["dense", 0]["final"] + by["dense", 1]["final"]) / 2
    dct_mean = (by[dct, 0]["final"] + by[dct, 1]["final"]) / 2
    self.assertAlmostEqual(rows[1]["final"], dct_mean, places=12)
    if dense_mean:
      self.assertAlmostEqual(rows[1]["rel"], (dct_mean - dense_mean) / dense_mean, places=12)
    table = quality.results_table(rows).splitlines()
    self.assertLen(table, 4)
    self.assertTrue(table[2].startswith("| ncf | hr@10 (higher better) | adam ("))
    self.assertIn(f"| {dct} |", table[3])
