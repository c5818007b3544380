"""DeepSpeed ALST's Ulysses for Hugging Face models, around transformers' SDPA function.

The module is `deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF`. It runs on CPU
gloo ranks or GPUs, and is imported on the ranks only. The adapter calls it as an HF model does: HF
shapes, `position_ids`, the 4D mask dropped, one module reused across cases. docs/third-party.md
says what it reproduces of the HF path, and why.
"""

from __future__ import annotations

import torch

from harness.context import Capabilities, Impl, RunContext, RunFn
from harness.impls.adapters._common import (
    Variant,
    installed_version,
    require_importable,
    require_supported,
    variant,
)
from harness.impls.adapters.deepspeed import init_deepspeed

EXTRA = "deepspeed"

CAPABILITIES = Capabilities(
    # the gathered sequence is the ranks' shards in rank order
    layouts=frozenset({"contiguous"}),
    # the module's is_causal; HF's 4D mask is dropped
    masks=frozenset({"none", "causal"}),
    dtypes=frozenset({"fp32", "fp16", "bf16"}),
    gqa=True,
    uneven=False,  # one all-to-all split for every rank
    world_sizes=(1, 8),
    backward=True,
    returns_lse=False,
    heads_divisible_by_world=True,
)
# option: none. Let through on purpose (`Variant.lets_run`): head counts W does not divide (ALST
# replicates kv heads when W is a multiple of them, refuses the rest in its constructor), per-rank
# lengths that differ (DeepSpeed #7384's class: on gloo the shorter rank aborts in the first
# collective) and the masks the HF path drops (sliding window, packed documents)
LETS_RUN = frozenset({"heads", "uneven", "mask:window", "mask:document"})
VARIANTS = {"deepspeed-alst": Variant(CAPABILITIES, lets_run=LETS_RUN)}

# per rank: the ALST module of each (group, shape), reused
_MODULES: dict[tuple, torch.nn.Module] = {}


class HFAttention(torch.nn.Module):
    """What transformers' attention functions read from the calling attention layer."""

    def __init__(self, is_causal: bool, num_key_value_groups: int) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = num_key_value_groups


def is_causal(ctx: RunContext) -> bool:
    """The HF layer's is_causal for the case's mask: no query sees a later key."""
    m = ctx.mask
    return m.kind in ("causal", "window") or (m.kind == "document" and m.causal)


def position_ids(ctx: RunContext, batch: int) -> torch.Tensor:
    """This rank's position_ids (batch, s/W): global positions, restarting at each document."""
    pos = ctx.positions.to(torch.int64)
    if ctx.mask.kind == "document":
        starts = torch.tensor(ctx.mask.doc_starts, dtype=torch.int64)
        pos = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]
    return pos.expand(batch, -1).to(ctx.device)


def alst_module(
    ctx: RunContext, batch: int, heads_q: int, heads_kv: int, head_dim: int
) -> torch.nn.Module:
    """The rank's UlyssesSPAttentionHF for this group and shape, built on first use."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key = (ctx.group.group_name, batch, heads_q, heads_kv, head_dim)
    if key not in _MODULES:
        _MODULES[key] = UlyssesSPAttentionHF(
            attn=sdpa_attention_forward,
            batch_size=batch,
            attn_head_count=heads_q,
            attn_head_size=head_dim,
            kv_head_count=heads_kv,
            num_hidden_layers=1,
            process_group=ctx.group,
            seq_length_is_variable=True,
        )
    return _MODULES[key]


def _run(name: str, caps: Capabilities, lets_run: frozenset[str]) -> RunFn:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        require_supported(name, ctx, caps, q, k, lets_run)
        init_deepspeed(ctx.group)
        batch, local, heads_q, dim = q.shape
        uattn = alst_module(ctx, batch, heads_q, k.shape[2], dim)
        layer = HFAttention(is_causal(ctx), heads_q // k.shape[2])
        out, _ = uattn(
            layer,
            *(t.transpose(1, 2) for t in (q, k, v)),
            None,
            dropout=0.0,
            scaling=ctx.softmax_scale,
            position_ids=position_ids(ctx, batch),
        )
        return out.reshape(batch, local, heads_q, dim)

    return run


def make(name: str) -> Impl:
    """The variant behind our run signature.

    ImportError when deepspeed or transformers is not importable. The run imports the libraries
    themselves, on the ranks.
    """
    declared = variant(VARIANTS, name)
    require_importable("deepspeed")
    require_importable("transformers")
    caps = declared.capabilities
    return Impl(
        name=name,
        run=_run(name, caps, declared.lets_run),
        capabilities=caps,
        version=f"{installed_version('deepspeed')}, transformers "
        f"{installed_version('transformers')}",
    )
