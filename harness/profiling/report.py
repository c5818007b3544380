"""Profile rings side by side: plan the calls, run them, judge the promises, print one table.

Each ring runs the same cases: the contiguous layout, no mask (every block is computed, so nothing
confounds overlap), fp32, an even split of `tokens_per_rank` tokens, at W = 1, 2, 4, 8 as declared
and as the ranks allow. Memory reads every W. Traffic and overlap read the largest W up to 4.
The length sweep (memory.LengthSweep) runs the two largest W again at 2 and 4 times the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.case import Case
from harness.errors import HarnessError
from harness.impls import registry
from harness.impls.capabilities import adapt
from harness.profiling import balance, devicetime, timeline
from harness.profiling.measure import CallProfile, profile_call
from harness.profiling.memory import LengthSweep, MemoryClass, kv_token_bytes
from harness.profiling.overlap import PhaseOverlap, overlap
from harness.profiling.serving_traffic import ServingTraffic, serving_traffic
from harness.profiling.traffic import PhaseTraffic, traffic
from harness.ranks.protocol import Pool

WORLD_SIZES = (1, 2, 4, 8)
TOKENS_PER_RANK = 64
LENGTHS = (1, 2, 4)  # the length sweep's tokens a rank, in multiples of `tokens_per_rank`


@dataclass
class RingProfile:
    """One ring's verdicts: memory class, traffic and overlap per phase."""

    impl: str
    memory: MemoryClass | None = None
    traffic: dict[str, PhaseTraffic] = field(default_factory=dict)
    overlap: dict[str, PhaseOverlap] = field(default_factory=dict)
    world_size: int = 0  # the W traffic and overlap were read at
    call: CallProfile | None = None  # that call: its timeline
    balance: dict[str, float] = field(default_factory=dict)  # layout -> max / mean FLOPs, causal
    straggler: tuple[float, float, float] | None = None  # (factor, plain s, straggled s)
    serving: ServingTraffic | None = None  # a decode call's bytes, for a ring that declares decode

    @property
    def kept(self) -> bool:
        """Every judged promise kept: memory O(n/W), bytes at the minimum, compute hides transfers."""
        parts = [t.kept for t in self.traffic.values()] + [o.kept for o in self.overlap.values()]
        return (self.memory is None or self.memory.kept) and all(parts)

    def broken(self) -> list[str]:
        """The promises it breaks, in words."""
        out = []
        if self.memory is not None:
            out += self.memory.broken()
        out += [f"{t.phase} traffic: {t.line()}" for t in self.traffic.values() if not t.kept]
        out += [f"{o.phase}: {o.verdict}" for o in self.overlap.values() if not o.kept]
        return out

    def device_times(self) -> list[devicetime.RankTimes]:
        """The timeline's call timed with CUDA events, per rank; empty on CPU ranks."""
        return [] if self.call is None else devicetime.device_times(self.call)

    def lines(self) -> list[str]:
        out = [f"{self.impl}: {'keeps' if self.kept else 'BREAKS'} ring attention's promises"]
        if self.memory is not None:
            out.append(f"    {self.memory.line()}")
            if self.memory.length is not None:
                out.append(f"    {self.memory.length.line()}")
        w = f"at W{self.world_size}"
        out += [f"    traffic {w}: {t.line()}" for t in self.traffic.values()]
        out += [f"    overlap {w}: {o.line()}" for o in self.overlap.values()]
        if self.serving is not None:
            out.append(f"    serving traffic: {self.serving.line()}")
        if self.call is not None:
            out.append(f"    {timeline.summary(self.call)}")
            out += [f"    {x}" for x in devicetime.lines(self.device_times())]
        if self.balance:
            said = ", ".join(f"{k} x{v:.2f}" for k, v in self.balance.items())
            out.append(f"    work balance {w}, causal (max / mean FLOPs a rank): {said}")
        if self.straggler is not None:
            f, plain, slow = self.straggler
            out.append(
                f"    straggler {w} (reported, not judged; noisy below ~100 ms): one rank x{f:g} "
                "slower in compute, "
                f"the call {plain * 1e3:.1f} -> {slow * 1e3:.1f} ms: x{slow / plain:.2f}"
            )
        return out

    def to_json(self) -> dict:
        return {
            "impl": self.impl,
            "kept": self.kept,
            "broken": self.broken(),
            "memory": None if self.memory is None else self.memory.to_json(),
            "world_size": self.world_size,
            "traffic": {p: vars(t) | {"ratio": t.ratio} for p, t in self.traffic.items()},
            "overlap": {p: vars(o) | {"verdict": o.verdict} for p, o in self.overlap.items()},
            "cuda_times": [t.to_json() for t in self.device_times()] or None,
            "work_balance": self.balance,
            "serving_traffic": None if self.serving is None else self.serving.to_json(),
            "straggler": None
            if self.straggler is None
            else dict(zip(("factor", "plain_s", "straggled_s"), self.straggler, strict=True)),
        }


