"""A sequence case: cases run in order on the same fresh ranks, the last one the failing case.

It reproduces a failure that depends on what ran before it in the same processes. An example is a
buffer cached across calls and not zeroed (issue #19). The last member carries the recorded
`result:`. The file is a top-level `sequence:` list of case mappings. Each member may say
`leak_check: false`: that run skipped the causality-leak run, a second forward + backward. Members
are validated like a case file (`harness.case.sequence_members`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import outputs
from harness.case import (
    FORMAT,
    MAX_SEQUENCE,
    Case,
    is_sequence,
    load,
    sequence_members,
    to_dict,
    yaml_text,
)
from harness.errors import HarnessError


@dataclass(frozen=True)
class Step:
    """One member of a sequence: a case and whether its run included the leak run."""

    case: Case
    leak: bool = True


@dataclass(frozen=True)
class CaseSequence:
    """Cases run in order on the same fresh ranks; the last one is the case that fails."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise HarnessError("a sequence needs at least one case")
        if len(self.steps) > MAX_SEQUENCE:
            raise HarnessError(
                f"a sequence has at most {MAX_SEQUENCE} cases, got {len(self.steps)}"
            )

    @property
    def last(self) -> Case:
        return self.steps[-1].case

    @property
    def pool_size(self) -> int:
        return max(s.case.pool_size for s in self.steps)

    def summary(self) -> str:
        before = len(self.steps) - 1
        return f"{self.last.summary()} after {before} earlier case{'s' if before != 1 else ''} on the same ranks"

    def key(self) -> str:
        blob = json.dumps([[to_dict(s.case), s.leak] for s in self.steps], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def sequence_from_dict(d: Any) -> CaseSequence:
    """Validated CaseSequence from plain data; raises HarnessError naming the bad member and
    field."""
    return CaseSequence(tuple(Step(case, leak) for case, leak in sequence_members(d)))


def sequence_to_dict(
    seq: CaseSequence, *, result: dict | None = None, expect: str | None = None
) -> dict:
    """Plain-data form of a sequence (the inverse of `sequence_from_dict`)."""
    members = []
    for i, s in enumerate(seq.steps):
        m = {k: v for k, v in to_dict(s.case).items() if k != "format"}
        if not s.leak:
            m["leak_check"] = False
        if result is not None and i == len(seq.steps) - 1:
            m["result"] = result
        members.append(m)
    d: dict = {"format": FORMAT}
    if expect is not None:
        d["expect"] = expect
    d["sequence"] = members
    return d


def load_sequence(path: str | os.PathLike) -> tuple[CaseSequence, dict]:
    """Read a case file as a sequence: a sequence file's members, or a plain case file as a sequence
    of one."""
    case, data = load(path)
    if is_sequence(data):
        return sequence_from_dict(data), data
    return CaseSequence((Step(case),)), data


def dumps_sequence(
    seq: CaseSequence,
    *,
    result: dict | None = None,
    note: str | None = None,
    expect: str | None = None,
) -> str:
    return yaml_text(sequence_to_dict(seq, result=result, expect=expect), note)


def save_sequence(
    seq: CaseSequence,
    path: str | os.PathLike,
    *,
    result: dict | None = None,
    note: str | None = None,
    expect: str | None = None,
) -> Path:
    """Atomic write of a sequence case file (as `save`)."""
    text = dumps_sequence(seq, result=result, note=note, expect=expect)
    return outputs.write(Path(path), text, "case file")
