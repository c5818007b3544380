"""`flash-ring`: a second, independent ring attention, with the arithmetic of flash kernels.

It shares no code with the reference ring (`ring_impl`). A case on which both rings disagree with
the harness thus points at the harness, not at one ring. It is also the calibration target of the
tolerance rule's flash-family floor (harness/judging/tolerance.py). docs/third-party.md says how its
buffers and peers are handled. It runs the four attention variants of docs/case-model.md (softcap,
ALiBi, learned sinks, a value head dim of its own) with its own code for each.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from harness.context import Capabilities, Impl, RunContext
from harness.errors import ImplError
from harness.impls.adapters._common import Variant, installed_version, require_supported, variant

EXTRA = None  # part of the project itself
# keys per tile of the online softmax (flash-attn uses 64-128; any size is correct)
KEY_TILE = 32
KV_TAG, DKV_TAG = 11, 12
# every layout, the original masks, dtype, uneven split and idle ranks, GQA/MQA, subgroup, the
# four variants; gloo ranks (pure torch: tested on CPU only)
VARIANTS = {
    "flash-ring": Variant(
        Capabilities(
            devices=frozenset({"cpu"}),
            returns_lse=True,
            idle_ranks=True,
            sinks=True,
            softcap=True,
            alibi=True,
            head_dim_v=True,
        )
    )
}
Shape = tuple[int, ...]


def visible(ctx: RunContext, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(Lq, Lk) bool: query at global position i may see key j (this module's own predicate)."""
    qp, kp = q_pos.view(-1, 1), k_pos.view(1, -1)
    m = ctx.mask
    if m.kind == "none":
        return torch.ones(qp.shape[0], kp.shape[1], dtype=torch.bool)
    if m.kind == "causal":
        return kp <= qp
    if m.kind == "window":
        return (kp <= qp) & (qp - kp <= int(m.window))
    if m.kind == "document":
        starts = torch.tensor(m.doc_starts, dtype=torch.long)
        same = torch.bucketize(qp, starts, right=True) == torch.bucketize(kp, starts, right=True)
        return same & (kp <= qp) if m.causal else same
    raise ImplError(f"flash-ring: unknown mask kind {m.kind!r}")


class _Block:
    """The score function of the local queries against one owner's K/V block, tile by tile.

    In fp32: s = scale * q.k, then softcap's cap * tanh(s / cap), then ALiBi's -slope_h * |p_i -
    p_j| over global positions, then -inf where the mask hides the key (docs/case-model.md).
    """

    def __init__(self, ctx: RunContext, owner: int) -> None:
        q_pos, k_pos = ctx.all_positions[ctx.rank], ctx.all_positions[owner]
        self.vis = visible(ctx, q_pos, k_pos)
        self.scale, self.cap = float(ctx.softmax_scale), ctx.softcap
        self.slopes = self.dist = None
        if ctx.alibi_slopes is not None:
            self.slopes = ctx.alibi_slopes.detach().float().view(1, -1, 1, 1)
            self.dist = (q_pos.view(-1, 1) - k_pos.view(1, -1)).abs().float()

    def scores(self, qf: torch.Tensor, k_t: torch.Tensor, start: int, stop: int):
        """(s, c) of keys start..stop, or None when no query sees them.

        c is softcap's factor 1 - tanh^2(s / cap) for the backward (None without a cap).
        """
        vis = self.vis[:, start:stop]
        if not bool(vis.any()):
            return None
        s = torch.matmul(qf, k_t.transpose(-1, -2)) * self.scale
        c = None
        if self.cap is not None:
            t = torch.tanh(s / self.cap)
            s, c = self.cap * t, 1 - t * t
        if self.slopes is not None:
            s = s - self.slopes * self.dist[:, start:stop]
        return s.masked_fill(~vis, float("-inf")), c


