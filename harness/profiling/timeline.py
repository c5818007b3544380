"""The timeline of one profiled call: a Chrome/Perfetto trace, a Gantt chart, and where time went.

Each rank is a track, on one clock: perf_counter is the machine's monotonic clock, shared by the
rank processes, and the call's first rank to start is 0. Compute is a span from the rank's previous
event to the end of the ops that computed, with their FLOPs. A wait is a span from the wait call to
the op's completion: exposed communication. A post is an instant with its bytes. Times are
reported, never judged: they depend on the machine's load. On CUDA ranks each wait also carries
the GPU's milliseconds on it, from CUDA events (harness.profiling.devicetime), as `cuda_ms`. The
trace opens in chrome://tracing or ui.perfetto.dev.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.profiling.measure import CallProfile, RankProfile

# the trace-event format's required keys per event type used here (Chrome's "Trace Event Format")
TRACE_PHASES = {
    "X": ("name", "ph", "ts", "dur", "pid", "tid"),
    "i": ("name", "ph", "ts", "pid", "tid", "s"),
    "M": ("name", "ph", "pid", "args"),
}
METADATA = (
    "process_name",
    "process_labels",
    "process_sort_index",
    "thread_name",
    "thread_sort_index",
)


@dataclass
class Span:
    """One piece of a rank's timeline, in microseconds from the call's start."""

    kind: str  # "compute" or "wait"
    start_us: float
    dur_us: float
    label: str
    phase: str
    cuda_ms: float | None = None  # a wait on a CUDA rank: the GPU's time on it, from CUDA events


def spans(
    rank: RankProfile, origin: float | None = None
) -> tuple[list[Span], list[tuple[float, str]]]:
    """A rank's compute and wait spans, and its posts as (time, label), in microseconds from
    `origin` (default: the rank's own start)."""
    out: list[Span] = []
    posts: list[tuple[float, str]] = []
    waiting: dict[int, float] = {}
    gpu = {w[0]: w[2] for w in rank.cuda_waits}
    last = rank.start
    zero = rank.start if origin is None else origin

    def us(t: float) -> float:
        return (t - zero) * 1e6

    for kind, value, phase, t in rank.events:
        if kind == "compute":
            out.append(
                Span("compute", us(last), max(us(t) - us(last), 0.0), f"{value:,} FLOPs", phase)
            )
        elif kind == "post":
            op = rank.ops[value] if value < len(rank.ops) else ["?", None, 0]
            posts.append((us(t), f"post {op[0]} #{value} ({op[2]:,} B)"))
        elif kind == "wait":
            waiting[value] = t
        elif kind == "done" and value in waiting:
            t0 = waiting.pop(value)
            op = rank.ops[value] if value < len(rank.ops) else ["?"]
            label = f"wait {op[0]} #{value}"
            out.append(Span("wait", us(t0), us(t) - us(t0), label, phase, gpu.get(value)))
        last = t
    return out, posts


def _origin(call: CallProfile) -> float:
    """The call's 0: its first rank's start."""
    return min((r.start for r in call.ranks), default=0.0)


def trace(call: CallProfile) -> dict:
    """The call as trace-event JSON: one process per rank, compute and waits on one thread."""
    events: list[dict] = []
    for rank in call.ranks:
        pid = rank.rank
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": f"rank {pid}"},
            }
        )
        timeline, posts = spans(rank, _origin(call))
        for s in timeline:
            events.append(
                {
                    "name": s.label,
                    "cat": s.kind,
                    "ph": "X",
                    "ts": s.start_us,
                    "dur": s.dur_us,
                    "pid": pid,
                    "tid": 0,
                    "args": {"phase": s.phase}
                    | ({} if s.cuda_ms is None else {"cuda_ms": s.cuda_ms}),
                }
            )
        events += [
            {"name": label, "cat": "post", "ph": "i", "s": "t", "ts": ts, "pid": pid, "tid": 0}
            for ts, label in posts
        ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"case": call.case.summary()},
    }


def valid(data: dict) -> list[str]:
    """What breaks the trace-event format in `data` (empty when nothing does)."""
    errors = []
    if not isinstance(data.get("traceEvents"), list):
        return ["no traceEvents list"]
    for i, e in enumerate(data["traceEvents"]):
        ph = e.get("ph")
        if ph not in TRACE_PHASES:
            errors.append(f"event {i}: event type {ph!r} is not one this trace uses")
            continue
        errors += [f"event {i}: no {k!r}" for k in TRACE_PHASES[ph] if k not in e]
        if ph == "i" and e.get("s") not in ("g", "p", "t"):
            errors.append(f"event {i}: instant scope {e.get('s')!r} is not g, p or t")
        if ph == "M" and e.get("name") not in METADATA:
            errors.append(f"event {i}: metadata {e.get('name')!r} is not a known one")
        for k in ("ts", "dur"):
            if k in e and not (isinstance(e[k], (int, float)) and e[k] >= 0):
                errors.append(f"event {i}: {k} is not a non-negative number")
    return errors


def summary(call: CallProfile) -> str:
    """'network or compute?' in one line: per rank the share of the call spent waiting."""
    parts = []
    for rank in call.ranks:
        timeline, _ = spans(rank)
        total = max((s.start_us + s.dur_us for s in timeline), default=0.0)
        waited = sum(s.dur_us for s in timeline if s.kind == "wait")
        parts.append(f"rank {rank.rank} {waited / total:.0%}" if total else f"rank {rank.rank} -")
    return "time spent waiting on communication (reported, not judged): " + ", ".join(parts)


def write(call: CallProfile, directory: str | Path, stem: str) -> list[Path]:
    """The trace JSON, and the Gantt PNG when matplotlib is installed."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{stem}.trace.json"
    path.write_text(json.dumps(trace(call)), encoding="utf-8")
    out = [path]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return out
    out.append(gantt(call, d / f"{stem}.gantt.png"))
    return out


def gantt(call: CallProfile, path: Path) -> Path:
    """A Gantt chart: a row per rank, compute blue, waits red, posts as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.6 * len(call.ranks) + 1.2))
    for rank in call.ranks:
        timeline, posts = spans(rank, _origin(call))
        y = rank.rank
        for kind, color in (("compute", "tab:blue"), ("wait", "tab:red")):
            bars = [(s.start_us / 1e3, s.dur_us / 1e3) for s in timeline if s.kind == kind]
            ax.broken_barh(bars, (y - 0.35, 0.7), color=color, label=kind if y == 0 else None)
        ax.plot([t / 1e3 for t, _ in posts], [y + 0.4] * len(posts), "k|", markersize=6)
    ax.set_yticks([r.rank for r in call.ranks], [f"rank {r.rank}" for r in call.ranks])
    ax.set_xlabel("ms from the call's start (compute blue, waits red, posts |)")
    ax.set_title(f"{call.impl}: {call.case.summary()}", fontsize=9)
    ax.invert_yaxis()
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
