"""Mutants in the ring's communication: peers, wait order, buffer reuse, number of steps."""

from __future__ import annotations

from typing import Any

from ring_impl.comm import RingComm, RingPeers
from ring_impl.mutants.base import mutant


def group_ranks_as_peers(group: Any, rank: int, world_size: int) -> RingPeers:
    """Uses group-local ranks as P2P peers; torch.distributed wants global ranks."""
    return RingPeers(
        rank=rank,
        world_size=world_size,
        send_to=(rank + 1) % world_size,
        recv_from=(rank - 1) % world_size,
    )


class ReadBeforeWaitComm(RingComm):
    """wait() completes only the PREVIOUS exchange, so each received block is read before its
    wait."""

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        super().__init__(group, peers, tag)
        self._late: list[Any] = []

    def wait(self) -> None:
        for work in self._late:
            work.wait()
        self._late = self._sends + self._recvs
        self._recvs, self._sends = [], []

    def close(self) -> None:
        self.wait()
        self.wait()


class SendBufferReuseComm(RingComm):
    """wait() completes the receives but each send one step late: the double buffer's next receive
    is posted into a slot whose send has not completed."""

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        super().__init__(group, peers, tag)
        self._late_sends: list[Any] = []

    def wait(self) -> None:
        for work in self._late_sends + self._recvs:
            work.wait()
        self._late_sends, self._recvs, self._sends = self._sends, [], []

    def close(self) -> None:
        self.wait()
        self.wait()


group_local_peer = mutant(
    "group-local-peer",
    """Sends to / receives from group-local ranks as if they were global ranks (ring-flash-attention
    commit 7895974). Visible only inside a subgroup that is not ranks 0..W-1 of the world (e.g.
    global ranks 2..5): raises, hangs or talks to the wrong process.""",
    peers=group_ranks_as_peers,
)

read_before_wait = mutant(
    "read-before-wait",
    """Computes on each received K/V (and dk/dv) buffer before waiting for its receive; the wait comes
    one step later (no single public report). Visible under a fault injector that fills receive
    buffers with NaN until wait(); on a plain backend it is a data race.""",
    comm=ReadBeforeWaitComm,
)

send_buffer_overwrite = mutant(
    "send-buffer-overwrite",
    """Waits for each send one step late, so the next receive overwrites a double-buffer slot that is
    still being sent (no single public report). Visible under a fault injector that sends the
    buffer's content at completion (forward needs W >= 3; the dk/dv ring shows it at W >= 2).""",
    comm=SendBufferReuseComm,
)

skipped_ring_step = mutant(
    "skipped-ring-step",
    """Runs W - 1 ring steps (W - 2 K/V hops), an off-by-one in the loop bound (no single public
    report): every rank misses the block of owner rank + 1. Visible with W >= 2 whenever that block
    is not fully masked.""",
    steps=lambda world_size: max(world_size - 1, 1),
)
