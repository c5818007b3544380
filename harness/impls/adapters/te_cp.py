"""NVIDIA Transformer Engine's context parallelism, driven through `DotProductAttention`.

Each variant picks one of TE's comm types: a K/V ring, all-to-all or all-gather.
TE shards by dual-chunk swap, which is our zigzag layout.
The THD variant packs documents as TE's sequences and reshards around TE's own partition.
TE itself is GPU only and has not been run here.
Details: docs/third-party.md, "How the adapters drive their libraries", `te-cp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.errors import ImplError
from harness.impls.adapters._common import (
    FLASH_HEAD_DIMS,
    GatherRanks,
    Variant,
    flash_mask,
    installed_version,
    require_supported,
    variant,
)
from ring_impl.masks import EXPR, WINDOW_RIGHT, MaskSpec

EXTRA = "te"


def _caps(masks: set[str], layouts: frozenset[str] = frozenset({"zigzag"})) -> Capabilities:
    return Capabilities(
        layouts=layouts,
        masks=frozenset(masks),
        dtypes=frozenset({"fp16", "bf16"}),
        gqa=True,
        uneven=False,
        world_sizes=(1, 8),
        backward=True,
        devices=frozenset({"cuda"}),
        returns_lse=False,
        head_dims=FLASH_HEAD_DIMS,
    )


# sliding windows, one- or two-sided, with or without causal (TE's tests run (512, 0) causal and
# (512, 512) no_mask with a2a and all_gather; they skip windows with p2p): what `flash_mask` maps
# without documents
WINDOWS = {"none", "causal", "window", EXPR, "and", "full", WINDOW_RIGHT}
# option: TE's cp_comm_type, and ":thd" for packed documents (every layout: the adapter reshards)
THD_CAPS = _caps({"none", "causal", "document"}, frozenset({"contiguous", "zigzag", "striped"}))
VARIANTS = {
    "te-cp-p2p": Variant(_caps({"none", "causal"}), option="p2p"),
    "te-cp-a2a": Variant(_caps(WINDOWS), option="a2a"),
    "te-cp-all-gather": Variant(_caps(WINDOWS), option="all_gather"),
    "te-cp-p2p-thd": Variant(THD_CAPS, option="p2p:thd"),
}


def mask_args(ctx: RunContext, thd: bool = False) -> dict:
    """TE's attn_mask_type and window_size for our mask (THD: padding masks; documents are its
    sequences)."""
    if thd:
        if ctx.mask.kind not in ("none", "causal", "document"):
            raise ImplError(f"te-cp: mask {ctx.mask.kind} has no TE THD equivalent here")
        causal = ctx.mask.is_causal
        return {
            "attn_mask_type": "padding_causal" if causal else "padding",
            "window_size": (-1, 0 if causal else -1),
        }
    fm = flash_mask(ctx.mask, ctx.total_len)
    if fm is None or fm.doc_starts != (0,):
        raise ImplError(f"te-cp: the mask {ctx.mask.describe()} has no TE equivalent here")
    if fm.causal:
        return {"attn_mask_type": "causal", "window_size": (fm.window[0], 0)}
    return {"attn_mask_type": "no_mask", "window_size": fm.window}


@dataclass(frozen=True)
class Thd:
    """A case's batch packed as TE's THD sequences: batch row b's documents, in order, each
    padded to a multiple of 2W. `rows[b * total + p]` is the packed row of global token p of
    batch row b."""

    cu_seqlens: torch.Tensor  # int32 (sequences + 1,): real lengths
    # int32: padded lengths; the same object as cu_seqlens when no padding
    cu_seqlens_padded: torch.Tensor
    rows: torch.Tensor  # int64 (batch * total,)
    causal: bool

    @property
    def total_padded(self) -> int:
        return int(self.cu_seqlens_padded[-1])


def thd_packing(
    mask: MaskSpec, total: int, batch: int, world_size: int, device: torch.device
) -> Thd:
    """The THD packing of a case: its documents (one sequence for no mask or causal) for every batch
    row."""
    starts = tuple(mask.doc_starts) if mask.kind == "document" else (0,)
    lengths = [b - a for a, b in zip(starts, (*starts[1:], total), strict=True)] * batch
    unit = 2 * world_size
    padded = [(n + unit - 1) // unit * unit for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    # each token's sequence start
    first = cu_padded[:-1].long().repeat_interleave(torch.tensor(lengths))
    within = torch.cat([torch.arange(n) for n in lengths])
    rows = (first + within).to(device)
    cu, cu_padded = cu.to(device), cu_padded.to(device)
    return Thd(cu, cu if padded == lengths else cu_padded, rows, causal=mask.is_causal)


def dual_chunk_rows(
    cu_seqlens_padded: torch.Tensor, total_padded: int, world_size: int, rank: int
) -> torch.Tensor:
    """Packed rows a rank holds in TE's THD partition, ascending.

    They are chunks rank and 2W-1-rank of every padded sequence.
    This is our reading of `tex.thd_get_partitioned_indices`, for the CPU resharding test.
    """
    out = []
    bounds = cu_seqlens_padded.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        c = (b - a) // (2 * world_size)
        for chunk in (rank, 2 * world_size - 1 - rank):
            out.append(torch.arange(a + chunk * c, a + (chunk + 1) * c))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Thd, list[torch.Tensor]], torch.Tensor]
Partition = Callable[[torch.Tensor, int, int, int], torch.Tensor]


def thd_run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx: RunContext,
    attend: Attend,
    partition: Partition,
) -> torch.Tensor:
    """Out (batch, local seq, heads, dim) at our positions, computed by `attend` on TE's THD
    partition.

    Our shards are all-gathered, put in global order and packed with `thd_packing`.
    Each rank keeps its rows of `partition`, which is TE's `thd_get_partitioned_indices`.
    `attend(q, k, v, packing, rows of every rank)` returns this rank's out, (rows, heads_q * dim).
    The outputs are all-gathered and read back at our positions.
    """
    batch, _, heads_q, dim = q.shape
    w, rank = ctx.world_size, ctx.rank
    pack = thd_packing(ctx.mask, ctx.total_len, batch, w, q.device)
    rows = [
        partition(pack.cu_seqlens_padded, pack.total_padded, w, r).long().to(q.device)
        for r in range(w)
    ]
    # global position -> gathered row
    order = torch.argsort(torch.cat(list(ctx.all_positions)).to(q.device))

    def own_rows(x: torch.Tensor) -> torch.Tensor:
        whole = GatherRanks.apply(x.transpose(0, 1).contiguous(), ctx.group).index_select(0, order)
        flat = whole.transpose(0, 1).reshape(batch * ctx.total_len, *x.shape[2:])
        packed = flat.new_zeros(pack.total_padded, *x.shape[2:]).index_copy(0, pack.rows, flat)
        return packed.index_select(0, rows[rank])

    out = attend(own_rows(q), own_rows(k), own_rows(v), pack, rows)
    gathered = GatherRanks.apply(out.reshape(out.shape[0], heads_q * dim), ctx.group)
    packed = gathered.new_zeros(pack.total_padded, heads_q * dim).index_copy(
        0, torch.cat(rows), gathered
    )
    whole = packed.index_select(0, pack.rows).view(batch, ctx.total_len, heads_q, dim)
    return whole.index_select(1, ctx.positions.to(q.device))


def check_shapes(name: str, ctx: RunContext, heads_q: int, heads_kv: int) -> None:
    """TE's own preconditions: equal dual chunks; a2a scatters heads over the ranks."""
    if ctx.total_len % (2 * ctx.world_size):
        raise ImplError(
            f"{name}: total length {ctx.total_len} is not divisible by 2*W = {2 * ctx.world_size}"
        )
    if variant(VARIANTS, name).option == "a2a" and (
        heads_q % ctx.world_size or heads_kv % ctx.world_size
    ):
        raise ImplError(
            f"{name}: a2a needs head counts divisible by W={ctx.world_size} "
            f"(got {heads_q} query, {heads_kv} kv heads)"
        )


