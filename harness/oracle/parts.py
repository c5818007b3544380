"""What a share's two passes give, and how the parent combines them.

A rows pass gives a `RowsPart`, a keys pass a `KeysPart`, each twice: float64 and the same-dtype
base. A pass gets its inputs through a `Fetch`. `gather_stats` puts every share's row statistics
together for the keys passes (`RowStats`). `TermScales` reads the magnitudes of the terms from all
the parts. docs/oracle.md has the derivation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# how a pass gets its inputs: (q/k/v/dout, global positions) -> (B, len, heads, D)
Fetch = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class RowStats:
    """What the keys pass needs of every query row, one compute dtype, (B, Hq, N).

    The softmax's row max and sum of exp(s - max); D (float64: rowsum(dout * out); the base:
    sum_j P_ij dP_ij); and, float64 only, A, the term scale of D (`TermScales`)."""

    mx: torch.Tensor
    total: torch.Tensor
    delta: torch.Tensor
    amp: torch.Tensor | None = None

    def to(self, device) -> RowStats:
        moved = (
            None if t is None else t.to(device) for t in (self.mx, self.total, self.delta, self.amp)
        )
        return RowStats(*moved)


@dataclass
class RowsPart:
    """The rows pass of one share, one compute dtype.

    Its query rows' out, lse and dq, their statistics (`RowStats`), and, float64 only, the row
    maxima of the term scales: out, dq, dq_d, max_q, max_dout (and dsinks, dsinks_d,
    dsinks_dout). With sinks, also the share's dsinks: the sum over its own rows."""

    rows: torch.Tensor  # (r,) global query positions, in the order of the rows below
    out: torch.Tensor  # (B, r, Hq, Dv) in the compute dtype
    lse: torch.Tensor  # (B, Hq, r) float64 / float32
    dq: torch.Tensor  # (B, r, Hq, D)
    # (B, Hq, r) in the accumulation dtype: the rows' score max (-inf: sees no key)
    mx: torch.Tensor
    total: torch.Tensor  # (B, Hq, r): sum_j exp(s_ij - mx_i)
    delta: torch.Tensor  # (B, Hq, r)
    amp: torch.Tensor | None = None  # (B, Hq, r) float64
    maxima: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    dsinks: torch.Tensor | None = None  # (Hq,): d loss / d sink_h over these rows (with sinks)

    def cpu(self) -> RowsPart:
        for name in ("rows", "out", "lse", "dq", "mx", "total", "delta", "amp", "dsinks"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).cpu())
        return self


@dataclass
class KeysPart:
    """The keys pass of one share, one compute dtype.

    Its keys' dk and dv from every query. Float64 only: the term scales' column sums over every
    query (ds, pa, p: (B, Hkv, c)), max|k| and max|v|."""

    keys: torch.Tensor  # (c,) global key positions
    dk: torch.Tensor  # (B, c, Hkv, D) in the compute dtype
    dv: torch.Tensor  # (B, c, Hkv, Dv)
    cols: dict[str, torch.Tensor] = field(default_factory=dict)
    max_k: float = 0.0
    max_v: float = 0.0
    seconds: float = 0.0

    def cpu(self) -> KeysPart:
        self.keys, self.dk, self.dv = self.keys.cpu(), self.dk.cpu(), self.dv.cpu()
        self.cols = {n: t.cpu() for n, t in self.cols.items()}
        return self


# -- combining the shares -------------------------------------------------------------------


class TermScales:
    """The magnitude of the terms each result is summed from, in float64.

    Not of the result itself, which can be exactly 0 (dq of a query that sees one key). The row
    maxima come from the shares' rows passes, the column sums from their keys passes. docs/oracle.md
    ("Term scales") has the table of what each scale is."""

    def __init__(self, rows: Sequence[RowsPart], keys: Sequence[KeysPart]) -> None:
        self.sinks = any(p.dsinks is not None for p in rows)
        self.maxima = {
            name: max((p.maxima.get(name, 0.0) for p in rows), default=0.0)
            for name in ("out", "dq", "dq_d", "max_q", "max_dout")
        }
        # dsinks is judged summed over the shares: each share's largest head's sum, added up,
        # bounds the terms of every head's sum over every row
        self.maxima.update(
            {
                name: sum(p.maxima.get(name, 0.0) for p in rows)
                for name in ("dsinks", "dsinks_d", "dsinks_dout")
            }
        )
        self.max_k = max((p.max_k for p in keys), default=0.0)
        self.max_v = max((p.max_v for p in keys), default=0.0)
        self.top = {
            name: max(
                (float(p.cols[name].max()) for p in keys if p.cols[name].numel()), default=0.0
            )
            for name in ("ds", "pa", "p")
        }

    def scales(self, scale: float) -> dict[str, dict[str, float]]:
        """{tensor: {rounding class: scale}} for the tolerance rule."""
        mq, mk, mdo, x = self.maxima["max_q"], self.max_k, self.maxima["max_dout"], self.maxima
        out = {
            "out": {"terms": x["out"]},
            "lse": {"terms": scale * mq * mk},
            "dq": {"terms": scale * mk * x["dq"], "D": scale * mk * x["dq_d"]},
            "dk": {"terms": scale * mq * self.top["ds"], "D": scale * mq * self.top["pa"]},
            "dv": {"terms": mdo * self.top["p"]},
            "blocks": {"max_v": self.max_v},
        }
        if self.sinks:  # the shares' largest heads' sums over their rows, added up
            out["dsinks"] = {"terms": x["dsinks"], "D": x["dsinks_d"], "dout": x["dsinks_dout"]}
        return out


def gather_stats(rows: Sequence[RowsPart], n: int) -> RowStats:
    """Every row's statistics, (B, Hq, n), from the rows passes of all the shares of one compute
    dtype."""
    first = rows[0]
    b, hq = first.mx.shape[:2]

    def whole(name: str) -> torch.Tensor | None:
        if getattr(first, name) is None:
            return None
        t = getattr(first, name).new_zeros(b, hq, n)
        for p in rows:
            t.index_copy_(2, p.rows.to(t.device), getattr(p, name))
        return t

    return RowStats(whole("mx"), whole("total"), whole("delta"), whole("amp"))
