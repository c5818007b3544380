"""The fault battery behind `ring-harness check --faults`: many small seeded cases, one fault kind
each in turn, every verdict tallied by kind, the pool's healing probed after each failed case, the
straggler slowdown measured, and no worker process left behind (checked, not assumed)."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.case import Case, make_case
from harness.errors import HarnessError
from harness.faults.schema import CRASH_HOW, KINDS, expected_verdict, make_fault, parse_faults
from ring_impl.masks import MaskSpec

VERDICT_COLS = ("pass", "silent-corruption", "fail-stop", "hang", "diverged", "invalid")
MASKS = (MaskSpec("none"), MaskSpec("causal"), MaskSpec("window", window=3))
LAYOUTS = ("contiguous", "zigzag", "striped")


def parse_kinds(text: str) -> tuple[str, ...]:
    """'all' or a comma list of fault kinds -> kinds in canonical order; one clear error otherwise."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return KINDS
    bad = [n for n in names if n not in KINDS]
    if bad or not names:
        raise HarnessError(f"--faults: unknown fault kind {bad[0] if bad else text!r}; "
                           f"expected 'all' or some of {', '.join(KINDS)}")
    return tuple(k for k in KINDS if k in names)


def fault_for(kind: str, world: int, rng: random.Random, n: int) -> dict:
    """One seeded fault of `kind` whose schedule fires on any ring of `world` ranks (op < W - 1)."""
    rank = rng.randrange(world)
    phase = rng.choice(("forward", "backward"))
    index = rng.randrange(max(1, world - 1))
    if kind == "delay":
        one = rng.random() < 0.5  # one rank only, or every rank
        return make_fault(kind, rank=rank if one else None, phase=rng.choice(("forward", "backward", "any")),
                          op=rng.choice(("any", "send", "recv")), index=rng.choice((None, index)),
                          seconds=rng.choice((0.0, 0.005, 0.02, 0.05)), jitter=rng.choice((0.0, 0.01, 0.03)),
                          where=rng.choice(("post", "complete")))
    if kind in ("early-read", "send-reuse"):
        return make_fault(kind, rank=rng.choice((None, rank)), phase=rng.choice(("forward", "backward", "any")),
                          index=rng.choice((None, index)))
    if kind == "drop":
        return make_fault(kind, rank=rank, phase=phase, index=index)
    if kind == "corrupt":
        return make_fault(kind, rank=rank, phase=phase, op=rng.choice(("send", "recv")), index=index,
                          bit=rng.choice((None, 30, 22, 12)), count=rng.choice((1, 1, 4)))
    if kind == "straggler":
        return make_fault(kind, rank=rank, factor=rng.choice((2.0, 3.0, 4.0)),
                          slow="comm" if n % 3 == 2 else "compute")
    if kind == "crash":
        return make_fault(kind, rank=rank, phase=phase, index=index, how=CRASH_HOW[n % len(CRASH_HOW)])
    raise HarnessError(f"unknown fault kind {kind!r}")


