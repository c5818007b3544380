"""Where a failing case's errors are: the worst per rank and tensor, and where they concentrate.

They may concentrate on one rank, zigzag chunks, rank or chunk edges, document edges, the diagonal
block, one ring step, one block, or blocks the mask hides. The token level is free: the run's
error maps say which global tokens exceed the tolerance. The block level costs 2W extra runs of the
implementation (harness.impls.probe): V kept on one key block (out, dq), or dout kept on one query
block (dk, dv). Each (token, block) cell's error is that block's own for out, dk and dv: it is
measured under the implementation's own lse, so a wrong block does not move the right ones
(harness.diagnose.split). dq's cells keep the exact split, which no block line reads. The lines and
their rules are in harness.diagnose.findings; the heatmaps in harness.diagnose.plot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.diagnose import split
from harness.diagnose.findings import SPLIT_TENSORS, block_findings, token_findings
from harness.diagnose.geometry import (
    QUERY_TENSORS,
    block_visibility,
    by_step,
    chunk_ids,
    doc_edges,
    owners,
    row_order,
    shard_edges,
    step_of,
)
from harness.impls import probe
from harness.oracle.assemble import attention
from harness.oracle.variant import variant_of
from harness.ranks.pool import RankPool
from harness.result import CaseResult
from harness.runner import run_case
from ring_impl.layouts import all_positions

# the geometry and the findings, as callers have always found them here
__all__ = [
    "BLOCK_TENSORS",
    "QUERY_TENSORS",
    "SPLIT_TENSORS",
    "Localisation",
    "allowed_by_tensor",
    "block_findings",
    "block_visibility",
    "by_step",
    "chunk_ids",
    "doc_edges",
    "lines",
    "localise",
    "owners",
    "probe_blocks",
    "probe_split",
    "row_order",
    "shard_edges",
    "step_of",
    "summary",
    "token_findings",
    "token_ratios",
    "worst_checks",
]

BLOCK_TENSORS = ("out", "dq", "dk", "dv")


@dataclass
class Localisation:
    """Per-token ratios (error / allowed), optional per-block ratios, and the findings in words."""

    case: Case
    verdict: str
    worst: list[dict] = field(default_factory=list)
    # tensor -> (N,) worst ratio per token
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensor -> (N, W) ratio per token x block (out, dk, dv: each block's own error, `probe_split`)
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensor -> (N, W) bool: block not masked
    visible: dict[str, torch.Tensor] = field(default_factory=dict)
    shares: dict[str, dict] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)


# -- maps ------------------------------------------------------------------------------------------


def allowed_by_tensor(result: CaseResult) -> dict[str, float]:
    """The tolerance of each checked tensor. It is the same on every rank."""
    out: dict[str, float] = {}
    for c in result.checks:
        out[c.tensor] = max(out.get(c.tensor, 0.0), c.allowed)
    return out


def token_ratios(result: CaseResult) -> dict[str, torch.Tensor]:
    """tensor -> (N,) worst error / allowed over batch and heads, from the run's error maps."""
    allowed = allowed_by_tensor(result)
    return {
        t: m.amax(dim=(0, 2)).double() / allowed[t] for t, m in result.maps.items() if t in allowed
    }


def _assemble(
    case: Case, shards: dict[int, dict[str, torch.Tensor]], tensor: str
) -> torch.Tensor | None:
    parts = [shards.get(r, {}).get(tensor) for r in range(case.world_size)]
    if any(p is None for p in parts):
        return None
    pos = all_positions(case.layout, case.seq_lens)
    glob = torch.empty(
        (parts[0].shape[0], case.total_len, *parts[0].shape[2:]), dtype=torch.float64
    )
    for p, t in zip(pos, parts, strict=True):
        glob[:, p] = t.double()
    return glob


def _token_error(got: torch.Tensor | None, want: torch.Tensor) -> torch.Tensor:
    if got is None:
        return torch.full((want.shape[1],), float("nan"), dtype=torch.float64)
    return (got - want).abs().nan_to_num(nan=float("inf")).amax(dim=(0, 2, 3))


def _fill(
    case: Case,
    grids: dict[str, torch.Tensor],
    blk: int,
    shards: dict,
    want: dict[str, torch.Tensor],
    allowed: dict[str, float],
) -> None:
    """Column `blk` of each grid: one probe run's error against its references, per token."""
    for t, ref in want.items():
        if t in grids:
            got = _assemble(case, shards, t) if shards else None
            grids[t][:, blk] = _token_error(got, ref) / allowed[t]


def _probe_run(case: Case, pool: RankPool, name: str, kind: str, blk: int) -> dict:
    """One probe run's shards (empty when it did not complete)."""
    r = run_case(
        case, pool, probe.spec(name, kind, blk), allow_import=True, leak=False, keep_shards=True
    )
    return r.shards or {}


def probe_blocks(
    result: CaseResult, pool: RankPool, impl: str | None = None
) -> dict[str, torch.Tensor]:
    """tensor -> (N, W) error / allowed of each (token, block) cell, from 2W probe runs.

    `probe_split` says more.
    """
    return probe_split(result, pool, impl)[0]


