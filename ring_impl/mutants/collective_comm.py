"""Mutants that move the ring's blocks by collectives and break a collective's buffer promise.

Each exchange is one collective over the ring's group, so every rank makes it, empty blocks too.
Both trust a barrier where the promise needs the op's own wait. A gloo barrier finishes every
earlier op of the group, so both are right on a plain backend; only the fault stage sees them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ring_impl.comm import RingComm, RingPeers
from ring_impl.mutants.base import mutant


class AllGatherReadEarlyComm(RingComm):
    """Each exchange all-gathers every rank's block, padded to the slot; the block from the previous
    rank is copied out of the gathered buffer after a barrier, before the all-gather's wait."""

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        super().__init__(group, peers, tag)
        self._gathers: list[tuple[Any, torch.Tensor, int, torch.Tensor]] = []

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        # padded to the whole slot, one size on every rank (a prefix of it is the block)
        n, w = send.untyped_storage().nbytes() // send.element_size(), self.peers.world_size
        whole = send.new_zeros(n)
        whole[: send.numel()] = send
        gathered = torch.empty(w * n, dtype=whole.dtype, device=whole.device)
        work = dist.all_gather_into_tensor(gathered, whole, group=self.group, async_op=True)
        self._gathers.append((work, gathered, n, recv))

    def wait(self) -> None:
        if self._gathers:
            dist.barrier(group=self.group)
        prev = (self.peers.rank - 1) % self.peers.world_size
        for work, gathered, n, recv in self._gathers:
            recv.copy_(gathered[prev * n : prev * n + recv.numel()])  # read before the wait
            work.wait()
        self._gathers.clear()


class AllToAllInputReuseComm(RingComm):
    """Each exchange is one all-to-all (this rank's block to the next rank, the previous rank's into
    `recv`); the sent slot is cleared for its next use after a barrier, before the op's wait."""

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        super().__init__(group, peers, tag)
        self._swaps: list[tuple[Any, torch.Tensor]] = []

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        w, r = self.peers.world_size, self.peers.rank
        ins, outs = [0] * w, [0] * w
        ins[(r + 1) % w], outs[(r - 1) % w] = send.numel(), recv.numel()
        work = dist.all_to_all_single(recv, send, outs, ins, group=self.group, async_op=True)
        self._swaps.append((work, send))

    def wait(self) -> None:
        if self._swaps:
            dist.barrier(group=self.group)
        for work, send in self._swaps:
            send.zero_()  # the slot's next use, before the all-to-all has completed
            work.wait()
        self._swaps.clear()


all_gather_read_before_wait = mutant(
    "all-gather-read-before-wait",
    """Moves K/V (and dk/dv) by an async all-gather and copies the received block out of its output
    after a barrier, before waiting on it (issue #52: reads an all-gather's output before its wait;
    no single public report). A gloo barrier happens to finish the gather. Visible under a fault
    injector that keeps an async collective's output NaN until its wait().""",
    comm=AllGatherReadEarlyComm,
)

all_to_all_input_reuse = mutant(
    "all-to-all-input-reuse",
    """Moves K/V (and dk/dv) by an async all-to-all and clears the sent slot for reuse after a barrier,
    before the all-to-all's wait (issue #52: reuses an all-to-all's input before the work completes;
    no single public report). A gloo barrier happens to finish the op. Visible under a fault
    injector that watches a collective's input until its wait().""",
    comm=AllToAllInputReuseComm,
)