def _case(impl: str, w: int, tokens: int, allow_import: bool) -> Case | None:
    """The profile case at W and `tokens` a rank, adapted to the ring; None if that changes W."""
    caps = registry.resolve(impl, allow_import=allow_import).capabilities
    c = adapt(caps, balance.profile_case(impl, w, tokens, "contiguous", "none"))
    return c if c is not None and c.world_size == w else None


def plan(impl: str, pool_size: int, tokens_per_rank: int, allow_import: bool) -> list[Case]:
    """The ring's cases, one per W it declares and the ranks allow."""
    lo, hi = registry.resolve(impl, allow_import=allow_import).capabilities.world_sizes
    out = []
    for w in WORLD_SIZES:
        if not lo <= w <= min(hi, pool_size):
            continue
        c = _case(impl, w, tokens_per_rank, allow_import)
        if c is not None:
            out.append(c)
    if not out:
        raise HarnessError(
            f"{impl}: declares no ring size of {WORLD_SIZES} that {pool_size} ranks run"
        )
    return out


def profile_ring(
    impl: str,
    pool: Pool,
    *,
    tokens_per_rank: int = TOKENS_PER_RANK,
    allow_import: bool = False,
    straggler: float = 0.0,
) -> RingProfile:
    """Run and judge one ring; with `straggler` > 1, also time one rank that much slower."""
    cases = plan(impl, pool.capacity, tokens_per_rank, allow_import)
    out = RingProfile(impl)
    found, warm = _peaks(cases, pool, impl, allow_import)
    peaks = {c.world_size: p for c, p in zip(cases, found, strict=True)}
    kv = {c.world_size: kv_token_bytes(c) for c in cases}
    out.memory = MemoryClass(tokens_per_rank, peaks, kv, instrument=warm[-1].instrument)
    out.memory.length = _length_sweep(impl, pool, peaks, tokens_per_rank, allow_import)
    at = [c for c in warm if c.case.world_size <= 4][-1]
    out.world_size, out.call = at.case.world_size, at
    out.traffic, out.overlap = traffic(at), overlap(at)
    w = out.world_size
    out.serving = serving_traffic(impl, pool, w, allow_import=allow_import)
    if w > 1:
        out.balance = balance.work_balance(
            impl, pool, w, tokens_per_rank, allow_import=allow_import
        )
    if w > 1 and straggler > 1:
        plain, slow = balance.straggler(
            impl, pool, w, tokens_per_rank, straggler, allow_import=allow_import
        )
        out.straggler = (straggler, plain, slow)
    return out


def _peaks(
    cases: list[Case], pool: Pool, impl: str, allow_import: bool
) -> tuple[list[int], list[CallProfile]]:
    """Each case's peak bytes per rank (the largest over ranks), and its second call.

    Each case runs twice. An async collective's buffer may be freed a little later on a busy host:
    the peak is the smaller of the two (torch's all-to-all ring varied by one K/V block). The
    second call is warm (its connections made), so its timeline is the one shown.
    """
    first = [profile_call(c, pool, impl, allow_import=allow_import) for c in cases]
    warm = [profile_call(c, pool, impl, allow_import=allow_import) for c in cases]
    peaks = [
        min(max(r.peak for r in a.ranks), max(r.peak for r in b.ranks))
        for a, b in zip(first, warm, strict=True)
    ]
    return peaks, warm