def probe_split(
    result: CaseResult, pool: RankPool, impl: str | None = None
) -> tuple[dict[str, torch.Tensor], bool]:
    """(tensor -> (N, W) error / allowed of each (token, block) cell, renormalised), in 2W runs.

    For out and dq, V is kept on key block b (column b). For dk and dv, dout is kept on query block
    a (column a). out, dk and dv are measured against references under the implementation's own
    lse (harness.diagnose.split), dq against the exact outputs. `renormalised` is False when the
    implementation gives no lse: then every reference is the exact one. The columns of probe runs
    that did not complete are NaN.
    """
    case = result.case
    name = impl or result.impl
    n, w = case.total_len, case.world_size
    allowed = allowed_by_tensor(result)
    grids = {
        t: torch.full((n, w), float("nan"), dtype=torch.float64)
        for t in BLOCK_TENSORS
        if t in allowed
    }
    kinds = [k for k, ts in (("kv", ("out", "dq")), ("q", ("dk", "dv"))) if set(ts) & set(grids)]
    g = inputs.make_global(case)
    own = owners(case)
    # The implementation's lse is the same in every probe (V does not move it). Its out is a q
    # probe's (they keep V whole). Runs go one at a time: each holds every rank's outputs.
    first = {k: _probe_run(case, pool, name, k, 0) for k in kinds[-1:]}
    whole = next(iter(first.values()), {})
    exact_out = torch.zeros(())
    for blk in range(w):
        keep = (own == blk).view(1, -1, 1, 1)
        exact = attention(
            g["q"],
            g["k"],
            g["v"] * keep,
            g["dout"],
            case.mask,
            case.scale,
            compute=torch.float64,
            variant=variant_of(case),
        )
        if blk == 0:
            lse, renormalised = split.row_lse(exact.lse, split.global_lse(case, whole))
        exact_out = exact_out + exact.out
        if "kv" in kinds:
            shards = first.pop("kv") if "kv" in first else _probe_run(case, pool, name, "kv", blk)
            want = {"out": split.out_reference(exact.out, exact.lse, lse), "dq": exact.dq}
            _fill(case, grids, blk, shards, want, allowed)
    if "q" in kinds:
        impl_out = _assemble(case, whole, "out") if whole else None
        stats = split.RowStats(lse, split.row_delta(exact_out, g["dout"], impl_out))
        for blk in range(w):
            shards = whole if blk == 0 else _probe_run(case, pool, name, "q", blk)
            dk, dv = split.key_grads(case, g, stats, blk)
            _fill(case, grids, blk, shards, {"dk": dk, "dv": dv}, allowed)
    return grids, renormalised


def worst_checks(result: CaseResult) -> list[dict]:
    """Per failing rank and tensor: worst error, allowed, ratio and global (batch, head, token)."""
    out = []
    for c in sorted(result.failed_checks(), key=lambda c: -c.ratio):
        p = c.position or {}
        out.append(
            {
                "tensor": c.tensor,
                "rank": c.rank,
                "error": float(c.error),
                "allowed": float(c.allowed),
                "ratio": float(c.ratio) if c.ratio != float("inf") else "inf",
                "batch": p.get("batch"),
                "head": p.get("head"),
                "token": p.get("token"),
            }
        )
    return out


def localise(
    result: CaseResult, pool: RankPool | None = None, *, probes: bool = True
) -> Localisation:
    """Where the errors of a result are.

    With a pool and `probes`, it also splits them by block, in 2W runs.
    """
    case = result.case
    loc = Localisation(case=case, verdict=result.verdict, worst=worst_checks(result))
    if not result.checks:
        return loc
    if case.serving is not None:
        # the token and block splits read a rank's queries as its keys: a training shape's
        loc.findings.append("a serving case is localised by its worst values only (#54)")
        return loc
    loc.tokens = token_ratios(result)
    tok_shares, tok_words = token_findings(case, loc.tokens)
    loc.shares.update({f"tokens/{t}": v for t, v in tok_shares.items()})
    loc.findings.extend(tok_words)
    if probes and pool is not None and not result.passed:
        loc.blocks, renormalised = probe_split(result, pool)
        by_key, by_query = block_visibility(case)
        loc.visible = {t: by_key if t in QUERY_TENSORS else by_query for t in loc.blocks}
        failing = {c.tensor for c in result.failed_checks()}
        blk_shares, blk_words = block_findings(
            case,
            {t: g for t, g in loc.blocks.items() if t in failing},
            loc.visible,
            named=SPLIT_TENSORS if renormalised else (),
            leak=result.leak,
        )
        loc.shares.update({f"blocks/{t}": v for t, v in blk_shares.items()})
        loc.findings.extend(blk_words)
    return loc


def summary(loc: Localisation) -> dict:
    """A YAML-friendly record of a localisation, for a saved case's `result:` block.

    It holds the worst error of each tensor, the findings and the shares behind them. Every rank's
    worst error is in `checks`.
    """
    worst: dict[str, dict] = {}
    for w in loc.worst:  # sorted worst first
        if w["tensor"] not in worst:
            ratio = w["ratio"] if isinstance(w["ratio"], str) else float(f"{w['ratio']:.4g}")
            worst[w["tensor"]] = {
                "rank": w["rank"],
                "ratio": ratio,
                "error": float(f"{w['error']:.4g}"),
                "batch": w["batch"],
                "head": w["head"],
                "token": w["token"],
            }
    return {"worst": worst, "findings": loc.findings, "shares": loc.shares}


def lines(loc: Localisation) -> list[str]:
    """Indented report lines: the findings. report.details prints the worst errors."""
    return [f"        where: {f}" for f in loc.findings]