class _Ring:
    """Send to the next rank of the group and receive from the previous one, into fresh buffers."""

    def __init__(self, ctx: RunContext, tag: int) -> None:
        w = ctx.world_size
        self.ctx, self.tag = ctx, tag
        self.next, self.prev = (
            ctx.global_ranks[(ctx.rank + 1) % w],
            ctx.global_ranks[(ctx.rank - 1) % w],
        )
        self.works: list[Any] = []

    def post(self, send: torch.Tensor, recv_numel: int, dtype: torch.dtype) -> torch.Tensor:
        recv = torch.empty(recv_numel, dtype=dtype, device=send.device)
        if send.numel():
            self.works.append(dist.isend(send, dst=self.next, group=self.ctx.group, tag=self.tag))
        if recv_numel:
            self.works.append(dist.irecv(recv, src=self.prev, group=self.ctx.group, tag=self.tag))
        return recv

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def _heads_first(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """(B, L, H, D) -> float32 (B, H * group, L, D), each head repeated for its
    `group` query heads.
    """
    x = x.float().permute(0, 2, 1, 3)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _flat(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _split(flat: torch.Tensor, shapes: tuple[Shape, ...]) -> tuple[torch.Tensor, ...]:
    """The views of `flat` with these shapes, one after another (K and V may differ in width)."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape))
        at += n
    return tuple(out)


def _kv_shapes(
    k: torch.Tensor, v: torch.Tensor, ctx: RunContext, owner: int, heads_first: bool = False
) -> tuple[Shape, Shape]:
    """The shapes of owner's K and V blocks: (B, L, H, D) and (B, L, H, Dv), or heads first."""
    b, n, h = k.shape[0], ctx.lengths[owner], k.shape[2]
    if heads_first:
        return (b, h, n, k.shape[3]), (b, h, n, v.shape[3])
    return (b, n, h, k.shape[3]), (b, n, h, v.shape[3])


def _numel(shapes: tuple[Shape, ...]) -> int:
    return sum(math.prod(s) for s in shapes)


def _tiles(n: int):
    for start in range(0, n, KEY_TILE):
        yield start, min(n, start + KEY_TILE)


def flash_forward(q, k, v, ctx: RunContext) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, L, Hq, Dv) in q.dtype and lse (B, Hq, L) in float32: the local queries over the ring.

    K/V blocks ride the ring: at step s, rank r holds the block of owner (r - s) mod W. Within a
    block, keys are taken in tiles of KEY_TILE. One running row max m, row sum l and accumulator acc
    serve the whole ring: an online softmax, all in fp32.
    - S is `_Block.scores`: softcap and ALiBi in fp32, before the mask.
    - P = exp(S - m) in fp32, and l += rowsum(P) in fp32.
    - P is rounded to the input dtype before P @ V, which accumulates in fp32.
    - The sink joins m and l once, after the ring (`_add_sink`).
    - out = acc / l, cast to the input dtype once. lse = m + log(l) in fp32.
    """
    dtype, w, r = q.dtype, ctx.world_size, ctx.rank
    group = q.shape[2] // k.shape[2]
    qf = _heads_first(q)
    b, h, lq, _ = qf.shape
    m = torch.full((b, h, lq), float("-inf"))
    row_sum = torch.zeros(b, h, lq)
    acc = torch.zeros(b, h, lq, v.shape[-1])
    ring = _Ring(ctx, KV_TAG) if w > 1 else None
    kv = _flat(k, v)
    for step in range(w):
        owner = (r - step) % w
        if step + 1 < w:
            nxt = ring.post(kv, _numel(_kv_shapes(k, v, ctx, (owner - 1) % w)), dtype)
        k_j, v_j = _split(kv, _kv_shapes(k, v, ctx, owner))
        kf, vf = _heads_first(k_j, group), _heads_first(v_j, group)
        block = _Block(ctx, owner)
        for start, stop in _tiles(kf.shape[2]):
            scored = block.scores(qf, kf[:, :, start:stop], start, stop)
            if scored is None:
                continue
            s = scored[0]
            m_new = torch.maximum(m, s.amax(dim=-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe.unsqueeze(-1))
            alpha = torch.exp(m - safe)
            row_sum = row_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(
                p.to(dtype).float(), vf[:, :, start:stop]
            )
            m = m_new
        if step + 1 < w:
            ring.wait()
            kv = nxt
    if ctx.sinks is not None:
        m, row_sum, acc = _add_sink(ctx.sinks, m, row_sum, acc)
    empty = row_sum == 0
    out = acc / torch.where(empty, torch.ones_like(row_sum), row_sum).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m + torch.log(row_sum))
    return out.to(dtype).permute(0, 2, 1, 3).contiguous(), lse


def _add_sink(sinks: torch.Tensor, m, row_sum, acc):
    """The online softmax's state with one more key: logit sink_h, value 0. In fp32, once a row.

    A row that saw no key gets m = sink_h, l = 1 and acc = 0: out 0, lse sink_h.
    """
    sink = sinks.detach().float().view(1, -1, 1).expand_as(m)
    m_new = torch.maximum(m, sink)
    alpha = torch.exp(m - m_new)  # 0 where m is -inf: m_new is finite
    row_sum = row_sum * alpha + torch.exp(sink - m_new)
    return m_new, row_sum, acc * alpha.unsqueeze(-1)


def _block_backward(qf, dof, delta, lse_f, kf, vf, block: _Block, dq, dtype):
    """One K/V block's dk and dv per query head (fp32, dk unscaled); adds its part to dq.

    - P = exp(S - lse) in fp32, and dV += round(P)^T @ dO.
    - dP = dO @ V^T in fp32. dS = P * (dP - D), times softcap's 1 - tanh^2(s / cap), then rounded
      to the input dtype before dQ += dS @ K and dK += dS^T @ Q, which accumulate in fp32.
    """
    dk_h, dv_h = torch.zeros_like(kf), torch.zeros_like(vf)
    for start, stop in _tiles(kf.shape[2]):
        k_t, v_t = kf[:, :, start:stop], vf[:, :, start:stop]
        scored = block.scores(qf, k_t, start, stop)
        if scored is None:
            continue
        s, c = scored
        vis = block.vis[:, start:stop]
        p = torch.where(vis, torch.exp(s - lse_f), torch.zeros_like(s))
        dv_h[:, :, start:stop] += torch.matmul(p.to(dtype).float().transpose(-1, -2), dof)
        dp = torch.matmul(dof, v_t.transpose(-1, -2))
        ds = p * (dp - delta)
        ds = (ds if c is None else ds * c).to(dtype).float()
        dq += torch.matmul(ds, k_t)
        dk_h[:, :, start:stop] += torch.matmul(ds.transpose(-1, -2), qf)
    return dk_h, dv_h


def flash_backward(dout, q, k, v, out, lse, ctx: RunContext):
    """(dq, dk, dv, dsinks): q's, k's and v's in the input dtype, the sinks' in fp32 (or None).

    `out` is the dtype-rounded output, and lse the float32 one (with the sink in it).
    - D = rowsum(dO * O) in fp32, from the dtype-rounded O: the output the caller got.
    - `_block_backward` does each block, tile by tile.
    dq accumulates locally in fp32. The dk/dv accumulators travel with the ring in fp32, and make
    one more hop home. Each gradient is cast to the input dtype once.
    """
    dtype, w, r, scale = q.dtype, ctx.world_size, ctx.rank, float(ctx.softmax_scale)
    hkv, group = k.shape[2], q.shape[2] // k.shape[2]
    qf, dof = _heads_first(q), _heads_first(dout)
    # D from the dtype-rounded O, in fp32
    delta = (dof * _heads_first(out)).sum(dim=-1, keepdim=True)
    lse_f = lse.float().unsqueeze(-1)
    lse_f = torch.where(torch.isinf(lse_f), torch.zeros_like(lse_f), lse_f)
    dq = torch.zeros_like(qf)
    kv_ring = _Ring(ctx, KV_TAG) if w > 1 else None
    dkv_ring = _Ring(ctx, DKV_TAG) if w > 1 else None
    kv = _flat(k, v)
    # the accumulator of this rank's own keys: dk then dv, heads first
    dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32)
    for step in range(w):
        owner = (r - step) % w
        if step + 1 < w:
            nxt = kv_ring.post(kv, _numel(_kv_shapes(k, v, ctx, (owner - 1) % w)), dtype)
        k_j, v_j = _split(kv, _kv_shapes(k, v, ctx, owner))
        kf, vf = _heads_first(k_j, group), _heads_first(v_j, group)
        dk_h, dv_h = _block_backward(qf, dof, delta, lse_f, kf, vf, _Block(ctx, owner), dq, dtype)
        dk_acc, dv_acc = _split(dkv, _kv_shapes(k, v, ctx, owner, heads_first=True))
        b, _, n, d = dk_h.shape
        dk_acc += dk_h.view(b, hkv, group, n, d).sum(dim=2) * scale
        dv_acc += dv_h.view(b, hkv, group, n, dv_h.shape[-1]).sum(dim=2)
        # the accumulator goes on to the next rank; the previous rank's comes in
        if w > 1:
            prev = _kv_shapes(k, v, ctx, (owner - 1) % w, heads_first=True)
            incoming = dkv_ring.post(dkv, _numel(prev), torch.float32)
            dkv_ring.wait()
            dkv = incoming
        if step + 1 < w:
            kv_ring.wait()
            kv = nxt
    dk, dv = _split(dkv, _kv_shapes(k, v, ctx, r, heads_first=True))
    dq = (dq * scale).to(dtype).permute(0, 2, 1, 3)
    dsinks = None if ctx.sinks is None else _sinks_grad(ctx.sinks, lse, delta)
    return dq, dk.to(dtype).permute(0, 2, 1, 3), dv.to(dtype).permute(0, 2, 1, 3), dsinks


def _sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dsink_h = -sum of exp(sink_h - lse_i) D_i over this rank's rows and the batch, in fp32.

    exp(sink_h - lse_i) is the sink's probability in row i: its dP is 0, so its dS is -P D.
    """
    p_sink = torch.exp(sinks.detach().float().view(1, -1, 1) - lse.float())
    return -(p_sink * delta.squeeze(-1)).sum(dim=(0, 2)).to(sinks.dtype)


class _FlashRing(torch.autograd.Function):
    """The ring as one autograd node. `sinks` is an input (ctx.sinks) so that its .grad lands."""

    @staticmethod
    def forward(fctx, q, k, v, sinks, ctx):
        out, lse = flash_forward(q, k, v, ctx)
        fctx.save_for_backward(q, k, v, out, lse)
        fctx.ring_ctx = ctx
        fctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(fctx, dout, _dlse):
        q, k, v, out, lse = fctx.saved_tensors
        dq, dk, dv, dsinks = flash_backward(dout, q, k, v, out, lse, fctx.ring_ctx)
        return dq, dk, dv, dsinks, None


def make(name: str) -> Impl:
    """The flash-style ring. `name` is "flash-ring", the one entry of VARIANTS."""
    caps = variant(VARIANTS, name).capabilities

    def run(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RunContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        require_supported(name, ctx, caps, q, k)
        if ctx.world_size > 1 and ctx.group is None:
            raise ImplError(f"{name}: a ring of {ctx.world_size} ranks needs a process group")
        if q.device.type != "cpu":
            raise ImplError(f"{name}: runs on CPU tensors only (gloo ranks)")
        return _FlashRing.apply(q, k, v, ctx.sinks, ctx)

    return Impl(name=name, run=run, capabilities=caps, version=installed_version("ring-harness"))
