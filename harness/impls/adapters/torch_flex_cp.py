"""PyTorch's context parallelism for FlexAttention: `_ContextParallel(FLEX)` and `flex_attention`.

torch's flex CP is not a ring: it all-gathers K and V, and each rank attends with its own queries to
the whole sequence, under a BlockMask. The adapter's work is the mask: `mask_mod` evaluates our mask
language on global positions, so every mask and layout is exact. docs/third-party.md says what is
declared, and why: the backward and the compiled variant run on CUDA only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch

from harness.context import Capabilities, Impl, RunContext
from harness.impls.adapters._common import (
    Variant,
    installed_version,
    require_supported,
    require_torch_api,
    to_bhsd,
    variant,
)
from ring_impl.mask_eval import evaluate, lookups
from ring_impl.masks import MASK_FEATURES, MaskSpec

EXTRA = None  # torch itself (CUDA build for the backward)
_CAPS = Capabilities(
    # the mask reads global positions (docs/third-party.md)
    layouts=frozenset({"contiguous", "zigzag", "striped"}),
    masks=frozenset(MASK_FEATURES),  # any mask_mod: the whole language
    dtypes=frozenset({"fp16", "bf16", "fp32"}),
    gqa=True,
    uneven=False,  # all_gather_single gathers equal pieces
    world_sizes=(1, 8),
    backward=True,
    devices=frozenset({"cuda"}),  # flex_attention has no CPU backward
    returns_lse=True,
    head_dims=None,
)
VARIANTS = {
    "torch-flex-cp": Variant(_CAPS, option="eager"),
    "torch-flex-cp-compiled": Variant(
        dataclasses.replace(_CAPS, head_dims=tuple(range(16, 257))), option="compiled"
    ),
}


def _api():
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return _ContextParallel, parallelize_module, create_block_mask, flex_attention


def mask_mod(spec: MaskSpec, q_positions: torch.Tensor, kv_positions: torch.Tensor) -> Callable:
    """flex's `mask_mod` for a mask other than none.

    Query row i is global position q_positions[i], and key column j is kv_positions[j]. flex
    evaluates it under vmap on 0-d index tensors, and the compiled kernel lowers it to pointwise
    code. So it is `mask_eval.evaluate` on two 0-d positions. Its document and block tables are made
    here (`mask_eval.lookups`), not inside the function.
    """
    e = spec.expression()
    tables = lookups(e, int(kv_positions.numel()), kv_positions.device)

    def mod(b, h, q_idx, kv_idx):
        return evaluate(e, q_positions[q_idx], kv_positions[kv_idx], tables=tables)

    return mod


def block_mask(spec: MaskSpec, ctx: RunContext, compiled: bool):
    """This rank's BlockMask: its local queries against the gathered sequence, or None.

    It is None without a mask.
    """
    if spec.kind == "none":
        return None
    _, _, create_block_mask, _ = _api()
    kv_positions = torch.cat([p.to(ctx.device) for p in ctx.all_positions])
    mod = mask_mod(spec, ctx.positions.to(ctx.device), kv_positions)
    return create_block_mask(
        mod,
        None,
        None,
        int(ctx.lengths[ctx.rank]),
        ctx.total_len,
        device=ctx.device,
        _compile=compiled,
    )


# dynamo's per-function and accumulated recompile limits (default 8 and 256): one compile per mask
# and shape
RECOMPILE_LIMITS = {"recompile_limit": 1 << 16, "accumulated_recompile_limit": 1 << 16}


@contextlib.contextmanager
def _recompiles(compiled: bool) -> Iterator[None]:
    """Lift dynamo's recompile limits for a compiled run.

    Past them, it would run flex eagerly, unannounced.
    """
    if not compiled:
        yield
        return
    import torch._dynamo

    config = torch._dynamo.config
    saved = {k: getattr(config, k) for k in RECOMPILE_LIMITS if hasattr(config, k)}
    for k, v in saved.items():
        setattr(config, k, max(v, RECOMPILE_LIMITS[k]))
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)


# torch.compile(flex_attention), made once per rank process
_COMPILED: list[Callable] = []


def flex_function(compiled: bool) -> Callable:
    """flex_attention, or its compiled form (the Triton kernel on CUDA)."""
    flex = _api()[3]
    if not compiled:
        return flex
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex))
    return _COMPILED[0]


def _lse_call(flex: Callable) -> Callable:
    """flex_attention returning (out, lse), through AuxRequest where this torch has it."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9
        return lambda *a, **kw: flex(*a, return_lse=True, **kw)

    def call(*a, **kw):
        out, aux = flex(*a, return_aux=AuxRequest(lse=True), **kw)
        return out, aux.lse

    return call


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext, compiled: bool):
    """(out, lse) of torch's flex CP for local shards (batch, seq, heads, dim).

    lse is float32 (B, H, L).
    """
    from torch.distributed.device_mesh import DeviceMesh

    ContextParallel, parallelize_module, _, _ = _api()
    call = _lse_call(flex_function(compiled))

    # the module torch's ParallelStyle hooks: (query, key, value) first
    class _Flex(torch.nn.Module):
        def forward(self, query, key, value, **kw):
            return call(query, key, value, **kw)

    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
    style = ContextParallel(seq_dim=2, attention_type=ContextParallel.AttentionType.FLEX)
    module = parallelize_module(_Flex(), mesh, style)
    with _recompiles(compiled):
        out, lse = module(
            to_bhsd(q),
            to_bhsd(k),
            to_bhsd(v),
            block_mask=block_mask(ctx.mask, ctx, compiled),
            scale=ctx.softmax_scale,
            enable_gqa=q.shape[2] != k.shape[2],
        )
    return to_bhsd(out), lse.float()


def make(name: str) -> Impl:
    """torch's flex CP, eager or compiled. ImplError when this torch lacks the API."""
    declared = variant(VARIANTS, name)
    require_torch_api(name, _api)
    compiled, caps = declared.option == "compiled", declared.capabilities

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext):
        require_supported(name, ctx, caps, q, k)
        return forward(q, k, v, ctx, compiled)

    return Impl(
        name=name,
        run=run,
        capabilities=caps,
        version=f"torch {installed_version('torch')}",
        # NCCL's reduce-scatter of dK/dV; compiled: autotuning may pick another tiling
        deterministic=False,
    )