def make(name: str) -> Impl:
    """TE's DotProductAttention with the variant's cp_comm_type; imports TE (ImportError when
    absent)."""
    declared = variant(VARIANTS, name)
    from transformer_engine.pytorch import DotProductAttention

    comm, _, fmt = declared.option.partition(":")
    thd, caps = fmt == "thd", declared.capabilities
    modules: dict[tuple, torch.nn.Module] = {}

    def module_for(ctx: RunContext, q: torch.Tensor, k: torch.Tensor) -> torch.nn.Module:
        key = (
            id(ctx.group),
            tuple(ctx.global_ranks),
            q.shape[2],
            k.shape[2],
            q.shape[3],
            ctx.softmax_scale,
            repr(mask_args(ctx, thd)),
        )
        if key not in modules:
            m = DotProductAttention(
                q.shape[2],
                q.shape[3],
                num_gqa_groups=k.shape[2],
                attention_dropout=0.0,
                qkv_format="thd" if thd else "bshd",
                softmax_scale=ctx.softmax_scale,
                **mask_args(ctx, thd),
            )
            m.set_context_parallel_group(
                ctx.group, list(ctx.global_ranks), torch.cuda.Stream(), comm
            )
            modules[key] = m.to(ctx.device)
        return modules[key]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k)
        if thd:
            import transformer_engine_torch as tex

            def attend(qt, kt, vt, pack: Thd, rows) -> torch.Tensor:
                cu, cu_padded = pack.cu_seqlens, pack.cu_seqlens_padded
                return module_for(ctx, q, k)(
                    qt,
                    kt,
                    vt,
                    cu_seqlens_q=cu,
                    cu_seqlens_kv=cu,
                    cu_seqlens_q_padded=cu_padded,
                    cu_seqlens_kv_padded=cu_padded,
                )

            return thd_run(q, k, v, ctx, attend, tex.thd_get_partitioned_indices)
        check_shapes(name, ctx, q.shape[2], k.shape[2])
        out = module_for(ctx, q, k)(q, k, v)
        return out.view(q.shape)

    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=installed_version("transformer-engine"),
        deterministic=False,
    )


def dual_chunk_positions(total: int, world_size: int, rank: int) -> torch.Tensor:
    """Global positions TE's dual-chunk-swap sharding gives `rank` (its tests' index_select): the
    THD partition of one sequence."""
    return dual_chunk_rows(torch.tensor([0, total]), total, world_size, rank)
