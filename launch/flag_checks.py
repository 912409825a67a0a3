"""Flag checks that need no TensorFlow: the launcher's (`launch/train.py`) and
those of drivers that start launcher jobs in other processes without
importing TensorFlow themselves (`bench/e2e_link.py`).
"""

from __future__ import annotations

import math

from absl import app

# The launcher's --optimizer values (launch/train.py builds them).
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adagrad")
# The Adam family among them: Adam correction, residual decay and DCT-MP's
# rescale default depend on it.
ADAM_OPTIMIZERS = ("adam", "adamw")


class FlagError(app.UsageError, ValueError):
  """A bad flag or flag combination, raised before any training starts."""


def check_range(name: str, value, lo: float, hi: float | None,
                lo_open: bool, hi_open: bool) -> None:
  """Raises FlagError naming `--name` and the interval unless `value` is a
  finite number in it (`hi` None: no upper bound)."""
  ok = (value is not None and math.isfinite(value)
        and (value > lo if lo_open else value >= lo)
        and (hi is None or (value < hi if hi_open else value <= hi)))
  if not ok:
    interval = (f"{'(' if lo_open else '['}{lo}, {'inf' if hi is None else hi}"
                f"{')' if hi_open or hi is None else ']'}")
    raise FlagError(f"--{name} must be in {interval}, got {value}")


def parse_schedule(items, comp: str, *,
                   none_word: bool = False) -> tuple[tuple[int, float], ...]:
  """--sparsity_schedule's steps:sparsity items as ((steps, sparsity), ...);
  raises FlagError naming the flag and the allowed values.

  `none_word`: the flag also takes the single item 'none' (no schedule, ()),
  and the error message says so.
  """
  if not items:
    return ()
  if none_word and list(items) == ["none"]:
    return ()
  if isinstance(items, tuple) and all(isinstance(i, tuple) for i in items):
    return items  # already parsed
  if comp != "dct":
    raise FlagError(f"--sparsity_schedule is for --compression=dct, not --compression={comp}")
  out = []
  for item in items:
    steps, sep, sparsity = str(item).partition(":")
    try:
      pair = (int(steps), float(sparsity))
    except ValueError:
      pair = None
    if not sep or pair is None or pair[0] < 1 or not 0 < pair[1] < 1:
      also = ", or the single word 'none' for no schedule" if none_word else ""
      raise FlagError(f"--sparsity_schedule: each item must be steps:sparsity with steps >= 1 "
                      f"and sparsity in (0, 1){also}, got {item!r}")
    out.append(pair)
  return tuple(out)
