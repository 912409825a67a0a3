r"""End-to-end step time of DLRM on an emulated constrained link.

`--workers` worker processes (2 by default), each in its own Linux network
namespace with an address 10.77.0.<i + 1>/24. Two workers are joined by a
veth pair; more each have a veth to a bridge in a switch namespace. Every
link is shaped with `tc` at both ends, so each worker has the rate in each
direction (netem rate + delay when the kernel has netem, else tbf: rate
only, and the report says the delay was not emulated). Each configuration
runs on fresh workers (`bench/e2e_worker.py`, which trains with
`launch.train.Job` under `tf_dct.MultiWorkerReplicator`), same seed and data:

  native    the launcher's --compression=none: tf_dct Dense, which sends what
            stock TensorFlow sends: MLP gradients all-reduced, the embedding
            gradient's IndexedSlices all-gathered. The baseline of the ratios
  dense     ring all-reduce of every gradient, the embedding table's densified
            (4 bytes per entry: the DCT paper's dense baseline)
  dctdp     DCT-DP(sparsity 0.99, L = 1000)
  dctdp_mp  DCT-DP plus DCT-MP(0.9) at DLRM's paper splits (bottom_1, top_1).
            With one CPU per worker the split only masks in place; its bytes
            are what *would* cross a device boundary (DCTSplit accounting)
  deft      DEFT(density 0.01)
  topk      TopK(density 0.01)
  dctdp_fc  (opt-in) DCT-DP(0.99, L = 1000) on the MLP layers only, as DCT §3.1
            compresses DLRM; the embedding table is excluded
            (--compression_exclude=embeddings) and its IndexedSlices are
            all-gathered as in native

Printed per configuration: step time over the timed steps (after
--warmup_steps untimed steps), bytes per worker and step from tf_dct's
accounting and from the veth counters over exactly the timed steps (the
workers stop at a file handshake at both ends of the window, when every
collective of the step before has completed on every worker), their ratio, the
TCP payload (wire minus 66 header bytes per frame; GSO is off so every packet
is one frame), packets, CPU time per step, link utilization (wire bytes /
(rate x time), per direction), test loss on a fixed eval set after --steps
steps, and step time and test loss against native (stock TF) first, then
against dense, of the same run. The accounting's own bytes are also set
against what stock TF would send for the same gradients ("stock /
accounting"). Results and method: docs/performance.md.

Needs root (namespaces, veth, tc); refuses to start otherwise. Namespaces and
worker process groups are removed on exit, error, Ctrl-C and SIGTERM (workers
also die with the driver via PR_SET_PDEATHSIG); after a SIGKILL of the driver,
`--cleanup_stale` deletes the namespaces it left behind.

  sudo python bench/e2e_link.py --quick                       # ~4 min on 2 cores
  sudo python bench/e2e_link.py --rate=1gbit --delay=0.5ms    # ~30 min
  sudo python bench/e2e_link.py --rate=100mbit --delay=0.5ms --configs=native,dctdp
  sudo python bench/e2e_link.py --quick --workers=4 --png=/tmp/e2e.png
  python bench/e2e_link.py --plot_json=a.json,b.json --png=fig.png  # no root

`--png` draws step time and test loss against native per configuration;
`--plot_json` draws several earlier `--json` results into one figure.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a script: the repository root is not on it
  sys.path.insert(0, REPO_ROOT)
# pylint: disable=g-import-not-at-top,wrong-import-position
from launch.flag_checks import check_range  # TensorFlow-free, as this driver is
from launch.flag_checks import FlagError
from launch.flag_checks import OPTIMIZERS
from launch.flag_checks import parse_schedule
# pylint: enable=g-import-not-at-top,wrong-import-position

WORKER = os.path.join(REPO_ROOT, "bench", "e2e_worker.py")

CONFIGS = ("dense", "dctdp", "dctdp_mp", "deft", "topk", "native", "dctdp_fc")
DEFAULT_CONFIGS = ("native", "dense", "dctdp", "dctdp_mp", "deft", "topk")
# tf_dct.dct_mp.RESCALES, spelled out: the driver imports no TensorFlow.
MP_RESCALES = ("none", "l1", "l1_backward")
SHAPERS = ("auto", "netem", "tbf")
NS_PREFIX = "dcte2e_"
SUBNET = "10.77.0"
MAX_WORKERS = 8
NUM_TABLES, EMBEDDING_DIM = 26, 16  # DLRM (DCT §3.1)
FRAME_HEADER_BYTES = 14 + 20 + 32  # Ethernet + IPv4 + TCP with timestamps

# --quick / full defaults of the flags left unset (None).
QUICK = {"vocab_size": 2000, "steps": 10, "warmup_steps": 4, "eval_steps": 4}
FULL = {"vocab_size": 20000, "steps": 100, "warmup_steps": 5, "eval_steps": 20}

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
MIN_RATE, MAX_RATE = 1e6, 40e9     # bit/s
MAX_DELAY = 1.0                    # s
MAX_VOCAB = (2**31 - 1) // (NUM_TABLES * EMBEDDING_DIM)  # int32 positions


# --- flags -----------------------------------------------------------------------


def parse_rate(text: str) -> float:
  """'100mbit' -> 1e8 bit/s (tc's units bit, kbit, mbit, gbit). Raises FlagError."""
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text.strip().lower())
  if not m:
    raise FlagError(f"--rate: expected a number and a unit of {'/'.join(_RATE_UNITS)} "
                    f"(e.g. 1gbit, 100mbit), got {text!r}")
  rate = float(m.group(1)) * _RATE_UNITS[m.group(2)]
  if not MIN_RATE <= rate <= MAX_RATE:
    raise FlagError(f"--rate must be in [1mbit, 40gbit], got {text!r}")
  return rate


