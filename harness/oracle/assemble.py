"""The oracle's global outputs, put together from the shares' parts.

The oracle is single-device full attention with the explicit mask, forward and backward. It gives
two sets of outputs: `exact`, in float64, which every rank is judged against, and `base`, the same
attention in the case's own dtype, whose error sets the tolerance. `two_passes` runs the shares'
rows passes, gathers every row's statistics, runs the keys passes, and `assemble` puts the parts in
place. Who runs the passes is `harness.oracle.mode`'s choice; `local` runs them all here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.inputs import FLASH_BASE_VALUES
from harness.oracle.keys_pass import keys_part
from harness.oracle.parts import KeysPart, RowsPart, RowStats, TermScales, gather_stats
from harness.oracle.rows_pass import rows_part
from harness.oracle.shares import case_fetch, share_keys, share_rows
from harness.oracle.tile_store import TileStore
from harness.oracle.tiles import block, block_size, groups, runs
from harness.oracle.variant import PLAIN, TileVariant, variant_of
from harness.serving_case import mask_of

BLOCK: int | None = None  # tile side for `attention`; None: tiles.block_size's score budget


@dataclass
class OracleOutputs:
    """Global out, lse and q/k/v gradients, all in one compute dtype, and (float64 only) the term
    scales the tolerance rule reads. With sinks, each share's dsinks: row g is the sum over share
    g's query rows, what rank g's ring returns."""

    out: torch.Tensor  # (B, N, Hq, Dv)
    lse: torch.Tensor  # (B, Hq, N)
    dq: torch.Tensor  # (B, N, Hq, D)
    dk: torch.Tensor  # (B, N, Hkv, D)
    dv: torch.Tensor  # (B, N, Hkv, Dv)
    # tensor -> {class: scale}
    term_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    dsinks: torch.Tensor | None = None  # (W, Hq), or None without sinks


Pair = tuple[OracleOutputs, OracleOutputs]  # (exact: float64, base: the case's dtype)


def assemble(
    n: int,
    scale: float,
    rows: Sequence[RowsPart],
    keys: Sequence[KeysPart],
    n_keys: int | None = None,
) -> OracleOutputs:
    """The global outputs from the parts of every share of one compute dtype.

    Each rows part's out, lse and dq go into its rows (n of them), each keys part's dk and dv into
    its keys (`n_keys`, n unless said). The rows parts' dsinks are stacked, in share order. The
    term scales (float64 only) come from all of them."""
    first, kfirst = rows[0], keys[0]
    b, _, hq, _ = first.out.shape
    out = first.out.new_zeros(b, n, *first.out.shape[2:])
    dq = first.dq.new_zeros(b, n, *first.dq.shape[2:])
    lse = first.lse.new_zeros(b, hq, n)
    nk = n if n_keys is None else n_keys
    dk = kfirst.dk.new_zeros(b, nk, *kfirst.dk.shape[2:])
    dv = kfirst.dv.new_zeros(b, nk, *kfirst.dv.shape[2:])
    for p in rows:
        out.index_copy_(1, p.rows, p.out)
        dq.index_copy_(1, p.rows, p.dq)
        lse.index_copy_(2, p.rows, p.lse)
    for p in keys:
        dk.index_copy_(1, p.keys, p.dk)
        dv.index_copy_(1, p.keys, p.dv)
    is_exact = out.dtype == torch.float64
    dsinks = None if first.dsinks is None else torch.stack([p.dsinks for p in rows])
    scales = TermScales(rows, keys).scales(scale) if is_exact else {}
    return OracleOutputs(out, lse, dq, dk, dv, scales, dsinks)


Parts = tuple  # (float64 part, base part) of one share


def two_passes(
    n: int,
    world_size: int,
    scale: float,
    run_rows: Callable[[], dict[int, Parts]],
    run_keys: Callable[[tuple[RowStats, RowStats]], dict[int, Parts]],
) -> tuple[OracleOutputs, OracleOutputs, float]:
    """(exact, base, the slowest share's seconds) from the W shares' two passes.

    `run_rows()` maps group rank -> (float64, base) RowsPart. Every row's statistics are gathered
    here. `run_keys(stats)` then maps group rank -> (float64, base) KeysPart."""
    got = run_rows()
    rows = [got[g] for g in range(world_size)]
    stats = tuple(gather_stats([r[i] for r in rows], n) for i in (0, 1))
    got = run_keys(stats)
    keys = [got[g] for g in range(world_size)]
    exact, base = (assemble(n, scale, [r[i] for r in rows], [k[i] for k in keys]) for i in (0, 1))
    seconds = max(
        sum(p.seconds for p in r) + sum(p.seconds for p in k)
        for r, k in zip(rows, keys, strict=True)
    )
    return exact, base, seconds


def attention_pair(
    q, k, v, dout, mask, scale: float, dtype: torch.dtype, variant: TileVariant = PLAIN
) -> Pair:
    """(exact, base in `dtype`) of full attention of global tensors rounded to `dtype`.

    Forward and backward, every query and key in one share, positions 0, 1, ... There are as many
    queries as keys, or fewer: the first ones. `variant`: softcap, ALiBi and sinks
    (`TileVariant.make`)."""
    tensors = {"q": q, "k": k, "v": v, "dout": dout}

    def fetch(name: str, pos: torch.Tensor) -> torch.Tensor:
        t = tensors[name]
        return t[:, pos.to(t.device)]

    size = BLOCK or block_size(q.shape[0], q.shape[2])
    return _one_share(fetch, q.shape[1], k.shape[1], k.shape[2], mask, scale, dtype, size, variant)


def _one_share(
    fetch, nq: int, nk: int, hkv: int, mask, scale: float, dtype, size: int, variant, exact=False
) -> Pair:
    """(exact, base) of queries 0..nq-1 against keys 0..nk-1 as one share: both passes, position
    order, the tiles of side `size`."""
    qpos, kpos = torch.arange(nq), torch.arange(nk)
    key_groups = groups([kpos], size)
    kblocks = [g.pos for g in key_groups]
    store = TileStore()  # the rows pass's tiles, for the keys pass
    rows = rows_part(fetch, qpos, kblocks, hkv, mask, scale, dtype, size, exact, variant, store)
    stats = tuple(gather_stats([r], nq) for r in rows)
    qblocks = [qpos[a:z] for a, z in runs(qpos, size)]
    keys = keys_part(
        fetch, kpos, 0, qblocks, key_groups, hkv, stats, mask, scale, dtype, exact, variant, store
    )
    return tuple(assemble(nq, scale, [rows[i]], [keys[i]], nk) for i in (0, 1))


def whole_ok(case: Case) -> bool:
    """Whether `whole` computes this case: a training case without sinks. A serving case's queries
    are apart from its keys, and each rank's dsinks is its own share's sum: those keep the shares."""
    return case.serving is None and case.sinks is None


def whole(case: Case) -> Pair:
    """(exact, base) of a small case in one pass: every position one share, in position order.

    The base is then plain attention over the whole sequence, as one autograd graph rounds it, and
    the pass's fixed costs are paid once, not once a rank (docs/oracle.md, "One pass")."""
    return _one_share(
        case_fetch(case),
        case.total_len,
        case.total_len,
        case.heads_kv,
        mask_of(case),
        case.scale,
        TORCH_DTYPES[case.dtype],
        block(case),
        variant_of(case),
        case.values in FLASH_BASE_VALUES,
    )


def attention(
    q, k, v, dout, mask, scale: float, compute: torch.dtype, variant: TileVariant = PLAIN
) -> OracleOutputs:
    """One of `attention_pair`. For compute=float64: the exact outputs of the inputs rounded to
    float32. Else the base of a case in `compute`, inputs rounded to it."""
    if compute == torch.float64:
        return attention_pair(q, k, v, dout, mask, scale, torch.float32, variant)[0]
    return attention_pair(q, k, v, dout, mask, scale, compute, variant)[1]


def local(case: Case) -> Pair:
    """(exact, base) computed here, share after share: what the ranks compute."""
    exact, base, _ = two_passes(
        case.total_len,
        case.world_size,
        case.scale,
        lambda: {g: share_rows(case, g) for g in range(case.world_size)},
        lambda stats: {g: share_keys(case, g, stats) for g in range(case.world_size)},
    )
    return exact, base
