"""zhuzilin's `ring-flash-attn`, four variants over flash-attn kernels.

They run on CUDA/NCCL with a real flash-attn, and on CPU gloo ranks with the flash-attn stand-in
(`harness.kernels`). The library's ring logic is plain torch.distributed, so it runs unmodified. It
is imported on the ranks only. docs/third-party.md gives the signatures, the layout mapping, and why
the zigzag variant declares `zigzag_odd=False` but lets odd lengths run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

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
from ring_impl.masks import WINDOW_RIGHT

EXTRA = "ring-flash-attn"
# its library calls flash-attn: ranks report which one (`_common.kernel_label`)
KERNEL = FLASH_KERNEL


def _caps(layout: str, masks: set[str], sends_to_itself: bool = True) -> Capabilities:
    """What a variant declares. Zigzag needs two equal chunks per rank: an even local length."""
    return Capabilities(
        layouts=frozenset({layout}),
        masks=frozenset(masks),
        dtypes=frozenset({"fp16", "bf16"}),  # flash-attn 2 kernels
        gqa=True,
        uneven=False,
        world_sizes=flash_world_sizes((1, 8), sends_to_itself),  # W=1 on gloo: a send to itself
        backward=True,
        devices=flash_devices(),  # cpu where the CPU stand-in serves the ranks
        returns_lse=True,
        head_dims=FLASH_HEAD_DIMS,
        zigzag_odd=layout != "zigzag",
    )


# all-gathers K/V over packed documents: driven differently
LLAMA3 = "llama3_flash_attn_varlen_func"
# option: the library function
VARIANTS = {
    "ring-flash-attn": Variant(
        _caps("contiguous", {"none", "causal"}), option="ring_flash_attn_func"
    ),
    # odd zigzag lengths are undeclared but let through to the library: the probe reports what it
    # does
    "ring-flash-attn-zigzag": Variant(
        _caps("zigzag", {"causal"}),
        option="zigzag_ring_flash_attn_func",
        lets_run=frozenset({"zigzag-odd"}),
    ),
    "ring-flash-attn-stripe": Variant(
        _caps("striped", {"causal"}), option="stripe_flash_attn_func"
    ),
    # every mask `flash_mask` expresses (documents, causal, windows, their conjunctions,
    # per-document) but a window reaching right of the diagonal: without causal, llama3 gives each
    # rank's query piece of a document the whole document's keys, so flash-attn's bottom-right
    # alignment misplaces a two-sided window on every piece that does not end the document
    "ring-flash-attn-llama3": Variant(
        _caps("contiguous", set(FLASH_MASK_FEATURES - {WINDOW_RIGHT}), sends_to_itself=False),
        option=LLAMA3,
    ),
}


def _library(name: str, func: str) -> tuple[Any, Callable[..., Any]]:
    """(the ring_flash_attn module, its function `func`), imported on first use, on a rank."""
    lib = importlib.import_module("ring_flash_attn")
    fn = getattr(lib, func, None)
    if fn is None:
        raise ImplError(
            f"{name}: ring_flash_attn {installed_version('ring-flash-attn')} has no {func}"
        )
    return lib, fn


def _ring_run(
    func: str, name: str, caps: Capabilities, lets_run: frozenset[str] = frozenset()
) -> RunFn:
    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        require_supported(name, ctx, caps, q, k, lets_run)
        _, fn = _library(name, func)
        out, lse, _ = fn(
            q,
            k,
            v,
            dropout_p=0.0,
            softmax_scale=ctx.softmax_scale,
            causal=ctx.mask.is_causal,
            window_size=(-1, -1),
            deterministic=True,
            return_attn_probs=True,
            group=ctx.group,
        )
        return out, lse.float()

    return run


def _llama3_run(name: str, caps: Capabilities) -> RunFn:
    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        require_supported(name, ctx, caps, q, k)
        fm = require_flash_mask(name, ctx)
        lib, fn = _library(name, LLAMA3)
        causal = fm.causal
        cu_q, cu_k, max_q, max_k, k_slice = lib.llama3_flash_attn_prepare_cu_seqlens(
            fm.cu_seqlens(ctx.total_len).to(q.device),
            causal=causal,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
        outs, lses = [], []
        # the varlen API packs one token stream; batch elements are separate
        for b in range(q.shape[0]):
            out, lse, _ = fn(
                q[b],
                k[b],
                v[b],
                cu_q,
                cu_k,
                max_q,
                max_k,
                heads_k_stride=1,
                local_k_slice=k_slice,
                dropout_p=0.0,
                softmax_scale=ctx.softmax_scale,
                causal=causal,
                window_size=fm.window,
                deterministic=True,
                return_attn_probs=True,
                group=ctx.group,
            )
            outs.append(out)
            lses.append(lse.float())
        return torch.stack(outs), torch.stack(lses)  # lse: (heads, tokens) per element

    return run


def make(name: str) -> Impl:
    """The variant's library function behind our run signature.

    ImportError when ring_flash_attn is not importable. The run imports the library itself, on the
    ranks, where flash-attn or its CPU stand-in is. A version without the function is an ImplError
    there.
    """
    declared = variant(VARIANTS, name)
    require_importable("ring_flash_attn")
    func, caps = declared.option, declared.capabilities
    run = (
        _llama3_run(name, caps)
        if func == LLAMA3
        else _ring_run(func, name, caps, declared.lets_run)
    )
    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=installed_version("ring-flash-attn"),
        deterministic=False,
    )


def extract_local(
    layout: str, x: torch.Tensor, rank: int, world_size: int, dim: int = 1
) -> torch.Tensor:
    """The library's own sharding helpers, from its tests, for checking our layout mapping.

    - contiguous: `x.chunk(W)[rank]`
    - zigzag: chunks r and 2W-1-r of `x.chunk(2W)`
    - striped: `stack(x.split(W), dim).transpose(dim, dim+1)[rank]`
    """
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank]
    if layout == "zigzag":
        c = x.chunk(2 * world_size, dim=dim)
        return torch.cat([c[rank], c[2 * world_size - rank - 1]], dim=dim)
    if layout == "striped":
        s = torch.stack(x.split(world_size, dim=dim), dim=dim).transpose(dim, dim + 1)
        return s.select(dim, rank)
    raise ValueError(f"unknown layout {layout!r}")
