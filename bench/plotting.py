"""One plotting style for every figure the benchmarks write.

Every PNG under `docs/` goes through `figure` and `save`: 150 dpi, legend and
tick labels of at least 8 pt, titles of at least 9 pt, and each labelled
series its own marker and line style, so a series drawn over another stays
visible and the figures read in greyscale too. A band of zero height is
outlined and labelled as such. Legends go below their axes, outside the
data.

A figure's lines can be stored as JSON (`record`) and drawn again later
(`draw`), so a style change re-plots a study without re-running it.
"""

from __future__ import annotations

import itertools
import json
from typing import Sequence

DPI = 150
MARKERS = ("o", "s", "^", "v", "D", "x", "P", "*")
LINESTYLES = ("-", "--", "-.", ":")
# Every (marker, line style) pair, in the order series receive them: the
# first eight differ in both marker and line style.
_FIRST = tuple((m, LINESTYLES[i % len(LINESTYLES)]) for i, m in enumerate(MARKERS))
STYLES = _FIRST + tuple((m, ls) for ls, m in itertools.product(LINESTYLES, MARKERS)
                        if (m, ls) not in _FIRST)
_NO_MARKER = ("None", "", " ", None)
MARKS_PER_LINE = 12  # markers on a long line: enough to tell it, few enough to see it

RC = {
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "legend.framealpha": 0.85,
    "lines.markersize": 4,
}


def pyplot():
  """`matplotlib.pyplot` on the Agg backend with the shared style applied."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  matplotlib.rcParams.update(RC)
  return plt


def figure(figsize: tuple[float, float] = (9, 5.5)):
  """A new figure with constrained layout (room for legends outside the axes)."""
  return pyplot().figure(figsize=figsize, layout="constrained")


def _series(ax) -> list:
  """The labelled lines of `ax` (reference lines such as axhline have none)."""
  return [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def distinguish(fig) -> None:
  """Gives each labelled series a (marker, line style) no other in its axes has.

  A series keeps the style its study chose when that style has a marker and
  is not taken yet in its axes; a label seen in an earlier axes keeps that
  axes' style, so the panels of one figure agree. Where the other series'
  line styles differ (they carry meaning, e.g. solid: ours, dashed: the
  paper's), a series keeps its line style and gets its colour's marker (a
  marker no other colour has); otherwise it gets the next free `STYLES`
  entry. Long lines carry `MARKS_PER_LINE` markers, shifted per series so the
  markers of overlapping lines do not coincide.
  """
  by_label = {}
  for ax in fig.axes:
    series = _series(ax)
    used, styles, owner = set(), [None] * len(series), {}  # owner: marker -> colour
    for k, line in enumerate(series):  # first the styles kept, then the others
      own = (line.get_marker(), line.get_linestyle())
      style = by_label.get(line.get_label())
      if style is None and own[0] not in _NO_MARKER:
        style = own
      if style is not None and style not in used:
        styles[k] = style
        used.add(style)
        owner.setdefault(style[0], line.get_color())
    meaningful = len({line.get_linestyle() for line in series}) > 1
    for k, line in enumerate(series):
      if styles[k] is None and meaningful:
        ls, color = line.get_linestyle(), line.get_color()
        mine = [m for m in MARKERS if owner.get(m) == color]
        free = [m for m in MARKERS if m not in owner]
        marker = next((m for m in mine + free if (m, ls) not in used), None)
        if marker is not None:
          styles[k] = (marker, ls)
          owner.setdefault(marker, color)
      if styles[k] is None:
        styles[k] = next(s for s in STYLES if s not in used)
      used.add(styles[k])
      by_label.setdefault(line.get_label(), styles[k])
      line.set_marker(styles[k][0])
      line.set_linestyle(styles[k][1])
      n = len(line.get_xdata())
      if n > MARKS_PER_LINE:
        step = n // MARKS_PER_LINE
        line.set_markevery((k * step // max(1, len(series)), step))


def legends(fig) -> None:
  """Redraws every axes' legend below the axes, outside the data."""
  for ax in fig.axes:
    old = ax.get_legend()
    handles, labels = ax.get_legend_handles_labels()
    if old is None or not handles:
      continue
    old.remove()
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              ncols=2 if len(handles) > 3 else 1, borderaxespad=0.0)


def readable(fig) -> None:
  """Raises any title or tick label a plot made smaller than `RC`'s sizes."""
  for ax in fig.axes:
    if ax.title.get_fontsize() < RC["axes.titlesize"]:
      ax.title.set_fontsize(RC["axes.titlesize"])
    for name in ("x", "y"):
      if any(t.get_fontsize() < RC[f"{name}tick.labelsize"]
             for t in getattr(ax, f"get_{name}ticklabels")()):
        ax.tick_params(axis=name, labelsize=RC[f"{name}tick.labelsize"])


# Appended to the legend label of a band of zero height (`degenerate_spans`).
ZERO_WIDTH = " (zero width)"


def _spans(ax) -> list:
  """The horizontal bands (`axhspan`) of `ax`."""
  return [patch for patch in ax.patches
          if patch.get_data_transform() == ax.get_yaxis_transform() and hasattr(patch, "get_y")]


