"""PyTorch's public context parallelism: `context_parallel(mesh, buffers=...)` + SDPA (CUDA/NCCL).

Inside the context, `F.scaled_dot_product_attention` takes local shards (batch, heads, seq, dim),
wraps them as DTensors sharded on the sequence and dispatches SDPA's CUDA flash / efficient ops to
torch's ring. Sharding: with `_cp_options.enable_load_balance` and a sequence divisible by 2W,
torch's head-tail balancer gives rank r chunks r and 2W-1-r (our "zigzag"); otherwise plain
`Shard(seq)` (our "contiguous"). Load balancing exists only for causal SDPA. The context also
shards one buffer we pass (the global positions), which checks torch's sharding against our layout.

The DTensor dispatch is only active inside the context, but the harness calls backward after
`run` returns; so a custom autograd Function records SDPA's graph inside the context and replays
its backward inside a fresh context (torchtitan runs forward and backward in one context).

What is declared, and why (read from torch 2.13's `torch/distributed/tensor/experimental/
_context_parallel/`; GPU-only, not run here):
- zigzag with no mask. torch balances load only for causal SDPA (`_templated_ring_attention` raises
  "Load balancing requires `is_causal=True`" otherwise, _attention.py:405), so a non-causal run is
  sharded plainly and the sharding check used to refuse every zigzag run without a mask. But the
  adapter hands SDPA our local shards directly, and without a mask every query attends to every key
  whatever rank holds it: the plain ring is exact for zigzag shards too (as in `torch_ring`). The
  sharding check is therefore made only for causal runs, where the positions matter.
- zigzag needs an even per-rank length: torch load-balances only when the sequence divides by 2W
  (`_create_default_load_balancer`, _load_balancer.py:475); otherwise it shards contiguously and the
  sharding check would refuse the run. Declared: `zigzag_odd=False` (the case side adapts odd
  lengths up to even ones; a run is refused with one line before it reaches torch).
- fp16/bf16 only, head_dim a multiple of 8 up to 256: then SDPA picks the flash kernel, whose lse is
  (B, H, L). fp32 (and head dims flash refuses) go to the memory-efficient kernel, whose lse is
  padded to ceil(L/32)*32 (`meta__scaled_dot_product_efficient_attention`,
  torch/_meta_registrations.py: 6523; CUDA's kAlignLSE = 32). `_SDPAMerger._merge_one`
  (_attention.py:151-207) unsqueezes that lse to (B, H, Lpad, 1) and merges it with outputs (B, H,
  L, D): from the second ring step on this raises for 1 < L, L % 32 != 0, broadcasts out to 32 rows
  for L == 1 (a wrong shape), and with load balancing `lse.chunk(2)` halves the padded lse, not the
  rows, unless L % 64 == 0. So fp32 is not declared (tests/impls/test_torch_cp_lse_padding.py runs
  torch's own merger on such shapes on CPU).
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
    dtypes=frozenset({"fp16", "bf16"}),  # fp32 goes to the efficient kernel: padded lse (docstring)
    gqa=False,  # the CP handlers take the flash / efficient ops, which get equal head counts
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
    """torch's CP context for this run's mesh, rotation and load balancing; checks the sharding."""
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
            # without a mask the result does not depend on which rank holds which token (docstring)
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
    """torch's public CP with the variant's rotation; ImplError when this torch lacks the API."""
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
