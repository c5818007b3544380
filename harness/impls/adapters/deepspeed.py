"""DeepSpeed's Ulysses sequence parallelism, with torch's SDPA as the local attention.

DistributedAttention turns sequence shards into head shards of the whole sequence.
The local attention then applies the case's mask, so any layout and mask work.
Two variants cover the batch-first and sequence-first layouts that callers use.
DeepSpeed is imported on the ranks only; `make` checks that it is importable.
Details: docs/third-party.md, "How the adapters drive their libraries", `deepspeed-ulysses`.
"""

from __future__ import annotations

import torch

from harness.context import Capabilities, Impl, RunContext, RunFn
from harness.errors import ImplError
from harness.impls.adapters._common import (
    Variant,
    installed_version,
    require_importable,
    require_supported,
    variant,
)
from ring_impl.masks import MASK_FEATURES

EXTRA = "deepspeed"


def _caps() -> Capabilities:
    return Capabilities(
        # the local attention gets the whole sequence: any mask, as a dense one
        masks=frozenset(MASK_FEATURES),
        # the local attention is ours: it carries every variant, for the heads each rank holds
        sinks=True,
        softcap=True,
        alibi=True,
        head_dim_v=True,
        dtypes=frozenset({"fp32", "fp16", "bf16"}),
        gqa=True,
        uneven=False,
        world_sizes=(1, 8),
        backward=True,
        returns_lse=False,
        # the even all-to-all; other counts take the uneven-heads path: let through
        heads_divisible_by_world=True,
    )


# option: the tensor layout DistributedAttention is called with.
# Let through though undeclared, so the probe shows what DeepSpeed does:
# head counts W does not divide, and unequal per-rank lengths (docs/third-party.md).
LETS_RUN = frozenset({"heads", "uneven"})
VARIANTS = {
    "deepspeed-ulysses": Variant(_caps(), option="batch-first", lets_run=LETS_RUN),
    "deepspeed-ulysses-seqfirst": Variant(_caps(), option="seq-first", lets_run=LETS_RUN),
}


class SequenceParallelMpu:
    """The part of a model-parallel unit DeepSpeed's sequence parallelism reads
    (utils/groups.py)."""

    def __init__(self, group: object) -> None:
        self.group = group

    def get_sequence_parallel_group(self) -> object:
        return self.group

    def get_sequence_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def get_sequence_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)


def init_deepspeed(group: object) -> None:
    """DeepSpeed's comm over the existing process group, with the ring as its SP group.

    The comm ops are marked incompatible, so no CPU all-reduce op gets JIT-compiled.
    That compile takes minutes and would rendezvous every world rank, hanging subgroups.
    Ulysses needs only all_to_all_single. Why: docs/third-party.md, `deepspeed-ulysses`.
    Releases differ: 0.16 reads the table's entry and finds the shm op compatible.
    """
    import deepspeed
    import deepspeed.comm as dc
    import deepspeed.ops
    import torch.distributed as dist
    from deepspeed.utils import groups

    ops = vars(deepspeed.ops).get("__compatible_ops__")
    if isinstance(ops, dict):  # read at each init: mark the comm ops (shm, ccl) off in place
        ops.update({name: False for name in ops if name.endswith("_comm")})
    else:
        deepspeed.ops.__compatible_ops__ = {}
    if not dc.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    groups.mpu = SequenceParallelMpu(group)


def local_attention(positions: torch.Tensor, ctx: RunContext, seq_dim: int):
    """torch's SDPA over the whole sequence, with the case's mask and scale.

    `positions` are the global positions of the gathered sequence, in rank order.
    A row that sees no key gets out 0, unlike CUDA's SDPA kernels (docs/third-party.md).
    """
    from ring_impl.mask_eval import allowed

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if seq_dim == 0:  # [s, b, h, d] -> [b, h, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        else:  # [b, s, h, d] -> [b, h, s, d]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        pos = positions.to(q.device)
        mask = allowed(ctx.mask, pos, pos)
        mask = None if mask is None else mask.to(q.device)
        if ctx.variants:
            out = variant_attention(q, k, v, mask, pos, ctx)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                scale=ctx.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        if mask is not None:
            out = out.masked_fill(~mask.any(-1)[:, None], 0.0)
        return out.permute(2, 0, 1, 3) if seq_dim == 0 else out.transpose(1, 2)

    return attend


def variant_attention(q, k, v, mask, pos: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """Attention with the case's variants over this rank's heads (b, h, s, d), in float32.

    Ulysses gives rank r the r-th contiguous group of heads, following the kv heads. So the sinks and
    ALiBi slopes are those of heads r * h .. (r + 1) * h. The sink is a zero-valued logit column,
    dropped after the softmax; autograd takes its gradient back to the whole sinks tensor.
    """
    import torch.distributed as dist

    h, g = q.shape[1], q.shape[1] // k.shape[1]
    heads = slice(dist.get_rank(ctx.group) * h, (dist.get_rank(ctx.group) + 1) * h)
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * ctx.softmax_scale
    if ctx.softcap is not None:
        s = torch.tanh(s / ctx.softcap) * ctx.softcap
    if ctx.alibi_slopes is not None:
        dist_ij = (pos.view(-1, 1) - pos.view(1, -1)).abs().float()
        s = s - ctx.alibi_slopes[heads].float().view(1, -1, 1, 1) * dist_ij
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if ctx.sinks is not None:
        sink = ctx.sinks[heads].float().view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if ctx.sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p, vf).to(q.dtype)


def require_kv_head_per_rank(name: str, ctx: RunContext, k: torch.Tensor) -> None:
    """One line for kv heads fewer than W, which DeepSpeed's all-to-all asserts against."""
    if k.shape[2] < ctx.world_size:
        raise ImplError(
            f"{name}: unsupported here: {k.shape[2]} kv heads for W={ctx.world_size} "
            "(DeepSpeed asserts at least one kv head per rank, layer.py "
            "_resolve_kv_heads)"
        )


def _run(name: str, caps: Capabilities, option: str, lets_run: frozenset[str]) -> RunFn:
    seq_first = option == "seq-first"

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)
        require_kv_head_per_rank(name, ctx, k)
        from deepspeed.sequence.layer import DistributedAttention

        init_deepspeed(ctx.group)
        positions = torch.cat([p.reshape(-1) for p in ctx.all_positions])
        attend = local_attention(positions, ctx, seq_dim=0 if seq_first else 1)
        if seq_first:
            attn = DistributedAttention(attend, ctx.group, scatter_idx=2, gather_idx=0)
            out = attn(*(t.transpose(0, 1) for t in (q, k, v)), batch_dim_idx=1)
            return out.transpose(0, 1)
        attn = DistributedAttention(attend, ctx.group, scatter_idx=2, gather_idx=1)
        return attn(q, k, v, batch_dim_idx=0)

    return run


def make(name: str) -> Impl:
    """The variant behind our run signature. ImportError when deepspeed is not importable; the
    library itself is imported by the run, on the ranks."""
    declared = variant(VARIANTS, name)
    require_importable("deepspeed")
    caps = declared.capabilities
    return Impl(
        name=name,
        run=_run(name, caps, declared.option, declared.lets_run),
        capabilities=caps,
        version=installed_version("deepspeed"),
    )
