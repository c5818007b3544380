"""feifeibear's `yunchang` (long-context-attention): ring, Ulysses and USP over flash-attn.

They run on CUDA/NCCL with a real flash-attn, and on CPU gloo ranks with the flash-attn stand-in
(`harness.kernels`). The library is imported on the ranks only. For USP, the adapter builds the
Ulysses and ring groups itself, from this ring's global ranks. docs/third-party.md says how each
mode is called, and why it declares what it does.
"""

from __future__ import annotations

import hashlib

import torch

from harness.context import Capabilities, Impl, RunContext, RunFn
from harness.errors import ImplError
from harness.impls.adapters._common import (
    FLASH_HEAD_DIMS,
    FLASH_KERNEL,
    FLASH_MASK_FEATURES,
    Variant,
    flash_devices,
    flash_world_sizes,
    installed_version,
    require_flash_mask,
    require_importable,
    require_supported,
    variant,
)

EXTRA = "yunchang"
# its library calls flash-attn: ranks report which one (`_common.kernel_label`)
KERNEL = FLASH_KERNEL
RING_TYPE = {"contiguous": "basic", "zigzag": "zigzag", "striped": "strip"}


def _caps(
    layouts: set[str],
    masks: set[str],
    world_size: tuple[int, int],
    sends_to_itself: bool = True,
    heads_divisible_by_world: bool = False,
) -> Capabilities:
    return Capabilities(
        layouts=frozenset(layouts),
        masks=frozenset(masks),
        dtypes=frozenset({"fp16", "bf16"}),
        gqa=True,
        uneven=False,
        world_sizes=flash_world_sizes(world_size, sends_to_itself),  # W=1 on gloo: a send to itself
        backward=True,
        devices=flash_devices(),  # cpu where the CPU stand-in serves the ranks
        returns_lse=False,
        head_dims=FLASH_HEAD_DIMS,
        # ring-flash-attn's zigzag code: two equal chunks per rank
        zigzag_odd="zigzag" not in layouts,
        heads_divisible_by_world=heads_divisible_by_world,
    )


# option: the mode, "ring" (RING_IMPL_DICT by layout), "ulysses" (UlyssesAttention) or "usp"
# (LongContextAttention over Ulysses x ring groups)
VARIANTS = {
    # zigzag and strip assert causal; "basic" also runs non-causal, but the product of layouts and
    # masks is what a capability set promises, so non-causal is left to the contiguous variants odd
    # zigzag lengths are undeclared but let through to the library: the probe reports what it does
    "yunchang-ring": Variant(
        _caps(set(RING_TYPE), {"causal"}, (1, 8)), option="ring", lets_run=frozenset({"zigzag-odd"})
    ),
    # each rank attends the whole sequence (for its heads), so flash-attn's window is exact on both
    # sides; its flash_attn_func call takes no documents (no cu_seqlens)
    "yunchang-ulysses": Variant(
        _caps(
            {"contiguous"},
            set(FLASH_MASK_FEATURES - {"document", "per-document"}),
            (1, 8),
            False,
            heads_divisible_by_world=True,
        ),
        option="ulysses",
    ),
    "yunchang-usp": Variant(_caps({"contiguous"}, {"none", "causal"}, (4, 8)), option="usp"),
}


def usp_degrees(world_size: int, heads_q: int, heads_kv: int) -> tuple[int, int]:
    """(ulysses, ring) degrees for USP. U is the largest 1 < U < W that divides W and both heads."""
    for u in range(world_size - 1, 1, -1):
        if world_size % u == 0 and heads_q % u == 0 and heads_kv % u == 0:
            return u, world_size // u
    raise ImplError(
        f"yunchang-usp: no Ulysses degree 1 < U < {world_size} divides W and both head counts "
        f"({heads_q}, {heads_kv})"
    )


