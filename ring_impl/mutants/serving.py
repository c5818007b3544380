"""Mutants of the decode reference (issue #54): wrong the way serving engines' CP decode went wrong.

Each runs `ring_impl.decode.decode_attention` and is right on training shapes: the bug lives in the
serving path, as it does in the engines (their decode path is not their prefill or training path).
So each survives a check with the inference shapes switched off. `requests` is the case's
`RunContext.serving`, None for a training case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ring_impl.decode import decode_attention
from ring_impl.merge import merge
from ring_impl.paged import read_kv
from ring_impl.parts import REFERENCE_PARTS

LN2 = 0.6931471805599453


def decode_mutant(name: str, doc: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A mutant with the decode signature (plus `requests`), marked for the decode adapter."""
    fn.__name__ = fn.__qualname__ = name.replace("-", "_")
    fn.__doc__ = doc
    fn.decode_form = "all-gather"  # how harness.impls.adapters.serving wraps it
    return fn


def _log2_merge(out, lse, block_out, block_lse):
    """The kernel's lse in base 2, merged as if natural, the result taken back to natural."""
    o, s = merge(out, lse / LN2, block_out, block_lse / LN2)
    return o, s * LN2


def _lse_log2_merged(q, k, v, *, requests=None, **given):
    if requests is not None:
        given["parts"] = dataclasses.replace(REFERENCE_PARTS, merge=_log2_merge)
    return decode_attention(q, k, v, **given)


def _lse_returned_log2(q, k, v, *, requests=None, **given):
    out, lse = decode_attention(q, k, v, **given)
    return (out, lse / LN2) if requests is not None else (out, lse)


def _contiguous_guess(requests, rank: int) -> torch.Tensor:
    """This rank's KV positions if each request's share were contiguous: its local slots counted
    from the request's start plus the lengths the ranks before it hold."""
    pieces = []
    for r, start in enumerate(requests.starts):
        before = sum(requests.kv_lengths[g][r] for g in range(rank))
        pieces.append(start + before + torch.arange(requests.kv_lengths[rank][r]))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _own_positions_from(guess: Callable[[Any, int], torch.Tensor]) -> Callable[..., Any]:
    """The decode reference with this rank's KV positions taken as `guess(requests, rank)`."""

    def run(q, k, v, *, requests=None, **given):
        if requests is not None:
            import torch.distributed as dist

            rank = dist.get_rank(given.get("group"))
            positions = list(given["positions"])
            positions[rank] = guess(requests, rank)
            given["positions"] = positions
        return decode_attention(q, k, v, **given)

    return run


def _nan_rows(block_forward):
    def forward(q, k, v, scale, mask=None, **kw):
        out, lse = block_forward(q, k, v, scale, mask, **kw)
        empty = torch.isneginf(lse).transpose(1, 2).unsqueeze(-1)  # (B, L, H, 1)
        return torch.where(empty, torch.full_like(out, float("nan")), out), lse

    return forward


def _nan_nothing_seen(q, v, acc):
    b, n, h, _ = q.shape
    return q.new_full((b, n, h, v.shape[-1]), float("nan"), dtype=acc), q.new_full(
        (b, h, n), float("-inf"), dtype=acc
    )


def _empty_share_nan(q, k, v, *, requests=None, **given):
    if requests is not None:
        given["parts"] = dataclasses.replace(
            REFERENCE_PARTS,
            block_forward=_nan_rows(REFERENCE_PARTS.block_forward),
            no_blocks=_nan_nothing_seen,
        )
    return decode_attention(q, k, v, **given)


