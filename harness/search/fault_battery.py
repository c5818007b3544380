"""The fault battery's cases (behind `ring-harness check --faults`): many small seeded cases, one
fault kind each in turn over masks, layouts and world sizes. `harness.checks.fault_battery` runs
them and tallies the verdicts. For a ring that communicates only by collectives, the faults select
collectives instead (`collective=True`): one-shot faults the first one of a phase, since such a
ring may make a single collective per phase."""

from __future__ import annotations

import random

from harness.case import Case, make_case
from harness.errors import HarnessError
from harness.faults.schema import CRASH_HOW, make_fault
from ring_impl.masks import MaskSpec

MASKS = (MaskSpec("none"), MaskSpec("causal"), MaskSpec("window", window=3))
LAYOUTS = ("contiguous", "zigzag", "striped")


def fault_for(
    kind: str, world_size: int, rng: random.Random, n: int, collective: bool = False
) -> dict:
    """One seeded fault of `kind` whose schedule fires on any ring of `world` ranks (op < W - 1).

    `collective`: it selects collectives (a one-shot fault the first of the forward's).
    """
    if collective:
        return _collective_fault(kind, world_size, rng, n)
    rank = rng.randrange(world_size)
    phase = rng.choice(("forward", "backward"))
    index = rng.randrange(max(1, world_size - 1))
    if kind == "delay":
        one = rng.random() < 0.5  # one rank only, or every rank
        return make_fault(
            kind,
            rank=rank if one else None,
            phase=rng.choice(("forward", "backward", "any")),
            op=rng.choice(("any", "send", "recv")),
            index=rng.choice((None, index)),
            seconds=rng.choice((0.0, 0.005, 0.02, 0.05)),
            jitter=rng.choice((0.0, 0.01, 0.03)),
            where=rng.choice(("post", "complete")),
        )
    if kind in ("early-read", "send-reuse"):
        return make_fault(
            kind,
            rank=rng.choice((None, rank)),
            phase=rng.choice(("forward", "backward", "any")),
            index=rng.choice((None, index)),
        )
    if kind == "drop":
        return make_fault(kind, rank=rank, phase=phase, index=index)
    if kind == "corrupt":
        return make_fault(
            kind,
            rank=rank,
            phase=phase,
            op=rng.choice(("send", "recv")),
            index=index,
            bit=rng.choice((None, 30, 22, 12)),
            count=rng.choice((1, 1, 4)),
        )
    if kind == "straggler":
        return make_fault(
            kind,
            rank=rank,
            factor=rng.choice((2.0, 3.0, 4.0)),
            slow="comm" if n % 3 == 2 else "compute",
        )
    if kind == "crash":
        return make_fault(
            kind, rank=rank, phase=phase, index=index, how=CRASH_HOW[n % len(CRASH_HOW)]
        )
    raise HarnessError(f"unknown fault kind {kind!r}")


def _collective_fault(kind: str, world_size: int, rng: random.Random, n: int) -> dict:
    """One seeded fault of `kind` on collectives: every ring that uses them makes one in forward."""
    rank = rng.randrange(world_size)
    if kind in ("drop", "corrupt", "crash"):
        extra = {
            "drop": {},
            "corrupt": {"bit": rng.choice((30, 22)), "count": rng.choice((1, 4))},
            "crash": {"how": CRASH_HOW[n % len(CRASH_HOW)]},
        }[kind]
        return make_fault(kind, rank=rank, phase="forward", op="collective", index=0, **extra)
    if kind == "delay":
        return make_fault(
            kind,
            rank=rng.choice((None, rank)),
            phase=rng.choice(("forward", "backward", "any")),
            op="collective",
            seconds=rng.choice((0.0, 0.005, 0.02)),
            jitter=rng.choice((0.0, 0.01)),
            where=rng.choice(("post", "complete")),
        )
    if kind in ("early-read", "send-reuse"):  # fire on async collectives only
        return make_fault(kind, rank=rng.choice((None, rank)), op="collective")
    return fault_for(kind, world_size, rng, n)  # a straggler selects no op


def fault_cases(
    kinds: tuple[str, ...],
    n: int,
    *,
    impl: str = "reference",
    seed: int = 0,
    deadline_s: float = 8.0,
    max_world: int = 4,
    collective: bool = False,
) -> list[Case]:
    """`n` small seeded faulted cases (W 2..max_world, every layout and mask), kinds taken in
    turn; `collective`: faults on collectives (fault_for)."""
    if n < 1:
        raise HarnessError(f"--fault-cases must be at least 1, got {n}")
    rng = random.Random(f"fault-battery:{seed}")
    cases = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        w = rng.randint(2, max(2, max_world))
        # >= 2 tokens per rank: no empty zigzag shard skips a transfer
        total = rng.randint(2 * w, 8 * w)
        cases.append(
            make_case(
                world_size=w,
                total_len=total,
                layout=rng.choice(LAYOUTS),
                mask=rng.choice(MASKS),
                heads_q=rng.choice((2, 4)),
                heads_kv=2,
                head_dim=rng.choice((8, 16)),
                seed=rng.randrange(2**31),
                impl=impl,
                deadline_s=deadline_s,
                faults=(fault_for(kind, w, rng, i // len(kinds), collective),),
            )
        )
    return cases


def kind_of(case: Case) -> str:
    """The fault kind a battery case is filed under (its first fault's)."""
    return case.faults[0]["kind"] if case.faults else "none"
