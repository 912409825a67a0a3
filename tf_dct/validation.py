"""Small checks and counts shared by the compressors and the DCT-MP ops."""

from __future__ import annotations

import decimal
import math
import numbers

import numpy as np


def as_decimal(x: float) -> decimal.Decimal:
  """The decimal value of `x` as written (0.29 stays 0.29, not 0.2899...)."""
  return decimal.Decimal(repr(float(as_python_number(x))))


def floor_fraction(n: int, fraction: float) -> int:
  """floor(n * fraction), on the decimal value of `fraction`.

  Binary floating point would give floor(100 * 0.29) = 28; sparsities and
  densities are meant as written, so this gives 29.

  Example:
    >>> math.floor(100 * 0.29)
    28
    >>> floor_fraction(100, 0.29)
    29
  """
  return math.floor(as_decimal(fraction) * n)


def as_python_number(value):
  """A numpy scalar as the Python number it was written as, else `value`.

  `np.float32(0.9)` holds 0.899999976...; its shortest repr is "0.9", so it
  becomes the Python float 0.9, as if the user had written 0.9. Parameters
  then select the same counts whatever scalar type they came in.

  Example:
    >>> float(np.float32(0.9))
    0.8999999761581421
    >>> as_python_number(np.float32(0.9))
    0.9
  """
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.floating):
    return float(str(value))
  return value


def check_number(owner: str, name: str, value, kind, lo, lo_open: bool,
                 hi=None, hi_open: bool = False):
  """Returns `value` if it is a finite `kind` in range, else a ValueError.

  The message names the owner, the parameter and the allowed range, e.g.
  "DCTDP: sparsity must be a number in (0, 1), got 1.5". A numpy scalar is
  taken as the number it was written as (`as_python_number`).

  Example:
    >>> check_number("DCTDP", "sparsity", 0.99, numbers.Real, 0, True, 1, True)
    0.99
    >>> check_number("DCTDP", "sparsity", 1.5, numbers.Real, 0, True, 1, True)
    Traceback (most recent call last):
    ...
    ValueError: DCTDP: sparsity must be a number in (0, 1), got 1.5
  """
  if hi is None:
    allowed = f"{'>' if lo_open else '>='} {lo}"
  else:
    allowed = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
  what = "an int" if kind is numbers.Integral else "a number"
  value = as_python_number(value)
  ok = (not isinstance(value, bool) and isinstance(value, kind)
        and math.isfinite(value)
        and (value > lo if lo_open else value >= lo)
        and (hi is None or (value < hi if hi_open else value <= hi)))
  if not ok:
    raise ValueError(f"{owner}: {name} must be {what} {allowed}, got {value!r}")
  return value
