"""Whether compute hides the transfers: the FLOPs a rank computes between posting each receive and
waiting on it.

A ring posts the next block's transfer, computes the current block, then waits: every receive but
the last of a channel has a block's FLOPs between its post and its wait. A ring that waits right
after posting has none. The count is deterministic on any device: it reads the order of events,
not their times (harness.ranks.instrument). A blocking collective is posted and waited at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.profiling.measure import CallProfile

RECEIVES = ("irecv", "recv")
SENDS = ("isend", "send")
OVERLAPPED = 0.5  # at least this share of a phase's receives hide compute: overlapped


@dataclass
class PhaseOverlap:
    """One phase over every rank: its receives, and how many had compute while in flight."""

    phase: str
    receives: int = 0
    hidden: int = 0

    @property
    def verdict(self) -> str:
        if not self.receives:
            return "no communication"
        if self.hidden == 0:
            return "waits before computing"
        return "overlapped" if self.hidden >= OVERLAPPED * self.receives else "partly overlapped"

    @property
    def kept(self) -> bool:
        return self.verdict in ("overlapped", "no communication")

    def line(self) -> str:
        return f"{self.phase} {self.verdict} ({self.hidden}/{self.receives} receives hide compute)"


def _receives(ops: list[list]) -> set[int]:
    """Op indices of receives and collectives (a collective receives too)."""
    return {i for i, (kind, *_rest) in enumerate(ops) if kind in RECEIVES or kind not in SENDS}


def overlap(call: CallProfile) -> dict[str, PhaseOverlap]:
    """Per phase (forward, backward): every rank's receives and how many hid compute."""
    out: dict[str, PhaseOverlap] = {}
    for rank in call.ranks:
        wanted = _receives(rank.ops)
        flops, posted = 0, {}
        for kind, value, phase, *_t in rank.events:
            if kind == "compute":
                flops += value
            elif kind == "post":
                posted[value] = (flops, phase)
            elif kind == "wait" and value in wanted and value in posted:
                at, ph = posted.pop(value)
                row = out.setdefault(ph, PhaseOverlap(ph))
                row.receives += 1
                row.hidden += flops > at
    return out
