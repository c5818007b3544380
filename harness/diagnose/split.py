"""Each block's own error: the probes' outputs against references that share the ring's normaliser.

Softmax couples the key blocks a query sees: their weights share one sum, exp(lse). A block that
is wrong changes that sum: a skipped block, keys the mask hides, wrong scores. Every other block's
output then moves with it. Against the exact outputs, blocks that are right show error too, often
more than the wrong one. A skipped block 0, say, leaves the query's own diagonal block with all the
weight.

So the references here use the implementation's own lse for each query row. For dk and dv they
also use its own D = rowsum(dout * out). A block that the implementation computed right matches
them to rounding, whatever its other blocks did. The error left is the wrong blocks' own.

- out, V kept on key block b: exp(lse - lse_impl) * out_b, out_b exact.
- dk, dv, dout kept on query block a: the exact backward with p = exp(s - lse_impl) and D_impl.
- dq has no such split. Its D = rowsum(dout * out_b) reaches every key, so a wrong block moves
  every column. Its split stays the exact one.

An implementation that returns no lse gets the exact references: no renormalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.case import Case
from ring_impl.layouts import all_positions
from ring_impl.mask_eval import allowed

ELEMENTS = 1 << 22  # score elements (batch x heads x rows x keys) per chunk of query rows
MAX_EXPONENT = 700.0  # exp() of more overflows float64


@dataclass
class RowStats:
    """Per query row (B, Hq, N), float64: the normaliser (`row_lse`) and D (`row_delta`)."""

    lse: torch.Tensor
    delta: torch.Tensor


def global_lse(case: Case, shards: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """The implementation's lse, (B, Hq, N) in global token order, or None if a rank has none."""
    parts = [shards.get(r, {}).get("lse") for r in range(case.world_size)]
    if any(p is None or p.dim() != 3 for p in parts):
        return None
    b, h = parts[0].shape[:2]
    glob = torch.full((b, h, case.total_len), float("nan"), dtype=torch.float64)
    for pos, t in zip(all_positions(case.layout, case.seq_lens), parts, strict=True):
        if tuple(t.shape) != (b, h, pos.numel()):
            return None
        glob[:, :, pos] = t.double()
    return glob


def row_lse(exact_lse: torch.Tensor, impl_lse: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """(B, Hq, N) normaliser of each query row, and whether it is the implementation's.

    Its own lse where it gave a finite one, else the exact one. A row that sees no key in both
    gets +inf: its weights are then exactly 0.
    """
    lse = exact_lse.double()
    renormalised = impl_lse is not None and impl_lse.shape == exact_lse.shape
    if renormalised:
        lse = torch.where(impl_lse.isfinite(), impl_lse.double(), lse)
    return torch.where(lse.isfinite(), lse, torch.full_like(lse, float("inf"))), renormalised


def row_delta(
    exact_out: torch.Tensor, dout: torch.Tensor, impl_out: torch.Tensor | None
) -> torch.Tensor:
    """(B, Hq, N) D = rowsum(dout * out) of each query row: the implementation's where finite."""
    dout = dout.double()
    exact = (dout * exact_out.double()).sum(-1).transpose(1, 2)
    if impl_out is None or impl_out.shape != exact_out.shape:
        return exact
    d = (dout * impl_out.double()).sum(-1).transpose(1, 2)
    return torch.where(d.isfinite(), d, exact)


def out_reference(
    exact_b: torch.Tensor, exact_lse: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """out with V kept on one key block, under the normaliser `lse` (`row_lse`).

    exact_b (B, N, Hq, D) is the exact output of that probe; exact_lse is (B, Hq, N).
    """
    shift = (exact_lse.double() - lse).clamp(max=MAX_EXPONENT).nan_to_num(nan=0.0)
    return exact_b.double() * shift.exp().transpose(1, 2).unsqueeze(-1)


def _chunks(pos: torch.Tensor, per_row: int) -> list[torch.Tensor]:
    rows = max(1, ELEMENTS // max(per_row, 1))
    return [pos[i : i + rows] for i in range(0, pos.numel(), rows)]


def key_grads(
    case: Case, g: dict[str, torch.Tensor], stats: RowStats, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv), each (B, N, Hkv, D) float64: dout kept on query block `block`.

    Query rows go in chunks: a chunk's scores are at most ELEMENTS values.
    """
    q, k, v, dout = (g[n].double() for n in ("q", "k", "v", "dout"))
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    grp = hq // hkv
    # (B, Hkv, N, D) keys; (B, Hkv, grp, N, D) queries: query head h reads kv head h // grp
    kt, vt = (t.permute(0, 2, 1, 3) for t in (k, v))
    qt, dt = (t.permute(0, 2, 1, 3).reshape(b, hkv, grp, n, d) for t in (q, dout))
    lse = stats.lse.view(b, hkv, grp, n)
    delta = stats.delta.view(b, hkv, grp, n)
    dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)
    keys = torch.arange(n)
    pos = all_positions(case.layout, case.seq_lens)[block]
    for rows in _chunks(pos, b * hq * n):
        qc, dc = qt[:, :, :, rows], dt[:, :, :, rows]
        s = torch.einsum("bhgrd,bhnd->bhgrn", qc, kt) * case.scale
        m = allowed(case.mask, rows, keys)
        if m is not None:
            s = s.masked_fill(~m, float("-inf"))
        p = (s - lse[..., rows].unsqueeze(-1)).exp()
        dp = torch.einsum("bhgrd,bhnd->bhgrn", dc, vt)
        ds = p * (dp - delta[..., rows].unsqueeze(-1))
        dv += torch.einsum("bhgrn,bhgrd->bhnd", p, dc)
        dk += torch.einsum("bhgrn,bhgrd->bhnd", ds, qc) * case.scale
    return dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)
