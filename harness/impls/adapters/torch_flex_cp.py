"""PyTorch's context parallelism for FlexAttention: `_ContextParallel(FLEX)` + `flex_attention` + a
BlockMask.

torch's flex CP (torch >= 2.9, `torch/distributed/tensor/experimental/_context_parallel/`) is not a
ring: a forward pre-hook (`_ContextParallel.flex_input_fn`) all-gathers K and V over the CP group
(`cplib::flex_cp_allgather`, whose backward reduce-scatters dK and dV), and each rank runs
`flex_attention` for its own queries against the whole sequence, under a BlockMask for its local
query rows.

The mask is where this adapter does its work. flex takes any mask as a `mask_mod(b, h, q_idx,
kv_idx)`, so the whole mask language is declared (every primitive, combinator, two-sided windows):
`mask_mod` below is `ring_impl.mask_eval.evaluate` on two 0-d global positions, local query row i at
`ctx.positions[i]` and gathered key column j at the j-th position of the ranks' positions
concatenated in group-rank order (the all-gather's order), so every layout (contiguous, zigzag,
striped) is exact. Its document and block tables are made once (`mask_eval.lookups`): a tensor made
inside a mask_mod, a view or an expand does not lower in the compiled kernel (inductor's
LoweringException on CPU, torch 2.13). torch's own `_create_cp_block_mask` is not used: it needs
Q_LEN divisible by W * 128 (its NotImplementedError) and knows only its contiguous and head-tail
orders, while our cases have any length.

What is declared, and why (read from torch 2.13's source):
- devices cuda only: `flex_attention` refuses backward on CPU ("FlexAttention does not support
  backward on CPU", `_validate_device`), so gloo ranks can run only the forward.
  tests/impls/test_torch_flex_cp.py runs that forward on CPU gloo ranks against the float64 oracle,
  every layout and mask family; the backward (the reduce-scatter and flex's gradients) runs on CUDA
  only and has not been run here.
- equal shards (`uneven=False`, no idle rank): `funcol.all_gather_single` gathers equal-sized
  pieces.
- GQA: `enable_gqa=True` uses the grouped convention (query head i reads kv head i // G), ours.
- lse: `return_aux=AuxRequest(lse=True)` (natural log; rows that see nothing get -inf and out 0, our
  convention), handed on as float32; torch releases before AuxRequest take `return_lse=True`.
- Two variants: "torch-flex-cp" runs `flex_attention` eagerly (on CUDA torch's math path, which
  materialises each rank's (L/W, L) scores: CP plumbing and mask mapping, not the kernel);
  "torch-flex-cp- compiled" runs it under `torch.compile`, the Triton kernel users ship, which needs
  head_dim >= 16 ("NYI: embedding dimension ... must be at least 16",
  torch/_inductor/kernel/flex/flex_attention.py) and compiles once per mask and shape: its block
  mask is compiled too (`create_block_mask(_compile=True)`), and dynamo's recompile limit is lifted
  for the run so that a long check keeps testing the kernel instead of falling back to eager after 8
  masks. Compilation can take tens of seconds a case: give the check a `--deadline` to match. On CPU
  inductor (forward only, no lse there) the compiled block mask and kernel agree with eager (the
  slow-tier test); the Triton kernel has not been run here.
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
    # the mask reads global positions (docstring)
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
    """flex's `mask_mod` for a mask (not kind none): query row i is global position q_positions[i],
    key column j is kv_positions[j]. flex evaluates it under vmap on 0-d index tensors, and the
    compiled kernel lowers it to pointwise code: `mask_eval.evaluate` on two 0-d positions, with its
    document and block tables made here (`mask_eval.lookups`), not inside the function."""
    e = spec.expression()
    tables = lookups(e, int(kv_positions.numel()), kv_positions.device)

    def mod(b, h, q_idx, kv_idx):
        return evaluate(e, q_positions[q_idx], kv_positions[kv_idx], tables=tables)

    return mod


def block_mask(spec: MaskSpec, ctx: RunContext, compiled: bool):
    """This rank's BlockMask: its local queries against the gathered sequence; None without a
    mask."""
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
    """Lift dynamo's recompile limits for a compiled run: past them it would run flex eagerly,
    unannounced."""
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


_COMPILED: list[Callable] = []  # torch.compile(flex_attention), made once per rank process


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
    """(out, lse) of torch's flex CP for local shards (batch, seq, heads, dim); lse float32 (B, H,
    L)."""
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
    """torch's flex CP, eager or compiled; ImplError when this torch lacks the API."""
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
