"""bench/e2e_link.py: flag validation, the root check and cleanup (no root needed).

Nothing here creates a namespace or starts a worker: the testbed runs with a
fake command runner, a fake Popen and a fake killpg that record what they were
asked to do.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench import e2e_link


# --- fakes -----------------------------------------------------------------------


class FakeRunner:
  """Records commands; fails those matching `fail` (a substring of the command)."""

  def __init__(self, fail: str | None = None, error: str = "boom", netem: bool = False):
    self.commands: list[list[str]] = []
    self.fail, self.error, self.netem = fail, error, netem

  def __call__(self, cmd, check=True):
    cmd = list(cmd)
    self.commands.append(cmd)
    text = " ".join(cmd)
    if "netem" in cmd and not self.netem:
      raise e2e_link.CommandError(f"{text} failed (2): Error: Specified qdisc kind is unknown.")
    if self.fail and self.fail in text:
      if check:
        raise e2e_link.CommandError(f"{text} failed (1): {self.error}")
      return ""
    if cmd[:2] == ["ip", "-j"]:
      return json.dumps([{"stats64": {"tx": {"bytes": 1000, "packets": 10},
                                      "rx": {"bytes": 900, "packets": 9}}}])
    if cmd[:2] == ["tc", "-j"]:
      return json.dumps([{"kind": "tbf", "drops": 2}])
    return ""

  def matching(self, *words):
    return [c for c in self.commands if all(w in c for w in words)]


class FakeProc:
  """A worker that ends on SIGTERM (or, if `stubborn`, only on SIGKILL)."""

  def __init__(self, pid: int, stubborn: bool = False):
    self.pid, self.stubborn, self.returncode = pid, stubborn, None

  def poll(self):
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      raise subprocess.TimeoutExpired("worker", timeout)
    return self.returncode


class FakeProcesses:
  """`popen` and `killpg` stand-ins sharing one process table."""

  def __init__(self, stubborn: bool = False):
    self.procs: dict[int, FakeProc] = {}
    self.signals: list[tuple[int, int]] = []
    self.started: list[list[str]] = []
    self.stubborn = stubborn

  def popen(self, cmd, **kwargs):
    assert kwargs.get("start_new_session"), "workers need their own process group"
    proc = FakeProc(1000 + len(self.procs), self.stubborn)
    self.procs[proc.pid] = proc
    self.started.append(list(cmd))
    return proc

  def killpg(self, pgid, sig):
    self.signals.append((pgid, sig))
    proc = self.procs[pgid]
    if sig == signal.SIGKILL or not proc.stubborn:
      proc.returncode = -sig


def make_testbed(runner=None, stubborn=False, num_workers=2):
  procs = FakeProcesses(stubborn)
  bed = e2e_link.Testbed(runner or FakeRunner(), tag="42", popen=procs.popen,
                         killpg=procs.killpg, log=io.StringIO(), num_workers=num_workers)
  return bed, procs


# --- flags -----------------------------------------------------------------------


@pytest.mark.parametrize("argv,flag", [
    (["--rate=fast"], "--rate"),
    (["--rate=100"], "--rate"),
    (["--rate=1gbits"], "--rate"),
    (["--rate=500kbit"], "--rate"),
    (["--rate=100gbit"], "--rate"),
    (["--delay=5"], "--delay"),
    (["--delay=-1ms"], "--delay"),
    (["--delay=2s"], "--delay"),
    (["--shaper=htb"], "--shaper"),
    (["--optimizer=lamb"], "--optimizer"),
    (["--configs="], "--configs"),
    (["--configs=dense,foo"], "--configs"),
    (["--configs=dense,dense"], "--configs"),
    (["--steps=1"], "--steps"),
    (["--warmup_steps=0"], "--warmup_steps"),
    (["--steps=10", "--warmup_steps=10"], "--warmup_steps"),
    (["--eval_steps=0"], "--eval_steps"),
    (["--vocab_size=1"], "--vocab_size"),
    ([f"--vocab_size={e2e_link.MAX_VOCAB + 1}"], "--vocab_size"),
    (["--batch_size=0"], "--batch_size"),
    (["--batch_size=255"], "--batch_size"),
    (["--learning_rate=0"], "--learning_rate"),
    (["--learning_rate=nan"], "--learning_rate"),
    (["--sparsity=1"], "--sparsity"),
    (["--sparsity=0"], "--sparsity"),
    (["--mp_sparsity=1"], "--mp_sparsity"),
    (["--density=0"], "--density"),
    (["--density=1.5"], "--density"),
    (["--threshold_life=0"], "--threshold_life"),
    (["--compression_warmup=-1"], "--compression_warmup"),
    (["--min_count=-1"], "--min_count"),
    (["--steps=10", "--compression_warmup=11"], "--compression_warmup"),
    (["--sparsity_schedule=10:1"], "--sparsity_schedule"),
    (["--sparsity_schedule=0:0.9"], "--sparsity_schedule"),
    (["--sparsity_schedule=10"], "--sparsity_schedule"),
    (["--compressor_options=[1]"], "--compressor_options"),
    (["--compressor_options={"], "--compressor_options"),
    (["--seed=-1"], "--seed"),
    (["--nice=20"], "--nice"),
    (["--port=80"], "--port"),
    (["--port=65534"], "--port"),
    (["--timeout=0"], "--timeout"),
    (["--workers=1"], "--workers"),
    ([f"--workers={e2e_link.MAX_WORKERS + 1}"], "--workers"),
    (["--workers=3"], "--batch_size"),  # 256 rows do not split over 3 workers
    (["--workers=8", "--port=65500"], "--port"),
    (["--plot_json=/nonexistent.json", "--png=/tmp/x.png"], "--plot_json"),
])
def test_bad_flag_is_named(argv, flag):
  with pytest.raises(e2e_link.FlagError, match=flag):
    e2e_link.parse_args(argv)


def test_sparsity_schedule_error_names_the_word_none_the_flag_takes():
  with pytest.raises(e2e_link.FlagError) as err:
    e2e_link.parse_args(["--sparsity_schedule=nope"])
  assert str(err.value) == ("--sparsity_schedule: each item must be steps:sparsity with "
                            "steps >= 1 and sparsity in (0, 1), or the single word 'none' "
                            "for no schedule, got 'nope'")
  assert e2e_link.parse_args(["--sparsity_schedule=none"]).sparsity_schedule == "none"
  with pytest.raises(e2e_link.FlagError, match="got 'none'"):  # only on its own
    e2e_link.parse_args(["--sparsity_schedule=10:0.9,none"])


def test_defaults_presets_and_units():
  full = e2e_link.parse_args([])
  assert (full.rate_bps, full.delay_s) == (1e9, 5e-4)
  assert full.config_list == e2e_link.DEFAULT_CONFIGS
  assert full.optimizer == "adam"
  argv = e2e_link.worker_argv(e2e_link.parse_args(["--optimizer=sgd"]), "dctdp_fc", "/x")
  assert "--optimizer=sgd" in argv and "--config=dctdp_fc" in argv
  argv = e2e_link.worker_argv(e2e_link.parse_args(["--optimizer=momentum"]), "dctdp", "/x")
  assert "--optimizer=momentum" in argv
  argv = e2e_link.worker_argv(e2e_link.parse_args(["--compression_warmup=5"]), "dctdp", "/x")
  assert "--compression_warmup=5" in argv
  assert full.vocab_size == e2e_link.FULL["vocab_size"]
  quick = e2e_link.parse_args(["--quick", "--steps=7", "--rate=100mbit", "--delay=200us",
                               "--configs=topk, dense"])
  assert quick.steps == 7  # an explicit flag beats the preset
  assert quick.vocab_size == e2e_link.QUICK["vocab_size"]
  assert (quick.rate_bps, quick.delay_s) == (1e8, pytest.approx(2e-4))
  assert quick.config_list == ("topk", "dense")
  assert e2e_link.parse_rate("2.5Gbit") == 2.5e9
  assert e2e_link.parse_delay("0ms") == 0.0


def test_driver_checks_flags_as_the_launcher_without_tensorflow():
  # The driver imports the launcher's TensorFlow-free checks, not TensorFlow.
  code = ("import sys; from bench import e2e_link; "
          "print(sorted(m for m in ('tensorflow', 'launch.train', 'launch.registry') "
          "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=e2e_link.REPO_ROOT).stdout
  assert out.strip() == "[]"
  from launch import registry  # pylint: disable=g-import-not-at-top
  assert e2e_link.OPTIMIZERS == registry.OPTIMIZERS


def test_worker_passes_the_compression_warmup_to_the_launcher():
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  for flags, config, want in (([], "dctdp", 0),
                              (["--compression_warmup=5"], "dctdp_fc", 5)):
    argv = e2e_link.worker_argv(e2e_link.parse_args(flags), config, "/x")
    cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
    assert cfg["warmup_steps"] == want
    assert cfg["compression"] == "dct"


def test_worker_passes_mp_rescale_to_dctdp_mp():
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  assert set(e2e_link.MP_RESCALES) == set(tf_dct.dct_mp.RESCALES)
  for flags, config, want in (([], "dctdp_mp", "none"),
                              (["--mp_rescale=l1"], "dctdp_mp", "l1"),
                              (["--mp_rescale=l1"], "dctdp", "none")):
    argv = e2e_link.worker_argv(e2e_link.parse_args(flags), config, "/x")
    cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
    assert cfg["mp_rescale"] == want, (flags, config)
  with pytest.raises(SystemExit):  # argparse names the choices
    e2e_link.parse_args(["--mp_rescale=l2"])


def test_worker_passes_min_count_to_compressing_configs_only():
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  for flags, config, want in (([], "dctdp", None),
                              (["--min_count=8"], "dctdp", 8),
                              (["--min_count=8"], "native", None)):
    argv = e2e_link.worker_argv(e2e_link.parse_args(flags), config, "/x")
    cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
    assert cfg.get("min_count") == want, (flags, config)


def test_worker_passes_the_sparsity_schedule_to_dct_only():
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  for flags, config, want in (([], "dctdp", ()),
                              (["--sparsity_schedule=10:0.9,5:0.97"], "dctdp",
                               ((10, 0.9), (5, 0.97))),
                              (["--sparsity_schedule=none"], "dctdp", ()),
                              (["--sparsity_schedule=10:0.9"], "topk", ())):
    argv = e2e_link.worker_argv(e2e_link.parse_args(flags), config, "/x")
    cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
    assert tuple(cfg.get("sparsity_schedule") or ()) == want, (flags, config)


def test_worker_compressors_record_gradient_types_through_a_subclass():
  from tests import util  # pylint: disable=g-import-not-at-top
  util.setup_cpus()  # the first op of a process fixes its devices for every module
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  from models.flavour import keras  # pylint: disable=g-import-not-at-top
  for config, kind in (("dense", e2e_worker.DensifiedDense), ("native", "Dense"),
                       ("dctdp", "DCTDP"), ("topk", "TopK")):
    argv = e2e_link.worker_argv(e2e_link.parse_args(["--quick"]), config, "/x")
    cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
    types = {}
    compressor = e2e_worker.make_compressor(config, cfg, types)
    base = kind if isinstance(kind, type) else getattr(tf_dct.compression, kind)
    assert isinstance(compressor, base), (config, type(compressor).__mro__)
    if config == "dctdp":
      assert compressor.sparsity == cfg["sparsity"]
      with_options = e2e_worker.make_compressor(config, cfg, {}, {"min_count": 3})
      assert (compressor.min_count, with_options.min_count) == (64, 3)
    rows = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([1]), tf.constant([4, 2]))
    repl = tf_dct.Replicator(["/cpu:0"])
    with repl.scope():
      table = tf.Variable(tf.zeros([4, 2]), name="table")
      bias = tf.Variable(0.0, name="b")
    repl.wrap_optimizer(keras.optimizers.SGD(0.1), compression=compressor)

    def step():
      compressor.aggregate([(rows, table), (tf.constant(1.0), bias)])
      return tf.constant(0)

    repl.run(step)
    assert types["table"] == "IndexedSlices" and set(types) == {"table", "b"}, (config, types)


def test_launcher_compressor_class_must_subclass_the_flags_class():
  import tf_dct  # pylint: disable=g-import-not-at-top
  from bench import e2e_worker  # pylint: disable=g-import-not-at-top
  from launch import train  # pylint: disable=g-import-not-at-top
  argv = e2e_link.worker_argv(e2e_link.parse_args(["--quick"]), "dctdp", "/x")
  cfg = e2e_worker.launcher_config(e2e_worker.parse_args(argv))
  with pytest.raises(TypeError, match=r"cls must be a subclass of "
                     r"tf_dct.compression.DCTDP \(--compression=dct\)"):
    train.make_compressor(cfg, cls=tf_dct.compression.TopK)
  assert train.make_compressor(dict(cfg, compression="none")) is None


def test_main_reports_bad_flag_before_anything(capsys):
  def factory():
    raise AssertionError("no testbed may be created for a bad flag")
  assert e2e_link.main(["--rate=fast"], testbed_factory=factory, geteuid=lambda: 0) == 2
  assert "--rate" in capsys.readouterr().err


def test_refuses_without_root(capsys):
  def factory():
    raise AssertionError("nothing may be touched without root")
  status = e2e_link.main(["--quick"], testbed_factory=factory, geteuid=lambda: 1000,
                         install_signals=False)
  assert status == 1
  err = capsys.readouterr().err
  assert "must run as root" in err and "Nothing was changed" in err


# --- testbed and cleanup -----------------------------------------------------------


def test_setup_falls_back_to_tbf_and_cleanup_removes_everything():
  bed, procs = make_testbed()
  shaping = bed.setup(1e9, 5e-4, "auto")
  assert (shaping.shaper, shaping.delay_emulated) == ("tbf", False)
  runner = bed.run
  assert [c[-1] for c in runner.matching("netns", "add")] == bed.namespaces
  assert len(runner.matching("tbf")) == 2           # both ends shaped
  assert len(runner.matching("gso_max_segs")) == 2  # MTU frames by default
  for i in range(2):
    bed.start_worker(i, ["--config=dense"], {}, os.devnull, nice=5)
  assert all(cmd[:4] == ["ip", "netns", "exec", bed.namespaces[i]]
             for i, cmd in enumerate(procs.started))
  before = len(runner.commands)
  bed.cleanup()
  assert sorted(procs.signals) == [(1000, signal.SIGTERM), (1001, signal.SIGTERM)]
  deleted = [c[-1] for c in runner.matching("netns", "del")]
  assert sorted(deleted) == sorted(bed.namespaces)
  assert runner.matching("link", "del", bed.veths[0])
  after = len(runner.commands)
  assert after > before
  bed.cleanup()  # idempotent: nothing more to do
  assert len(runner.commands) == after and len(procs.signals) == 2


def test_four_workers_meet_at_a_shaped_bridge():
  bed, procs = make_testbed(num_workers=4)
  shaping = bed.setup(1e8, 0.0, "tbf")
  runner = bed.run
  switch = f"{e2e_link.NS_PREFIX}42_4"
  assert bed.switch == switch
  assert [c[-1] for c in runner.matching("netns", "add")] == bed.namespaces + [switch]
  assert runner.matching("-n", switch, "br0", "type", "bridge")
  assert len(runner.matching("type", "veth")) == 4
  # Each bridge port is enslaved to br0; each worker's end is in its namespace.
  for port in bed.ports:
    assert runner.matching("-n", switch, port, "master", "br0")
  for ns, dev, addr in zip(bed.namespaces, bed.veths, bed.addresses):
    assert runner.matching("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
  # Both ends of every link shaped: what a worker sends and what it receives.
  tbf = runner.matching("tbf")
  assert sorted((c[2], c[6]) for c in tbf) == sorted(
      list(zip(bed.namespaces, bed.veths)) + [(switch, p) for p in bed.ports])
  assert len(shaping.commands) == 8
  assert max(len(d) for d in bed.veths + bed.ports) <= 15  # IFNAMSIZ
  for i in range(4):
    bed.start_worker(i, ["--config=dense"], {}, os.devnull, nice=0)
  assert len(bed.counters()) == 4
  bed.cleanup()
  assert sorted(c[-1] for c in runner.matching("netns", "del")) == sorted(
      bed.namespaces + [switch])
  assert len(procs.signals) == 4
  # The switch namespace of a dead run is stale like the workers'.
  assert e2e_link.stale_namespaces([switch], alive=lambda pid: False) == [switch]


def test_netem_shapes_both_ends_with_rate_and_delay():
  bed, _ = make_testbed(FakeRunner(netem=True))
  shaping = bed.setup(1e8, 5e-4, "auto", gso=True)
  assert (shaping.shaper, shaping.delay_emulated) == ("netem", True)
  netem = bed.run.matching("netem")
  assert [c[2] for c in netem] == bed.namespaces
  assert all("100000000bit" in c and "500us" in c for c in netem)
  assert not bed.run.matching("gso_max_segs")
  bed.cleanup()


def test_netem_required_but_missing_is_a_clear_error_and_cleans_up():
  bed, _ = make_testbed()
  with pytest.raises(e2e_link.CommandError, match="sch_netem"):
    with e2e_link.CleanupOnExit(bed, install_signals=False):
      bed.setup(1e9, 5e-4, "netem")
  assert sorted(c[-1] for c in bed.run.matching("netns", "del")) == sorted(bed.namespaces)


def test_cleanup_after_partial_setup():
  # `ip link add` fails: both namespaces exist, the veth does not.
  bed, _ = make_testbed(FakeRunner(fail="link add"))
  with pytest.raises(e2e_link.CommandError):
    bed.setup(1e9, 0.0)
  bed.cleanup()
  assert sorted(c[-1] for c in bed.run.matching("netns", "del")) == sorted(bed.namespaces)
  # First namespace created, the second failed: both are still deleted (the
  # failed one tolerantly, with check=False).
  bed, _ = make_testbed(FakeRunner(fail=f"netns add {e2e_link.NS_PREFIX}42_1"))
  with pytest.raises(e2e_link.CommandError):
    bed.setup(1e9, 0.0)
  bed.cleanup()
  assert sorted(c[-1] for c in bed.run.matching("netns", "del")) == sorted(bed.namespaces)
  assert not bed.run.matching("link", "del")  # the veth was never created


def test_cleanup_tolerates_failing_deletes():
  bed, _ = make_testbed(FakeRunner(fail="del"))
  bed.setup(1e9, 0.0)
  bed.cleanup()  # must not raise
  assert len(bed.run.matching("netns", "del")) == 2


def test_stubborn_worker_gets_sigkill():
  bed, procs = make_testbed(stubborn=True)
  bed.start_worker(0, [], {}, os.devnull, nice=0)
  bed.stop_workers(grace=0.01)
  assert procs.signals == [(1000, signal.SIGTERM), (1000, signal.SIGKILL)]
  assert not bed.procs


def test_cleanup_runs_on_exception_and_unregisters():
  bed, procs = make_testbed()
  with pytest.raises(RuntimeError, match="mid-run"):
    with e2e_link.CleanupOnExit(bed, install_signals=False):
      bed.setup(1e9, 0.0)
      bed.start_worker(0, [], {}, os.devnull, nice=0)
      raise RuntimeError("mid-run")
  assert procs.signals == [(1000, signal.SIGTERM)]
  assert sorted(c[-1] for c in bed.run.matching("netns", "del")) == sorted(bed.namespaces)
  assert not bed.created_namespaces and not bed.root_veths


def test_sigterm_cleans_up_and_restores_handlers():
  bed, procs = make_testbed()
  previous = signal.getsignal(signal.SIGTERM)
  with pytest.raises(SystemExit) as exit_info:
    with e2e_link.CleanupOnExit(bed):
      bed.setup(1e9, 0.0)
      bed.start_worker(0, [], {}, os.devnull, nice=0)
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(200):  # the handler raises at the next bytecode or in sleep
        time.sleep(0.01)
      raise AssertionError("the handler should have raised SystemExit")
  assert exit_info.value.code == 128 + signal.SIGTERM
  assert procs.signals == [(1000, signal.SIGTERM)]
  assert len(bed.run.matching("netns", "del")) == 2
  assert signal.getsignal(signal.SIGTERM) == previous


def test_main_cleans_up_when_the_run_fails(monkeypatch, capsys):
  monkeypatch.setattr(e2e_link.shutil, "which", lambda name: f"/usr/sbin/{name}")
  beds = []

  def factory(num_workers):
    bed, _ = make_testbed(FakeRunner(fail="tbf", error="RTNETLINK answers: busy"),
                          num_workers=num_workers)
    beds.append(bed)
    return bed

  status = e2e_link.main(["--quick"], testbed_factory=factory, geteuid=lambda: 0,
                         install_signals=False)
  assert status == 1
  assert "RTNETLINK answers: busy" in capsys.readouterr().err
  assert sorted(c[-1] for c in beds[0].run.matching("netns", "del")) == sorted(
      beds[0].namespaces)


def test_stale_namespaces_only_of_dead_runs():
  names = ["dcte2e_11_0", "dcte2e_11_1", "dcte2e_22_0", "other_33_0", "dcte2e_x_0"]
  assert e2e_link.stale_namespaces(names, alive=lambda pid: pid == 22) == [
      "dcte2e_11_0", "dcte2e_11_1"]


def test_counters_and_summary_arithmetic():
  bed, _ = make_testbed()
  counters = bed.counters()
  assert counters[0] == {"tx_bytes": 1000, "rx_bytes": 900, "tx_packets": 10,
                         "qdisc_drops": 2}

  def worker(sent):
    return {"timed_steps": 4, "window_seconds": 2.0, "step_times": [0.5] * 4,
            "per_step": {"dp_bytes_sent": sent, "dp_stock_bytes": 2e6,
                         "dp_dense_bytes": 4e6, "mp_bytes": 0, "mp_dense_bytes": 0},
            "eval": {"loss": 0.5}, "table_entries": 10, "num_parameters": 20}

  raw = {"config": "dctdp", "workers": [worker(1e6), worker(1e6)], "wall_seconds": 9.0,
         "before": [{"tx_bytes": 0, "tx_packets": 0, "qdisc_drops": 0}] * 2,
         "after": [{"tx_bytes": 4.4e6, "tx_packets": 4000, "qdisc_drops": 0}] * 2}
  row = e2e_link.summarize(raw, rate_bps=1e8)
  assert row["train_loss_tail"] is None  # these workers report no losses
  raw["workers"][0]["losses"] = [5.0, 4.0, 3.0, 2.0, 1.0]
  tail = e2e_link.summarize(raw, rate_bps=1e8)
  assert tail["train_loss_tail"] == pytest.approx(2.0)  # steps 3-5
  assert tail["tail_steps"] == "3-5"
  assert row["step_ms"] == pytest.approx(500.0)
  assert row["wire_bytes"] == pytest.approx(1.1e6)
  assert row["wire_over_acct"] == pytest.approx(1.1)
  assert row["utilization"] == pytest.approx(4.4e6 * 8 / (1e8 * 2.0))
  assert row["stock_bytes"] == pytest.approx(2e6)
  assert row["dense_bytes"] == pytest.approx(4e6)


def _row(config, step_ms, test_loss, acct=1e6, stock=2e6):
  return {"config": config, "step_ms": step_ms, "median_step_ms": step_ms,
          "cpu_ms": None, "acct_bytes": acct, "stock_bytes": stock,
          "dense_bytes": 4e6, "wire_bytes": 1.05 * acct, "wire_over_acct": 1.05,
          "tcp_payload_bytes": acct, "wire_packets": 100, "utilization": 0.5,
          "qdisc_drops": 0, "mp_bytes": 0, "mp_dense_bytes": 0, "test_loss": test_loss}


def test_report_ratios_vs_native_first():
  rows = [_row("native", 100.0, 0.5, acct=2e6), _row("dense", 400.0, 0.5, acct=4e6),
          _row("dctdp", 80.0, 0.51)]
  out = io.StringIO()
  shaping = e2e_link.Shaping("netem", True, [])
  verdict = e2e_link.report(rows, e2e_link.parse_args([]), shaping, out)
  assert verdict["step_ratio"] == {"dense": pytest.approx(4.0),
                                   "dctdp": pytest.approx(0.8)}
  assert verdict["loss_rel"]["dctdp"] == pytest.approx(0.02)
  assert verdict["step_ratio_dense"]["dctdp"] == pytest.approx(0.2)
  text = out.getvalue()
  header = next(line for line in text.splitlines() if line.startswith("| config"))
  assert header.index("vs native") < header.index("vs dense")
  assert header.index("loss vs native") < header.index("loss vs dense")
  dctdp = next(line for line in text.splitlines() if line.startswith("| dctdp"))
  cells = [c.strip() for c in dctdp.split("|")[1:-1]]
  assert cells[2:7] == ["0.800x", "0.200x", "0.51000", "+2.000%", "+2.000%"]
  assert cells[9] == "2.000x"  # stock / accounting
  assert ("- dctdp: step time 0.800x native (stock TF), test loss +2.000% vs "
          "native; 0.200x dense (densified all-reduce), +2.000% vs dense") in text
  # The training loss over the last 60% of the steps, against native's.
  rows[0].update(train_loss_tail=0.4, tail_steps="41-100")
  rows[2].update(train_loss_tail=0.404, tail_steps="41-100")
  out = io.StringIO()
  verdict = e2e_link.report(rows, e2e_link.parse_args([]), shaping, out)
  assert verdict["train_rel"] == {"dctdp": pytest.approx(0.01)}
  assert "training loss over steps 41-100 +1.000% vs native" in out.getvalue()
  # Without native the ratios against it are "-", and the report says so.
  out = io.StringIO()
  verdict = e2e_link.report(rows[1:], e2e_link.parse_args([]), shaping, out)
  assert verdict["step_ratio"] == {}
  assert "no native configuration in --configs" in out.getvalue()


def _result(rate, optimizer, ratios, losses):
  return {"args": {"rate": rate, "optimizer": optimizer, "learning_rate": 1e-3,
                   "workers": 2, "steps": 100},
          "verdict": {"step_ratio": ratios, "loss_rel": losses}}


def test_plot_json_draws_without_root(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  paths = []
  for i, rate in enumerate(("100mbit", "1gbit")):
    paths.append(str(tmp_path / f"r{i}.json"))
    with open(paths[-1], "w", encoding="utf-8") as f:
      json.dump(_result(rate, "adam", {"dctdp": 0.5 + i / 4}, {"dctdp": 0.012}), f)
  png = str(tmp_path / "fig.png")
  status = e2e_link.main([f"--plot_json={','.join(paths)}", f"--png={png}"],
                         geteuid=lambda: 1000)
  assert status == 0
  assert "drew 2 run(s)" in capsys.readouterr().out
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert e2e_link._label(_result("100mbit", "adam", {}, {})) == (
      "adam(0.001), 100 Mbit/s, 2 workers, 100 steps")
  with pytest.raises(ValueError, match="nothing to draw"):
    e2e_link.plot([_result("1gbit", "sgd", {}, {})], png)


def test_plot_json_needs_png():
  with pytest.raises(e2e_link.FlagError, match="--plot_json needs --png"):
    e2e_link.parse_args(["--plot_json=a.json"])
