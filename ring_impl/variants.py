"""The attention variants models run: softcap, ALiBi, learned sinks and a value head dim of its own.

A variant changes the score of a query-key pair, or adds a sink to every row's softmax. The score
of query i (global position p_i) and key j (p_j) of head h is

    s = scale * q.k;  s = cap * tanh(s / cap) (softcap);  s = s - slope_h * |p_i - p_j| (ALiBi)

and a sink adds exp(sink_h) to the row's denominator, once. Both the reference ring and the float64
oracle read this module, so the definition lives once. docs/case-model.md has the derivation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slopes for `heads` heads: the paper's geometric series (Press et al., 2022).

    For a power of two n: 2^(-8 (h + 1) / n). Otherwise the slopes of the nearest lower power of
    two m, then every other slope of 2m, as the paper's reference code does.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    if heads < 1:
        raise ValueError(f"ALiBi needs at least one head, got {heads}")
    m = 1 << (heads.bit_length() - 1)
    if m == heads:
        return power_of_two(heads)
    return power_of_two(m) + power_of_two(2 * m)[0::2][: heads - m]


@dataclass(frozen=True)
class Variant:
    """The score function's settings: softcap's cap and ALiBi's slopes (one per query head)."""

    softcap: float | None = None
    alibi: tuple[float, ...] | None = None

    @property
    def plain(self) -> bool:
        return self.softcap is None and self.alibi is None


PLAIN = Variant()


def capped(s: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(s / cap), or s unchanged without a cap."""
    return s if cap is None else torch.tanh(s / cap) * cap


def cap_factor(s: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """d(capped s) / ds = 1 - tanh^2(s / cap), from the scores before the cap; None without a cap."""
    if cap is None:
        return None
    t = torch.tanh(s / cap)
    return 1 - t * t


def alibi_bias(
    slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """-slope_h * |p_i - p_j| as (Hq, Lq, Lk) in `dtype`, from global positions."""
    dist = (q_pos.view(-1, 1) - k_pos.view(1, -1)).abs().to(dtype)
    return -slopes.to(dtype).view(-1, 1, 1) * dist


@dataclass(frozen=True)
class Scores:
    """One block's score function for the kernel: the variant and the block's global positions.

    `apply(s, qs, ks)` turns scaled scores (B, Hq, tq, tk) of query tile qs and key tile ks into
    the variant's scores. `factor(s, qs, ks)` is the derivative of that map at s (None: 1).
    """

    variant: Variant
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    slopes: torch.Tensor | None = None

    @classmethod
    def of(cls, variant: Variant, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Scores | None:
        """The block's score function, or None for plain attention (the kernel's fast path)."""
        if variant.plain:
            return None
        slopes = None if variant.alibi is None else torch.tensor(variant.alibi, dtype=torch.float64)
        return cls(variant, q_pos, k_pos, slopes)

    def apply(self, s: torch.Tensor, qs: slice = slice(None), ks: slice = slice(None)):
        s = capped(s, self.variant.softcap)
        if self.slopes is not None:
            bias = alibi_bias(self.slopes, self.q_pos[qs], self.k_pos[ks], s.dtype)
            s = s + bias.to(s.device)
        return s

    def factor(self, s: torch.Tensor) -> torch.Tensor | None:
        return cap_factor(s, self.variant.softcap)


ScoreFn = Callable[[torch.Tensor, slice, slice], torch.Tensor]


def sink_lse(sinks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The sink as a block's lse: sink_h for every row, shaped like an lse (B, Hq, L)."""
    return sinks.to(like.dtype).to(like.device).view(1, -1, 1).expand_as(like)


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sink_h = -sum over rows of exp(sink_h - lse_i) * D_i, for these rows.

    `lse` is the rows' lse with the sink in it and `delta` their D = rowsum(dout * out), both
    (B, Hq, L). Rows with lse -inf (no key, no sink) contribute nothing.
    """
    w = torch.exp(sink_lse(sinks, lse) - lse)
    w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
    return -(w * delta).sum(dim=(0, 2))


def finite_sinks(values: tuple[float, ...]) -> bool:
    """Whether every sink logit is a finite number."""
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in values)
