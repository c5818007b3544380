"""Helpers that the adapters share, kept in one place.

They declare variants, refuse unsupported runs, report versions and convert layouts.
This module imports only torch and the harness, never a third-party library.
It never imports the registry either, since the registry imports the adapters.
Details: docs/third-party.md, "How the adapters drive their libraries", shared helpers.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import math
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.context import Capabilities, Impl, RunContext
from harness.dtypes import dtype_name
from harness.errors import ImplError
from harness.impls.capabilities import feature_words, missing_features
from harness.kernels import flash_standin
from ring_impl.masks import EXPR, WINDOW_RIGHT, Expr, MaskSpec

# flash-attn 2 / cuDNN fused attention: multiples of 8 up to 256
FLASH_HEAD_DIMS = tuple(range(8, 257, 8))


@dataclass(frozen=True)
class Variant:
    """One built-in implementation an adapter module offers, declared once in its `VARIANTS`.

    `capabilities` is what it declares it supports.
    `option` is the one setting that tells it apart from its siblings; empty for a lone variant.
    `lets_run` names undeclared features it still lets through, so the probe sees the library.
    Only features that cannot hang a ring belong there. See docs/third-party.md, shared helpers.
    """

    capabilities: Capabilities
    option: str = ""
    lets_run: frozenset[str] = frozenset()


def variant(variants: Mapping[str, Variant], name: str) -> Variant:
    """`variants[name]`, or ImplError naming the variants the module declares (for `make(name)`)."""
    try:
        return variants[name]
    except KeyError:
        raise ImplError(
            f"no built-in variant {name!r} here; declared: {', '.join(variants)}"
        ) from None


def installed_version(dist_name: str) -> str:
    """The installed distribution's version, or 'unknown' when it has no metadata."""
    try:
        return md.version(dist_name)
    except md.PackageNotFoundError:
        return "unknown"


def device_of(ctx: RunContext) -> str:
    """The device the run's tensors live on, as `Capabilities.devices` names it: 'cuda' or 'cpu'."""
    return "cuda" if ctx.device.type == "cuda" else "cpu"


def is_subgroup(ctx: RunContext) -> bool:
    """Whether the ring is not global ranks 0..W-1 (the capability rule's "subgroup")."""
    return tuple(ctx.global_ranks) != tuple(range(ctx.world_size))


def unsupported_reasons(
    ctx: RunContext,
    caps: Capabilities,
    q: torch.Tensor,
    k: torch.Tensor,
    lets_run: Collection[str] = (),
) -> list[str]:
    """What this run asks for that `caps` does not declare, in words; empty when all is supported.

    The feature keys in `lets_run` are left out.
    The rule is `capabilities.missing_features`, the same one the case side uses.
    Here the subgroup and the tensors' device are known, so they are checked too.
    """
    missing = missing_features(
        caps,
        layout=ctx.layout,
        mask_kind=ctx.mask,
        dtype=dtype_name(q.dtype),
        world_size=ctx.world_size,
        heads_q=q.shape[2],
        heads_kv=k.shape[2],
        lengths=ctx.lengths,
        head_dim=q.shape[-1],
        subgroup=is_subgroup(ctx),
        device=device_of(ctx),
        variants=ctx.variants,
    )
    keys = [f for f in missing if f not in lets_run]
    why = [
        feature_words(
            f,
            caps,
            heads_q=q.shape[2],
            heads_kv=k.shape[2],
            lengths=ctx.lengths,
            global_ranks=ctx.global_ranks,
            world_size=ctx.world_size,
        )
        for f in keys
    ]
    masks = [i for i, f in enumerate(keys) if f.startswith("mask:")]
    # name the whole expression once, after its last missing piece
    if masks and ctx.mask.kind == "expr":
        why[masks[-1]] += (
            f" (the mask is {ctx.mask.describe()}; declared: {', '.join(sorted(caps.masks))})"
        )
    return why


