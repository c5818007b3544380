"""Heatmaps of where a failing case's error is (matplotlib, an optional extra, imported lazily).

One PNG per tensor (out, dq, dk, dv). Left panel: token x block (out/dq: query token x key block,
dk/dv: key token x query block); right panel: the same cells by ring step. Colour is error /
tolerance on a log scale (above 1 fails); rows are grouped by rank with rank boundaries drawn,
the causal-diagonal (local) block is outlined, and blocks the mask hides entirely are hatched:
colour in a hatched cell is error where the mask allows none. The leak check says whether it is
a leak (docs/cases.md, "The `where:` lines").
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from harness.diagnose.localise import QUERY_TENSORS, Localisation, by_step, owners, row_order
from harness.errors import HarnessError

FLOOR = 1e-3  # ratios below this are drawn as the lowest colour
ANNOTATE_CELLS = 96  # write the ratio in each cell when the grid is at most this big


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HarnessError("--plot needs matplotlib: pip install 'ring-harness[plot]'") from None
    return plt


def _groups(rank_of_row: torch.Tensor) -> list[tuple[int, int, int]]:
    """(rank, first row, end row) of each run of rows held by one rank."""
    out, start = [], 0
    for i in range(1, len(rank_of_row) + 1):
        if i == len(rank_of_row) or rank_of_row[i] != rank_of_row[start]:
            out.append((int(rank_of_row[start]), start, i))
            start = i
    return out


def _panel(
    ax,
    grid: torch.Tensor,
    visible: torch.Tensor,
    diag_col,
    norm,
    cmap,
    xlabel: str,
    ylabel: str,
    rows: torch.Tensor,
    rank_of_row: torch.Tensor,
    title: str,
):
    """One heatmap: grid (rows x W) already in row order; diag_col(rank) is the local block's
    column."""
    n, w = grid.shape
    import numpy as np

    # NaN: probe not run
    data = np.ma.masked_invalid(grid.clamp(min=FLOOR).nan_to_num(posinf=1e30).numpy())
    im = ax.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=norm,
        extent=(-0.5, w - 0.5, n - 0.5, -0.5),
    )
    _hatch_masked(ax, visible)
    _outline_local(ax, rank_of_row, diag_col)
    if n * w <= ANNOTATE_CELLS:
        _annotate(ax, grid)
    _grid_lines(ax, rank_of_row, w)
    _label_axes(ax, rows, rank_of_row, w, xlabel, ylabel)
    ax.set_title(title, fontsize=10)
    return im


def _hatch_masked(ax, visible: torch.Tensor) -> None:
    """Hatch the cells the mask hides entirely: each run of them in a column as one patch (fast on
    big grids)."""
    from matplotlib.patches import Rectangle

    for j in range(visible.shape[1]):
        masked = (~visible[:, j]).tolist() + [False]
        start = None
        for i, m in enumerate(masked):
            if m and start is None:
                start = i
            elif not m and start is not None:
                ax.add_patch(
                    Rectangle(
                        (j - 0.5, start - 0.5),
                        1,
                        i - start,
                        fill=False,
                        hatch="///",
                        edgecolor="0.6",
                        lw=0,
                    )
                )
                start = None


def _outline_local(ax, rank_of_row: torch.Tensor, diag_col) -> None:
    """Outline each rank's local (causal-diagonal) block in cyan."""
    from matplotlib.patches import Rectangle

    for rank, a, b in _groups(rank_of_row):
        ax.add_patch(
            Rectangle(
                (diag_col(rank) - 0.5, a - 0.5), 1, b - a, fill=False, edgecolor="cyan", lw=1.5
            )
        )


def _annotate(ax, grid: torch.Tensor) -> None:
    """Write each cell's ratio in it (cells not run stay blank)."""
    n, w = grid.shape
    for i in range(n):
        for j in range(w):
            v = float(grid[i, j])
            if not math.isnan(v):
                ax.text(
                    j,
                    i,
                    f"{v:.2g}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if v < 1 else "black",
                )


