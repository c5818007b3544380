"""PyTorch's own ring attention, driven directly on CPU gloo ranks.

It calls torch's private templated ring forward and backward with the CPU flash op.
The public `context_parallel()` runs only on CUDA, so this reaches the ring underneath.
Causal zigzag runs use torch's head-tail load balancer; other runs use the plain ring.
Torch's global CP options are set for each call and restored afterwards.
Details: docs/third-party.md, "How the adapters drive their libraries", `torch-ring`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.errors import ImplError
from harness.impls.adapters._common import Variant, require_supported, to_bhsd, variant

EXTRA = None  # torch itself
NEEDED = (
    "_templated_ring_attention",
    "_templated_ring_attention_backward",
    "_cp_options",
    "_RotateMethod",
)
MODULES = (
    "torch.distributed.tensor.experimental._context_parallel._attention",  # torch >= 2.9
    "torch.distributed.tensor.experimental._attention",  # torch 2.5 - 2.8 (a re-export later)
)
CPU_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)

_CAPS = Capabilities(
    layouts=frozenset({"contiguous", "zigzag"}),
    masks=frozenset({"none", "causal"}),
    dtypes=frozenset({"fp32", "fp16", "bf16"}),
    gqa=True,  # the CPU flash op takes fewer kv heads natively (grouped convention)
    uneven=False,  # the ring reshapes received buffers to the local shape
    world_sizes=(1, 8),
    backward=True,
    devices=frozenset({"cpu"}),
    returns_lse=True,
    # chunk(2) of a one-token shard: IndexError (odd L >= 3 works: let through, see above)
    zigzag_odd=False,
)
# option: the K/V rotation, "allgather" (torch's default: all-gather K/V once) or "alltoall"
# (permute each step)
_LETS_RUN = frozenset({"zigzag-odd"})
VARIANTS = {
    "torch-ring": Variant(_CAPS, option="allgather", lets_run=_LETS_RUN),
    "torch-ring-alltoall": Variant(_CAPS, option="alltoall", lets_run=_LETS_RUN),
}


def load_private_api() -> ModuleType:
    """The module holding torch's templated ring, or ImplError naming what this torch lacks."""
    missing: list[str] = list(NEEDED)
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        missing = [s for s in NEEDED if not hasattr(mod, s)]
        if not missing:
            rotate = getattr(mod, "_RotateMethod", None)
            if all(hasattr(rotate, m) for m in ("ALL_GATHER", "ALL_TO_ALL")):
                break
            missing = ["_RotateMethod.ALL_GATHER/ALL_TO_ALL"]
    else:
        mod = None
    ops = [op for op in CPU_OPS if not hasattr(torch.ops.aten, op)]
    if mod is None or missing or ops:
        what = ", ".join(missing + [f"aten.{op}" for op in ops])
        raise ImplError(
            f"torch-ring: unsupported torch version {torch.__version__} (missing {what})"
        )
    return mod


def load_balance(ctx: RunContext) -> bool:
    """Whether torch's head-tail load balancing is on: exactly for causal runs in zigzag layout."""
    return ctx.mask.kind == "causal" and ctx.layout == "zigzag"


def head_tail_positions(total: int, world_size: int) -> list[torch.Tensor]:
    """Global positions each rank holds under torch's head-tail load balancer (for layout
    checks)."""
    balancer = None
    for name in (
        "torch.distributed.tensor.experimental._context_parallel._load_balancer",
        "torch.distributed.tensor.experimental._attention",
    ):
        try:
            balancer = getattr(importlib.import_module(name), "_HeadTailLoadBalancer", None)
        except ImportError:
            continue
        if balancer is not None:
            break
    if balancer is None:
        raise ImplError(
            f"torch-ring: unsupported torch version {torch.__version__} (missing "
            "_HeadTailLoadBalancer)"
        )
    idx = balancer(total, world_size, "cpu")._generate_indices(restore=False)[0].long()
    return list(idx.chunk(world_size))


@contextlib.contextmanager
def torch_options(mod: ModuleType, rotate: str, balance: bool) -> Iterator[None]:
    """Set torch's global CP options for one call and restore them afterwards."""
    opts = mod._cp_options
    saved = (opts.rotate_method, opts.enable_load_balance)
    opts.rotate_method = (
        mod._RotateMethod.ALL_GATHER if rotate == "allgather" else mod._RotateMethod.ALL_TO_ALL
    )
    opts.enable_load_balance = balance
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = saved


class _TorchRing(torch.autograd.Function):
    """Forward: torch's templated ring with the CPU flash op; backward: its templated backward."""

    @staticmethod
    def forward(fctx, q, k, v, mod, group, causal, scale, rotate, balance):
        with torch_options(mod, rotate, balance):
            out, lse = mod._templated_ring_attention(
                group,
                2,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                q,
                k,
                v,
                is_causal=causal,
                dropout_p=0.0,
                scale=scale,
            )[:2]
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.args = (mod, group, causal, scale, rotate, balance)
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        q, k, v, out, lse = fctx.saved_tensors
        mod, group, causal, scale, rotate, balance = fctx.args
        with torch_options(mod, rotate, balance):
            dq, dk, dv = mod._templated_ring_attention_backward(
                group,
                2,
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=dout.contiguous(),
                grad_out_name="grad_out",
                query=q,
                key=k,
                value=v,
                out=out,
                logsumexp=lse,
                is_causal=causal,
                dropout_p=0.0,
                scale=scale,
            )[:3]
        return dq, dk, dv, None, None, None, None, None, None


def make(name: str) -> Impl:
    """torch's ring with the variant's rotation; ImplError when this torch lacks the private API."""
    declared = variant(VARIANTS, name)
    mod = load_private_api()
    rotate, caps, lets_run = declared.option, declared.capabilities, declared.lets_run

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        require_supported(name, ctx, caps, q, k, lets_run)
        if ctx.group is None:
            raise ImplError(f"{name}: needs a process group")
        qt, kt, vt = (to_bhsd(t).contiguous() for t in (q, k, v))
        out, lse = _TorchRing.apply(
            qt,
            kt,
            vt,
            mod,
            ctx.group,
            ctx.mask.kind == "causal",
            ctx.softmax_scale,
            rotate,
            load_balance(ctx),
        )
        return to_bhsd(out), lse.float()

    return Impl(name=name, run=run, capabilities=caps, version=f"torch {torch.__version__}")
