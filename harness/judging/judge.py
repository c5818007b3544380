"""Judging one case: every rank's out/lse/dq/dk/dv against the float64 oracle, and the exact
causality-leak check. Produces per-rank, per-tensor checks with error ratios and positions."""

from __future__ import annotations

import torch

from harness import inputs
from harness.case import Case
from harness.judging import tolerance
from harness.judging.oracle import Reference
from harness.result import LeakCheck, TensorCheck
from ring_impl.layouts import all_positions
from ring_impl.masks import visible_keys


def _as_bnhd(t: torch.Tensor, name: str) -> torch.Tensor:
    """lse comes as (B, H, L); view it as (B, L, H, 1) so one code path handles every tensor."""
    return t.permute(0, 2, 1).unsqueeze(-1) if name == "lse" else t


def _unravel(flat: int, shape: torch.Size) -> tuple[int, int, int]:
    """(batch, token, head) of a flat index into a (B, L, H, D) tensor."""
    rest, _ = divmod(flat, shape[3])
    rest, hi = divmod(rest, shape[2])
    bi, li = divmod(rest, shape[1])
    return bi, li, hi


def check_tensors(case: Case, shards: dict[int, dict[str, torch.Tensor]], ref: Reference, base: Reference,
                  maps: dict[str, torch.Tensor] | None = None) -> list[TensorCheck]:
    """Compare each rank's shards (group rank -> {tensor: shard}) with the reference.

    With `maps`, also fill maps[tensor] with the (batch, global token, head) max-abs error (inf where
    non-finite), so harness.localise can say where errors concentrate."""
    pos_all = all_positions(case.layout, case.seq_lens)
    checks = []
    lse_max = float(ref.lse.abs().max()) if ref.lse.numel() else 0.0
    names = [n for n in ("out", "lse", "dq", "dk", "dv") if any(n in s for s in shards.values())]
    for name in names:
        r64 = _as_bnhd(getattr(ref, name), name)
        b = _as_bnhd(getattr(base, name), name).to(torch.float64)
        base_err = float((b - r64).abs().nan_to_num(nan=float("inf")).max()) if r64.numel() else 0.0
        ref_max = float(r64.abs().max()) if r64.numel() else 0.0
        allowed = tolerance.bound(name, case.dtype, base_err, ref_max, case.tolerance, case.world_size, lse_max,
                                  ref.term_scale.get(name, 0.0))
        for rank, tensors in sorted(shards.items()):
            if name not in tensors:
                continue
            got = _as_bnhd(tensors[name], name).to(torch.float64)
            want = r64.index_select(1, pos_all[rank])
            diff = (got - want).abs()
            nonfinite = int((~torch.isfinite(got)).sum())
            if diff.numel() == 0:
                checks.append(TensorCheck(name, rank, 0.0, allowed, 0, {}, True))
                continue
            diff = diff.nan_to_num(nan=float("inf"))
            if maps is not None:
                m = maps.setdefault(name, torch.zeros(r64.shape[:3], dtype=torch.float32))
                m[:, pos_all[rank]] = diff.amax(dim=3).float()
            flat = int(diff.argmax())
            bi, li, hi = _unravel(flat, diff.shape)  # torch.unravel_index: same result, 5x the cost
            err = float(diff.max())
            position = {"batch": int(bi), "token": int(pos_all[rank][li]), "head": int(hi)}
            kinds = ""
            if nonfinite:
                bad = got[~torch.isfinite(got)]
                counts = (("NaN", bad.isnan()), ("+inf", bad == float("inf")), ("-inf", bad == float("-inf")))
                kinds = ",".join(k for k, mask in counts if bool(mask.any()))
            checks.append(TensorCheck(name, rank, err, allowed, nonfinite, position,
                                      passed=nonfinite == 0 and err <= allowed, nonfinite_kinds=kinds))
    return checks


def check_leak(case: Case, leak_shards: dict[int, dict[str, torch.Tensor]]) -> LeakCheck | None:
    """Exact check: with dout zero outside S, keys invisible to S get dk = dv = 0 exactly."""
    if case.mask.kind == "none" or not leak_shards:
        return None
    n = case.total_len
    queries = inputs.leak_queries(case)
    hidden = ~visible_keys(case.mask, queries, n)
    pos_all = all_positions(case.layout, case.seq_lens)
    result = LeakCheck(queries=queries.tolist(), hidden_keys=int(hidden.sum()))
    for rank, t in sorted(leak_shards.items()):
        local_hidden = hidden[pos_all[rank]]
        for name in ("dk", "dv"):
            g = t[name]
            nz = (g != 0).any(dim=3).any(dim=2).any(dim=0)  # per local key token
            bad = (nz & local_hidden).nonzero().view(-1)
            if bad.numel():
                result.leaks.append({"rank": rank, "tensor": name, "token": int(pos_all[rank][bad[0]]),
                                     "count": int(bad.numel())})
    return result
