"""PyTorch's public context parallelism, `context_parallel(mesh, buffers=...)` with SDPA.

It runs on CUDA/NCCL. Inside the context, SDPA's CUDA ops dispatch to torch's ring. The harness
calls backward after `run` returns, outside the context. So a custom autograd Function records
SDPA's graph inside the context and replays its backward inside a fresh one. docs/third-party.md
says how torch shards, and why only fp16 and bf16 at flash head dims are declared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.errors import ImplError
from harness.impls.adapters._common import (
    FLASH_HEAD_DIMS,
    Variant,
    installed_version,
    require_supported,
    require_torch_api,
    to_bhsd,
    variant,
)
from harness.impls.adapters.torch_ring import load_balance

EXTRA = None  # torch itself (CUDA build)
_CAPS = Capabilities(
    layouts=frozenset({"contiguous", "zigzag"}),
    masks=frozenset({"none", "causal"}),
    # fp32 goes to the efficient kernel: a padded lse (docs/third-party.md)
    dtypes=frozenset({"fp16", "bf16"}),
    # the CP handlers take the flash / efficient ops, which get equal head counts
    gqa=False,
    uneven=False,
    world_sizes=(1, 8),
    backward=True,
    devices=frozenset({"cuda"}),
    returns_lse=False,
    # what SDPA's flash kernel takes; others fall back to the efficient one
    head_dims=FLASH_HEAD_DIMS,
    # torch load-balances only a sequence divisible by 2W: two equal chunks per rank
    zigzag_odd=False,
)
# option: torch's `set_rotate_method` argument, "allgather" (its default) or "alltoall"
VARIANTS = {
    "torch-cp": Variant(_CAPS, option="allgather"),
    "torch-cp-alltoall": Variant(_CAPS, option="alltoall"),
}


def _api():
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    return context_parallel, _cp_options, set_rotate_method


@contextlib.contextmanager
def cp_context(ctx: RunContext, rotate: str) -> Iterator[None]:
    """The CP context for this run's mesh, rotation and load balancing. It checks the sharding."""
    from torch.distributed.device_mesh import DeviceMesh

    context_parallel, opts, set_rotate_method = _api()
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    saved = (opts.rotate_method, opts.enable_load_balance)
    set_rotate_method(rotate)
    opts.enable_load_balance = load_balance(ctx)
    positions = torch.arange(ctx.total_len, device=ctx.device).view(1, -1)
    try:
        with context_parallel(
            mesh, buffers=[positions], buffer_seq_dims=[1], no_restore_buffers={positions}
        ):
            # without a mask the result does not depend on which rank holds which token
            # (docs/third-party.md)
            if ctx.mask.is_causal and not torch.equal(
                positions.view(-1).cpu(), ctx.positions.cpu()
            ):
                raise ImplError(
                    f"torch-cp: torch sharded rank {ctx.rank} as "
                    f"{positions.view(-1).tolist()[:8]}..., "
                    f"not as layout {ctx.layout}"
                )
            yield
    finally:
        opts.rotate_method, opts.enable_load_balance = saved


def _sdpa(q, k, v, ctx: RunContext):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        # looked up at call time: the context replaces F.scaled_dot_product_attention
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=ctx.mask.kind == "causal", scale=ctx.softmax_scale
        )


class _TorchCP(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, ctx, rotate):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            with cp_context(ctx, rotate):
                out = _sdpa(*leaves, ctx)
        fctx.graph = (leaves, out, ctx, rotate)
        return out.detach()

    @staticmethod
    def backward(fctx, dout):
        leaves, out, ctx, rotate = fctx.graph
        with cp_context(ctx, rotate):
            grads = torch.autograd.grad(out, leaves, dout)
        return (*grads, None, None)


def make(name: str) -> Impl:
    """torch's public CP with the variant's rotation. ImplError when this torch lacks the API."""
    declared = variant(VARIANTS, name)
    require_torch_api(name, _api)
    rotate, caps = declared.option, declared.capabilities

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k)
        out = _TorchCP.apply(to_bhsd(q), to_bhsd(k), to_bhsd(v), ctx, rotate)
        return to_bhsd(out)

    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=f"torch {installed_version('torch')}",
        deterministic=False,
    )