def usp_groups(
    global_ranks: tuple[int, ...], ulysses: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(ulysses groups, ring groups) as global ranks.

    They come in the ulysses-low order of `set_seq_parallel_pg`.
    """
    w = len(global_ranks)
    ring = w // ulysses
    uly = [[global_ranks[r * ulysses + u] for u in range(ulysses)] for r in range(ring)]
    rng = [[global_ranks[r * ulysses + u] for r in range(ring)] for u in range(ulysses)]
    return uly, rng


_GROUPS: dict[tuple, object] = {}


def _group(ranks: list[int], ring: object) -> object:
    """The process group of the global `ranks`, created by its members only.

    It is cached per harness ring group. torch names a locally synchronised group by hashing its
    ranks with the number of groups the calling process knows
    (`distributed_c10d._hash_ranks_to_str`). That number differs between pool ranks: a rank outside
    an earlier ring never registered that ring's group. The members of a new group would then
    rendezvous under different store prefixes and hang. This was seen on a W=4 USP case after any
    W=2 case. So the name is made from what every member agrees on: the harness's ring group and the
    ranks. The ring group (`ring.group_name`) is created collectively, and fresh after a failed
    case, so no stale group is reused.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    tag = str(getattr(ring, "group_name", ""))
    key = (tag, tuple(ranks))
    if key not in _GROUPS:
        name = hashlib.sha1(
            f"ring-harness-usp/{tag}/{'_'.join(map(str, ranks))}".encode()
        ).hexdigest()
        original = getattr(c10d, "_hash_ranks_to_str", None)
        if original is not None:
            c10d._hash_ranks_to_str = lambda _ranks: name
        try:
            _GROUPS[key] = dist.new_group(ranks=ranks, use_local_synchronization=True)
        finally:
            if original is not None:
                c10d._hash_ranks_to_str = original
    return _GROUPS[key]


def _ring_run(name: str, caps: Capabilities, lets_run: frozenset[str] = frozenset()) -> RunFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)
        from yunchang.hybrid.utils import RING_IMPL_DICT
        from yunchang.kernels import AttnType

        fn = RING_IMPL_DICT[RING_TYPE[ctx.layout]]
        out = fn(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=ctx.softmax_scale,
            causal=ctx.mask.is_causal,
            window_size=(-1, -1),
            deterministic=True,
            return_attn_probs=False,
            group=ctx.group,
            attn_type=AttnType.FA,
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def _ulysses_run(name: str, caps: Capabilities, lets_run: frozenset[str] = frozenset()) -> RunFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)  # refuses heads W does not divide
        from yunchang import UlyssesAttention
        from yunchang.kernels import AttnType

        # no documents: undeclared, refused above
        fm = require_flash_mask(name, ctx)
        attn = UlyssesAttention(ctx.group, scatter_idx=2, gather_idx=1, attn_type=AttnType.FA)
        return attn(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=ctx.softmax_scale,
            causal=fm.causal,
            window_size=fm.window,
            deterministic=True,
        )

    return run


def _usp_run(name: str, caps: Capabilities, lets_run: frozenset[str] = frozenset()) -> RunFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)
        u, _ = usp_degrees(ctx.world_size, q.shape[2], k.shape[2])
        from yunchang import LongContextAttention
        from yunchang.globals import PROCESS_GROUP
        from yunchang.kernels import AttnType

        uly, rng = usp_groups(tuple(ctx.global_ranks), u)
        me = ctx.global_ranks[ctx.rank]
        PROCESS_GROUP.ULYSSES_PG = _group(next(g for g in uly if me in g), ctx.group)
        PROCESS_GROUP.RING_PG = _group(next(g for g in rng if me in g), ctx.group)
        attn = LongContextAttention(
            scatter_idx=2, gather_idx=1, ring_impl_type="basic", attn_type=AttnType.FA
        )
        return attn(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=ctx.softmax_scale,
            causal=ctx.mask.is_causal,
            window_size=(-1, -1),
            deterministic=True,
        )

    return run


_RUNS = {"ring": _ring_run, "ulysses": _ulysses_run, "usp": _usp_run}


def make(name: str) -> Impl:
    """The variant's mode behind our run signature.

    ImportError when yunchang is not importable. The run imports the library itself, on the ranks,
    where flash-attn or its CPU stand-in is.
    """
    declared = variant(VARIANTS, name)
    require_importable("yunchang")
    caps = declared.capabilities
    run = _RUNS[declared.option](name, caps, declared.lets_run)
    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=installed_version("yunchang"),
        deterministic=False,
    )


def extract_local(
    kind: str, x: torch.Tensor, rank: int, world_size: int, ring: int, ulysses: int
) -> torch.Tensor:
    """yunchang's `EXTRACT_FUNC_DICT` sharding, restated without process groups, for layout tests.

    - basic: chunk W.
    - zigzag: chunks r and 2R-1-r of 2R over the ring rank r = rank // U, then chunk U by the
      Ulysses rank u = rank % U.
    - strip: per ring index j, tokens j, j+R, ..., then chunk W.
    """
    b, n = x.shape[:2]
    if kind == "basic":
        return x.chunk(world_size, dim=1)[rank]
    if kind == "zigzag":
        r, u = rank // ulysses, rank % ulysses
        c = x.chunk(2 * ring, dim=1)
        return torch.cat([c[r], c[2 * ring - r - 1]], dim=1).chunk(ulysses, dim=1)[u]
    if kind == "strip":
        y = x.reshape(b, n // ring, ring, -1).transpose(1, 2).reshape(b, n, *x.shape[2:])
        return y.chunk(world_size, dim=1)[rank]
    raise ValueError(f"unknown yunchang sharding {kind!r}")