def require_supported(
    name: str,
    ctx: RunContext,
    caps: Capabilities,
    q: torch.Tensor,
    k: torch.Tensor,
    lets_run: Collection[str] = (),
) -> None:
    """Refuse, with one line, a run outside the declared capabilities.

    The features in `lets_run`, the variant's `Variant.lets_run`, are let through.
    Refusing beats calling the library: bad inputs can hang a ring or give wrong numbers.
    Probing outside the contract is deliberate: `lets_run` names what a variant lets through.
    """
    why = unsupported_reasons(ctx, caps, q, k, lets_run)
    if why:
        raise ImplError(f"{name}: unsupported here: {'; '.join(why)}")


def require_torch_api(name: str, api: Callable[[], object]) -> None:
    """ImplError naming this torch's version when `api()` (an import of torch's experimental
    symbols) fails."""
    try:
        api()
    except ImportError as e:
        raise ImplError(f"{name}: unsupported torch version {torch.__version__} ({e})") from None


def require_whole_world(name: str, ctx: RunContext) -> None:
    """For libraries that address peers by global rank in the default group (and barrier on it)."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if world_size != ctx.world_size or tuple(ctx.global_ranks) != tuple(range(ctx.world_size)):
        raise ImplError(
            f"{name}: runs only on the whole default process group (global ranks "
            f"0..{world_size - 1}); "
            f"this ring is global ranks {list(ctx.global_ranks)} of {world_size}"
        )


def to_bhsd(t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads, dim) -> (batch, heads, seq, dim), as SDPA and torch's ring want."""
    return t.transpose(1, 2)


