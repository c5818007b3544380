"""Bytes and messages per rank and phase, from the op log, against the ring's minimum.

The ring's minimum per rank: forward, K and V once around (W - 1 hops of this rank's K and V);
backward, K and V once around again plus the dk/dv accumulators around and home (W hops), in
float32: accumulating gradients in the input dtype loses precision (the precision check's finding). An
all-gather moves the same bytes: (W - 1) shards in, reduce-scatter the gradients back. So bytes
alone cannot tell the two apart; memory does (harness.profiling.memory). A collective's bytes on the
wire are estimated as a ring algorithm's (`wire_bytes`): the op log holds only its input's size. A
"round" is the sends posted
between two waits: one per hop when K and V travel in one batch, two when they go one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.case import Case
from harness.dtypes import TORCH_DTYPES
from harness.profiling.measure import CallProfile
from harness.profiling.memory import kv_token_bytes
from harness.profiling.overlap import RECEIVES, SENDS

SLACK = 1.01  # bytes within 1% of the minimum are at it


@dataclass
class PhaseTraffic:
    """One phase, the busiest rank: bytes sent, messages and rounds, against the minimum."""

    phase: str
    sent: int
    messages: int
    rounds: int
    minimum: int
    hops: int  # the ring's hops in this phase (K/V hops forward; K/V plus dk/dv backward)
    # collectives moved some of the bytes: their wire bytes are estimates, reported, not judged
    estimated: bool = False

    @property
    def ratio(self) -> float:
        return self.sent / self.minimum if self.minimum else 0.0

    @property
    def kept(self) -> bool:
        """At the minimum, one round a hop; judged on point-to-point traffic only."""
        return self.estimated or (self.ratio <= SLACK and self.rounds <= self.hops)

    def line(self) -> str:
        at = "at the ring's minimum" if self.ratio <= SLACK else f"x{self.ratio:.2f} the minimum"
        if self.estimated:
            at = f"~x{self.ratio:.2f} the minimum, estimated for collectives: reported, not judged"
        per = f"{self.messages / self.hops:.1f}" if self.hops else "-"
        rounds = f"{self.rounds / self.hops:.1f}" if self.hops else "-"
        return (
            f"{self.phase} {self.sent / 1024:.1f} KiB sent ({at}), {self.messages} messages "
            f"({per} a hop), {self.rounds} rounds ({rounds} a hop)"
        )


def _minimum(c: Case, phase: str) -> tuple[int, int]:
    """(bytes, hops) of the ring's minimum for one rank of an even split."""
    w, local = c.world_size, c.total_len // c.world_size
    kv = kv_token_bytes(c) * local
    if phase == "forward":
        return (w - 1) * kv, w - 1
    acc = kv // TORCH_DTYPES[c.dtype].itemsize * 4  # the accumulators, float32
    return (w - 1) * kv + w * acc, (w - 1) + w


def wire_bytes(kind: str, nbytes: int, w: int) -> int:
    """What a rank sends in a ring algorithm's collective whose input is `nbytes`: an all-gather
    sends its shard W - 1 times; a reduce-scatter or all-to-all, (W - 1) / W of its whole input;
    an all-reduce twice that; a scatter's root, all but its own share of its list. Any other
    collective: its input once."""
    if kind.startswith("all_gather"):
        return (w - 1) * nbytes
    if kind == "scatter":
        return (w - 1) * nbytes // w
    if kind.startswith(("reduce_scatter", "all_to_all")):
        return (w - 1) * nbytes // w
    if kind == "all_reduce":
        return 2 * (w - 1) * nbytes // w
    return nbytes


def _rank_phase(
    ops: list[list], events: list[list], phase: str, w: int
) -> tuple[int, int, int, bool]:
    """(bytes sent, messages, rounds, whether a collective's bytes were estimated) of one rank in
    one phase."""
    sent = messages = 0
    estimated = False
    for kind, _peer, nbytes, ph, _state in ops:
        if ph != phase:
            continue
        if kind in SENDS:
            sent, messages = sent + nbytes, messages + 1
        elif kind not in RECEIVES:
            sent, messages = sent + wire_bytes(kind, nbytes, w), messages + 1
            estimated = True
    rounds, open_round = 0, False
    for kind, value, ph, *_t in events:
        if ph != phase:
            continue
        if kind == "post" and ops[value][0] not in RECEIVES:  # a send or a collective
            rounds += not open_round
            open_round = True
        elif kind == "wait":
            open_round = False
    return sent, messages, rounds, estimated


def traffic(call: CallProfile) -> dict[str, PhaseTraffic]:
    """Per phase, the busiest rank's traffic against the minimum."""
    c = call.case
    out: dict[str, PhaseTraffic] = {}
    for phase in ("forward", "backward"):
        minimum, hops = _minimum(c, phase)
        rows = [_rank_phase(r.ops, r.events, phase, c.world_size) for r in call.ranks]
        if not any(r[1] for r in rows):  # no message in this phase (W = 1)
            continue
        sent, messages, rounds, _ = max(rows)
        estimated = any(r[3] for r in rows)
        out[phase] = PhaseTraffic(phase, sent, messages, rounds, minimum, hops, estimated)
    return out
