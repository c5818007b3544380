"""Ring point-to-point communication: send to the next rank of the group, receive from the previous.

Peers are GLOBAL ranks (torch.distributed.get_global_rank), so a ring inside a subgroup of a
larger world talks to the right processes. Calls go through the `dist` module attribute so a
fault injector that monkeypatches torch.distributed.isend/irecv sees every transfer.
Empty tensors (zero-length shards) are never sent nor received: both sides know every rank's
length, so they skip the same transfers and the ring cannot hang on a size mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RingPeers:
    """This rank's place in the ring: group rank, group size and the neighbours' GLOBAL ranks."""

    rank: int
    world_size: int
    send_to: int
    recv_from: int


def ring_peers(group: Any, rank: int, world_size: int) -> RingPeers:
    """Neighbours of group rank `rank`, translated to global ranks for torch.distributed P2P."""
    return RingPeers(
        rank=rank,
        world_size=world_size,
        send_to=dist.get_global_rank(group, (rank + 1) % world_size),
        recv_from=dist.get_global_rank(group, (rank - 1) % world_size),
    )


class RingComm:
    """One ring channel: `exchange` posts a non-blocking send/receive pair, `wait` completes it.

    Even ranks post the send first and odd ranks the receive first, so lazily created pairwise
    communicators (NCCL) are not all waiting on each other around the ring. `tag` keeps channels
    (K/V, dk/dv) apart.
    """

    def __init__(self, group: Any, peers: RingPeers, tag: int = 0) -> None:
        self.group = group
        self.peers = peers
        self.tag = tag
        self._sends: list[Any] = []
        self._recvs: list[Any] = []

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Start sending `send` to the next rank and receiving `recv` from the previous one."""
        if self.peers.rank % 2 == 0:
            self._post_send(send)
            self._post_recv(recv)
        else:
            self._post_recv(recv)
            self._post_send(send)

    def _post_send(self, t: torch.Tensor) -> None:
        if t.numel():
            self._sends.append(
                dist.isend(t, dst=self.peers.send_to, group=self.group, tag=self.tag)
            )

    def _post_recv(self, t: torch.Tensor) -> None:
        if t.numel():
            self._recvs.append(
                dist.irecv(t, src=self.peers.recv_from, group=self.group, tag=self.tag)
            )

    def wait(self) -> None:
        """Complete every posted transfer: received data is readable, sent buffers are reusable.

        Sends are waited first, so a backend (or fault injector) that only delivers a send once it
        is waited cannot deadlock the ring.
        """
        for work in self._sends + self._recvs:
            work.wait()
        self._sends.clear()
        self._recvs.clear()

    def close(self) -> None:
        """Finish the channel; nothing may stay in flight after the ring returns."""
        self.wait()


class LocalComm(RingComm):
    """The ring of one rank (no process group): the previous and next rank are this rank."""

    def __init__(self) -> None:
        super().__init__(None, RingPeers(rank=0, world_size=1, send_to=0, recv_from=0))

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        recv.copy_(send)
