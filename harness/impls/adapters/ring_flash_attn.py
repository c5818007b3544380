"""zhuzilin's `ring-flash-attn` (flash-attn kernels), four variants: on CUDA/NCCL with a real
flash-attn, and on CPU gloo ranks with ring-harness's flash-attn stand-in (`harness.kernels`), which
the ranks install where no real flash-attn is importable. Its ring logic (K/V rotation, lse merge,
zigzag / stripe / llama3 bookkeeping) is plain torch.distributed, so it runs unmodified; `versions:
kernel` in a saved case says which kernel it ran on. The library is imported inside the run (on the
ranks, after the stand-in is in place), never in the parent: `make` only checks that it is
importable.

Signatures (ring-flash-attn 0.1.x):
- `ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
  deterministic, return_attn_probs, group)`: contiguous layout;
- `zigzag_ring_flash_attn_func(...)`: same arguments; rank r holds chunks r and 2W-1-r of 2W
  (its tests' `extract_local`), i.e. our "zigzag"; asserts causal;
- `stripe_flash_attn_func(...)`: token i on rank i mod W (its tests' `extract_local`: split into
  W-sized groups, take index r), i.e. our "striped"; asserts causal;
- `llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  heads_k_stride, local_k_slice, ...)` with `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens,
  causal, rank, world_size)`: all-gathers K/V; rank r holds tokens [r*N/W, (r+1)*N/W) of the packed
  stream (contiguous). Packed documents (cu_seqlens) give our document masks; flash-attn aligns a
  causal window to the bottom right of each (q, k) document piece, and llama3's causal pieces end at
  the same global token, so window_size=(w, 0) is our window mask exactly: every mask
  `_common.flash_mask` expresses (conjunctions of documents, causal and windows, per-document ones)
  but a two-sided window (non-causal pieces take the whole document's keys: the alignment is off).
  Batches run one element at a time.
Tensors are (batch, seq, heads, dim) like ours; GQA is native with the grouped convention.
With return_attn_probs=True they return (out, lse, None), lse (batch, heads, seq) in float32.
The ring variants pass window_size to every block in block-local coordinates, which is not a
global sliding window (upstream issue #35), so only llama3 declares the window mask.

What the library supports, as declared: fp16/bf16 only and head_dim a multiple of 8 up to 256
(flash-attn 2 refuses fp32 and other head dims with its own error); equal per-rank lengths (every
ring step sends the same K/V buffer shape; llama3 asserts total % W == 0); zigzag and stripe assert
causal. Zigzag also needs an even per-rank length: its forward splits a rank's tokens at L//2 but
its backward with chunk(2), which for odd L disagree (zigzag_ring_flash_attn.py:22-23 vs :114-118,
upstream issue #39), so the zigzag variant declares `zigzag_odd=False`: battery cases are adapted to
even lengths and property-based runs draw only even ones. Its run does not refuse odd lengths,
though (`lets_run`): the library accepts them without an error (L = 3: every rank silently wrong; L
>= 5: a size mismatch in backward; L = 1: IndexError), and refusing would turn the check's probe of
the undeclared feature into "rejected with an error (right)" and a replay of the saved findings
(cases/ring-flash-attn-zigzag-odd-local-length*.yaml) into a refusal. So the probe runs the library
on an odd length and reports its wrong answer as a finding (see README, "Third-party rings").
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
    """What a variant declares; zigzag needs two equal chunks per rank (an even local length)."""
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
    """(the ring_flash_attn module, its function `func`), imported on first use (on a rank)."""
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
    """The variant's library function behind our run signature. ImportError when ring_flash_attn is
    not importable; the library itself is imported by the run, on the ranks (where flash-attn, or
    its CPU stand-in, is), and a version without the function is an ImplError there."""
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
    """The library's own sharding helpers (from its tests), for checking our layout mapping.

    contiguous: `x.chunk(W)[rank]`; zigzag: chunks r and 2W-1-r of `x.chunk(2W)`; striped:
    `stack(x.split(W), dim).transpose(dim, dim+1)[rank]`.
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
