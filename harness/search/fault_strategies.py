"""Hypothesis strategies for fault lists, so property-based runs can mix faults into drawn cases.

Schedules are drawn to fire on any ring: op numbers stay below W - 1 (every rank of a ring of W
makes at least W - 1 sends and W - 1 receives per phase), and a fatal fault (drop, crash) is always
alone, since whatever comes after it may never run. Draws shrink towards fewer faults, rank 0, the
first op, and the earlier kinds of `kinds`. With `collective=True` the faults select collectives
(a one-shot fault the first of the forward's: such a ring may make one collective per phase).
"""

from __future__ import annotations

from hypothesis import strategies as st

from harness.faults.schema import CRASH_HOW, FATAL, KINDS, make_fault

SHORT_DELAYS = (0.0, 0.001, 0.005, 0.02)


def _index(w: int, every: bool) -> st.SearchStrategy[int | None]:
    some = st.integers(0, max(0, w - 2))
    return st.one_of(st.none(), some) if every else some


@st.composite
def fault(draw, kind: str, world_size: int, collective: bool = False) -> dict:
    """One canonical fault mapping of `kind` for a ring of `world_size` (>= 2) ranks.

    `collective`: it selects collectives rather than P2P ops.
    """
    w = world_size
    rank = st.integers(0, w - 1)
    phase = st.sampled_from(("forward", "backward", "any"))
    if collective and kind in ("drop", "corrupt", "crash"):
        extra = {"corrupt": {"bit": draw(st.sampled_from((30, 22)))}, "crash": {"how": "sigkill"}}
        return make_fault(
            kind, rank=draw(rank), phase="forward", op="collective", index=0, **extra.get(kind, {})
        )
    if collective and kind in ("delay", "early-read", "send-reuse"):
        more = {"seconds": draw(st.sampled_from(SHORT_DELAYS))} if kind == "delay" else {}
        return make_fault(
            kind, rank=draw(st.one_of(st.none(), rank)), phase=draw(phase), op="collective", **more
        )
    if kind == "delay":
        return make_fault(
            kind,
            rank=draw(st.one_of(st.none(), rank)),
            phase=draw(phase),
            op=draw(st.sampled_from(("any", "send", "recv"))),
            index=draw(_index(w, True)),
            seconds=draw(st.sampled_from(SHORT_DELAYS)),
            jitter=draw(st.sampled_from(SHORT_DELAYS)),
            where=draw(st.sampled_from(("post", "complete"))),
        )
    if kind in ("early-read", "send-reuse"):
        return make_fault(
            kind,
            rank=draw(st.one_of(st.none(), rank)),
            phase=draw(phase),
            index=draw(_index(w, True)),
        )
    if kind == "drop":
        return make_fault(
            kind,
            rank=draw(rank),
            phase=draw(st.sampled_from(("forward", "backward"))),
            index=draw(_index(w, False)),
        )
    if kind == "corrupt":
        return make_fault(
            kind,
            rank=draw(rank),
            phase=draw(phase),
            op=draw(st.sampled_from(("send", "recv"))),
            index=draw(_index(w, False)),
            bit=draw(st.one_of(st.none(), st.integers(0, 15))),
            count=draw(st.integers(1, 3)),
        )
    if kind == "straggler":
        return make_fault(
            kind,
            rank=draw(rank),
            factor=draw(st.sampled_from((2.0, 3.0, 4.0))),
            slow=draw(st.sampled_from(("compute", "comm"))),
        )
    if kind == "crash":
        return make_fault(
            kind,
            rank=draw(rank),
            phase=draw(st.sampled_from(("forward", "backward"))),
            index=draw(_index(w, False)),
            how=draw(st.sampled_from(CRASH_HOW)),
        )
    raise ValueError(f"unknown fault kind {kind!r}")


@st.composite
def faults(
    draw,
    world_size: int,
    kinds: tuple[str, ...] = KINDS,
    max_faults: int = 2,
    collective: bool = False,
) -> tuple[dict, ...]:
    """0..max_faults fault mappings for a ring of `world_size` (none for W = 1: no
    communication); `collective`: on collectives."""
    if world_size < 2 or not kinds:
        return ()
    n = draw(st.integers(0, max_faults))
    out: list[dict] = []
    for _ in range(n):
        kind = draw(st.sampled_from(kinds))
        if kind in FATAL:
            return (draw(fault(kind, world_size, collective)),)
        if kind == "straggler" and any(f["kind"] == "straggler" for f in out):
            continue
        out.append(draw(fault(kind, world_size, collective)))
    return tuple(out)


@st.composite
def faulted_cases(
    draw,
    kinds: tuple[str, ...] = KINDS,
    max_faults: int = 2,
    deadline_s: float = 10.0,
    collective: bool = False,
    **case_kw,
) -> object:
    """A drawn Case (harness.strategies.cases, same keywords) with a drawn fault list and a short
    deadline. The plain training call unless `model_calls=True`: a fault on a backward op never
    fires in a call without one. `collective`: the faults select collectives."""
    from harness.search.strategies import cases

    case_kw.setdefault("model_calls", False)
    case = draw(cases(deadline_s=deadline_s, **case_kw))
    return case.replace(faults=draw(faults(case.world_size, kinds, max_faults, collective)))


__all__ = ["fault", "faults", "faulted_cases"]