def _grid_lines(ax, rank_of_row: torch.Tensor, w: int) -> None:
    """White lines at the rank boundaries between row groups and between the columns."""
    for i in range(1, len(rank_of_row)):
        if rank_of_row[i] != rank_of_row[i - 1]:
            ax.axhline(i - 0.5, color="white", lw=1.5)
    for j in range(1, w):
        ax.axvline(j - 0.5, color="white", lw=0.6)


def _label_axes(
    ax, rows: torch.Tensor, rank_of_row: torch.Tensor, w: int, xlabel: str, ylabel: str
) -> None:
    """Column ticks, and row ticks at every rank's first row and every (n / 24)th."""
    n = len(rank_of_row)
    ax.set_xticks(range(w))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    step = max(1, n // 24)
    ticks = [
        i for i in range(n) if i % step == 0 or (i > 0 and rank_of_row[i] != rank_of_row[i - 1])
    ]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{int(rows[i])} (r{int(rank_of_row[i])})" for i in ticks], fontsize=7)


def heatmaps(loc: Localisation, directory: str | Path, stem: str = "case") -> list[Path]:
    """Write one heatmap PNG per tensor with a block map; returns the paths."""
    if not loc.blocks:
        raise HarnessError("no block error maps to plot (localise with a rank pool and probes)")
    plt = _pyplot()
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for tensor, grid in loc.blocks.items():
        path = out_dir / f"{stem}-{tensor}.png"
        _tensor_heatmap(plt, loc, tensor, grid, path)
        paths.append(path)
    return paths


def _tensor_heatmap(plt, loc: Localisation, tensor: str, grid: torch.Tensor, path: Path) -> None:
    """One tensor's figure: the block panel, the ring-step panel and the colour bar, to `path`."""
    from matplotlib.colors import LogNorm

    case = loc.case
    rows = row_order(case)
    rank_of_row = owners(case)[rows]
    w = case.world_size
    query_side = tensor in QUERY_TENSORS
    vis_s = by_step(case, tensor, loc.visible[tensor].double())[rows] > 0.5
    top = max(float(grid.nan_to_num(nan=0.0, posinf=1e30).max()), 10.0)
    norm = LogNorm(vmin=FLOOR, vmax=top)
    cmap = plt.get_cmap("inferno").with_extremes(bad="0.75")
    other = (
        "key block (rank that owns the keys)"
        if query_side
        else "query block (rank that owns the queries)"
    )
    ylabel = f"{'query' if query_side else 'key'} token: position (rank)"
    # at least 10 x 4.5 inches: the two x-labels and the title lines fit even for a 1 x 1 grid
    # (W1, L = 1)
    fig, axes = plt.subplots(
        1,
        2,
        figsize=(max(10.0, 5 + 1.1 * w), max(4.5, 3.2 + min(0.22 * len(rows), 9))),
        squeeze=False,
        layout="constrained",
    )
    im = _panel(
        axes[0][0],
        grid[rows],
        loc.visible[tensor][rows],
        lambda r: r,
        norm,
        cmap,
        other,
        ylabel,
        rows,
        rank_of_row,
        "by key block" if query_side else "by query block",
    )
    _panel(
        axes[0][1],
        by_step(case, tensor, grid)[rows],
        vis_s,
        lambda r: 0,
        norm,
        cmap,
        "ring step ("
        + ("key block = rank - step" if query_side else "query block = rank + step")
        + " mod W)",
        "",
        rows,
        rank_of_row,
        "by ring step",
    )
    cb = fig.colorbar(im, ax=axes[0].tolist(), fraction=0.05)
    cb.set_label("|error| / tolerance (log; > 1 fails)")
    cb.ax.axhline(1.0, color="cyan", lw=1.5)
    fig.suptitle(
        f"{tensor} error by block ({_kept(tensor)}) - {loc.verdict}\n{case.summary()}\n"
        "rows grouped by rank; cyan outline: local (causal-diagonal) block;\n"
        "hatched: block fully masked (must be 0); grey: not run",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kept(tensor: str) -> str:
    """What a block's error is measured with: the part of the sum kept on one block."""
    return {
        "out": "V kept on one key block",
        "dq": "V kept on one key block (not an exact split for dq)",
    }.get(tensor, "dout kept on one query block")
