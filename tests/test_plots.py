"""The reports' shared plots draw only what carries information."""

import pytest

from kvjax import plots


@pytest.fixture
def ax():
  fig, axes = plots.panels(1, 4, 3)
  yield axes[0]
  plots.pyplot().close(fig)


def test_one_shared_x_becomes_a_bar_per_label(ax):
  series = {"snapkv": [(128, 40.0)], "sablock": [(128, 40.0)], "knorm": [(128, 0.0)]}
  plots.compare(ax, series, xlabel="budget", ylabel="accuracy (%)", ylim=(-5, 105),
                reference={"full": 100.0})
  assert [round(p.get_height(), 6) for p in ax.patches] == [0.0, 40.0, 40.0]  # sorted labels
  assert [t.get_text() for t in ax.get_xticklabels()] == ["knorm", "sablock", "snapkv"]
  assert ax.get_xlabel() == "budget: 128"
  assert [l.get_label() for l in ax.get_lines()] == ["full"]  # the reference line alone
  assert ax.get_ylim() == (-5, 105)


def test_several_x_draw_a_line_per_label_dodged_apart(ax):
  series = {"a": [(64, 0.0), (128, 100.0)], "b": [(64, 0.0), (128, 100.0)]}
  plots.compare(ax, series, xlabel="budget", ylabel="accuracy (%)", dodge=0.1)
  a, b = ax.get_lines()
  assert a.get_xdata()[0] < 64 < b.get_xdata()[0]  # equal values stay visible side by side
  assert ax.get_xscale() == "log" and not ax.patches


@pytest.mark.parametrize("values, scale, bottom", [
    ([982.69, 982.70, 982.73], "linear", 0.0),  # a narrow range: from 0, not a log axis
    ([1.0, 9.0], "linear", 0.0),
    ([1.0, 50.0], "log", None),  # more than 10x: log
])
def test_value_axis(ax, values, scale, bottom):
  plots.value_scale(ax, values)
  assert ax.get_yscale() == scale
  if bottom is not None:
    assert ax.get_ylim()[0] == bottom and ax.get_ylim()[1] >= max(values)


def test_memory_plot_of_one_context_length(tmp_path):
  from kvjax.bench import report
  row = dict(model="m", batch_size=1, device="cpu", context_length=8000, prefill_chunk=0,
             decode_ms_per_token=10.0)
  rows = [dict(row, policy=p, budget=b, peak_rss_bytes=int(mib * 2**20))
          for p, b, mib in (("full", None, 982.69), ("snapkv", 1024, 982.73))]
  paths = report.plot(rows, tmp_path)
  assert [p.name for p in paths] == ["decode_ms_per_token.png", "peak_memory.png"]
  for path in paths:  # PNG images of one 6 x 4 inch panel at plots.save's 110 dpi, RGBA
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert plots.pyplot().imread(path).shape == (4 * 110, 6 * 110, 4), path