def parse_delay(text: str) -> float:
  """'0.5ms' -> 5e-4 s (units us, ms, s). Raises FlagError."""
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", text.strip().lower())
  if not m:
    raise FlagError(f"--delay: expected a number and a unit of us/ms/s (e.g. 0.5ms), "
                    f"got {text!r}")
  delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
  if delay > MAX_DELAY:
    raise FlagError(f"--delay must be in [0, 1s], got {text!r}")
  return delay


def parse_configs(text: str) -> tuple[str, ...]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  if not names:
    raise FlagError(f"--configs: give at least one of {','.join(CONFIGS)}")
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    raise FlagError(f"--configs: unknown {','.join(unknown)}; allowed: {','.join(CONFIGS)}")
  if len(set(names)) != len(names):
    raise FlagError(f"--configs lists a configuration twice: {text}")
  return tuple(names)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="bench/e2e_link.py", description=__doc__.split("\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rate", default="1gbit", help="link rate per direction, tc units "
                 "(bit/kbit/mbit/gbit), in [1mbit, 40gbit]; default 1gbit")
  p.add_argument("--delay", default="0.5ms", help="one-way delay per direction "
                 "(us/ms/s), in [0, 1s]; needs netem; default 0.5ms")
  p.add_argument("--shaper", default="auto", help="netem (rate + delay), tbf (rate "
                 "only) or auto (netem if the kernel has it, else tbf); default auto")
  p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                 help=f"comma list of {','.join(CONFIGS)} (dctdp_fc is opt-in)")
  p.add_argument("--quick", action="store_true",
                 help=f"smoke run: defaults {QUICK} instead of {FULL}")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps per configuration (test loss after these), >= 2")
  p.add_argument("--warmup_steps", type=int, default=None,
                 help="untimed first steps (tracing, first DCT-DP threshold), "
                 "in [1, steps - 1]")
  p.add_argument("--eval_steps", type=int, default=None,
                 help="eval batches (fixed eval split), in [1, 10000]")
  p.add_argument("--vocab_size", type=int, default=None,
                 help=f"rows per embedding table (26 tables x dim 16), in [2, {MAX_VOCAB}]")
  p.add_argument("--workers", type=int, default=2,
                 help=f"worker processes, one CPU replica each, in [2, {MAX_WORKERS}]; more "
                 "than the machine's cores measures only the shape of the run")
  p.add_argument("--batch_size", type=int, default=256,
                 help="global batch (all workers), divisible by --workers, in [2, 65536]")
  p.add_argument("--optimizer", default="adam",
                 help=f"one of {','.join(OPTIMIZERS)}, for every configuration")
  p.add_argument("--learning_rate", type=float, default=1e-3, help="> 0")
  p.add_argument("--sparsity", type=float, default=0.99, help="DCT-DP sparsity in (0, 1)")
  p.add_argument("--threshold_life", type=int, default=1000, help="DCT-DP L, >= 1")
  p.add_argument("--mp_sparsity", type=float, default=0.9, help="DCT-MP sparsity in [0, 1)")
  p.add_argument("--mp_rescale", default="none", choices=MP_RESCALES,
                 help="dctdp_mp: DCT-MP's rescale of the kept activations, as the "
                 "launcher's --mp_rescale (none: Algorithm 2; l1: each row's L1 kept; "
                 "l1_backward: the gradient scaled only)")
  p.add_argument("--density", type=float, default=0.01, help="DEFT/TopK density in (0, 1]")
  p.add_argument("--min_count", type=int, default=None,
                 help="entries every compressed variable sends at least, >= 0 "
                      "(default: the compressor's)")
  p.add_argument("--compression_warmup", type=int, default=0,
                 help="first steps every compressor aggregates densely (their "
                 "warmup_steps), in [0, steps]; default 0")
  p.add_argument("--sparsity_schedule", default=None,
                 help="DCT-DP sparsity stages after the warm-up, comma list of "
                 "steps:sparsity (steps >= 1, sparsity in (0, 1)) as the launcher's "
                 "--sparsity_schedule; 'none' for none; default: the launcher's")
  p.add_argument("--compressor_options", default="{}",
                 help="JSON object of extra keyword arguments for the compressor of "
                 "every compressing configuration, e.g. '{\"adam_select\": \"raw\"}'; "
                 "default none")
  p.add_argument("--seed", type=int, default=0, help="model and data seed, >= 0")
  p.add_argument("--gso", action="store_true",
                 help="keep GSO on the veth (default off: MTU-sized frames, so the "
                 "counters see per-frame headers as on a wire)")
  p.add_argument("--port", type=int, default=23456,
                 help="first worker port; configuration i uses ports port + n i to port + n i + n - 1 "
                 "(n = --workers)")
  p.add_argument("--nice", type=int, default=10, help="niceness of the workers, in [0, 19]")
  p.add_argument("--timeout", type=float, default=3600.0,
                 help="seconds per configuration before giving up, > 0")
  p.add_argument("--json", default="", help="also write every number to this file")
  p.add_argument("--png", default="", help="also draw step time and test loss against "
                 "native per configuration to this PNG (needs matplotlib)")
  p.add_argument("--plot_json", default="",
                 help="comma list of earlier --json files: only draw them to --png "
                 "(one group per file), run nothing; needs no root")
  p.add_argument("--keep_logs", action="store_true",
                 help="keep the worker logs (their directory is printed)")
  p.add_argument("--cleanup_stale", action="store_true",
                 help="only delete namespaces left by e2e_link runs that no longer "
                 "exist (e.g. after a SIGKILL), then exit")
  return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
  """Fills --quick / full defaults and checks every flag; raises FlagError."""
  preset = QUICK if args.quick else FULL
  for name, value in preset.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  args.rate_bps = parse_rate(args.rate)
  args.delay_s = parse_delay(args.delay)
  if args.optimizer not in OPTIMIZERS:
    raise FlagError(f"--optimizer must be one of {','.join(OPTIMIZERS)}, got "
                    f"{args.optimizer!r}")
  if args.shaper not in SHAPERS:
    raise FlagError(f"--shaper must be one of {','.join(SHAPERS)}, got {args.shaper!r}")
  args.config_list = parse_configs(args.configs)
  args.plot_list = [f for f in args.plot_json.split(",") if f] if args.plot_json else []
  if args.plot_list and not args.png:
    raise FlagError("--plot_json needs --png (the file to draw to)")
  for f in args.plot_list:
    if not os.path.isfile(f):
      raise FlagError(f"--plot_json: no such file {f!r}")

  def check_int(name, lo, hi):
    v = getattr(args, name)
    if not lo <= v <= hi:
      raise FlagError(f"--{name} must be in [{lo}, {hi}], got {v}")

  check_int("steps", 2, 10**7)
  check_int("warmup_steps", 1, args.steps - 1)
  check_int("eval_steps", 1, 10000)
  check_int("vocab_size", 2, MAX_VOCAB)
  check_int("batch_size", 2, 65536)
  check_int("workers", 2, MAX_WORKERS)
  if args.batch_size % args.workers:
    raise FlagError(f"--batch_size must be divisible by --workers={args.workers}, "
                    f"got {args.batch_size}")
  check_int("threshold_life", 1, 10**9)
  check_int("compression_warmup", 0, args.steps)
  if args.min_count is not None:
    check_int("min_count", 0, 10**9)
  try:
    options = json.loads(args.compressor_options)
  except ValueError:
    options = None
  if not isinstance(options, dict):
    raise FlagError(f"--compressor_options must be a JSON object, got "
                    f"{args.compressor_options!r}")
  if args.sparsity_schedule is not None:
    parse_schedule(args.sparsity_schedule.split(","), "dct", none_word=True)
  check_int("seed", 0, 2**31 - 1)
  check_int("nice", 0, 19)
  check_int("port", 1024, 65535 - args.workers * len(args.config_list))

  for name, lo, hi, lo_open, hi_open in (
      ("learning_rate", 0, None, True, True), ("sparsity", 0, 1, True, True),
      ("mp_sparsity", 0, 1, False, True), ("density", 0, 1, True, False),
      ("timeout", 0, None, True, True)):
    check_range(name, getattr(args, name), lo, hi, lo_open, hi_open)
  return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """Parses and validates; raises FlagError (argparse's own errors exit 2)."""
  return validate(build_parser().parse_args(argv))


