"""Fault specs: the `faults` list of a Case, validated into frozen FaultSpecs (one clear error
line).

A fault applies on one group rank (or every rank), to the n-th communication op on that rank that
matches its phase (forward/backward) and `op`, or to every matching op. `op` is a direction (send,
recv, collective) or a collective family (all_gather, all_to_all, ...: `COLLECTIVE_FAMILIES`).
The YAML form is a plain mapping per fault; `to_dict` writes the canonical form with every field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.errors import HarnessError

KINDS = ("delay", "drop", "early-read", "send-reuse", "corrupt", "straggler", "crash")
PHASES = ("any", "forward", "backward")
DIRECTIONS = ("any", "send", "recv", "collective")
# a collective fault's `op` may name a family: it selects c10d's and the functional ops of it
COLLECTIVE_FAMILIES: dict[str, tuple[str, ...]] = {
    "all_gather": (
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather_into_tensor_coalesced",
    ),
    "all_to_all": ("all_to_all", "all_to_all_single"),
    "reduce_scatter": (
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor_coalesced",
    ),
    "broadcast": ("broadcast", "broadcast_"),
    "all_reduce": ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"),
    "scatter": ("scatter",),
    "gather": ("gather",),
    "reduce": ("reduce",),
    "barrier": ("barrier",),
}
FAMILIES = tuple(COLLECTIVE_FAMILIES)
FAMILY_OF = {k: fam for fam, kinds in COLLECTIVE_FAMILIES.items() for k in kinds}
DELAY_WHERE = ("post", "complete")
CRASH_HOW = ("exit0", "exit1", "sigkill")
STRAGGLER_SLOW = ("compute", "comm")
BENIGN = frozenset({"delay", "straggler", "early-read", "send-reuse"})  # must not change results
FATAL = frozenset({"drop", "crash"})  # must end in fail-stop

COMMON = ("kind", "rank", "phase", "op", "index")
EXTRA = {
    "delay": ("seconds", "jitter", "where"),
    "drop": (),
    "early-read": (),
    "send-reuse": (),
    "corrupt": ("bit", "count"),
    "straggler": ("factor", "slow"),
    "crash": ("how",),
}
# which op directions a kind may target, its default direction, and whether `rank` is required
# (send-reuse on a collective: its input is watched until the wait; `any`: sends and collectives)
DIRECTION_CHOICES = {
    "delay": DIRECTIONS + FAMILIES,
    "drop": ("send", "collective") + FAMILIES,
    "early-read": ("any", "recv", "collective") + FAMILIES,
    "send-reuse": ("send", "any", "collective") + FAMILIES,
    "corrupt": ("send", "recv", "collective") + FAMILIES,
    "straggler": ("any",),
    "crash": DIRECTIONS + FAMILIES,
}
DEFAULT_DIRECTION = {
    "delay": "any",
    "drop": "send",
    "early-read": "any",
    "send-reuse": "send",
    "corrupt": "send",
    "straggler": "any",
    "crash": "any",
}
NEEDS_RANK = frozenset({"drop", "corrupt", "straggler", "crash"})
ONE_SHOT = frozenset({"drop", "corrupt", "crash"})  # index defaults to 0 (the first matching op)
MAX_DELAY_S = 30.0
MAX_FACTOR = 100.0


@dataclass(frozen=True)
class FaultSpec:
    """One scheduled fault; `fid` is its position in the case's list (used to report that it
    fired)."""

    fid: int
    kind: str
    rank: int | None = None
    phase: str = "any"
    op: str = "any"
    index: int | None = None
    seconds: float = 0.05
    jitter: float = 0.0
    where: str = "post"
    bit: int | None = None
    count: int = 1
    factor: float = 4.0
    slow: str = "compute"
    how: str = "sigkill"

    def applies_to(self, phase: str, direction: str, kind: str = "", inputs: bool = True) -> bool:
        """Whether an op `kind` in `phase` going `direction` counts towards this fault's schedule.

        `inputs`: a collective reads inputs apart from its output (send-reuse watches them).
        """
        if phase not in ("forward", "backward") or (
            self.kind == "early-read" and direction == "send"
        ):
            return False  # early-read schedules count only ops that deliver data (recv, collective)
        if self.kind == "send-reuse" and (
            direction == "recv" or (direction == "collective" and not inputs)
        ):
            return False  # send-reuse counts only ops that read a caller's buffer while in flight
        if self.phase not in ("any", phase):
            return False
        if self.op in ("any", direction):
            return True
        return direction == "collective" and FAMILY_OF.get(kind, kind) == self.op

    def describe(self) -> str:
        """Short human form, e.g. 'drop rank 1 forward send #0'."""
        where = "every rank" if self.rank is None else f"rank {self.rank}"
        which = "every op" if self.index is None else f"#{self.index}"
        sched = "" if self.kind == "straggler" else f" {self.phase} {self.op} {which}"
        extra = {
            "delay": f" {self.seconds:g}s"
            + (f"+~{self.jitter:g}s" if self.jitter else "")
            + f" at {self.where}",
            "straggler": f" x{self.factor:g} {self.slow}",
            "crash": f" {self.how}",
            "corrupt": f" {self.count} elem" + (f" bit {self.bit}" if self.bit is not None else ""),
        }
        return f"{self.kind} {where}{sched}{extra.get(self.kind, '')}".replace("  ", " ")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _bad(i: int, name: str | None, msg: str) -> HarnessError:
    field = f"faults[{i}]" + (f".{name}" if name else "")
    return HarnessError(f"case field '{field}': {msg}")


def parse_fault(i: int, d: Any, world_size: int) -> FaultSpec:
    """One fault mapping -> FaultSpec; raises HarnessError naming `faults[i].field`."""
    if not isinstance(d, dict):
        raise _bad(i, None, f"must be a mapping like {{kind: delay, rank: 0}}, got {d!r}")
    kind = d.get("kind")
    if kind not in KINDS:
        raise _bad(i, "kind", f"unknown fault kind {kind!r}; expected one of {', '.join(KINDS)}")
    allowed = set(COMMON) | set(EXTRA[kind])
    unknown = sorted(map(str, set(d) - allowed))
    if unknown:
        raise _bad(
            i, unknown[0], f"not a field of a {kind} fault; allowed: {', '.join(sorted(allowed))}"
        )
    rank = d.get("rank")
    if rank is None:
        if kind in NEEDS_RANK:
            raise _bad(
                i,
                "rank",
                f"a {kind} fault needs the group rank it applies to (0..{world_size - 1})",
            )
    elif not (_is_int(rank) and 0 <= rank < world_size):
        raise _bad(i, "rank", f"must be a group rank in 0..{world_size - 1} or null, got {rank!r}")
    phase = d.get("phase", "any")
    if phase not in PHASES:
        raise _bad(i, "phase", f"must be one of {', '.join(PHASES)}, got {phase!r}")
    op = d.get("op", DEFAULT_DIRECTION[kind])
    if op not in DIRECTION_CHOICES[kind]:
        ops = [o for o in DIRECTION_CHOICES[kind] if o not in FAMILIES]
        fams = (
            " or a collective family (" + ", ".join(FAMILIES) + ")" if kind != "straggler" else ""
        )
        raise _bad(i, "op", f"a {kind} fault applies to {'/'.join(ops)} ops{fams}, got {op!r}")
    index = d.get("index", 0 if kind in ONE_SHOT else None)
    if kind == "straggler":
        if "index" in d and index is not None:
            raise _bad(i, "index", "a straggler slows every op of its rank; give no index")
    elif not (index is None or (_is_int(index) and 0 <= index < 1_000_000)):
        raise _bad(
            i,
            "index",
            f"must be an op number >= 0 (0 = the first matching op) or null, got {index!r}",
        )
    if kind in ONE_SHOT and index is None:
        raise _bad(i, "index", f"a {kind} fault happens once: give the op number")
    spec = FaultSpec(fid=i, kind=kind, rank=rank, phase=phase, op=op, index=index)
    return _parse_extra(i, kind, d, spec)


def _parse_extra(i: int, kind: str, d: dict, spec: FaultSpec) -> FaultSpec:
    """The kind-specific fields (seconds, jitter, where, bit, count, factor, slow, how)."""
    from dataclasses import replace

    vals: dict[str, Any] = {}
    for name in ("seconds", "jitter"):
        if name in d:
            v = d[name]
            if not (_is_num(v) and 0 <= v <= MAX_DELAY_S):
                raise _bad(
                    i, name, f"must be a number of seconds in [0, {MAX_DELAY_S:g}], got {v!r}"
                )
            vals[name] = float(v)
    if "where" in d:
        if d["where"] not in DELAY_WHERE:
            raise _bad(i, "where", f"must be one of {', '.join(DELAY_WHERE)}, got {d['where']!r}")
        vals["where"] = d["where"]
    if "bit" in d and d["bit"] is not None:
        if not (_is_int(d["bit"]) and 0 <= d["bit"] < 64):
            raise _bad(
                i,
                "bit",
                f"must be a bit number in 0..63 (within one element) or null, got {d['bit']!r}",
            )
        vals["bit"] = d["bit"]
    if "count" in d:
        if not (_is_int(d["count"]) and 1 <= d["count"] <= 1024):
            raise _bad(i, "count", f"must be a number of elements in 1..1024, got {d['count']!r}")
        vals["count"] = d["count"]
    if "factor" in d:
        if not (_is_num(d["factor"]) and 1 <= d["factor"] <= MAX_FACTOR):
            raise _bad(
                i,
                "factor",
                f"must be a slowdown factor in [1, {MAX_FACTOR:g}], got {d['factor']!r}",
            )
        vals["factor"] = float(d["factor"])
    if "slow" in d:
        if d["slow"] not in STRAGGLER_SLOW:
            raise _bad(i, "slow", f"must be one of {', '.join(STRAGGLER_SLOW)}, got {d['slow']!r}")
        vals["slow"] = d["slow"]
    if "how" in d:
        if d["how"] not in CRASH_HOW:
            raise _bad(i, "how", f"must be one of {', '.join(CRASH_HOW)}, got {d['how']!r}")
        vals["how"] = d["how"]
    return replace(spec, **vals) if vals else spec


def parse_faults(faults: Any, world_size: int) -> tuple[FaultSpec, ...]:
    """Validate a case's `faults` list; raises HarnessError naming the first bad field."""
    if not isinstance(faults, (list, tuple)):
        raise HarnessError(f"case field 'faults': must be a list of fault mappings, got {faults!r}")
    specs = tuple(parse_fault(i, d, world_size) for i, d in enumerate(faults))
    stragglers = [s.fid for s in specs if s.kind == "straggler"]
    by_rank = {s.rank for s in specs if s.kind == "straggler"}
    if len(by_rank) < len(stragglers):
        raise _bad(stragglers[-1], "rank", "one straggler per rank")
    return specs


def to_dict(s: FaultSpec) -> dict:
    """Canonical YAML mapping of a fault: the common fields plus its kind's own."""
    d = {"kind": s.kind, "rank": s.rank, "phase": s.phase}
    if s.kind != "straggler":
        d.update(op=s.op, index=s.index)
    for name in EXTRA[s.kind]:
        d[name] = getattr(s, name)
    return d


def make_fault(kind: str, **fields: Any) -> dict:
    """A validated canonical fault mapping (for code that builds cases)."""
    d = {"kind": kind, **fields}
    world_size = (d["rank"] + 1) if _is_int(d.get("rank")) else 1
    return to_dict(parse_fault(0, d, max(world_size, 1)))
