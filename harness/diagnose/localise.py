"""Where a failing case's errors are: the worst per rank and tensor, and where they concentrate.

They may concentrate on causal-diagonal blocks, rank or chunk boundaries, document boundaries,
masked blocks or one ring step. The token level is free: the run's error maps say which global
tokens exceed the tolerance, and whether they sit at edges. The block level costs 2W extra runs of
the implementation (harness.impls.probe). It splits the error exactly by key block for out and dq,
and by query block for dk and dv. A bug on one ring step, or in a block the mask hides, then shows
as one hot column in the heatmap (harness.diagnose.plot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness import inputs
from harness.case import Case
from harness.impls import probe
from harness.oracle.assemble import attention
from harness.ranks.pool import RankPool
from harness.result import CaseResult
from harness.runner import run_case
from ring_impl.layouts import all_positions, zigzag_chunks
from ring_impl.mask_eval import full_mask
from ring_impl.masks import doc_starts_of

GRADS = ("dq", "dk", "dv")
# indexed by query token; dk/dv by key token
QUERY_TENSORS = ("out", "lse", "dq")
BLOCK_TENSORS = ("out", "dq", "dk", "dv")
CONCENTRATED = 0.75  # share of the error that makes a finding
MAX_LISTED = 16


@dataclass
class Localisation:
    """Per-token ratios (error / allowed), optional per-block ratios, and the findings in words."""

    case: Case
    verdict: str
    worst: list[dict] = field(default_factory=list)
    # tensor -> (N,) worst ratio per token
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensor -> (N, W) ratio per token x block
    blocks: dict[str, torch.Tensor] = field(default_factory=dict)
    # tensor -> (N, W) bool: block not masked
    visible: dict[str, torch.Tensor] = field(default_factory=dict)
    shares: dict[str, dict] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)


# -- geometry of a case --------------------------------------------------------------------------


def owners(case: Case) -> torch.Tensor:
    """(N,) group rank that holds each global token."""
    own = torch.empty(case.total_len, dtype=torch.long)
    for r, pos in enumerate(all_positions(case.layout, case.seq_lens)):
        own[pos] = r
    return own


def row_order(case: Case) -> torch.Tensor:
    """Global tokens grouped by rank in local order: the heatmaps' row order."""
    return torch.cat(all_positions(case.layout, case.seq_lens))


def shard_edges(case: Case) -> torch.Tensor:
    """(N,) bool: the first or last token of a run of tokens that one rank holds.

    These are the rank and zigzag chunk edges.
    """
    n = case.total_len
    own = owners(case)
    # cut[p]: an edge lies between p - 1 and p
    cut = torch.zeros(n + 1, dtype=torch.bool)
    cut[0] = cut[n] = True
    cut[1:n] = own[1:] != own[:-1]
    if case.layout == "zigzag":
        start = 0
        for _, size in zigzag_chunks(case.seq_lens):
            start += size
            cut[min(start, n)] = True
    return cut[:-1] | cut[1:]


def doc_edges(case: Case) -> torch.Tensor:
    """(N,) bool: the first or last token of a document.

    Documents come from document masks, or from expressions with a document primitive or a
    per-document combinator. It takes two or more documents.
    """
    n = case.total_len
    edge = torch.zeros(n, dtype=torch.bool)
    for starts in doc_starts_of(case.mask.expression()):
        for s in starts[1:]:
            if s < n:
                edge[s] = True
                edge[s - 1] = True
    return edge