# --- the testbed: namespaces, veth, tc, worker processes -----------------------


class CommandError(RuntimeError):
  """A command of the testbed failed."""


class Runner:
  """Runs a command and returns its stdout; raises CommandError on failure."""

  def __call__(self, cmd: Sequence[str], check: bool = True) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and proc.returncode:
      raise CommandError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip()}")
    return proc.stdout


@dataclasses.dataclass
class Shaping:
  """What was installed on each veth end."""
  shaper: str
  delay_emulated: bool
  commands: list


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the driver dies, even by SIGKILL.

  `ip netns exec`, `nice` and python exec in turn, so the worker keeps the
  setting. Best effort (Linux prctl PR_SET_PDEATHSIG).
  """
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
  except (OSError, AttributeError):
    pass


class Testbed:
  """The workers' namespaces, their shaped links, and the workers inside them.

  Two workers are joined by one veth pair, each end shaped. More workers
  each get a veth to a bridge in a switch namespace of their own, shaped at
  both ends (the worker's end for what it sends, the bridge port for what it
  receives), so every worker has the rate in each direction.

  Everything it creates is recorded *before* the command that creates it
  runs, so `cleanup()` also removes partially created state; it is
  idempotent and never raises.

  Args:
    runner: `runner(cmd, check=True) -> stdout`, raising on failure.
    tag: unique part of the names (default: this process id).
    popen: `subprocess.Popen`-like, for the workers.
    killpg: `os.killpg`-like.
    log: where progress and cleanup problems are printed.
    num_workers: workers to connect, in [2, MAX_WORKERS].
  """

  def __init__(self, runner: Callable = None, tag: str | None = None,
               popen: Callable = subprocess.Popen, killpg: Callable = os.killpg,
               log=None, num_workers: int = 2):
    self.run = runner or Runner()
    tag = str(os.getpid()) if tag is None else tag
    self.namespaces = [f"{NS_PREFIX}{tag}_{i}" for i in range(num_workers)]
    self.addresses = [f"{SUBNET}.{i + 1}" for i in range(num_workers)]
    # Interface names have at most 15 characters (IFNAMSIZ).
    if num_workers == 2:
      self.switch = None
      self.veths = [f"dcte{tag}{c}" for c in "ab"]
      self.ports: list[str] = []
    else:  # the switch namespace's index follows the workers' (stale cleanup)
      self.switch = f"{NS_PREFIX}{tag}_{num_workers}"
      self.veths = [f"dcte{tag}w{i}" for i in range(num_workers)]
      self.ports = [f"dcte{tag}p{i}" for i in range(num_workers)]
    self.popen, self.killpg = popen, killpg
    self.log = log or sys.stderr
    self.created_namespaces: list[str] = []
    self.root_veths: list[str] = []  # created, maybe not yet moved out of the root
    self.procs: list = []
    self.cleaning = False

  # -- network ------------------------------------------------------------------

  def shaped(self) -> list[tuple[str, str]]:
    """(namespace, device) of every shaped interface: the workers' ends, then
    the bridge ports."""
    return (list(zip(self.namespaces, self.veths))
            + [(self.switch, port) for port in self.ports])

  def setup(self, rate_bps: float, delay_s: float, shaper: str = "auto",
            gso: bool = False) -> Shaping:
    """Creates and shapes the links; returns what was installed."""
    for ns in self.namespaces + ([self.switch] if self.switch else []):
      self.created_namespaces.append(ns)
      self.run(["ip", "netns", "add", ns])
    if self.switch:
      self.run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
      self.run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
      pairs = list(zip(self.veths, self.ports))
    else:
      pairs = [tuple(self.veths)]
    for a, b in pairs:
      self.root_veths.append(a)
      self.run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
    for port in self.ports:
      self.run(["ip", "link", "set", port, "netns", self.switch])
      self.run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
    for ns, dev, addr in zip(self.namespaces, self.veths, self.addresses):
      self.run(["ip", "link", "set", dev, "netns", ns])
      self.run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
      self.run(["ip", "-n", ns, "link", "set", "lo", "up"])
    for ns, dev in self.shaped():
      if not gso:  # MTU-sized skbs: counters and shaping see real frames
        self.run(["ip", "-n", ns, "link", "set", dev, "gso_max_segs", "1"])
      self.run(["ip", "-n", ns, "link", "set", dev, "up"])
    return self._shape(rate_bps, delay_s, shaper)

  def _shape(self, rate_bps: float, delay_s: float, shaper: str) -> Shaping:
    rate = f"{int(rate_bps)}bit"
    bytes_per_s = rate_bps / 8
    # Queue: 100 ms at the rate (>= 1 MB), so TCP bursts are queued, not dropped.
    limit_bytes = int(max(bytes_per_s * 0.1, 1 << 20))
    commands = []
    kind = shaper
    shaped = self.shaped()

    def netem(ns, dev):
      return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "rate", rate,
              "delay", f"{delay_s * 1e6:.0f}us", "limit", str(max(1000, limit_bytes // 1500))]

    if shaper in ("auto", "netem"):
      cmd = netem(*shaped[0])
      try:
        self.run(cmd)
        kind = "netem"
      except CommandError as e:
        if shaper == "netem" or "unknown" not in str(e).lower():
          raise CommandError(f"{e}\n(--shaper=netem needs the sch_netem kernel module; "
                             "--shaper=tbf shapes the rate without delay)") from None
        kind = "tbf"
    if kind == "netem":
      commands.append(cmd)
      for ns, dev in shaped[1:]:
        commands.append(netem(ns, dev))
        self.run(commands[-1])
      return Shaping("netem", True, commands)
    # tbf: the bucket holds 1 ms at the rate (>= 10 MTU frames).
    burst = int(max(bytes_per_s * 1e-3, 15140))
    for ns, dev in shaped:
      cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
             "burst", str(burst), "limit", str(limit_bytes)]
      self.run(cmd)
      commands.append(cmd)
    return Shaping("tbf", delay_s == 0, commands)

  def counters(self) -> list[dict]:
    """Per worker: tx/rx bytes and packets of its veth end, qdisc drops."""
    out = []
    for ns, dev in zip(self.namespaces, self.veths):
      link = json.loads(self.run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev]))[0]
      stats = link.get("stats64") or link["stats"]
      qdiscs = json.loads(self.run(["tc", "-j", "-s", "-n", ns, "qdisc", "show", "dev",
                                    dev]) or "[]")
      out.append({"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                  "tx_packets": stats["tx"]["packets"],
                  "qdisc_drops": sum(q.get("drops", 0) for q in qdiscs)})
    return out

  # -- workers ------------------------------------------------------------------

  def start_worker(self, index: int, argv: Sequence[str], env: dict, log_path: str,
                   nice: int):
    """Starts worker `index` in its namespace, in a process group of its own."""
    cmd = ["ip", "netns", "exec", self.namespaces[index], "nice", "-n", str(nice),
           sys.executable, "-u", WORKER, *argv]
    with open(log_path, "w", encoding="utf-8") as log:
      proc = self.popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True, preexec_fn=_die_with_parent)
    self.procs.append(proc)
    return proc

  def stop_workers(self, grace: float = 5.0) -> None:
    """SIGTERM to every worker's process group, SIGKILL after `grace` seconds."""
    procs, self.procs = self.procs, []
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
      alive = [p for p in procs if p.poll() is None]
      for p in alive:
        try:
          self.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
          pass
      deadline = time.monotonic() + wait
      for p in alive:
        try:
          p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          pass
    left = [p.pid for p in procs if p.poll() is None]
    if left:
      print(f"e2e_link: warning: worker process(es) {left} survived SIGKILL",
            file=self.log)

  # -- cleanup ------------------------------------------------------------------

  def cleanup(self) -> None:
    """Kills the workers and deletes what was created. Idempotent, never raises."""
    if self.cleaning:
      return
    self.cleaning = True
    try:
      try:
        self.stop_workers()
      except Exception as e:  # pylint: disable=broad-except
        print(f"e2e_link: warning: stopping workers: {e}", file=self.log)
      # Deleting a namespace deletes the veth end inside it (and its peer).
      while self.created_namespaces:
        ns = self.created_namespaces.pop()
        try:
          self.run(["ip", "netns", "del", ns], check=False)
        except Exception as e:  # pylint: disable=broad-except
          print(f"e2e_link: warning: deleting namespace {ns}: {e}", file=self.log)
      while self.root_veths:  # still in the root namespace if a move failed
        dev = self.root_veths.pop()
        try:
          self.run(["ip", "link", "del", dev], check=False)
        except Exception as e:  # pylint: disable=broad-except
          print(f"e2e_link: warning: deleting {dev}: {e}", file=self.log)
    finally:
      self.cleaning = False


