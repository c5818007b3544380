"""Mutants for `ring-harness profile`, never for `check`: right numbers, broken promises.

Each returns exactly the reference's numbers. What breaks is a promise of ring attention: memory
O(n/W) per rank, compute that hides the transfers, one message per hop. PROFILE_MUTANTS maps a
name to each; `mutant:NAME` resolves them too. Selftest does not run them: `check` cannot and must
not tell them from the reference. Even splits only (the all-gather needs equal shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ring_impl.comm import RingComm, RingPeers
from ring_impl.mutants.base import mutant
from ring_impl.ring import KV_TAG


class WaitingComm(RingComm):
    """Waits for each transfer right after posting it: no compute overlaps any hop."""

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        super().exchange(send, recv)
        super().wait()


class SplitHopsComm(RingComm):
    """Sends K and V as two separate hops, each waited before the next: two messages a step."""

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        half = send.numel() // 2  # a flat K/V block: K, then V of the same size
        for a, b in ((send[:half], recv[:half]), (send[half:], recv[half:])):
            super().exchange(a, b)
            super().wait()


class AllGatherKV(RingComm):
    """The K/V channel as one all-gather: the first exchange gathers every rank's block, later
    ones copy the next owner's from that copy. Every block stays alive: O(n) per rank."""

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        super().__init__(group, peers, tag)
        self.blocks: list[torch.Tensor] = []
        self.calls = 0

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        if not self.blocks:
            self.blocks = [torch.empty_like(send) for _ in range(self.peers.world_size)]
            dist.all_gather(self.blocks, send.contiguous(), group=self.group)
        self.calls += 1
        recv.copy_(self.blocks[(self.peers.rank - self.calls) % self.peers.world_size])

    def wait(self) -> None:
        return None


def all_gather_kv(group: Any, peers: RingPeers, tag: int) -> RingComm:
    """K/V by all-gather; the dk/dv accumulators still ride the ring (they add up on the way)."""
    return AllGatherKV(group, peers, tag) if tag == KV_TAG else RingComm(group, peers, tag)


wait_before_compute = mutant(
    "wait-before-compute",
    """Waits for every K/V and dk/dv transfer as soon as it is posted, then computes: the ring's
    compute never hides a transfer. Right numbers; visible to `profile` only, as "waits before
    computing" in both phases.""",
    comm=WaitingComm,
)

split_unbatched_hops = mutant(
    "split-unbatched-hops",
    """Sends K and V in two separate hops per ring step, each waited at once: twice the messages of
    one batched hop, and no overlap. Right numbers; visible to `profile` only (messages per hop,
    overlap).""",
    comm=SplitHopsComm,
)

all_gather_kv_ring = mutant(
    "all-gather-kv",
    """Gathers every rank's K and V with one all-gather, then computes block by block: correct,
    but O(n) memory per rank, the "V2 collective" of the ring attention texts. Right numbers;
    visible to `profile` only, as memory that grows with W at a fixed length a rank.""",
    comm=all_gather_kv,
)

PROFILE_MUTANTS: dict[str, Callable[..., Any]] = {
    fn.__name__.replace("_", "-"): fn
    for fn in (wait_before_compute, split_unbatched_hops, all_gather_kv_ring)
}

__all__ = ["PROFILE_MUTANTS"]
