"""The range of every number the harness is handed: case fields, options and `--shape`.

Each range is written once, here. A value outside it gets one line that names the field or the
flag and gives the range. The ranges keep every size inside what torch can index and what a
machine can hold. The memory estimate (harness.runner.check_memory) then judges the product of the
sizes. docs/cases.md lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.errors import HarnessError
from ring_impl.masks import MAX_MASK_PARAM

MAX_WORLD = 64


@dataclass(frozen=True)
class Range:
    """A closed range of integers or finite numbers; `open_lo` leaves its lower end out."""

    lo: float
    hi: float
    integer: bool = True
    open_lo: bool = False
    unit: str = ""

    def holds(self, value: Any) -> bool:
        """Whether `value` is of the range's kind and inside it (a bool is never a number)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.lo if self.open_lo else value >= self.lo
        return above and value <= self.hi

    def words(self) -> str:
        """E.g. 'an integer in [1, 4096]' or 'a number of seconds in (0, 3600]'."""
        kind = "an integer" if self.integer else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        left = "(" if self.open_lo else "["
        return f"{kind}{unit} in {left}{_num(self.lo)}, {_num(self.hi)}]"


def _num(x: float) -> str:
    """2**63 - 1 as '2**63 - 1', other large powers of two as '2**k', the rest plainly."""
    if x == 2**63 - 1:
        return "2**63 - 1"
    if isinstance(x, int) and x >= 2**20 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


SEED = Range(0, 2**63 - 1)
DAY = 86400.0

# Case fields (and the dimensions of `--shape`, which builds cases).
CASE = {
    "world_size": Range(1, MAX_WORLD),
    "group_offset": Range(0, MAX_WORLD - 1),
    "batch": Range(1, 4096),
    "heads_q": Range(1, 4096),
    "heads_kv": Range(1, 4096),
    "head_dim": Range(1, 4096),
    "head_dim_v": Range(1, 4096),
    "seq_lens": Range(0, 2**30),  # each rank's local length
    "total_len": Range(1, 2**31),
    "seed": SEED,
    "deadline_s": Range(0, 3600, integer=False, open_lo=True, unit="seconds"),
    "softmax_scale": Range(0, 1e4, integer=False, open_lo=True),
    "tolerance": Range(0, 1e6, integer=False, open_lo=True),  # a factor per tensor
    "softcap": Range(0, 1e4, integer=False, open_lo=True),
    "sinks": Range(-1e4, 1e4, integer=False),  # each query head's logit
    "mask": Range(0, MAX_MASK_PARAM),  # every mask parameter: positions, sizes, counts
}

# Options, by the flag a user types (a Python caller gets the same words).
OPTIONS = {
    "--world-size": CASE["world_size"],
    "--deadline": CASE["deadline_s"],
    "--max-examples": Range(0, 10**7),
    "--time-budget": Range(0, 7 * DAY, integer=False, open_lo=True, unit="seconds"),
    "--seed": SEED,
    "--fault-deadline": Range(1, 600, integer=False, unit="seconds"),
    "--fault-cases": Range(1, 10**4),
    "--fault-seed": SEED,
    "--maxfail": Range(1, 10**9),
    "--max-hangs": Range(0, 10**9),
    "--shape-budget": Range(0, 7 * DAY, integer=False, open_lo=True, unit="seconds"),
    "--false-alarm-cases": Range(1, 10**7),
    "--tokens-per-rank": Range(1, 2**20),
    "--straggler": Range(0, 100, integer=False),
}


def case_field(name: str, value: Any, part: str = "") -> None:
    """Raise HarnessError when case field `name` is out of its range.

    `part` names the part of the field in the message, e.g. 'window' of the mask.
    """
    r = CASE[name]
    if not r.holds(value):
        what = f"{part} must be" if part else "must be"
        raise HarnessError(f"case field '{name}': {what} {r.words()}, got {value!r}")


def option(flag: str, value: Any) -> None:
    """Raise HarnessError when option `flag` is given (not None) and out of its range."""
    r = OPTIONS[flag]
    if value is not None and not r.holds(value):
        raise HarnessError(f"{flag} must be {r.words()}, got {value!r}")


def options(values: dict[str, Any]) -> None:
    """`option` for each flag -> value of a mapping, in order."""
    for flag, value in values.items():
        option(flag, value)
