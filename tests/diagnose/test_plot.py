"""Heatmaps: one readable PNG per tensor from a localisation; one clear line without matplotlib."""

from __future__ import annotations

import sys

import pytest
import torch

from harness.case import make_case
from harness.diagnose import localise, plot
from harness.errors import HarnessError


def _loc(w=3, n_per=4):
    c = make_case(world_size=w, seq_lens=(n_per,) * w, layout="zigzag", mask={"kind": "causal"})
    by_key, by_query = localise.block_visibility(c)
    n = c.total_len
    blocks, visible = {}, {}
    for i, t in enumerate(("out", "dq", "dk", "dv")):
        g = torch.rand(n, w, generator=torch.Generator().manual_seed(i), dtype=torch.float64) * 0.5
        g[0, -1] = 1e4  # a hot cell
        g[1, 0] = float("nan")  # a probe run that did not complete
        blocks[t] = g
        visible[t] = by_key if t in ("out", "dq") else by_query
    return localise.Localisation(
        case=c, verdict="silent-corruption", blocks=blocks, visible=visible
    )


def test_writes_one_png_per_tensor(tmp_path):
    import matplotlib.image as mpimg

    paths = plot.heatmaps(_loc(), tmp_path / "plots", "case1")
    assert [p.name for p in paths] == [f"case1-{t}.png" for t in ("out", "dq", "dk", "dv")]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 500  # big enough to read
        assert img[..., :3].std() > 0.05  # not blank


def test_large_case_stays_a_sane_size(tmp_path):
    import matplotlib.image as mpimg

    (p, *_) = plot.heatmaps(_loc(w=8, n_per=8), tmp_path, "big")
    h, w = mpimg.imread(p).shape[:2]
    assert 300 < h < 2000 and 500 < w < 2000


def test_nothing_to_plot_is_one_clear_error(tmp_path):
    loc = localise.Localisation(
        case=make_case(world_size=1, seq_lens=(2,)), verdict="silent-corruption"
    )
    with pytest.raises(HarnessError, match="no block error maps"):
        plot.heatmaps(loc, tmp_path)


def test_missing_matplotlib_is_one_line(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    # makes `import matplotlib` raise ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(HarnessError) as e:
        plot.heatmaps(_loc(), tmp_path)
    assert "pip install 'ring-harness[plot]'" in str(e.value) and "\n" not in str(e.value)