def fault_cases(kinds: tuple[str, ...], n: int, *, impl: str = "reference", seed: int = 0,
                deadline_s: float = 8.0, max_world: int = 4) -> list[Case]:
    """`n` small seeded faulted cases (W 2..max_world, every layout and mask), kinds taken in turn."""
    if n < 1:
        raise HarnessError(f"--fault-cases must be at least 1, got {n}")
    rng = random.Random(f"fault-battery:{seed}")
    cases = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        w = rng.randint(2, max(2, max_world))
        total = rng.randint(2 * w, 8 * w)  # >= 2 tokens per rank: no empty zigzag shard skips a transfer
        cases.append(make_case(
            world_size=w, total_len=total, layout=rng.choice(LAYOUTS), mask=rng.choice(MASKS),
            heads_q=rng.choice((2, 4)), heads_kv=2, head_dim=rng.choice((8, 16)), seed=rng.randrange(2**31),
            impl=impl, deadline_s=deadline_s, faults=(fault_for(kind, w, rng, i // len(kinds)),),
        ))
    return cases


def kind_of(case: Case) -> str:
    """The fault kind a battery case is filed under (its first fault's)."""
    return case.faults[0]["kind"] if case.faults else "none"


@dataclass
class BatteryResult:
    """Tallies of one battery run."""

    rows: list[tuple[str, object]] = field(default_factory=list)  # (kind, CaseResult)
    heal_failures: list[str] = field(default_factory=list)
    over_deadline: list[str] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    seconds: float = 0.0

    def table(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for kind, r in self.rows:
            out.setdefault(kind, Counter())[r.verdict] += 1
        return out

    def unexpected(self) -> list[tuple[str, object]]:
        return [(k, r) for k, r in self.rows if not r.extra.get("as_expected", False)]


def run_battery(cases: list[Case], pool, impl: str, *, allow_import: bool = False,
                on_result: Callable[[int, str, object], None] | None = None, heal: bool = True,
                out: BatteryResult | None = None) -> BatteryResult:
    """Run every case; after a case that broke the pool (or its group), a fault-free run of the same
    case must pass on the healed pool. Worker pids are recorded for the leftover check."""
    from harness.runner import run_case

    out = BatteryResult() if out is None else out
    start = time.perf_counter()
    for i, c in enumerate(cases, 1):
        r = run_case(c, pool, impl, allow_import=allow_import)
        out.pids.update(pool.pids())
        kind = kind_of(c)
        out.rows.append((kind, r))
        slack = 3.0  # stack collection and reply transfer after the deadline
        if r.timings.get("wall_s", 0.0) > c.deadline_s + slack:
            out.over_deadline.append(f"case {i} ({kind}): {r.timings['wall_s']:.1f} s > deadline {c.deadline_s:g} s")
        if on_result is not None:
            on_result(i, kind, r)
        if heal and (pool.broken or getattr(pool, "fresh_group", False)):
            probe = run_case(c.replace(faults=()), pool, impl, allow_import=allow_import, leak=False)
            out.pids.update(pool.pids())
            r.extra["heal"] = probe.verdict
            if probe.verdict != "pass":
                out.heal_failures.append(f"case {i} ({kind}): fault-free rerun was {probe.verdict}: {probe.detail}")
    out.seconds = time.perf_counter() - start
    return out


def measure_straggler(pool, impl: str, *, factor: float = 4.0, world: int = 2, rank: int = 1, reps: int = 5,
                      allow_import: bool = False, tokens_per_rank: int = 512) -> dict:
    """Ring time (slowest rank's forward + backward) with one rank `factor` times slower at compute,
    against the fault-free ring: the straggler slowdown of the whole ring, medians over `reps`
    (after one warm-up run of each)."""
    from harness.runner import run_case

    base = make_case(world_size=world, total_len=world * tokens_per_rank, layout="zigzag", mask=MaskSpec("causal"),
                     heads_q=4, heads_kv=4, head_dim=32, seed=7, impl=impl, deadline_s=120.0)
    slow = base.replace(faults=(make_fault("straggler", rank=rank, factor=factor),))
    times: dict[str, list[float]] = {"base": [], "slow": []}
    verdicts = []
    for i in range(reps + 1):
        for name, c in (("base", base), ("slow", slow)):
            r = run_case(c, pool, impl, allow_import=allow_import, leak=False)
            verdicts.append(r.verdict)
            per_rank = [v.get("forward_s", 0.0) + v.get("backward_s", 0.0)
                        for k, v in r.timings.items() if k.startswith("rank") and isinstance(v, dict)]
            if i > 0:  # the first run of each warms up (lazy init, first connections)
                times[name].append(max(per_rank) if per_rank else float("nan"))
    b, s = statistics.median(times["base"]), statistics.median(times["slow"])
    b_min, s_min = min(times["base"]), min(times["slow"])  # least disturbed by other load on the machine
    return {"factor": factor, "world": world, "rank": rank, "reps": reps, "base_s": b, "slow_s": s,
            "slowdown": s / b if b > 0 else float("nan"), "slowdown_min": s_min / b_min if b_min > 0 else float("nan"),
            "times": times, "verdicts": verdicts, "summary": base.summary()}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (not a zombie) and still a harness worker (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z" and "harness.ranks.worker" in _cmdline(pid)


def leftover_workers(pids: set[int], parent: int | None = None, wait_s: float = 10.0, scan: bool = True) -> list[str]:
    """Worker processes still alive: any recorded pid, or (with `scan`, for after the pool is closed)
    any `harness.ranks.worker --parent <parent>` in /proc."""
    parent = os.getpid() if parent is None else parent
    end = time.monotonic() + wait_s
    while True:
        left = {p for p in pids if _alive(p)}
        for entry in os.listdir("/proc") if scan else ():
            if entry.isdigit():
                cmd = _cmdline(int(entry))
                if "harness.ranks.worker" in cmd and f"--parent {parent} " in cmd + " " and _alive(int(entry)):
                    left.add(int(entry))
        if not left or time.monotonic() > end:
            return [f"{p}: {_cmdline(p)[:120]}" for p in sorted(left)]
        time.sleep(0.2)


def table_lines(res: BatteryResult) -> list[str]:
    """The fault kind x verdict table, with each kind's expected verdict and how many met it."""
    tab = res.table()
    head = f"{'fault':<11} {'cases':>5} " + " ".join(f"{v:>{max(len(v), 4)}}" for v in VERDICT_COLS)
    head += f"  {'expected':<9} {'as-expected':>11}  {'max s':>5}"
    lines = [head, "-" * len(head)]
    kinds = [k for k in (*KINDS, "none") if k in tab]
    for k in kinds:
        rs = [r for kk, r in res.rows if kk == k]
        exp = expected_verdict(parse_faults(rs[0].case.faults, rs[0].case.world_size)) if rs[0].case.faults else "pass"
        ok = sum(1 for r in rs if r.extra.get("as_expected", False))
        cells = " ".join(f"{tab[k][v]:>{max(len(v), 4)}}" for v in VERDICT_COLS)
        worst = max(r.timings.get("wall_s", 0.0) for r in rs)
        lines.append(f"{k:<11} {len(rs):>5} {cells}  {exp or 'any':<9} {f'{ok}/{len(rs)}':>11}  {worst:5.1f}")
    total = Counter()
    for c in tab.values():
        total.update(c)
    cells = " ".join(f"{total[v]:>{max(len(v), 4)}}" for v in VERDICT_COLS)
    ok = sum(1 for _, r in res.rows if r.extra.get("as_expected", False))
    lines.append(f"{'total':<11} {len(res.rows):>5} {cells}  {'':<9} {f'{ok}/{len(res.rows)}':>11}")
    return lines
