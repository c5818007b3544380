"""One profiled call on the ranks: each rank's event stream, op log and peak memory; on CUDA ranks
also the CUDA-event times of each wait and of the whole call."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.case import Case
from harness.errors import HarnessError
from harness.ranks.protocol import IDLE, OK, Pool
from harness.runner import submit

LIVE_BYTES = "live tensor bytes"  # MemTracker's peak (harness.ranks.instrument)
CUDA_PEAK = "cuda max_memory_allocated"  # the device allocator's peak, on CUDA ranks


@dataclass
class RankProfile:
    """What one rank measured: events in program order, its op log, its peak live tensor bytes.

    An event is ("post" | "wait" | "done", op index, phase, seconds) or ("compute", flops, phase,
    seconds); seconds are perf_counter readings, `start` the first. An op log entry is [kind, peer,
    bytes, phase, state] (harness.faults.oplog). A CUDA rank adds the peak of
    `torch.cuda.max_memory_allocated` over the call, the call's milliseconds and each wait's
    [op index, phase, ms], from CUDA events (harness.ranks.instrument).
    """

    rank: int
    events: list[list]
    ops: list[list]
    peak_bytes: int
    start: float = 0.0
    cuda_peak_bytes: int | None = None
    cuda_call_ms: float | None = None
    cuda_waits: list[list] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The peak memory judged: the device's on a CUDA rank, live tensor bytes elsewhere."""
        return self.peak_bytes if self.cuda_peak_bytes is None else self.cuda_peak_bytes


@dataclass
class CallProfile:
    """Every ring rank's profile of one call of `impl` on `case`."""

    case: Case
    impl: str
    ranks: list[RankProfile] = field(default_factory=list)

    @property
    def instrument(self) -> str:
        """What measured the peaks: "cuda max_memory_allocated" or "live tensor bytes"."""
        cuda = any(r.cuda_peak_bytes is not None for r in self.ranks)
        return CUDA_PEAK if cuda else LIVE_BYTES


def profile_call(case: Case, pool: Pool, impl: str, *, allow_import: bool = False) -> CallProfile:
    """Run `case` once on every rank, instrumented. A call that raises, hangs or dies is no profile:
    HarnessError names the rank and what happened (`check` says whether the ring is right)."""
    ticket = submit(pool, case, impl, allow_import=allow_import, leak=False, profile=True)
    reply = pool.collect(ticket)
    stuck = {**reply.hung, **reply.dead}
    if stuck:
        rank, why = min(stuck.items())
        raise HarnessError(f"{impl}: rank {rank} did not finish the profiled call: {why[:200]}")
    out = CallProfile(case, impl)
    for rank, msg in sorted(reply.replies.items()):
        if msg.get("status") == IDLE:
            continue
        if msg.get("status") != OK or "profile" not in msg:
            error = msg.get("error", msg.get("status"))
            raise HarnessError(
                f"{impl}: rank {rank} failed the profiled call ({case.summary()}): {error}; "
                "profile measures a ring that works: run `ring-harness check` first"
            )
        p = msg["profile"]
        out.ranks.append(
            RankProfile(
                rank,
                p["events"],
                msg.get("comm", []),
                p["peak_bytes"],
                p["start"],
                p.get("cuda_peak_bytes"),
                p.get("cuda_call_ms"),
                p.get("cuda_waits", []),
            )
        )
    return out
