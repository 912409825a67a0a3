"""Shared output for `bench/reproduce.py`: markdown table, PNG and JSON per study."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
from typing import Callable, Sequence

from bench import plotting

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(_ROOT, "docs", "reproduction")


@dataclasses.dataclass
class Result:
  """What a study measured.

  Attributes:
    title: heading of the markdown page, e.g. "DCT Table 2: DCT-DP sweep".
    settings: data and settings, one markdown paragraph or bullet list.
    headers: table column names.
    rows: table rows (already formatted strings or numbers).
    verdict: plain statement of what reproduced and what did not, with numbers.
    plot: called with a fresh matplotlib Figure; draws the study's plot.
    extra: further markdown appended after the verdict (more tables).
  """
  title: str
  settings: str
  headers: Sequence[str]
  rows: Sequence[Sequence[object]]
  verdict: str
  plot: Callable[[object], None] | None = None
  extra: str = ""


def define_common(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--quick", action="store_true",
                      help="smoke-sized run, < 5 minutes on 2 cores")
  parser.add_argument("--out_dir", default=DEFAULT_OUT,
                      help="where <study>.md, <study>.png and <study>.json go")
  parser.add_argument("--replot", action="store_true",
                      help="redraw <study>.png from <study>.json in the current "
                      "style instead of running the study")


def common_argv(args: argparse.Namespace) -> list[str]:
  argv = ["--out_dir", args.out_dir]
  return (argv + (["--quick"] if args.quick else [])
          + (["--replot"] if args.replot else []))


def logical_cpus(wanted: int, strict: bool = False) -> list[str]:
  """All logical CPUs, splitting the CPU into max(wanted, 4) if TF is fresh.

  `tf_dct.split_cpu` works only before TensorFlow initializes its devices, so
  the first study of a `reproduce.py all` process fixes the split for every
  later one: at least 4 devices, which the 4-replica studies need. When an
  earlier study already split the CPU its devices are returned unchanged,
  possibly fewer than `wanted`; callers size their real-replica runs by the
  length of the list, or pass `strict=True` to get exactly the first `wanted`
  devices or a RuntimeError.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_dct  # pylint: disable=g-import-not-at-top
  try:
    devices = tf_dct.split_cpu(max(wanted, 4))
  except RuntimeError:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
  if not strict:
    return devices
  if len(devices) < wanted:
    raise RuntimeError(f"need {wanted} logical CPUs, TensorFlow was initialized "
                       f"with {len(devices)}")
  return devices[:wanted]


def floats(text: str) -> list[float]:
  """A `--sparsities` value as numbers: "0.9,0.95" -> [0.9, 0.95]; "none" -> []."""
  return [float(s) for s in text.split(",") if s.strip() and s.strip() != "none"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
  def cell(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(headers) + " |",
           "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def _without_out_dir(argv: Sequence[str]) -> list[str]:
  """`argv` minus `--out_dir X` / `--out_dir=X` (not part of the recipe)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == "--out_dir":
      skip = True
    elif not a.startswith("--out_dir="):
      out.append(a)
  return out


def output_name(name: str, args: argparse.Namespace) -> str:
  """`name`, or `<name>_quick` for a --quick run (never overwrites full results)."""
  return name + "_quick" if args.quick else name


def replot(name: str, args: argparse.Namespace) -> list[str]:
  """Redraws `<out_dir>/<name>.png` from the series its run stored in `<name>.json`."""
  name = output_name(name, args)
  path = os.path.join(args.out_dir, f"{name}.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"--replot needs {path}: run the study once first")
  png = os.path.join(args.out_dir, f"{name}.png")
  plotting.replot(path, png)
  return [png]


def write(name: str, result: Result, args: argparse.Namespace, seconds: float,
          argv: Sequence[str]) -> list[str]:
  """Writes `<out_dir>/<name>.md` (+ `.png`, `.json`); `<name>_quick.*` if --quick.

  The JSON holds the plotted series, so `--replot` can redraw the PNG in a
  later style without re-running the study.
  """
  os.makedirs(args.out_dir, exist_ok=True)
  paths = []
  name = output_name(name, args)
  png = os.path.join(args.out_dir, f"{name}.png")
  series = os.path.join(args.out_dir, f"{name}.json")
  if result.plot is not None:
    fig = plotting.figure()
    result.plot(fig)
    plotting.save_json(plotting.record(fig), series)
    plotting.save(fig, png)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  command = "python bench/reproduce.py " + " ".join(_without_out_dir(argv))
  md = [f"# {result.title}", "",
        f"Command: `{command}` ({'quick' if args.quick else 'full'} mode, "
        f"{seconds:.0f} s). Machine: {os.cpu_count()} cores, CPU only, "
        f"TensorFlow {tf.__version__}, Python {platform.python_version()}. "
        f"Date: {datetime.date.today().isoformat()}.", "",
        "## Data and settings", "", result.settings.strip(), "",
        "## Results", "", table(result.headers, result.rows), ""]
  if result.plot is not None:
    md += [f"![{name}]({name}.png)", ""]
  md += ["## Verdict", "", result.verdict.strip(), ""]
  if result.extra:
    md += [result.extra.strip(), ""]
  path = os.path.join(args.out_dir, f"{name}.md")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(md))
  paths.append(path)
  if result.plot is not None:
    paths += [png, series]
  return paths