def stale_namespaces(names: Sequence[str], alive: Callable[[int], bool]) -> list[str]:
  """The e2e_link namespaces among `names` whose creating process is gone."""
  out = []
  for name in names:
    m = re.fullmatch(re.escape(NS_PREFIX) + r"(\d+)_\d+", name)
    if m and not alive(int(m.group(1))):
      out.append(name)
  return out


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def cleanup_stale(runner: Callable) -> list[str]:
  names = [line.split()[0] for line in runner(["ip", "netns", "list"]).splitlines()
           if line.strip()]
  stale = stale_namespaces(names, _pid_alive)
  for ns in stale:
    runner(["ip", "netns", "del", ns], check=False)
  return stale


class CleanupOnExit:
  """Runs `testbed.cleanup()` on normal exit, exceptions, SIGINT/SIGTERM, atexit.

  A signal raises SystemExit(128 + signal) in the main thread so the `finally`
  of the caller runs; a signal arriving during cleanup is ignored.
  """

  def __init__(self, testbed: Testbed, install_signals: bool = True):
    self.testbed = testbed
    self.install_signals = install_signals
    self._previous = {}

  def _handler(self, signum, frame):
    del frame
    if self.testbed.cleaning:
      return
    raise SystemExit(128 + signum)

  def __enter__(self):
    atexit.register(self.testbed.cleanup)
    if self.install_signals:
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._previous[sig] = signal.signal(sig, self._handler)
    return self.testbed

  def __exit__(self, *exc):
    try:
      self.testbed.cleanup()
    finally:
      for sig, handler in self._previous.items():
        signal.signal(sig, handler)
      self._previous = {}
      atexit.unregister(self.testbed.cleanup)
    return False