def _length_sweep(
    impl: str, pool: Pool, peaks: dict[int, int], tokens: int, allow_import: bool
) -> LengthSweep | None:
    """The two largest W >= 2 of the W sweep again, at each of LENGTHS times `tokens` a rank.

    The first length is the W sweep's own call. None below two such W, or if the ring's adapter
    changes a case (its W or its length).
    """
    ws = sorted(w for w in peaks if w >= 2)[-2:]
    if len(ws) < 2:
        return None
    want = [(w, k * tokens) for w in ws for k in LENGTHS[1:]]
    cases = [_case(impl, w, t, allow_import) for w, t in want]
    if any(c is None or c.total_len != w * t for c, (w, t) in zip(cases, want, strict=True)):
        return None
    found = iter(_peaks(cases, pool, impl, allow_import)[0])
    grown = {w: [peaks[w]] + [next(found) for _ in LENGTHS[1:]] for w in ws}
    kv = {c.world_size: kv_token_bytes(c) for c in cases}
    return LengthSweep([k * tokens for k in LENGTHS], grown, kv)


def _bytes_cell(p: RingProfile, phase: str) -> str:
    """'x1.00', '~x1.75' (estimated), 'none seen' (compute but no message logged) or '-'."""
    t = p.traffic.get(phase)
    if t is not None:
        return f"{'~' if t.estimated else ''}x{t.ratio:.2f}"
    ran = p.call is not None and any(
        e[0] == "compute" and e[2] == phase for r in p.call.ranks for e in r.events
    )
    return "none seen" if ran and p.world_size > 1 else "-"


def table(rings: list[RingProfile]) -> list[str]:
    """One row per ring: memory (W sweep, length sweep), bytes against the minimum, rounds a hop,
    overlap per phase."""
    head = (
        f"{'ring':<28} {'memory':<18} {'over length':<18} {'fwd bytes':>9} {'bwd bytes':>9} "
        f"{'rounds/hop':>10}  overlap"
    )
    rows = [head]
    for p in rings:
        ratio = [_bytes_cell(p, phase) for phase in ("forward", "backward")]
        rounds = max((t.rounds / t.hops for t in p.traffic.values() if t.hops), default=0.0)
        rounds = f"{'~' if any(t.estimated for t in p.traffic.values()) else ''}{rounds:.1f}"
        ov = ", ".join(f"{o.phase} {o.verdict}" for o in p.overlap.values()) or "-"
        mem = p.memory.verdict if p.memory else "-"
        grown = p.memory.length.verdict if p.memory and p.memory.length else "-"
        rows.append(
            f"{p.impl:<28} {mem:<18} {grown:<18} {ratio[0]:>9} {ratio[1]:>9} {rounds:>10}  {ov}"
        )
    return rows


def profile(
    *impls: str,
    tokens_per_rank: int = TOKENS_PER_RANK,
    max_world_size: int = max(WORLD_SIZES),
    straggler: float = 0.0,
    allow_import: bool = True,
    device: str | None = None,
) -> list[RingProfile]:
    """`ring-harness profile` as a library call: each ring's verdicts, on a pool of its own.

    `RingProfile.kept` says whether a ring keeps every promise judged here; `.broken()` which not.
    `device`: "cpu" or "cuda" (the visible GPUs, as `ring-harness profile --device cuda`); None:
    $RING_HARNESS_DEVICE or cpu, as the command.
    """
    from harness.ranks.backend import placement_of, require_cuda
    from harness.ranks.launch import open_pool

    placement = placement_of(device)
    if placement.device == "cuda":
        require_cuda("device cuda")
    with open_pool("local", None, max_world_size, placement) as pool:
        return [
            profile_ring(
                name,
                pool,
                tokens_per_rank=tokens_per_rank,
                allow_import=allow_import,
                straggler=straggler,
            )
            for name in impls or ("reference",)
        ]
