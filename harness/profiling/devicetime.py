"""Exposed communication on CUDA ranks, per rank, phase and ring step, from CUDA events.

A CUDA rank records an event on its current stream just before and just after each wait
(harness.ranks.instrument). The time between the two is what the GPU spent on that wait: exposed
communication. Compute the GPU did not finish before the wait hides it. A ring step is the waits
between two computes: a ring posts, computes, then waits on the hop's sends and receives. The
whole call is timed the same way, inputs to results. The rest of the call is compute and the
harness's own work. Times are reported, never judged: they depend on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.profiling.measure import CallProfile


@dataclass
class StepTime:
    """One ring step of one phase: its waits and the GPU's milliseconds on them."""

    phase: str
    step: int  # 0, 1, ... within the phase
    waits: int
    exposed_ms: float


def steps(events: list[list], waited: list[tuple[int, float]]) -> list[StepTime]:
    """A rank's timed waits, (op index, ms), grouped into ring steps by its event stream.

    The waits between two computes are one step. A wait `waited` has no time for is left out.
    """
    ms = dict(waited)
    out: list[StepTime] = []
    count: dict[str, int] = {}
    open_step: StepTime | None = None
    for kind, value, phase, *_t in events:
        if kind == "compute":
            open_step = None
        elif kind == "wait" and value in ms:
            if open_step is None or open_step.phase != phase:
                open_step = StepTime(phase, count.get(phase, 0), 0, 0.0)
                count[phase] = open_step.step + 1
                out.append(open_step)
            open_step.waits += 1
            open_step.exposed_ms += ms[value]
    return out


@dataclass
class RankTimes:
    """One rank's call: its milliseconds on the GPU and its exposed communication per step."""

    rank: int
    call_ms: float
    steps: list[StepTime] = field(default_factory=list)

    @property
    def exposed_ms(self) -> float:
        return sum(s.exposed_ms for s in self.steps)

    @property
    def compute_ms(self) -> float:
        """The call less its exposed communication: compute, and the harness's own work."""
        return max(self.call_ms - self.exposed_ms, 0.0)

    def phase_ms(self, phase: str) -> float:
        return sum(s.exposed_ms for s in self.steps if s.phase == phase)

    def line(self) -> str:
        share = self.exposed_ms / self.call_ms if self.call_ms else 0.0
        phases = "; ".join(
            f"{ph} {self.phase_ms(ph):.2f} ms over steps "
            + ", ".join(f"{s.exposed_ms:.2f}" for s in self.steps if s.phase == ph)
            for ph in dict.fromkeys(s.phase for s in self.steps)
        )
        return (
            f"rank {self.rank}: call {self.call_ms:.2f} ms, exposed communication "
            f"{self.exposed_ms:.2f} ms ({share:.0%}), compute and the rest {self.compute_ms:.2f} ms"
            + (f"; {phases}" if phases else "")
        )

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "call_ms": self.call_ms,
            "exposed_ms": self.exposed_ms,
            "compute_ms": self.compute_ms,
            "steps": [vars(s) for s in self.steps],
        }


def device_times(call: CallProfile) -> list[RankTimes]:
    """Each CUDA rank's times; empty when no rank timed the call with CUDA events (CPU ranks)."""
    return [
        RankTimes(r.rank, r.cuda_call_ms, steps(r.events, [(w[0], w[2]) for w in r.cuda_waits]))
        for r in call.ranks
        if r.cuda_call_ms is not None
    ]


def lines(times: list[RankTimes]) -> list[str]:
    """The one-screen answer to "network or compute?" from CUDA events: a line per rank."""
    if not times:
        return []
    worst = max(times, key=lambda t: t.exposed_ms / t.call_ms if t.call_ms else 0.0)
    share = worst.exposed_ms / worst.call_ms if worst.call_ms else 0.0
    said = "network" if share >= 0.5 else "compute"
    head = (
        f"cuda events (reported, not judged): {said}: the GPU waits on communication at most "
        f"{share:.0%} of the call (rank {worst.rank}); per phase, the ms of each ring step:"
    )
    return [head] + [f"  {t.line()}" for t in times]
