r"""Re-measures the papers' tables and figures; one sub-command per study.

Every study lives in `bench/studies/<name>.py` and exposes
`DESCRIPTION: str`, `define(parser)` (its own flags) and
`run(args) -> Result` (see `bench/studies/common.py`). The result is written
to `docs/reproduction/<name>.md` and `docs/reproduction/<name>.png`, stating
data, settings and the command that produced it; `<name>.json` holds the
plotted series, which `--replot` redraws without running the study.

Usage:
  python bench/reproduce.py list
  python bench/reproduce.py <study> --quick     # each study < 5 min on 2 cores
  python bench/reproduce.py <study>             # full mode (committed results)
  python bench/reproduce.py all --quick
  python bench/reproduce.py <study> --replot    # redraw the PNG from its JSON
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from bench import studies  # pylint: disable=g-import-not-at-top,wrong-import-position
from bench.studies import common  # pylint: disable=g-import-not-at-top,wrong-import-position


def discover() -> dict[str, object]:
  """Study name -> module, for every `bench/studies/*.py` with a `run`."""
  found = {}
  for info in pkgutil.iter_modules(studies.__path__):
    if info.name.startswith("_") or info.name == "common":
      continue
    module = importlib.import_module(f"bench.studies.{info.name}")
    if hasattr(module, "run") and hasattr(module, "define"):
      found[info.name] = module
  return dict(sorted(found.items()))


def build_parser(found: dict[str, object]) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python bench/reproduce.py",
      description="Re-measure the DCT and DEFT papers' tables and figures.")
  sub = parser.add_subparsers(dest="study", required=True)
  sub.add_parser("list", help="list the studies")
  every = sub.add_parser("all", help="run every study in turn")
  common.define_common(every)
  for name, module in found.items():
    # argparse formats help with %: a literal one (e.g. "90%") must be doubled.
    p = sub.add_parser(name, help=module.DESCRIPTION.replace("%", "%%"))
    common.define_common(p)
    module.define(p)
  return parser


def main(argv: list[str] | None = None) -> int:
  found = discover()
  args = build_parser(found).parse_args(argv)
  if args.study == "list":
    for name, module in found.items():
      print(f"{name:24s} {module.DESCRIPTION}")
    return 0
  names = list(found) if args.study == "all" else [args.study]
  for name in names:
    module = found[name]
    if args.study == "all":  # each study's own defaults, common flags kept
      p = argparse.ArgumentParser()
      common.define_common(p)
      module.define(p)
      study_args = p.parse_args(common.common_argv(args))
    else:
      study_args = args
    if study_args.replot:
      print(f"[{name}] replotted -> " + ", ".join(common.replot(name, study_args)),
            flush=True)
      continue
    start = time.time()
    result = module.run(study_args)
    seconds = time.time() - start
    paths = common.write(name, result, study_args, seconds,
                         argv if argv is not None else sys.argv[1:])
    print(f"[{name}] {seconds:.0f}s -> " + ", ".join(paths), flush=True)
  return 0


if __name__ == "__main__":
  code = main()
  sys.stdout.flush()
  os._exit(code)  # pylint: disable=protected-access  # TF teardown can hang
