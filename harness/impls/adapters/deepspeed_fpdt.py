"""DeepSpeed FPDT: chunked Ulysses attention over flash-attn or the CPU stand-in.

FPDT holds its own strided layout, so the adapter reshards around the call.
It computes q, k and v from one linear layer, fed here with identity weights.
Only causal attention is declared, since that is FPDT's one mask.
DeepSpeed is imported on the ranks only; `make` checks that it is importable.
Details: docs/third-party.md, "How the adapters drive their libraries", `deepspeed-fpdt`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.context import Capabilities, Impl, RunContext, RunFn
from harness.impls.adapters._common import (
    FLASH_HEAD_DIMS,
    FLASH_KERNEL,
    GatherRanks,
    Variant,
    flash_devices,
    installed_version,
    q_prescale,
    require_importable,
    require_supported,
    variant,
)
from harness.impls.adapters.deepspeed import init_deepspeed, require_kv_head_per_rank

EXTRA = "deepspeed"
# its library calls flash-attn: ranks report which one (`_common.kernel_label`)
KERNEL = FLASH_KERNEL

CAPABILITIES = Capabilities(
    # FPDT's chunk loop is causal, with no mask argument (it asserts None)
    masks=frozenset({"causal"}),
    dtypes=frozenset({"fp16", "bf16"}),
    gqa=True,
    uneven=False,
    world_sizes=(1, 8),
    backward=True,
    returns_lse=False,
    head_dims=FLASH_HEAD_DIMS,
    heads_divisible_by_world=True,
    devices=flash_devices(),  # cpu where the CPU stand-in serves the ranks
)
VARIANTS = {"deepspeed-fpdt": Variant(CAPABILITIES, lets_run=frozenset({"heads"}))}
CHUNK_COUNTS = (4, 3, 2, 1)


def chunk_count(local_len: int) -> int:
    """FPDT's number of chunks for this per-rank length: the largest of CHUNK_COUNTS dividing it."""
    return next(n for n in CHUNK_COUNTS if local_len % n == 0)


def fpdt_rows(total: int, world_size: int, rank: int, chunks: int) -> torch.Tensor:
    """Global positions rank `rank` holds in FPDT's layout: piece `rank` of each of `chunks`
    segments."""
    piece = total // (world_size * chunks)
    starts = (torch.arange(chunks) * world_size + rank) * piece
    return (starts[:, None] + torch.arange(piece)).reshape(-1)


def _run(name: str, caps: Capabilities, lets_run: frozenset[str]) -> RunFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)
        require_kv_head_per_rank(name, ctx, k)
        from deepspeed.sequence.fpdt_layer import FPDT_Attention

        init_deepspeed(ctx.group)
        batch, local, heads_q, dim = q.shape
        heads_kv, w, total = k.shape[2], ctx.world_size, ctx.total_len
        chunks = chunk_count(local)
        rows = fpdt_rows(total, w, ctx.rank, chunks).to(q.device)
        # global position -> gathered row
        order = torch.argsort(torch.cat(list(ctx.all_positions)).to(q.device))

        # ours (b, s/W, h, d) -> FPDT's rows (s/W, b, h*d)
        def fpdt_shard(x: torch.Tensor) -> torch.Tensor:
            whole = GatherRanks.apply(x.transpose(0, 1).contiguous(), ctx.group).index_select(
                0, order
            )
            return whole.index_select(0, rows).flatten(2)

        qs = q * q_prescale(ctx.softmax_scale, dim)
        hidden = torch.cat([fpdt_shard(t) for t in (qs, k, v)], dim=2)
        width, out_width = hidden.shape[2], heads_q * dim
        config = SimpleNamespace(
            kv_channels=dim,
            num_attention_heads=heads_q,
            num_key_value_heads=heads_kv,
            hidden_size=width,
            attention_dropout=0.0,
        )
        eye = torch.eye(width, dtype=q.dtype, device=q.device)
        layer = FPDT_Attention(
            config,
            eye,
            torch.zeros(width, dtype=q.dtype, device=q.device),
            torch.eye(out_width, dtype=q.dtype, device=q.device),
            torch.zeros(out_width, dtype=q.dtype, device=q.device),
            ctx.group,
            gather_idx=1,
            chunk_size=total // chunks,
            enable_offloading=False,
        )
        # (s/W, b, heads_q * d) in FPDT's rows
        out, _ = layer(hidden, None, None, None, cpu_offloading=False)
        gathered = GatherRanks.apply(out, ctx.group)  # (s, b, heads_q * d), rank by rank
        every = torch.cat([fpdt_rows(total, w, r, chunks) for r in range(w)]).to(q.device)
        whole = torch.empty_like(gathered).index_copy(0, every, gathered)
        return (
            whole.index_select(0, ctx.positions.to(q.device))
            .transpose(0, 1)
            .reshape(batch, local, heads_q, dim)
        )

    return run


def make(name: str) -> Impl:
    """The variant behind our run signature. ImportError when deepspeed is not importable; the
    library is imported by the run, on the ranks (where flash-attn, or its CPU stand-in, is)."""
    declared = variant(VARIANTS, name)
    require_importable("deepspeed")
    caps = declared.capabilities
    return Impl(
        name=name,
        run=_run(name, caps, declared.lets_run),
        capabilities=caps,
        version=installed_version("deepspeed"),
    )