# --- one configuration ---------------------------------------------------------


class WorkerFailed(RuntimeError):
  """A worker died or the handshake timed out."""


def _tail(path: str, lines: int = 25) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return "".join(f.readlines()[-lines:])
  except OSError:
    return "(no log)"


def worker_argv(args: argparse.Namespace, config: str, handshake_dir: str) -> list[str]:
  return [f"--config={config}", f"--handshake_dir={handshake_dir}",
          f"--vocab_size={args.vocab_size}", f"--batch_size={args.batch_size}",
          f"--steps={args.steps}", f"--warmup_steps={args.warmup_steps}",
          f"--eval_steps={args.eval_steps}", f"--learning_rate={args.learning_rate}",
          f"--optimizer={args.optimizer}",
          f"--sparsity={args.sparsity}", f"--threshold_life={args.threshold_life}",
          f"--mp_sparsity={args.mp_sparsity}", f"--mp_rescale={args.mp_rescale}",
          f"--density={args.density}",
          f"--compression_warmup={args.compression_warmup}",
          f"--seed={args.seed}", f"--timeout={args.timeout}",
          f"--compressor_options={args.compressor_options}"] + (
              [] if args.min_count is None else [f"--min_count={args.min_count}"]) + (
              [] if args.sparsity_schedule is None
              else [f"--sparsity_schedule={args.sparsity_schedule}"])


