"""Mutants of the attention variants (issue #53): sinks, softcap, ALiBi, a value head dim.

Each is right on plain attention, so it survives a check with the variants switched off. Each goes
wrong the way a context-parallel library went wrong when it added the variant.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ring_impl.mutants.base import mutant
from ring_impl.parts import BlockAt
from ring_impl.ring import ring_attention
from ring_impl.variants import Scores, Variant, alibi_bias, capped


def every_step(world_size: int) -> int:
    """The sink joins a row once per ring step: W times."""
    return world_size


def no_sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The backward never differentiates the sink: its gradient is zero."""
    return torch.zeros_like(sinks)


@dataclasses.dataclass(frozen=True)
class _UnscaledCap(Scores):
    """softcap applied to q.k before the softmax scale: scale * cap * tanh(q.k / cap)."""

    scale: float = 1.0

    def apply(self, s, qs=slice(None), ks=slice(None)):
        s = capped(s / self.scale, self.variant.softcap) * self.scale
        if self.slopes is not None:
            s = s + alibi_bias(self.slopes, self.q_pos[qs], self.k_pos[ks], s.dtype).to(s.device)
        return s

    def factor(self, s):
        t = torch.tanh(s / self.scale / self.variant.softcap)
        return 1 - t * t


def unscaled_cap(variant: Variant, q_pos, k_pos, at: BlockAt, scale: float) -> Scores | None:
    fn = Scores.of(variant, q_pos, k_pos)
    if fn is None or variant.softcap is None:
        return fn
    return _UnscaledCap(fn.variant, fn.q_pos, fn.k_pos, fn.slopes, scale)


@dataclasses.dataclass(frozen=True)
class _NoCapGrad(Scores):
    """The forward caps the scores; the backward treats them as uncapped (no 1 - tanh^2)."""

    def factor(self, s):
        return None


def cap_grad_dropped(variant: Variant, q_pos, k_pos, at: BlockAt, scale: float) -> Scores | None:
    fn = Scores.of(variant, q_pos, k_pos)
    return None if fn is None else _NoCapGrad(fn.variant, fn.q_pos, fn.k_pos, fn.slopes)


def local_positions(variant: Variant, q_pos, k_pos, at: BlockAt, scale: float) -> Scores | None:
    """ALiBi from the block's local token indices, 0.. on every rank, instead of global positions."""
    q_local = torch.arange(q_pos.numel(), device=q_pos.device)
    k_local = torch.arange(k_pos.numel(), device=k_pos.device)
    return Scores.of(variant, q_local, k_local)


sink_every_step = mutant(
    "sink-every-step",
    """Adds the sink to every ring step's partial softmax instead of once per row, as a ring that
    hands the sink to each block's kernel does (TransformerEngine's p2p CP path passes per-step
    kernel arguments; MagiAttention added the sink once, in its final merge). Each row's
    denominator then holds W sinks. Visible with sinks at W >= 2 (exact at W = 1).""",
    sink_folds=every_step,
)

sink_forward_only = mutant(
    "sink-forward-only",
    """The sink is in the forward's denominator, but the backward never differentiates it: the
    sinks' gradient comes back exactly zero (TransformerEngine #2541 / PR #3551: the p2p path never
    passed the sink to its backward kernels; prime-rl PR #3397 lost it in **kwargs). Visible with
    sinks in a training call; a forward-only ring gets out and lse judged, which are right.""",
    sink_grad=no_sink_grad,
)

softcap_unscaled = mutant(
    "softcap-unscaled",
    """Applies softcap to q.k before the softmax scale, scale * cap * tanh(q.k / cap), instead of
    cap * tanh(scale * q.k / cap) (flash-attn's order, Gemma 2's definition). The two agree only
    where tanh is linear. Visible with softcap on scores that saturate.""",
    block_scores=unscaled_cap,
)

softcap_grad_dropped = mutant(
    "softcap-grad-dropped",
    """The forward caps the scores; the backward forgets tanh's derivative 1 - tanh^2 (a hand-written
    backward kernel that recomputes P from the capped scores but differentiates them as plain
    ones; there is no single public report: flash-attn's softcap backward keeps the factor, the
    class is hand-written kernels'). out and lse are right. Visible in dq and dk with softcap on
    scores that saturate.""",
    block_scores=cap_grad_dropped,
)

alibi_local_positions = mutant(
    "alibi-local-positions",
    """Computes ALiBi's bias from each rank's local token indices instead of global positions, the
    reason TransformerEngine #1046 refuses ALiBi under CP (the kernel does not know the chunk
    offsets). Right at W = 1. Visible with ALiBi at W >= 2: every block of another rank, and every
    zigzag or striped shard, gets the wrong distances.""",
    block_scores=local_positions,
)


def v_sized_like_k(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any):
    """Pads V to K's head dim for the ring (one buffer shape for both), then returns an output of
    that width: right when the head dims agree, the wrong shape otherwise (TransformerEngine #2868
    reshapes the output with V's layout taken from K and crashes under CP with MLA's head dims).
    Visible with a value head dim of its own."""
    if v.shape[-1] < k.shape[-1]:
        pad = k.shape[-1] - v.shape[-1]
        v = torch.nn.functional.pad(v, (0, pad))
    elif v.shape[-1] > k.shape[-1]:
        v = v[..., : k.shape[-1]]
    return ring_attention(q, k, v, **kw)


value_buffers_sized_by_head_dim = v_sized_like_k
value_buffers_sized_by_head_dim.__name__ = "value_buffers_sized_by_head_dim"
