"""The shared figure style of bench/plotting.py: resolution, fonts, series styles."""

import argparse
import json
import os

from absl.testing import absltest
from PIL import Image

from bench import plotting
from bench.studies import common


def _draw(fig):
  """Two panels; three series of one colour and no marker, one label in both
  panels, a reference line, a long series."""
  ax1, ax2 = fig.subplots(1, 2)
  for name in ("a", "b", "c"):
    ax1.plot([0, 1, 2], [1, 2, 3], color="C0", label=name)
  ax1.axhline(1.5, color="k", lw=0.5)
  ax1.axhspan(1.2, 1.8, color="C2", alpha=0.15, label="band")
  ax1.set_yscale("log", base=2)
  ax1.set_title("one")
  ax1.legend(fontsize=5)
  ax2.plot(range(100), range(100), "C1-", label="c")
  ax2.plot(range(100), range(100), "C2-", label="d")
  ax2.set_xticks([0, 50, 99])
  ax2.set_title("two", fontsize=6)
  ax2.legend()


class PlottingTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = self.create_tempdir().full_path

  def _saved(self, name="fig.png"):
    fig = plotting.figure((2.0, 1.5))
    _draw(fig)
    path = os.path.join(self.dir, name)
    data = plotting.record(fig)
    plotting.finish(fig)
    styles = plotting.series_styles(fig)
    texts = {
        "legend": [t.get_fontsize() for ax in fig.axes for t in ax.get_legend().get_texts()],
        "ticks": [t.get_fontsize() for ax in fig.axes
                  for t in ax.get_xticklabels() + ax.get_yticklabels()],
        "title": [ax.title.get_fontsize() for ax in fig.axes]}
    plotting.save(fig, path)
    return path, data, styles, texts

  def test_png_is_written_at_150_dpi(self):
    path, _, _, _ = self._saved()
    with Image.open(path) as png:
      self.assertEqual(png.size, (300, 225))  # 2 x 1.5 inches at 150 dpi
      self.assertGreaterEqual(png.info["dpi"][0], 149.5)

  def test_fonts_are_readable(self):
    _, _, _, texts = self._saved()
    self.assertNotEmpty(texts["legend"])
    self.assertGreaterEqual(min(texts["legend"]), 8)  # fontsize=5 asked: 8
    self.assertGreaterEqual(min(texts["ticks"]), 8)
    self.assertGreaterEqual(min(texts["title"]), 9)

  def test_series_get_distinct_markers_and_line_styles(self):
    _, _, styles, _ = self._saved()
    first, second = styles
    self.assertLen(first, 3)  # the axhline is a reference, not a series
    # the first series differ in marker and in line style alike
    self.assertLen({m for m, _ in first}, 3)
    self.assertLen({ls for _, ls in first}, 3)
    self.assertTrue(all(m not in ("None", "", " ") for m, _ in first + second))
    self.assertLen(set(second), 2)
    self.assertEqual(second[0], first[2])  # "c" looks the same in both panels

  def test_a_study_style_with_a_marker_is_kept_unless_taken(self):
    fig = plotting.figure((2.0, 1.5))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], "s--", label="paper")
    ax.plot([0, 1], [1, 0], "s--", label="paper, again")
    ax.plot([0, 1], [1, 1], "o-", label="ours")
    plotting.finish(fig)
    styles = plotting.series_styles(fig)[0]
    self.assertEqual(styles[0], ("s", "--"))
    self.assertEqual(styles[2], ("o", "-"))
    self.assertLen(set(styles), 3)
    plotting.pyplot().close(fig)

  def test_line_styles_that_differ_are_kept_and_colours_get_markers(self):
    # colour: the setting, solid / dashed: without / with the method
    fig = plotting.figure((2.0, 1.5))
    ax = fig.subplots()
    for i in range(3):
      ax.plot([0, 1], [i, i], f"C{i}-", label=f"base {i}")
      ax.plot([0, 1], [i, i + 1], f"C{i}--", label=f"method {i}")
    plotting.finish(fig)
    styles = plotting.series_styles(fig)[0]
    self.assertEqual([ls for _, ls in styles], ["-", "--"] * 3)
    markers = [m for m, _ in styles]
    self.assertEqual(markers[0::2], markers[1::2])  # one marker per colour
    self.assertLen(set(markers), 3)
    plotting.pyplot().close(fig)

  def test_legends_sit_below_their_axes(self):
    fig = plotting.figure((4.0, 3.0))
    _draw(fig)
    plotting.finish(fig)
    fig.canvas.draw()
    for ax in fig.axes:
      legend = ax.get_legend().get_window_extent()
      self.assertLess(legend.y1, ax.get_window_extent().y0)
    plotting.pyplot().close(fig)

  def test_recorded_figure_replots_the_same_series(self):
    path, data, styles, _ = self._saved()
    stored = os.path.join(self.dir, "fig.json")
    plotting.save_json(data, stored)
    with open(stored, encoding="utf-8") as f:
      self.assertEqual(json.load(f), data)
    self.assertEqual(data["axes"][0]["yscale"], {"value": "log", "base": 2.0})
    self.assertEqual(data["axes"][1]["xticks"], [0.0, 50.0, 99.0])
    self.assertEqual([ln["kind"] for ln in data["axes"][0]["lines"]],
                     ["line", "line", "line", "hline"])
    self.assertEqual(data["axes"][0]["spans"], [
        {"y0": 1.2, "y1": 1.8, "color": "#2ca02c", "alpha": 0.15, "label": "band"}])
    again = os.path.join(self.dir, "again.png")
    plotting.replot(stored, again)
    fig = plotting.figure(tuple(data["figsize"]))
    plotting.draw(fig, data)
    self.assertEqual(plotting.record(fig), data)
    plotting.finish(fig)
    self.assertEqual(plotting.series_styles(fig), styles)
    plotting.pyplot().close(fig)
    with Image.open(path) as a, Image.open(again) as b:
      self.assertEqual(a.size, b.size)

  def test_a_band_of_zero_height_is_outlined_and_labelled(self):
    # e.g. the spread of seeds that all gave the same BLEU
    fig = plotting.figure((2.0, 1.5))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="ours")
    ax.axhspan(-0.0, 0.0, color="grey", alpha=0.2, label="spread")
    ax.axhspan(-1.0, 1.0, color="C2", alpha=0.2, label="band")
    ax.legend()
    data = plotting.record(fig)
    flat, band = ax.patches
    before = (band.get_linewidth(), band.get_edgecolor(), band.get_facecolor())
    plotting.finish(fig)
    plotting.finish(fig)  # labelled once
    self.assertEqual(ax.get_legend_handles_labels()[1],
                     ["ours", "spread (zero width)", "band"])
    self.assertEqual(flat.get_linewidth(), 3.0)
    self.assertEqual(tuple(flat.get_edgecolor()), (128 / 255,) * 3 + (1.0,))  # grey, opaque
    self.assertAlmostEqual(flat.get_facecolor()[3], 0.2)  # the swatch keeps its shade
    # a band with a height: unchanged
    self.assertEqual((band.get_linewidth(), band.get_edgecolor(), band.get_facecolor()), before)
    self.assertEqual(band.get_label(), "band")
    plotting.pyplot().close(fig)
    # Drawn again from its record: the same.
    again = plotting.figure((2.0, 1.5))
    plotting.draw(again, data)
    plotting.finish(again)
    self.assertEqual(again.axes[0].get_legend_handles_labels()[1],
                     ["ours", "spread (zero width)", "band"])
    plotting.pyplot().close(again)

  def test_replot_needs_the_stored_series(self):
    args = argparse.Namespace(out_dir=self.dir, quick=True)
    with self.assertRaisesRegex(FileNotFoundError, r"--replot needs .*study_quick\.json: "
                                r"run the study once first"):
      common.replot("study", args)


if __name__ == "__main__":
  absltest.main()