def run_config(testbed: Testbed, args: argparse.Namespace, config: str, port: int,
               workdir: str) -> dict:
  """Runs one configuration on fresh workers; returns raw measurements."""
  hs = tempfile.mkdtemp(prefix=f"{config}_", dir=workdir)
  cluster = [f"{a}:{port + i}" for i, a in enumerate(testbed.addresses)]
  workers = range(len(testbed.namespaces))
  logs = [os.path.join(workdir, f"{config}_worker{i}.log") for i in workers]
  base_env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
  base_env.update(TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                  PYTHONPATH=os.pathsep.join(
                      [REPO_ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
  procs = []
  for i in workers:
    env = dict(base_env, TF_CONFIG=json.dumps(
        {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}}))
    procs.append(testbed.start_worker(i, worker_argv(args, config, hs), env, logs[i],
                                      args.nice))
  deadline = time.monotonic() + args.timeout

  def wait_for(names):
    paths = [os.path.join(hs, n) for n in names]
    while not all(os.path.exists(p) for p in paths):
      for i, p in enumerate(procs):
        if p.poll() is not None and not os.path.exists(
            os.path.join(hs, f"result_{i}.json")):
          raise WorkerFailed(f"{config}: worker {i} exited with {p.returncode}; log "
                             f"{logs[i]}:\n{_tail(logs[i])}")
      if time.monotonic() > deadline:
        raise WorkerFailed(f"{config}: no {names} within --timeout={args.timeout:g} s")
      time.sleep(0.005)
    return paths

  def go(phase):
    with open(os.path.join(hs, f"go_{phase}"), "w", encoding="utf-8"):
      pass

  started = time.monotonic()
  wait_for([f"ready_start_{i}" for i in workers])
  before = testbed.counters()
  go("start")
  wait_for([f"ready_end_{i}" for i in workers])
  after = testbed.counters()
  go("end")
  results = []
  for path in wait_for([f"result_{i}.json" for i in workers]):
    with open(path, encoding="utf-8") as f:
      results.append(json.load(f))
  for p in procs:  # they leave with os._exit; give them a moment, then kill
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass
  testbed.stop_workers()
  raw = {"config": config, "workers": results, "before": before, "after": after,
         "wall_seconds": time.monotonic() - started}
  with open(os.path.join(workdir, f"{config}_raw.json"), "w", encoding="utf-8") as f:
    json.dump(raw, f)
  return raw


# --- summary ---------------------------------------------------------------------


def summarize(raw: dict, rate_bps: float) -> dict:
  """Per-step numbers of one configuration, mean over the workers."""
  w = raw["workers"]
  timed = w[0]["timed_steps"]
  seconds = max(x["window_seconds"] for x in w)
  steps = [t for x in w for t in x["step_times"]]
  wire = [(a["tx_bytes"] - b["tx_bytes"]) / timed for a, b in zip(raw["after"], raw["before"])]
  packets = [(a["tx_packets"] - b["tx_packets"]) / timed
             for a, b in zip(raw["after"], raw["before"])]
  drops = sum(a["qdisc_drops"] - b["qdisc_drops"] for a, b in zip(raw["after"], raw["before"]))
  acct = statistics.mean(x["per_step"]["dp_bytes_sent"] for x in w)
  wire_mean = statistics.mean(wire)
  return {
      "config": raw["config"], "timed_steps": timed,
      "step_ms": 1e3 * seconds / timed, "median_step_ms": 1e3 * statistics.median(steps),
      "cpu_ms": (1e3 * statistics.mean(x["cpu_seconds"] for x in w) / timed
                 if all("cpu_seconds" in x for x in w) else None),
      "acct_bytes": acct, "wire_bytes": wire_mean, "wire_bytes_per_worker": wire,
      "wire_over_acct": wire_mean / acct if acct else math.inf,
      "stock_bytes": statistics.mean(x["per_step"].get("dp_stock_bytes", 0.0)
                                     for x in w),
      "dense_bytes": statistics.mean(x["per_step"]["dp_dense_bytes"] for x in w),
      "utilization": wire_mean * timed * 8 / (rate_bps * seconds),
      "qdisc_drops": drops, "wire_packets": statistics.mean(packets),
      # Without GSO every packet is one frame: Ethernet 14 + IPv4 20 + TCP 32
      # (with timestamps) bytes of headers; what is left is TCP payload (gRPC).
      "tcp_payload_bytes": wire_mean - FRAME_HEADER_BYTES * statistics.mean(packets),
      "mp_bytes": w[0]["per_step"].get("mp_bytes", 0),
      "mp_dense_bytes": w[0]["per_step"].get("mp_dense_bytes", 0),
      "test_loss": w[0]["eval"]["loss"], "test_auc": w[0]["eval"].get("auc"),
      **_train_tail(w[0].get("losses")),
      "eval_workers_agree": all(abs(x["eval"]["loss"] - w[0]["eval"]["loss"]) < 1e-6
                                for x in w),
      "density": w[0].get("last_density"),
      "embedding_grad_type": w[0].get("embedding_grad_type"),
      "table_entries": w[0]["table_entries"], "num_parameters": w[0]["num_parameters"],
      "wall_seconds": raw["wall_seconds"],
  }


# The training loss is compared over the last TAIL of the steps: the test loss
# after a short run moves by several percent with small changes in what is
# sent, the mean training loss over many steps far less.
TAIL = 0.6


def _train_tail(losses) -> dict:
  """Worker 0's mean training loss over the last `TAIL` of its steps
  (`train_loss_tail`, None without losses) and that window's steps."""
  if not losses:
    return {"train_loss_tail": None, "tail_steps": None}
  start = int(len(losses) * (1 - TAIL))
  tail = losses[start:]
  return {"train_loss_tail": statistics.mean(tail),
          "tail_steps": f"{start + 1}-{len(losses)}"}


def _mb(x: float) -> str:
  return f"{x / 1e6:.3f}"


def _versus(row: dict, base: dict | None) -> tuple:
  """(step time ratio, relative test loss) of `row` against `base`, or Nones."""
  if base is None:
    return None, None
  return (row["step_ms"] / base["step_ms"],
          (row["test_loss"] - base["test_loss"]) / base["test_loss"])


def report(rows: list[dict], args: argparse.Namespace, shaping: Shaping,
           out=sys.stdout) -> dict:
  """Prints the markdown table and the verdict; returns the verdict.

  Ratios are against native (stock TF) first, then against dense; a
  baseline not in --configs gives "-".
  """
  native = next((r for r in rows if r["config"] == "native"), None)
  dense = next((r for r in rows if r["config"] == "dense"), None)
  print("\n| config | step ms (mean / median) | vs native | vs dense | test loss "
        "| loss vs native | loss vs dense | CPU ms/step/worker "
        "| accounting MB/step/worker | stock / accounting "
        "| wire MB/step/worker (veth tx) | wire / accounting | TCP payload / accounting "
        "| packets/step | link util | qdisc drops "
        "| MP MB/step would cross (dense) |", file=out)
  print("|" + "---|" * 17, file=out)
  verdict = {"step_ratio": {}, "loss_rel": {}, "step_ratio_dense": {},
             "loss_rel_dense": {}, "train_rel": {}, "agreement": {}}
  x = lambda v: "-" if v is None else f"{v:.3f}x"
  pct = lambda v: "-" if v is None else f"{100 * v:+.3f}%"
  for r in rows:
    ratio, rel = _versus(r, native)
    ratio_d, rel_d = _versus(r, dense)
    verdict["agreement"][r["config"]] = r["wire_over_acct"]
    if native and r is not native:
      verdict["step_ratio"][r["config"]] = ratio
      verdict["loss_rel"][r["config"]] = rel
      if r.get("train_loss_tail") and native.get("train_loss_tail"):
        verdict["train_rel"][r["config"]] = (
            r["train_loss_tail"] / native["train_loss_tail"] - 1)
    if dense and r is not dense:
      verdict["step_ratio_dense"][r["config"]] = ratio_d
      verdict["loss_rel_dense"][r["config"]] = rel_d
    cpu = "-" if r.get("cpu_ms") is None else f"{r['cpu_ms']:.0f}"
    mp = (f"{_mb(r['mp_bytes'])} ({_mb(r['mp_dense_bytes'])})" if r["mp_dense_bytes"]
          else "-")
    payload = r["tcp_payload_bytes"] / r["acct_bytes"] if r["acct_bytes"] else math.inf
    stock = (x(r["stock_bytes"] / r["acct_bytes"])
             if r.get("stock_bytes") and r["acct_bytes"] else "-")
    print(f"| {r['config']} | {r['step_ms']:.1f} / {r['median_step_ms']:.1f} | "
          f"{x(ratio)} | {x(ratio_d)} | {r['test_loss']:.5f} | {pct(rel)} | "
          f"{pct(rel_d)} | {cpu} | {_mb(r['acct_bytes'])} | {stock} | "
          f"{_mb(r['wire_bytes'])} | {r['wire_over_acct']:.3f} | "
          f"{payload:.3f} | {r['wire_packets']:.0f} | {100 * r['utilization']:.1f}% | "
          f"{r['qdisc_drops']} | {mp} |", file=out)
  lines = []
  names = [r["config"] for r in rows if r is not native]
  for name in names:
    parts = []
    if name in verdict["step_ratio"]:
      parts.append(f"step time {verdict['step_ratio'][name]:.3f}x native (stock "
                   f"TF), test loss {pct(verdict['loss_rel'][name])} vs native")
      if name in verdict["train_rel"]:
        row = next(r for r in rows if r["config"] == name)
        parts.append(f"training loss over steps {row['tail_steps']} "
                     f"{pct(verdict['train_rel'][name])} vs native")
    if name in verdict["step_ratio_dense"]:
      parts.append(f"{verdict['step_ratio_dense'][name]:.3f}x dense (densified "
                   f"all-reduce), {pct(verdict['loss_rel_dense'][name])} vs dense")
    if parts:
      lines.append(f"- {name}: " + "; ".join(parts))
  if not native:
    lines.append("- no native configuration in --configs: no ratios vs stock TF")
  for name, agree in verdict["agreement"].items():
    if abs(agree - 1) > 0.10:
      lines.append(f"- {name}: wire / accounting {agree:.3f} is OUTSIDE 10% (per-step "
                   "fixed costs: TCP/IP and gRPC framing, RPC requests, ACKs, the loss "
                   "all-reduce and coordination traffic, which the accounting omits)")
    else:
      lines.append(f"- {name}: wire / accounting {agree:.3f}, within 10%")
  print("\n" + "\n".join(lines), file=out)
  if not shaping.delay_emulated:
    print(f"- NOTE: --delay={args.delay} was NOT emulated (shaper {shaping.shaper}: "
          "the kernel has no netem); the link adds only veth latency", file=out)
  out.flush()
  verdict["lines"] = lines
  return verdict


def _label(result: dict) -> str:
  """One result's link, optimizer, workers and steps, for the figure."""
  a = result["args"]
  rate = a["rate"].replace("mbit", " Mbit/s").replace("gbit", " Gbit/s")
  return (f"{a['optimizer']}({a['learning_rate']:g}), {rate}, "
          f"{a.get('workers', 2)} workers, {a['steps']} steps")


def plot(results: Sequence[dict], path: str) -> None:
  """Draws step time and test loss against native of every configuration,
  one group of bars per result (a run's `run()` return or --json file)."""
  from bench import plotting  # pylint: disable=g-import-not-at-top
  plt = plotting.pyplot()
  groups = []
  for result in results:
    v = result["verdict"]
    configs = list(v["step_ratio"])
    groups.append((_label(result), configs, [v["step_ratio"][c] for c in configs],
                   [100 * v["loss_rel"][c] for c in configs]))
  if not any(g[1] for g in groups):
    raise ValueError("nothing to draw: no result has native and another configuration")
  height = 0.8
  fig, axes = plt.subplots(1, 2, figsize=(12, 1.2 + 0.45 * sum(len(g[1]) + 1
                                                                for g in groups)))
  y, ticks, names = 0.0, [], []
  for label, configs, ratios, losses in groups:
    for config, ratio, loss in zip(configs, ratios, losses):
      axes[0].barh(y, ratio, height, color="tab:blue")
      axes[0].text(ratio, y, f" {ratio:.3f}x", va="center", fontsize=8)
      axes[1].barh(y, loss, height, color="tab:red" if loss > 1 else "tab:green")
      axes[1].text(loss, y, f" {loss:+.2f}%", va="center", fontsize=8)
      ticks.append(y)
      names.append(f"{config} | {label}")
      y += 1
    y += 0.6
  for ax in axes:
    ax.set_yticks(ticks)
    ax.invert_yaxis()
    ax.margins(x=0.2)  # room for the values printed past the bars
  axes[0].set_yticklabels(names, fontsize=8)
  axes[1].set_yticklabels([])
  axes[0].axvline(1.0, color="k", lw=0.8)
  axes[0].set_xlabel("step time / native (stock TF); below 1 is faster")
  axes[1].axvline(0.0, color="k", lw=0.8)
  axes[1].axvline(1.0, color="gray", lw=0.8, ls="--")
  axes[1].set_xlabel("test loss vs native (%); dashed: +1%")
  fig.suptitle("DLRM on an emulated link (bench/e2e_link.py), against stock TensorFlow")
  fig.tight_layout()
  plotting.save(fig, path)


def print_header(args: argparse.Namespace, shaping: Shaping, first: dict,
                 out=sys.stdout) -> None:
  n = first["table_entries"]
  delay = (args.delay if shaping.delay_emulated
           else f"{args.delay} requested, NOT emulated (no netem)")
  print(f"\nlink: {args.rate} per direction, delay {delay}, shaper {shaping.shaper}, "
        f"{'GSO' if args.gso else 'MTU frames (gso_max_segs 1)'}; {args.workers} workers x 1 CPU "
        f"replica; {args.optimizer}(lr {args.learning_rate:g}), global batch "
        f"{args.batch_size}; {args.steps} steps "
        f"({args.warmup_steps} untimed + {args.steps - args.warmup_steps} timed); "
        f"eval {args.eval_steps} batches", file=out)
  print(f"model: DLRM, 26 tables x {args.vocab_size} rows x 16 = {n:,} table entries, "
        f"{first['num_parameters']:,} parameters in all; embedding gradient arrives as "
        f"{first['embedding_grad_type']}", file=out)
  print("native sends what stock TF sends: MLP gradients all-reduced, the embedding "
        "IndexedSlices all-gathered (one row per looked-up id); dense: ring all-reduce "
        f"of all {first['num_parameters']:,} gradient entries (table densified), "
        f"{8 * first['num_parameters'] * (args.workers - 1) / args.workers / 1e6:.2f} MB "
        "per worker per step each way", file=out)
  cores = os.cpu_count() or 1
  if args.workers > cores:
    print(f"- NOTE: {args.workers} one-CPU workers share {cores} cores: step times show "
          "the shape of the run (bytes, collectives, the loss), not the speed of "
          f"{args.workers} machines", file=out)
  out.flush()


def run(args: argparse.Namespace, testbed: Testbed, out=sys.stdout) -> dict:
  """Sets up the link, runs every configuration, prints; returns all numbers."""
  shaping = testbed.setup(args.rate_bps, args.delay_s, args.shaper, args.gso)
  workdir = tempfile.mkdtemp(prefix="e2e_link_")
  print(f"e2e_link: namespaces {testbed.namespaces}, shaper {shaping.shaper}; worker logs "
        f"in {workdir}", file=out, flush=True)
  rows, raws, failed = [], [], {}
  try:
    for i, config in enumerate(args.config_list):
      print(f"e2e_link: running {config} ...", file=out, flush=True)
      try:
        raw = run_config(testbed, args, config, args.port + args.workers * i, workdir)
      except WorkerFailed as e:  # the other configurations still run
        testbed.stop_workers()
        failed[config] = str(e)
        print(f"e2e_link: {config} FAILED: {e}", file=out, flush=True)
        continue
      raws.append(raw)
      rows.append(summarize(raw, args.rate_bps))
      r = rows[-1]
      print(f"e2e_link:   {config}: {r['step_ms']:.1f} ms/step, wire "
            f"{_mb(r['wire_bytes'])} MB/step/worker, test loss {r['test_loss']:.5f} "
            f"({r['wall_seconds']:.0f} s)", file=out, flush=True)
  finally:
    if not args.keep_logs:
      shutil.rmtree(workdir, ignore_errors=True)
  if not rows:
    raise WorkerFailed(f"every configuration failed: {', '.join(failed)}")
  print_header(args, shaping, rows[0], out)
  verdict = report(rows, args, shaping, out)
  if failed:
    print(f"- FAILED (not in the table): {', '.join(failed)}", file=out, flush=True)
  result = {"args": {k: v for k, v in vars(args).items() if k != "config_list"},
            "shaping": dataclasses.asdict(shaping), "rows": rows, "raw": raws,
            "failed": failed, "verdict": verdict}
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(result, f, indent=1)
  if args.png:
    plot([result], args.png)
  return result


def main(argv: Sequence[str] | None = None, testbed_factory: Callable = Testbed,
         geteuid: Callable[[], int] = os.geteuid, install_signals: bool = True) -> int:
  """Validates flags, refuses without root, runs; returns the exit status."""
  try:
    args = parse_args(argv)
  except FlagError as e:
    print(f"e2e_link: error: {e}", file=sys.stderr)
    return 2
  if args.plot_list:
    results = []
    for path in args.plot_list:
      with open(path, encoding="utf-8") as f:
        results.append(json.load(f))
    plot(results, args.png)
    print(f"e2e_link: drew {len(results)} run(s) to {args.png}")
    return 0
  if geteuid() != 0:
    print("e2e_link: error: must run as root: it creates network namespaces, a veth "
          "pair and tc qdiscs (try: sudo python bench/e2e_link.py ...). Nothing was "
          "changed.", file=sys.stderr)
    return 1
  missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing:
    print(f"e2e_link: error: {' and '.join(missing)} not found (install iproute2)",
          file=sys.stderr)
    return 1
  if args.cleanup_stale:
    stale = cleanup_stale(Runner())
    print(f"e2e_link: deleted {len(stale)} stale namespace(s): {' '.join(stale)}")
    return 0
  testbed = testbed_factory(num_workers=args.workers)
  try:
    with CleanupOnExit(testbed, install_signals):
      result = run(args, testbed)
  except (CommandError, WorkerFailed) as e:
    print(f"e2e_link: error: {e}", file=sys.stderr)
    return 1
  return 1 if result["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
