"""TE's THD context-parallel attention as the `te-cp-p2p-thd` adapter reads it, for CPU gloo ranks
(loaded as tests.helpers.te_thd:NAME): the adapter's own resharding (`te_cp.thd_run`) around a
stand-in for TE's kernel, so tests/impls/test_te_thd.py can judge the packing, padding and
resharding end to end without a GPU.

The stand-in: this rank's packed query rows (TE's dual-chunk partition, `te_cp.dual_chunk_rows`)
against the keys of every rank (all-gathered, through the adapter's autograd gather), within the
query's own sequence, causal by offset in the sequence where the mask is, never a padding row;
float32 sums, out in the input dtype. `one_short` sees every sequence one key short (the class of TE
#1930, a length-7 sequence taken as 6).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from harness.context import Impl
from harness.impls.adapters import _common, te_cp
from harness.impls.adapters._common import require_supported

CAPS = dataclasses.replace(te_cp.THD_CAPS, devices=frozenset({"cpu"}))


def _attend(ctx, qt, kt, vt, pack: te_cp.Thd, rows, short: int = 0) -> torch.Tensor:
    everyone = torch.cat(rows)
    k = kt.new_zeros(pack.total_padded, *kt.shape[1:]).index_copy(
        0, everyone, _common.GatherRanks.apply(kt, ctx.group)
    )
    v = vt.new_zeros(pack.total_padded, *vt.shape[1:]).index_copy(
        0, everyone, _common.GatherRanks.apply(vt, ctx.group)
    )
    packed = torch.arange(pack.total_padded, device=qt.device)
    cu, cu_padded = pack.cu_seqlens.long(), pack.cu_seqlens_padded.long()
    seq = torch.searchsorted(cu_padded[1:], packed, right=True)
    offset = packed - cu_padded[seq]
    real = offset < (cu[1:] - cu[:-1] - short)[seq]
    mine = rows[ctx.rank]
    seen = (seq[mine].view(-1, 1) == seq.view(1, -1)) & real.view(1, -1)
    if pack.causal:
        seen &= offset.view(1, -1) <= offset[mine].view(-1, 1)
    group = qt.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", qt.float(), k) * ctx.softmax_scale
    p = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(qt.dtype).reshape(qt.shape[0], -1)


def _run(q, k, v, ctx, short: int = 0):
    require_supported("tests-te-thd", ctx, CAPS, q, k)
    return te_cp.thd_run(
        q, k, v, ctx, functools.partial(_attend, ctx, short=short), te_cp.dual_chunk_rows
    )


standin = Impl("tests-te-thd", _run, capabilities=CAPS)
one_short = Impl("tests-te-thd-one-short", functools.partial(_run, short=1), capabilities=CAPS)