def grouped_to_tiled(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Reorder query heads from the grouped GQA convention to the tiled one.

    Grouped (flash-attn, SDPA enable_gqa, the oracle): query head i uses kv head i // G.
    Tiled (einops '... h d -> ... (g h) d'): query head i uses kv head i % kv_heads.
    Grouped head (h, g) = h*G + g goes to tiled position g*kv_heads + h.
    """
    b, n, heads, d = q.shape
    if heads == kv_heads:
        return q
    g = heads // kv_heads
    return q.reshape(b, n, kv_heads, g, d).transpose(2, 3).reshape(b, n, heads, d)


def tiled_to_grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of `grouped_to_tiled` (for outputs, which carry query heads)."""
    b, n, heads, d = x.shape
    if heads == kv_heads:
        return x
    g = heads // kv_heads
    return x.reshape(b, n, g, kv_heads, d).transpose(2, 3).reshape(b, n, heads, d)


# -- libraries that call flash-attn (ring-flash-attn, yunchang)
# -------------------------------------------

# the value of an adapter module's KERNEL when its library calls flash-attn
FLASH_KERNEL = "flash-attn"


@dataclass(frozen=True)
class FlashMask:
    """A mask in flash-attn's terms: document starts, a causal flag and a window.

    `doc_starts` are the cu_seqlens starts, (0,) for one document.
    `window` is (left, right), with -1 for an unlimited side.
    flash-attn aligns causal and window to each document piece's bottom-right diagonal.
    """

    doc_starts: tuple[int, ...] = (0,)
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    def cu_seqlens(self, total: int) -> torch.Tensor:
        """The documents' boundaries of a `total`-token stream (int32), as flash-attn varlen takes
        them."""
        return torch.tensor([*(s for s in self.doc_starts if s < total), total], dtype=torch.int32)


FLASH_MASK_FEATURES = frozenset(
    {
        "none",
        "causal",
        "window",
        "document",
        EXPR,
        "and",
        "full",
        "per-document",
        # what `flash_mask` can express (a variant declares its part)
        WINDOW_RIGHT,
    }
)


def flash_mask(spec: MaskSpec, total: int) -> FlashMask | None:
    """The flash-attn form of a mask over `total` tokens, or None when flash-attn cannot express it.

    It takes conjunctions of full, causal, window and document leaves, and per-document masks.
    Documents intersect by the union of their starts, and windows by the smaller side.
    Causal cuts a window's right side to 0. The rules: docs/third-party.md, shared helpers.
    """
    if spec.kind != EXPR:
        if spec.kind == "document":
            return FlashMask(tuple(spec.doc_starts), spec.causal)
        if spec.kind == "window":
            return FlashMask(causal=True, window=(int(spec.window), 0))
        return FlashMask(causal=spec.kind == "causal")
    starts, causal, left, right = {0}, False, None, None

    def add(node: Expr, base: tuple[int, ...]) -> bool:
        """Fold `node` in; `base`: the document starts its positions are relative to ((0,): the
        stream)."""
        nonlocal causal, left, right
        if node.op == "and":
            return all(add(a, base) for a in node.args)
        # starts relative to each of base's documents, inside it
        if node.op in ("document", "per-document"):
            ends = (*base[1:], total)
            new = {
                b + s for b, e in zip(base, ends, strict=True) for s in node.params[0] if b + s < e
            }
            starts.update(new)
            return node.op == "document" or add(node.args[0], tuple(sorted(new | set(base))))
        if node.op == "causal":
            causal = True
            return True
        if node.op == "window":
            left = node.params[0] if left is None else min(left, node.params[0])
            right = node.params[1] if right is None else min(right, node.params[1])
            return True
        return node.op == "full"

    if not add(spec.expr, (0,)):
        return None
    if right is not None and (causal or right == 0):
        causal, right = True, 0
    window = (-1, -1)
    if left is not None:
        window = (left, -1 if right is None else right)
    return FlashMask(tuple(sorted(s for s in starts if s < max(1, total))), causal, window)


def require_flash_mask(name: str, ctx: RunContext) -> FlashMask:
    """The run's mask in flash-attn's terms, or ImplError naming the mask (a variant's declared
    masks are within what `flash_mask` expresses, so `require_supported` refuses the rest first)."""
    fm = flash_mask(ctx.mask, ctx.total_len)
    if fm is None:
        raise ImplError(f"{name}: flash-attn cannot express the mask {ctx.mask.describe()}")
    return fm


def flash_devices() -> frozenset[str]:
    """The one device a flash-attn library runs on here.

    It is cuda with a real flash-attn installed.
    Without one it is cpu, where gloo ranks install the CPU stand-in (`flash_standin`).
    """
    return frozenset({"cpu"}) if flash_standin.serves_gloo() else frozenset({"cuda"})


def flash_world_sizes(world_size: tuple[int, int], sends_to_itself: bool) -> tuple[int, int]:
    """`world_size` as declared for NCCL, starting at W=2 on gloo for self-sending libraries.

    Such a ring exchanges dk/dv once even with one rank.
    NCCL allows a send to oneself; gloo does not ("Pair is not connected").
    """
    lo, hi = world_size
    if sends_to_itself and "cpu" in flash_devices():
        return max(lo, 2), hi
    return lo, hi


def require_importable(module: str) -> None:
    """ImportError when `module` is not importable, checked without importing it.

    The registry turns that into its one-line "needs the optional extra".
    The library itself is imported inside the run, on the ranks, where the stand-in is.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def kernel_label(impl: Impl) -> str | None:
    """The flash-attn kernel this process gives `impl`, such as "cpu-standin" or "flash-attn 2.8.3".

    It applies when the impl's adapter module declares `KERNEL = "flash-attn"`, else None.
    A rank adds it to its result reply; a saved case records it under `versions: kernel`.
    """
    module = sys.modules.get(getattr(impl.run, "__module__", None) or "")
    if getattr(module, "KERNEL", None) != FLASH_KERNEL:
        return None
    return flash_standin.kernel_label()


class GatherRanks(torch.autograd.Function):
    """Every rank's equal-sized piece of x along dim 0, concatenated in group-rank order.

    Backward sums the gradient over the ranks and returns this rank's piece of it.
    """

    @staticmethod
    def forward(fctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        fctx.group, fctx.rank, fctx.n = group, dist.get_rank(group), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(fctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=fctx.group)
        return grad[fctx.rank * fctx.n : (fctx.rank + 1) * fctx.n], None


def q_prescale(softmax_scale: float, head_dim: int) -> float:
    """The factor on q that turns a library's fixed head_dim ** -0.5 into `softmax_scale`."""
    return softmax_scale * math.sqrt(head_dim)
