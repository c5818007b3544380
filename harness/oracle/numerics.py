"""The arithmetic of one tile: head layouts, the base's roundings and the softmax.

Float64 and the base are computed side by side. The float64 side is exact up to float64 rounding.
The base rounds to the case's dtype where plain attention under autograd rounds. docs/oracle.md
lists those roundings and why both passes must form each tile alike. A tile's score function and
its backward are `harness.oracle.variant`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Rounder = Callable[[torch.Tensor], torch.Tensor]


def amax(t: torch.Tensor) -> float:
    """max |t|, 0 for an empty tensor."""
    return float(t.abs().max()) if t.numel() else 0.0


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def rounder(dtype: torch.dtype) -> Rounder:
    """Round float32 values to `dtype`, kept in float32 (identity for float32)."""
    if dtype == torch.float32:
        return _same
    return lambda t: t.to(dtype).to(torch.float32)


def load(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inputs rounded to the case's dtype, held in float64 (exact)."""
    return t.detach().to(dtype).to(torch.float64)


# -- layouts --------------------------------------------------------------------------------


def group_heads(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """Queries (B, r, Hq, D) -> (B, Hkv, g, r, D), contiguous: query head h belongs to kv head
    h // g."""
    b, r, hq, d = t.shape
    return t.reshape(b, r, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4).contiguous()


def ungroup_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, g, r, D) -> (B, r, Hq, D)."""
    b, hkv, g, r, d = t.shape
    return t.permute(0, 3, 1, 2, 4).reshape(b, r, hkv * g, d)


def kv_heads(t: torch.Tensor) -> torch.Tensor:
    """Keys (B, c, Hkv, D) -> (B, Hkv, c, D), contiguous."""
    return t.permute(0, 2, 1, 3).contiguous()


def keys_t(k: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, c, D) -> (B, Hkv, 1, D, c): the right operand of a score matmul, broadcast over the
    group."""
    return k.unsqueeze(2).transpose(-1, -2)


def keys_side(t: torch.Tensor) -> torch.Tensor:
    """A tile (B, Hkv, g, q, k) as (B, Hkv, k, g q): the left operand of a key gradient. The group's
    query heads are summed inside the one matmul."""
    b, hkv, g, r, c = t.shape
    return t.permute(0, 1, 4, 2, 3).reshape(b, hkv, c, g * r)


# -- the base's roundings -------------------------------------------------------------------


def masked(s: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Scores with what the tile's mask hides set to -inf, in place (no mask: unchanged)."""
    return s if m is None else s.masked_fill_(~m, float("-inf"))


def lo_matmul(dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The base's q.k or dout.v, float32 out.

    A matmul of dtype values, summed in float32 as a dtype kernel does and rounded to the dtype
    once. `a` and `b` are contiguous, in the dtype for bf16, else float32. Both passes compute each
    tile with the same operands, shapes and layout, so it rounds alike in both (docs/oracle.md)."""
    c = torch.matmul(a, b)
    if dtype == torch.bfloat16:
        return c.float()
    if dtype == torch.float32:
        return c
    return c.to(dtype).float()  # fp16: CPU fp16 matmuls are ~15x slower


def operands(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64, the base's matmul operand) of a tile's inputs, contiguous: a canonical layout for
    `lo_matmul`."""
    t = t.contiguous()
    return t, t.to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


@dataclass(frozen=True)
class ScoreRounding:
    """How the base forms its scores.

    As plain attention does: q.k and the scaled scores rounded to the dtype. For values on which
    plain attention overflows (`harness.inputs.FLASH_BASE_VALUES`): kept in float32, as flash
    kernels keep them."""

    dtype: torch.dtype
    exact: bool = False

    def qk(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.float(), b.float()) if self.exact else lo_matmul(self.dtype, a, b)

    def scores(self) -> Rounder:
        return rounder(torch.float32 if self.exact else self.dtype)


# -- the softmax -------------------------------------------------------------------------

Norm = tuple  # (shift, denominator) of every row of a tile: (B, Hkv, g, q) each (`normaliser`)


def normaliser(mx: torch.Tensor, total: torch.Tensor) -> Norm:
    """A softmax's normalisation from the row max of the scores and the sum of exp(s - max).

    (max, sum), or (+inf, 1) for a row that sees no key: its p is then exp(-inf) = 0, never NaN."""
    empty = total <= 0
    return (
        torch.where(empty, torch.full_like(mx, float("inf")), mx),
        torch.where(empty, torch.ones_like(total), total),
    )


def norm_rows(norm: Norm, a: int, z: int) -> Norm:
    """Rows a:z of a normalisation."""
    return norm[0][..., a:z], norm[1][..., a:z]


def probs(s: torch.Tensor, norm: Norm) -> torch.Tensor:
    """p = exp(s - max) / sum in place, as a softmax forms it. exp(s - lse) would err by eps |lse|
    in float32."""
    shift, denom = norm
    return s.sub_(shift.unsqueeze(-1)).exp_().div_(denom.unsqueeze(-1))


def online(
    mx: torch.Tensor, total: torch.Tensor, s: torch.Tensor, a: int, z: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a tile's scores into rows a:z's running max and sum of exp(s - max).

    Returns exp(s - new max), in place of s, and the factor the rows' earlier partial sums are
    rescaled by."""
    new = torch.maximum(mx[..., a:z], s.amax(dim=-1))
    shift = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    alpha = (mx[..., a:z] - shift).exp_()
    p = s.sub_(shift.unsqueeze(-1)).exp_()
    total[..., a:z] = total[..., a:z] * alpha + p.sum(-1)
    mx[..., a:z] = new
    return p, alpha