def degenerate_spans(fig) -> None:
  """Outlines every band of zero height, which would not show otherwise (the
  spread of runs that all agree), and says so in its legend label.

  The band keeps its fill colour (its legend swatch); its edge is drawn as a
  dashed line in that colour, opaque, along the band's one value.
  """
  for ax in fig.axes:
    for span in _spans(ax):
      if span.get_height() != 0:
        continue
      face = span.get_facecolor()  # RGBA, the band's alpha applied
      span.set_alpha(None)
      span.set_facecolor(face)
      span.set_edgecolor((*face[:3], 1.0))
      span.set_linewidth(3.0)  # wider than the reference line often drawn on it
      span.set_linestyle("--")
      label = span.get_label()
      if not label.startswith("_") and ZERO_WIDTH not in label:
        span.set_label(label + ZERO_WIDTH)


def finish(fig) -> None:
  """Applies the shared series styles, font sizes, visible zero-width bands
  and legend placement."""
  distinguish(fig)
  readable(fig)
  degenerate_spans(fig)
  legends(fig)


def save(fig, path: str) -> None:
  """Finishes `fig`, writes it to `path` at `DPI` and closes it."""
  finish(fig)
  fig.savefig(path, dpi=DPI)
  pyplot().close(fig)


def _scale(axis) -> dict:
  scale = {"value": axis.get_scale()}
  base = getattr(axis.get_transform(), "base", None)  # log scales
  if base is not None:
    scale["base"] = float(base)
  return scale


def _floats(values) -> list:
  return [None if v != v else float(v) for v in (float(x) for x in values)]  # nan -> null


def record(fig) -> dict:
  """The figure's axes, lines and horizontal bands as a JSON-ready dict (see `draw`)."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  axes = []
  for ax in fig.axes:
    spec = ax.get_subplotspec()
    rows, cols, start, stop = spec.get_geometry()
    lines = []
    for line in ax.get_lines():
      kind = ("hline" if line.get_transform() == ax.get_yaxis_transform()
              else "vline" if line.get_transform() == ax.get_xaxis_transform()
              else "line")
      lines.append({
          "kind": kind, "label": line.get_label(), "x": _floats(line.get_xdata()),
          "y": _floats(line.get_ydata()), "color": _color(line.get_color()),
          "linestyle": line.get_linestyle(), "marker": line.get_marker(),
          "linewidth": float(line.get_linewidth()), "alpha": line.get_alpha()})
    spans = [{"y0": float(patch.get_y()), "y1": float(patch.get_y() + patch.get_height()),
              "color": _color(patch.get_facecolor()), "alpha": patch.get_alpha(),
              "label": patch.get_label()}
             for patch in _spans(ax)]  # axhspan: a band across the axes
    axes.append({
        "spans": spans,
        "grid": [int(rows), int(cols), int(start), int(stop)], "title": ax.get_title(),
        "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
        "xscale": _scale(ax.xaxis), "yscale": _scale(ax.yaxis),
        "xticks": (_floats(ax.get_xticks()) if isinstance(ax.xaxis.get_major_locator(),
                                                           ticker.FixedLocator) else None),
        "legend": ax.get_legend() is not None, "lines": lines})
  width, height = fig.get_size_inches()
  return {"figsize": [float(width), float(height)], "axes": axes}


def _color(color):
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  return colors.to_hex(color)


def draw(fig, data: dict) -> None:
  """Draws a `record`ed figure into the empty `fig` (style not yet finished)."""
  for spec in data["axes"]:
    rows, cols, start, stop = spec["grid"]
    ax = fig.add_subplot(rows, cols, start + 1 if start == stop else (start + 1, stop + 1))
    for line in spec["lines"]:
      style = {"color": line["color"], "linestyle": line["linestyle"],
               "marker": line["marker"], "lw": line["linewidth"],
               "alpha": line["alpha"], "label": line["label"]}
      y = [float("nan") if v is None else v for v in line["y"]]
      x = [float("nan") if v is None else v for v in line["x"]]
      if line["kind"] == "hline":
        ax.axhline(y[0], **style)
      elif line["kind"] == "vline":
        ax.axvline(x[0], **style)
      else:
        ax.plot(x, y, **style)
    for span in spec.get("spans", []):
      ax.axhspan(span["y0"], span["y1"], color=span["color"], alpha=span["alpha"],
                 label=span["label"])
    for name in ("x", "y"):
      scale = spec[f"{name}scale"]
      kwargs = {"base": scale["base"]} if "base" in scale and scale["value"] == "log" else {}
      getattr(ax, f"set_{name}scale")(scale["value"], **kwargs)
    ax.set_title(spec["title"])
    ax.set_xlabel(spec["xlabel"])
    ax.set_ylabel(spec["ylabel"])
    if spec.get("xticks") is not None:
      ax.set_xticks(spec["xticks"])
    if spec["legend"]:
      ax.legend()


def save_json(data: dict, path: str) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=None, separators=(",", ":"))
    f.write("\n")


def replot(json_path: str, png: str) -> None:
  """Draws the figure stored at `json_path` in the current style into `png`."""
  with open(json_path, encoding="utf-8") as f:
    data = json.load(f)
  fig = figure(tuple(data["figsize"]))
  draw(fig, data)
  save(fig, png)


def series_styles(fig) -> list[list[tuple[str, str]]]:
  """Per axes, the (marker, line style) of each labelled series."""
  return [[(ln.get_marker(), ln.get_linestyle()) for ln in _series(ax)] for ax in fig.axes]


__all__: Sequence[str] = ("DPI", "RC", "STYLES", "ZERO_WIDTH", "degenerate_spans", "draw",
                          "figure", "finish", "pyplot", "readable", "record", "replot",
                          "save", "save_json", "series_styles")
