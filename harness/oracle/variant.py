"""A case's attention variant as the oracle's tiles apply it: softcap, ALiBi and the sink.

Each tile's scores go through one score function, in float64 and in the base. The base rounds each
op of it as plain attention under autograd does. The sink enters each row's normaliser once, after
the online softmax. The definitions are `ring_impl.variants`'; docs/oracle.md has the roundings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.oracle.numerics import Norm, Rounder, masked, online, probs
from ring_impl.variants import alibi_bias, alibi_slopes

# a tile's global positions: (query positions, key positions), or None without ALiBi
Pos = tuple[torch.Tensor, torch.Tensor] | None


def _float32(values) -> tuple[float, ...]:
    """`values` rounded to float32, as Python floats."""
    return tuple(torch.tensor(list(values), dtype=torch.float32).double().tolist())


@dataclass(frozen=True)
class TileVariant:
    """Softcap's cap, ALiBi's slopes and the sinks, one per query head (None: off).

    The slopes and sinks hold the float32 values a ring gets (`RunContext.alibi_slopes`,
    `RunContext.sinks`)."""

    softcap: float | None = None
    slopes: tuple[float, ...] | None = None
    sinks: tuple[float, ...] | None = None

    @classmethod
    def make(
        cls,
        heads_q: int,
        softcap: float | None = None,
        alibi: bool = False,
        sinks=None,
    ) -> TileVariant:
        """The variant of a case with `heads_q` query heads; slopes and sinks rounded to
        float32."""
        slopes = _float32(alibi_slopes(heads_q)) if alibi else None
        sinks = None if sinks is None else _float32(sinks)
        return cls(None if softcap is None else float(softcap), slopes, sinks)

    @property
    def plain_scores(self) -> bool:
        return self.softcap is None and self.slopes is None

    # -- the score function -----------------------------------------------------------------

    def _bias(self, s: torch.Tensor, pos: Pos, dtype: torch.dtype) -> torch.Tensor:
        """-slope_h |p_i - p_j| in `dtype`, shaped (Hkv, g, q, k) for a tile (B, Hkv, g, q, k)."""
        qp, kp = (p.to(s.device) for p in pos)
        slopes = torch.tensor(self.slopes, dtype=torch.float64, device=s.device)
        return alibi_bias(slopes, qp, kp, dtype).view(*s.shape[1:])

    def exact(self, raw: torch.Tensor, scale: float, m, pos: Pos):
        """(scores, softcap's factor c or None) of a float64 tile from its q.k, consumed."""
        s, c = raw.mul_(scale), None
        if self.softcap is not None:
            t = s.div_(self.softcap).tanh_()
            c = 1 - t * t
            s = t.mul_(self.softcap)
        if self.slopes is not None:
            s = s.add_(self._bias(s, pos, torch.float64))
        return masked(s, m), c

    def base(self, raw: torch.Tensor, srnd: Rounder, scale: float, m, pos: Pos):
        """(scores, softcap's rounded tanh or None) of the base's tile from its q.k, consumed.

        Op by op: the scaled score rounded; softcap's divide, tanh and multiply each rounded; the
        bias made in float32, added and rounded."""
        s, t = srnd(raw.mul_(scale)), None
        if self.softcap is not None:
            t = srnd(srnd(s.div_(self.softcap)).tanh_())
            s = srnd(t * self.softcap)
        if self.slopes is not None:
            s = srnd(s.add_(self._bias(s, pos, torch.float32)))
        return masked(s, m), t

    # -- the backward of a tile --------------------------------------------------------------

    def backward(
        self, raw: torch.Tensor, dpr: torch.Tensor, m, scale: float, norm: Norm, delta, pos: Pos
    ):
        """(p, dS c, s dS c) of a float64 tile from q.k and dP = dout.v, both consumed.

        dS = p (dP - D), times softcap's factor c on its way to dq and dk."""
        return self.backward_of(self.exact(raw, scale, m, pos), dpr, scale, norm, delta)

    @staticmethod
    def backward_of(scores: tuple, dpr: torch.Tensor, scale: float, norm: Norm, delta):
        """`backward` from the tile's (scores, c) as `exact` made them, consumed."""
        s, c = scores
        p = probs(s, norm)
        ds = dpr.sub_(delta.unsqueeze(-1)).mul_(p)
        if c is not None:
            ds.mul_(c)
        return p, ds, ds * scale

    def base_backward(
        self,
        s: torch.Tensor,
        t: torch.Tensor | None,
        dp: torch.Tensor,
        rnd: Rounder,
        norm: Norm,
        delta: torch.Tensor,
        scale: float,
        srnd: Rounder,
    ):
        """(P, s dS) of the base's tile from its scores and tanh (`base`) and dP, all consumed.

        P and dS = P (dP - D) are rounded to the dtype as formed. Softcap's backward is autograd's:
        times cap, times 1 - t^2, over cap, each rounded as the scores are (`srnd`). s dS is
        rounded."""
        p = rnd(probs(s, norm))
        ds = rnd(dp.sub_(delta.unsqueeze(-1)).mul_(p))
        if t is not None:
            ds = srnd(ds.mul_(self.softcap))
            ds = srnd(ds.mul_(1 - t * t))
            ds = srnd(ds.div_(self.softcap))
        return p, rnd(ds.mul_(scale))

    # -- the sink ---------------------------------------------------------------------------

    def sink_rows(self, like: torch.Tensor) -> torch.Tensor:
        """sink_h for every row of `like` (B, Hkv, g, r), in its dtype and on its device."""
        b, hkv, g, r = like.shape
        col = torch.tensor(self.sinks, dtype=like.dtype, device=like.device)
        return col.view(1, hkv, g, 1).expand(b, hkv, g, r)

    def fold_sink(self, mx: torch.Tensor, total: torch.Tensor) -> torch.Tensor | None:
        """Fold exp(sink_h) into every row's max and sum, in place: one more key of logit sink_h
        and value 0. Returns the factor the rows' partial outputs are rescaled by (None: no
        sink)."""
        if self.sinks is None:
            return None
        _, alpha = online(mx, total, self.sink_rows(mx).unsqueeze(-1).clone(), 0, mx.shape[-1])
        return alpha


PLAIN = TileVariant()


def variant_of(case) -> TileVariant:
    """A case's variant (`harness.case.Case`: softcap, alibi, sinks)."""
    return TileVariant.make(case.heads_q, case.softcap, case.alibi, case.sinks)


def sink_grads(
    variant: TileVariant,
    norm,
    normb,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    rnd: Rounder,
) -> tuple:
    """The share's dsinks (Hq,), float64 and base, and its term scales' maxima over heads.

    dsink_h = -sum_i P_sink,i D_i over the share's rows of head h and the batch, P_sink =
    exp(sink_h - max) / sum. The base forms it as autograd's softmax backward of the sink's column:
    P_sink rounded, P_sink (0 - D) rounded, summed in float32 and rounded once. `stats`: the rows'
    (D, base D, A, sum_d |dout_id|). The terms, per head: sum_i P_sink,i |D_i|, sum_i P_sink,i A_i
    and sum_i P_sink,i sum_d |dout_id| (where a merge's error in out enters D)."""
    delta, deltab, amp, dout_l1 = stats
    ps = variant.sink_rows(delta).sub(norm[0]).exp_().div_(norm[1])
    dsinks = -(ps * delta).sum(dim=(0, 3)).reshape(-1)
    psb = rnd(variant.sink_rows(deltab).sub(normb[0]).exp_().div_(normb[1]))
    dsinksb = rnd(rnd(-(psb * deltab)).sum(dim=(0, 3)).reshape(-1))
    maxima = {
        name: float((ps * t).sum(dim=(0, 3)).max())
        for name, t in (("dsinks", delta.abs()), ("dsinks_d", amp), ("dsinks_dout", dout_l1))
    }
    return dsinks, dsinksb, maxima
