"""Rings whose bug has one known trigger, for the failure groups' experiments (issue #52).

Each is the reference ring with one bug, loaded as `tests.helpers.known_triggers:NAME`:
- `past_two_ranks`: the forward stops after two ring steps, so it is wrong exactly when W >= 3;
- `backward_only`: dv comes back twice too large; the forward is exact;
- `fp16_only`: the fp16 path stops one ring step early; bf16 and fp32 are exact;
- `zigzag_only`: the zigzag path returns its two chunks' outputs in the wrong order;
- `dkv_wrong_neighbour`: issue #52's third-party ring. Its dK/dV accumulators ride the ring the
  wrong way, so gradients are wrong at W >= 3 only. It declares what that ring did: the contiguous
  layout, no mask, fp16 and bf16, even splits
  (an uneven one makes its ranks' receives the wrong size: gloo aborts).
"""

from __future__ import annotations

import dataclasses

import torch

from harness.context import Capabilities, Impl
from ring_impl.comm import RingComm
from ring_impl.kernel import block_backward
from ring_impl.masks import MASK_FEATURES
from ring_impl.ring import DKV_TAG, REFERENCE_PARTS, make_ring_attention
from tests.helpers.impls import call_ring as _call

# what the reference declares: no probes of undeclared features
FULL = Capabilities(masks=frozenset(MASK_FEATURES), idle_ranks=True, returns_lse=True)
ISSUE_52 = Capabilities(
    layouts=frozenset({"contiguous"}),
    masks=frozenset({"none"}),
    dtypes=frozenset({"fp16", "bf16"}),
    uneven=False,
    returns_lse=True,
)


def _ring(**parts):
    return make_ring_attention(dataclasses.replace(REFERENCE_PARTS, **parts))


_REFERENCE = _ring()
_TWO_STEPS = _ring(steps=lambda w: min(w, 2))
_ONE_SHORT = _ring(steps=lambda w: w - 1)


def _dv_twice(*args, **kw):
    dq, dk, dv = block_backward(*args, **kw)
    return dq, dk, dv * 2


def _reversed_dkv(group, peers, tag):
    """The dK/dV channel sends to the previous rank: the same ring at W = 2, the wrong one above."""
    if tag == DKV_TAG:
        peers = dataclasses.replace(peers, send_to=peers.recv_from, recv_from=peers.send_to)
    return RingComm(group, peers, tag)


_DV_TWICE = _ring(block_backward=_dv_twice)
_WRONG_NEIGHBOUR = _ring(comm=_reversed_dkv)


def _fp16_only(q, k, v, ctx):
    return _call(_ONE_SHORT if q.dtype == torch.float16 else _REFERENCE, q, k, v, ctx)


def _zigzag_only(q, k, v, ctx):
    out, lse = _call(_REFERENCE, q, k, v, ctx)
    if ctx.layout != "zigzag" or out.shape[1] < 2:
        return out, lse
    half = (out.shape[1] + 1) // 2
    return torch.cat([out[:, half:], out[:, :half]], dim=1), lse


past_two_ranks = Impl(
    "tests-past-two-ranks", lambda q, k, v, ctx: _call(_TWO_STEPS, q, k, v, ctx), FULL
)
backward_only = Impl(
    "tests-backward-only", lambda q, k, v, ctx: _call(_DV_TWICE, q, k, v, ctx), FULL
)
fp16_only = Impl("tests-fp16-only", _fp16_only, FULL)
zigzag_only = Impl("tests-zigzag-only", _zigzag_only, FULL)
dkv_wrong_neighbour = Impl(
    "tests-dkv-wrong-neighbour",
    lambda q, k, v, ctx: _call(_WRONG_NEIGHBOUR, q, k, v, ctx),
    ISSUE_52,
)