def block_visibility(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(query x key block, key x query block) bool.

    Whether the mask lets the token see the block, or be seen by it.
    """
    n = case.total_len
    m = full_mask(case.mask, n)
    if m is None:
        m = torch.ones(n, n, dtype=torch.bool)
    pos = all_positions(case.layout, case.seq_lens)
    by_key = torch.stack([m[:, p].any(dim=1) for p in pos], dim=1)
    by_query = torch.stack([m[p, :].any(dim=0) for p in pos], dim=1)
    return by_key, by_query


def step_of(case: Case, tensor: str) -> torch.Tensor:
    """(N, W): the ring step at which each (token, block) cell is computed.

    At step s, rank r holds the keys of rank (r - s) mod W. A query on rank r meets key block b at
    step (r - b) mod W. A key of rank o meets query block a at step (a - o) mod W.
    """
    own = owners(case).view(-1, 1)
    blk = torch.arange(case.world_size).view(1, -1)
    w = case.world_size
    return (own - blk) % w if tensor in QUERY_TENSORS else (blk - own) % w


def by_step(case: Case, tensor: str, grid: torch.Tensor) -> torch.Tensor:
    """Re-index an (N, W) token x block grid as token x ring step."""
    out = torch.full_like(grid, float("nan"))
    steps = step_of(case, tensor)
    out.scatter_(1, steps, grid)
    return out


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


def probe_blocks(
    result: CaseResult, pool: RankPool, impl: str | None = None
) -> dict[str, torch.Tensor]:
    """tensor -> (N, W) error / allowed of each (token, block) cell, from 2W probe runs.

    For out and dq, V is kept on key block b (column b). For dk and dv, dout is kept on query block
    a (column a). The columns of probe runs that did not complete are NaN.
    """
    case = result.case
    name = impl or result.impl
    n, w = case.total_len, case.world_size
    allowed = allowed_by_tensor(result)
    g = inputs.make_global(case)
    own = owners(case)
    grids = {
        t: torch.full((n, w), float("nan"), dtype=torch.float64)
        for t in BLOCK_TENSORS
        if t in allowed
    }
    for blk in range(w):
        keep = (own == blk).view(1, -1, 1, 1)
        for kind, tensors in (("kv", ("out", "dq")), ("q", ("dk", "dv"))):
            if not any(t in grids for t in tensors):
                continue
            r = run_case(
                case,
                pool,
                probe.spec(name, kind, blk),
                allow_import=True,
                leak=False,
                keep_shards=True,
            )
            v = g["v"] * keep if kind == "kv" else g["v"]
            dout = g["dout"] * keep if kind == "q" else g["dout"]
            exact = attention(g["q"], g["k"], v, dout, case.mask, case.scale, compute=torch.float64)
            for t in tensors:
                if t in grids:
                    got = _assemble(case, r.shards, t) if r.shards else None
                    grids[t][:, blk] = _token_error(got, getattr(exact, t)) / allowed[t]
    return grids


# -- findings ------------------------------------------------------------------------------------


def _share(mass: torch.Tensor, where: torch.Tensor) -> float:
    total = float(mass.sum())
    return float(mass[where].sum()) / total if total > 0 else 0.0


def _excess(ratio: torch.Tensor) -> torch.Tensor:
    """The part of a ratio grid that counts as error: the cells over the tolerance, or all if none
    is.
    """
    r = ratio.nan_to_num(nan=0.0, posinf=1e30)
    over = torch.where(r > 1, r, torch.zeros_like(r))
    return over if float(over.sum()) > 0 else r


def token_findings(case: Case, tokens: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """Shares of failing tokens at rank/chunk edges and document edges, against their base rate."""
    sets = {"rank or chunk boundaries": shard_edges(case), "document boundaries": doc_edges(case)}
    own = owners(case)
    shares, words = {}, []
    for t, ratio in tokens.items():
        bad = ratio > 1
        if not bool(bad.any()):
            continue
        info = {
            "failing": f"{int(bad.sum())} of {bad.numel()} tokens",
            "tokens": bad.nonzero().view(-1).tolist()[:MAX_LISTED],
            "ranks": sorted(set(own[bad].tolist())),
        }
        for label, where in sets.items():
            if not where.any():
                continue
            base = float(where.float().mean())
            share = float((bad & where).sum()) / int(bad.sum())
            info[label.replace(" ", "_")] = f"{share:.0%} of failing tokens ({base:.0%} of all)"
            if where.any() and share >= CONCENTRATED and base <= 0.5:
                words.append(
                    f"{t}: {int((bad & where).sum())} of {int(bad.sum())} failing tokens "
                    f"are at {label} "
                    f"({base:.0%} of all tokens are)"
                )
        if len(info["ranks"]) < case.world_size:
            words.append(f"{t}: fails only on rank(s) {info['ranks']} of {case.world_size}")
        shares[t] = info
    return shares, words


def block_findings(
    case: Case,
    blocks: dict[str, torch.Tensor],
    visible: dict[str, torch.Tensor],
) -> tuple[dict, list[str]]:
    """Shares of error on the causal-diagonal block, on each ring step, and on masked blocks."""
    shares, words = {}, []
    w = case.world_size
    for t, grid in blocks.items():
        mass = _excess(grid)
        if float(mass.sum()) <= 0:
            continue
        steps = step_of(case, t)
        per_step = [_share(mass, steps == s) for s in range(w)]
        diag = per_step[0]
        hidden = _share(mass, ~visible[t])
        what = "key block" if t in ("out", "dq") else "query block"
        shares[t] = {
            "per_step": [round(s, 3) for s in per_step],
            "diagonal": round(diag, 3),
            "masked_blocks": round(hidden, 3),
            "axis": what,
        }
        if hidden >= 0.05:
            words.append(
                f"{t}: {hidden:.0%} of the error is in blocks the mask hides entirely "
                f"(they must contribute nothing: a mask/causality leak)"
            )
        top = max(range(w), key=lambda s: per_step[s])
        if w >= 2 and per_step[top] >= CONCENTRATED:
            label = "the causal-diagonal (local) block, step 0" if top == 0 else f"ring step {top}"
            words.append(
                f"{t}: {per_step[top]:.0%} of the error is on {label} ({what} = "
                + ("rank - " if t in ("out", "dq") else "rank + ")
                + f"{top} mod W)"
            )
    return shares, words


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
    loc.tokens = token_ratios(result)
    tok_shares, tok_words = token_findings(case, loc.tokens)
    loc.shares.update({f"tokens/{t}": v for t, v in tok_shares.items()})
    loc.findings.extend(tok_words)
    if probes and pool is not None and not result.passed:
        loc.blocks = probe_blocks(result, pool)
        by_key, by_query = block_visibility(case)
        loc.visible = {t: by_key if t in QUERY_TENSORS else by_query for t in loc.blocks}
        blk_shares, blk_words = block_findings(case, loc.blocks, loc.visible)
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
