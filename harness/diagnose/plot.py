"""Heatmaps of where a failing case's error is (matplotlib, an optional extra, imported lazily).

One PNG per tensor (out, dq, dk, dv). Left panel: token x block (out/dq: query token x key block,
dk/dv: key token x query block); right panel: the same cells by ring step. Colour is error /
tolerance on a log scale (above 1 fails); rows are grouped by rank with rank boundaries drawn,
the causal-diagonal (local) block is outlined, and blocks the mask hides entirely are hatched:
colour in a hatched cell is a leak.
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
    from matplotlib.patches import Rectangle

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
    # hatch each run of masked cells in a column as one patch (fast on big grids)
    for j in range(w):
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
    for rank, a, b in _groups(rank_of_row):
        ax.add_patch(
            Rectangle(
                (diag_col(rank) - 0.5, a - 0.5), 1, b - a, fill=False, edgecolor="cyan", lw=1.5
            )
        )
    if n * w <= ANNOTATE_CELLS:
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
    for i in range(1, n):  # rank boundaries between row groups
        if rank_of_row[i] != rank_of_row[i - 1]:
            ax.axhline(i - 0.5, color="white", lw=1.5)
    for j in range(1, w):
        ax.axvline(j - 0.5, color="white", lw=0.6)
    ax.set_xticks(range(w))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    step = max(1, n // 24)
    ticks = [
        i for i in range(n) if i % step == 0 or (i > 0 and rank_of_row[i] != rank_of_row[i - 1])
    ]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{int(rows[i])} (r{int(rank_of_row[i])})" for i in ticks], fontsize=7)
    ax.set_title(title, fontsize=10)
    return im


def heatmaps(loc: Localisation, directory: str | Path, stem: str = "case") -> list[Path]:
    """Write one heatmap PNG per tensor with a block map; returns the paths."""
    if not loc.blocks:
        raise HarnessError("no block error maps to plot (localise with a rank pool and probes)")
    plt = _pyplot()
    from matplotlib.colors import LogNorm

    case = loc.case
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = row_order(case)
    rank_of_row = owners(case)[rows]
    w = case.world_size
    paths = []
    for tensor, grid in loc.blocks.items():
        query_side = tensor in QUERY_TENSORS
        g = grid[rows]
        s = by_step(case, tensor, grid)[rows]
        vis = loc.visible[tensor][rows]
        vis_s = by_step(case, tensor, loc.visible[tensor].double())[rows] > 0.5
        top = max(float(grid.nan_to_num(nan=0.0, posinf=1e30).max()), 10.0)
        norm = LogNorm(vmin=FLOOR, vmax=top)
        cmap = plt.get_cmap("inferno").with_extremes(bad="0.75")
        token = "query" if query_side else "key"
        other = (
            "key block (rank that owns the keys)"
            if query_side
            else "query block (rank that owns the queries)"
        )
        ylabel = f"{token} token: position (rank)"
        what = {
            "out": "V kept on one key block",
            "dq": "V kept on one key block (not an exact split for dq)",
        }.get(tensor, "dout kept on one query block")
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
            g,
            vis,
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
            s,
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
            f"{tensor} error by block ({what}) - {loc.verdict}\n{case.summary()}\n"
            "rows grouped by rank; cyan outline: local (causal-diagonal) block;\n"
            "hatched: block fully masked (must be 0); grey: not run",
            fontsize=9,
        )
        path = out_dir / f"{stem}-{tensor}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