def _tail_guess(requests, rank: int) -> torch.Tensor:
    """This rank's KV positions as the causal offset of several new tokens reads them: its local
    keys of each request taken as the request's last ones, local(G) - k for local(G - k)."""
    pieces = []
    for r, start in enumerate(requests.starts):
        end = start + requests.context[r] + requests.new[r]
        count = requests.kv_lengths[rank][r]
        pieces.append(end - count + torch.arange(count))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _read_as(requests, rank: int, positions: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """This rank's KV positions as a mutant reads `counts[r]` tokens of each request r: its own,
    cut short, or padded with the request's last position, which every new token sees."""
    pieces, at = [], 0
    for r, start in enumerate(requests.starts):
        own = requests.kv_lengths[rank][r]
        mine = positions[at : at + own]
        at += own
        last = start + requests.context[r] + requests.new[r] - 1
        pad = torch.full((max(0, counts[r] - own),), last, dtype=torch.long)
        pieces.append(torch.cat([mine, pad])[: counts[r]])
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _lengths(requests) -> list[int]:
    """Each request's tokens, context and new (`requests` is the run's `ServingInfo`)."""
    return [c + n for c, n in zip(requests.context, requests.new, strict=True)]


def _rank_world(given: dict) -> tuple[int, int]:
    import torch.distributed as dist

    group = given.get("group")
    return dist.get_rank(group), dist.get_world_size(group)


def _pages_by_global_length(q, k, v, *, requests=None, pages=None, **given):
    if pages is not None:
        from ring_impl.paged import slots

        rank, world = _rank_world(given)
        counts = [-(-n // world) for n in _lengths(requests)]  # the even share, not its own
        positions = list(given["positions"])
        positions[rank] = _read_as(requests, rank, positions[rank].cpu(), counts)
        where = slots(pages, counts).to(k.device)
        k, v = k.flatten(0, 1)[where], v.flatten(0, 1)[where]
        given["positions"] = positions
    return decode_attention(q, k, v, **given)


CHUNK = 8  # the context chunk a workspace holds (vLLM's MLA chunked context)


def _chunk_local_length(q, k, v, *, requests=None, pages=None, **given):
    k, v = read_kv(k, v, pages)  # its pages read right: the chunks go wrong after
    if requests is not None and k.shape[1] > 0:
        rank, world = _rank_world(given)
        counts = [sum(min(CHUNK, n - i) // world for i in range(0, n, CHUNK))
                  for n in _lengths(requests)]  # fmt: skip
        own, rows, at = requests.kv_lengths[rank], [], 0
        for r, n in enumerate(counts):  # each request's rows from its own start, `n` of them
            rows.append(at + torch.arange(n))
            at += own[r]
        rows = torch.cat(rows).clamp(max=k.shape[1] - 1).to(k.device)
        positions = list(given["positions"])
        positions[rank] = _read_as(requests, rank, positions[rank].cpu(), counts)
        k, v, given["positions"] = k[:, rows], v[:, rows], positions
    return decode_attention(q, k, v, **given)


decode_lse_log2_merged = decode_mutant(
    "decode-lse-log2-merged",
    """The partial results' lse comes from the kernel in base 2 and is merged as a natural log
    (vLLM PR #47079; SGLang #33064 is the reverse, FlashInfer #4485 the base that depends on the
    kernel picked). Each rank's weight in the merge is wrong, so out and lse are. Visible in decode
    and prefill cases whose rows see keys on two or more ranks.""",
    _lse_log2_merged,
)

decode_lse_returned_log2 = decode_mutant(
    "decode-lse-returned-log2",
    """Merges right but returns the lse in base 2 while declaring natural log (vLLM PR #47079's
    other half: the caller reads a log2 lse as ln). out is right. Visible in the lse of every
    serving case; the judge names the base.""",
    _lse_returned_log2,
)

decode_causal_bound_from_local_length = decode_mutant(
    "decode-causal-bound-from-local-length",
    """Takes each rank's KV positions as a contiguous share of each request, from the local
    lengths, while the KV is interleaved or strided (TokenSpeed PR #364: the causal bound taken
    against the rank-local KV length). Right when each request's KV is contiguous on the ranks, and
    for one causal new token, which sees its whole request anyway. Visible with interleaved,
    striped or zigzag KV and several new tokens per request, or a window.""",
    _own_positions_from(_contiguous_guess),
)

decode_empty_share_nan = decode_mutant(
    "decode-empty-share-nan",
    """A rank that holds no visible key for a row returns out NaN (its kernel's 0 / 0) with lse
    -inf, and the merge multiplies it by its weight 0: NaN (vLLM's combine masks these rows; an
    unmasked combine does not). Visible when some rank holds no key a row sees: a short context
    interleaved over many ranks, a window, a request shorter than W.""",
    _empty_share_nan,
)

decode_multi_token_causal_offset = decode_mutant(
    "decode-multi-token-causal-offset",
    """With several new tokens per request, the causal bound of the token k before the last is
    taken as local(G) - k local slots instead of local(G - k) (vLLM PR #47181): a rank's keys of a
    request are read as its last ones. Right for causal decode, one new token per request. Visible
    with speculative or chunked new tokens at W >= 2.""",
    _own_positions_from(_tail_guess),
)

decode_pages_by_global_length = decode_mutant(
    "decode-pages-by-global-length",
    """Reads each request's pages for ceil(n / W) tokens, the even share of its global length,
    instead of the rank's own count (vLLM #41623 / PR #48003: paged-KV metadata from global
    lengths, so ranks read pages they do not own). Past its own tokens a rank reads stale slots
    and the null page as keys; short of them it drops keys. Right on contiguous shares and in
    training. Visible in a paged case whose ranks hold uneven shares of a request.""",
    _pages_by_global_length,
)

decode_context_chunk_local_length = decode_mutant(
    "decode-context-chunk-local-length",
    """Reads a request's KV in chunks of 8 tokens of its global length, taking each chunk's local
    length as floor(chunk / W) (vLLM #28476, PR #28526: a context spanning several chunks takes
    the wrong local chunk length). A rank then reads too few of its tokens, or runs into the next
    request's, and gives them the wrong positions. Right when W divides 8 and the request's length and each
    share is even; in training. Visible at W = 3, 5, 6 or 7, ragged lengths, interleaved KV.""",
    _chunk_local_length,
)
