"""Where a failure's errors concentrate, in words: the `where:` lines.

Token lines read the run's error maps: which tokens fail, on which ranks or zigzag chunks, and
whether they sit at rank, chunk or document edges. Block lines read the probes' (token, block)
split (harness.diagnose.localise.probe_split). A line is printed only when it holds: see the rules
in `token_findings` and `block_findings`, and docs/cases.md.
"""

from __future__ import annotations

import torch

from harness.case import Case
from harness.diagnose.geometry import (
    QUERY_TENSORS,
    chunk_ids,
    doc_edges,
    owners,
    shard_edges,
    step_of,
)
from harness.result import LeakCheck
from ring_impl.layouts import zigzag_chunks

# the tensors whose block split is each block's own error (harness.diagnose.split)
SPLIT_TENSORS = ("out", "dk", "dv")
CONCENTRATED = 0.75  # share of the error that makes a finding
MAX_LISTED = 16


def _share(mass: torch.Tensor, where: torch.Tensor) -> float:
    total = float(mass.sum())
    return float(mass[where].sum()) / total if total > 0 else 0.0


def _excess(ratio: torch.Tensor) -> torch.Tensor:
    """The part of a ratio grid that counts as error: the cells over the tolerance, or all if none
    is.

    A missing column (a probe that did not complete) counts nothing. Nor does a row that is
    non-finite in every column: whichever block V or dout is kept on, it is NaN or inf, so it says
    nothing about blocks.
    """
    r = ratio.nan_to_num(nan=0.0)
    r[(ratio.isinf() | ratio.isnan()).all(dim=1) & ratio.isinf().any(dim=1)] = 0.0
    r = r.nan_to_num(posinf=1e30)
    over = torch.where(r > 1, r, torch.zeros_like(r))
    return over if float(over.sum()) > 0 else r


def _chunk_words(case: Case, t: str, bad: torch.Tensor) -> str | None:
    """Zigzag: the chunks that fail, when some failing rank fails in one of its chunks only."""
    if case.layout != "zigzag" or case.world_size < 2:
        return None
    chunks = zigzag_chunks(case.seq_lens)
    ids = chunk_ids(case)
    failing = sorted(set(ids[bad].tolist()))
    ranks = {chunks[c][0] for c in failing}
    whole = all(c in failing for c, (r, size) in enumerate(chunks) if r in ranks and size > 0)
    if whole:
        return None  # "fails only on rank(s)" says it
    w = case.world_size
    line = f"{t}: fails only in zigzag chunk(s) {failing} of {2 * w}"
    if all(c >= w for c in failing):
        return f"{line}: the second chunk of rank(s) {sorted(ranks)}"
    if all(c < w for c in failing):
        return f"{line}: the first chunk of rank(s) {sorted(ranks)}"
    return line


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
        line = _chunk_words(case, t, bad)
        if line:
            words.append(line)
        shares[t] = info
    return shares, words


def _hidden_words(t: str, hidden: float, leak: LeakCheck | None) -> str:
    """The hidden-block line. It says leak only when the leak check (the report's column) failed."""
    head = f"{t}: {hidden:.0%} of the error is in blocks the mask hides entirely"
    if leak is None:
        return f"{head} (they must contribute nothing; no leak check ran on this case)"
    if not leak.passed:
        return (
            f"{head} (they must contribute nothing: a mask/causality leak, as the leak check found)"
        )
    n = len(leak.queries)
    return (
        f"{head} (they must contribute nothing; the leak check samples {n} "
        f"quer{'y' if n == 1 else 'ies'} and passed on {'it' if n == 1 else 'them'})"
    )


CLEAN_SHARE = 0.01  # a ring step with less of the error than this is called clean


def _concentration(case: Case, t: str, mass: torch.Tensor, per_step: list[float]) -> list[str]:
    """Where most of one tensor's error is: one ring step and one block (if it holds more), else
    the blocks off the diagonal."""
    w = case.world_size
    what = "key block" if t in QUERY_TENSORS else "query block"
    lines = []
    top = max(range(w), key=lambda s: per_step[s])
    if per_step[top] >= CONCENTRATED:
        label = "the causal-diagonal (local) block, step 0" if top == 0 else f"ring step {top}"
        sign = "-" if t in QUERY_TENSORS else "+"
        lines.append(
            f"{t}: {per_step[top]:.0%} of the error is on {label} ({what} = rank {sign} {top} mod W)"
        )
    per_block = (mass.sum(dim=0) / mass.sum()).tolist()
    blk = max(range(w), key=lambda b: per_block[b])
    if per_block[blk] >= CONCENTRATED and per_block[blk] > per_step[top]:
        held = "keys" if t in QUERY_TENSORS else "queries"
        lines.append(
            f"{t}: {per_block[blk]:.0%} of the error is on {what} {blk} (rank {blk}'s {held})"
        )
    if not lines and 1 - per_step[0] >= CONCENTRATED:
        lines.append(
            f"{t}: {1 - per_step[0]:.0%} of the error is off the causal-diagonal (local) block, "
            f"on {_steps_words(per_step)}"
        )
    return lines


def _steps_words(per_step: list[float]) -> str:
    """'ring steps 1 to 3', or 'ring steps 1 and 3 (step 2 clean)' when a step holds no error."""
    w = len(per_step)
    clean = [s for s in range(1, w) if per_step[s] < CLEAN_SHARE]
    if not clean:
        return f"ring steps 1 to {w - 1}"
    hit = [str(s) for s in range(1, w) if s not in clean]
    said = hit[0] if len(hit) == 1 else ", ".join(hit[:-1]) + " and " + hit[-1]
    none = ", ".join(str(s) for s in clean)
    return f"ring step{'s' if len(hit) > 1 else ''} {said} (step{'s' if len(clean) > 1 else ''} {none} clean)"


def block_findings(
    case: Case,
    blocks: dict[str, torch.Tensor],
    visible: dict[str, torch.Tensor],
    *,
    named: tuple[str, ...] = SPLIT_TENSORS,
    leak: LeakCheck | None = None,
) -> tuple[dict, list[str]]:
    """Shares of error on each ring step (step 0: the diagonal), each block and masked blocks.

    The error is the cells over the tolerance (all cells if none is). A line names blocks the mask
    hides entirely when 5% of a tensor's error is there: that is a leak only if `leak` failed too.
    For the tensors in `named` only (their split is each block's own error,
    harness.diagnose.split), when some cell is over the tolerance and every probe completed, one
    line names where 75% of it is: one ring step, else one block, else the blocks off the diagonal.
    """
    shares, words = {}, []
    w = case.world_size
    for t, grid in blocks.items():
        mass = _excess(grid)
        if float(mass.sum()) <= 0:
            continue
        steps = step_of(case, t)
        per_step = [_share(mass, steps == s) for s in range(w)]
        hidden = _share(mass, ~visible[t])
        shares[t] = {
            "per_step": [round(s, 3) for s in per_step],
            "diagonal": round(per_step[0], 3),
            "masked_blocks": round(hidden, 3),
            "axis": "key block" if t in QUERY_TENSORS else "query block",
            "own_error": t in named,
        }
        if hidden >= 0.05:
            words.append(_hidden_words(t, hidden, leak))
        over = bool((mass > 1).any())  # else the shares are of errors within the tolerance
        if w >= 2 and t in named and over and not bool(grid.isnan().any()):
            words.extend(_concentration(case, t, mass, per_step))
    return shares, words
