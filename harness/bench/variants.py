"""Timing variants of the reference ring for the overlap measurement (numerically wrong on purpose).

- `no_transfers`: every hop is a local copy instead of a send/receive (each rank keeps reusing its
  own K/V buffers): the ring's compute and bookkeeping without communication.
- `transfers_only`: the real ring's sends/receives with the block kernels replaced by zero-cost
  stubs: communication (and bookkeeping) alone.
Both keep the ring's structure, masks and skip decisions, so time(ring) against time(no_transfers)
and time(transfers_only) shows how much of the communication the ring hides behind compute.
Equal shards only (a local copy cannot change a block's size).
"""

from __future__ import annotations

import dataclasses

import torch

from harness.context import Impl, RunContext
from harness.impls.adapters.reference import REFERENCE_CAPABILITIES
from ring_impl import REFERENCE_PARTS, make_ring_attention
from ring_impl.comm import LocalComm


def _local_comm(group, peers, tag: int) -> LocalComm:
    return LocalComm()


def _stub_forward(q, k, v, scale, mask=None, *, kv_heads=None):
    b, n, h, _ = q.shape
    return q.new_zeros((b, n, h, v.shape[-1]), dtype=torch.float32), q.new_zeros(
        (b, h, n), dtype=torch.float32
    )


def _stub_backward(dout, q, k, v, out, lse, scale, mask=None, *, kv_heads=None):
    f32 = torch.float32
    return (
        q.new_zeros(q.shape, dtype=f32),
        k.new_zeros(k.shape, dtype=f32),
        v.new_zeros(v.shape, dtype=f32),
    )


NO_TRANSFERS = dataclasses.replace(REFERENCE_PARTS, comm=_local_comm)
TRANSFERS_ONLY = dataclasses.replace(
    REFERENCE_PARTS, block_forward=_stub_forward, block_backward=_stub_backward
)


def _impl(name: str, parts) -> Impl:
    attn = make_ring_attention(parts)

    def run(q, k, v, ctx: RunContext):
        return attn(
            q,
            k,
            v,
            group=ctx.group,
            layout=ctx.layout,
            lengths=ctx.lengths,
            mask=ctx.mask,
            softmax_scale=ctx.softmax_scale,
            return_lse=True,
        )

    return Impl(name=name, run=run, capabilities=REFERENCE_CAPABILITIES, version="bench")


def no_transfers() -> Impl:
    """`harness.bench.variants:no_transfers`."""
    return _impl("ring-no-transfers", NO_TRANSFERS)


def transfers_only() -> Impl:
    """`harness.bench.variants:transfers_only`."""
    return _impl("ring-transfers-only", TRANSFERS_ONLY)
