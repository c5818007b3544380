"""The faults scheduled on one rank for one case: which ops they select, and which of them fired.

The interposer (harness.faults.interpose) asks at every op which faults select it. A crash fires at
once, and delays add up to the time the op is held. The other faults come back by kind, for the
interposer to apply. What fired is counted here. After a one-shot fault it is also left on disk,
so the parent knows it even if this rank dies. Runs inside a rank process.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from harness.faults import inject
from harness.faults.oplog import Op
from harness.faults.schema import FaultSpec


class FaultSchedule:
    """Per-rank, per-case: the faults scheduled here, the ops each has seen, and what fired."""

    def __init__(
        self,
        rank: int,
        faults: Sequence[FaultSpec] = (),
        *,
        seed: int = 0,
        note_path: str | None = None,
        exit_fn: Callable[[int], None] | None = None,
        case_id: Any = None,
    ) -> None:
        self.rank = rank  # group rank
        self.faults = tuple(f for f in faults if f.rank is None or f.rank == rank)
        self.straggler = next((f for f in self.faults if f.kind == "straggler"), None)
        self.seed = seed
        self.fired: Counter[int] = Counter()
        self.seen: Counter[int] = Counter()
        # survives this rank's death: which faults fired (read by the pool)
        self.note_path = note_path
        self.exit_fn = exit_fn
        self.case_id = case_id
        if note_path and os.path.exists(note_path):
            os.unlink(note_path)

    def select(
        self, op: Op, direction: str, inputs: bool = True
    ) -> tuple[dict[str, list[FaultSpec]], float]:
        """The faults that select `op`, by kind, and the seconds to hold it back.

        A crash happens here, and so does a delay after the op (`where: post`). `inputs`: a
        collective reads buffers apart from its output (FaultSpec.applies_to).
        """
        matched: list[FaultSpec] = []
        for f in self.faults:
            if f.kind == "straggler" or not f.applies_to(op.phase, direction, op.kind, inputs):
                continue
            n = self.seen[f.fid]
            self.seen[f.fid] += 1
            if f.index is None or f.index == n:
                matched.append(f)
        hits: dict[str, list[FaultSpec]] = {}
        for f in matched:
            hits.setdefault(f.kind, []).append(f)
        if "crash" in hits:
            self.crash(hits["crash"][0], op)
        hold = 0.0
        for f in matched:
            if f.kind == "delay":
                secs = inject.delay_seconds(f, inject.rng_for(self.seed, f, self.rank, op.index))
                self.fired[f.fid] += 1
                if f.where == "post":
                    inject.sleep(secs)
                else:
                    hold += secs
        return hits, hold

    # -- the straggler ---------------------------------------------------------------------------
    def stretch(self, phase: str, idle_s: float) -> None:
        """Straggler (compute): the time spent outside communication calls, times k."""
        s = self.straggler
        if s is not None and s.slow == "compute" and s.applies_to(phase, "any") and idle_s > 0:
            inject.sleep((s.factor - 1.0) * idle_s)
            self.fired[s.fid] += 1

    def slow_comm(self, phase: str, seconds: float) -> None:
        """Straggler (comm): every communication call on this rank takes k times as long."""
        s = self.straggler
        if s is not None and s.slow == "comm" and s.applies_to(phase, "any") and seconds > 0:
            inject.sleep((s.factor - 1.0) * seconds)
            self.fired[s.fid] += 1

    # -- what fired --------------------------------------------------------------------------
    def fire(self, specs: Sequence[FaultSpec]) -> None:
        """Count every fault of one kind that selected this op (two identical faults both fire)."""
        for f in specs:
            self.fired[f.fid] += 1

    def note(self, crash: dict | None = None) -> dict:
        """What fired so far.

        It is left on disk after a one-shot fault, so it is known even if this rank dies.
        """
        note = {"rank": self.rank, "case_id": self.case_id, "fired": dict(self.fired)}
        if crash is not None:
            note["crash"] = crash
        if self.note_path and crash is None:
            inject.write_note(self.note_path, note)
        return note

    def crash(self, f: FaultSpec, op: Op) -> None:
        """Die now, as `f` says, leaving a note of where."""
        self.fired[f.fid] += 1
        note = self.note({"fault": f.fid, "how": f.how, "op": op.label()})
        inject.crash(f.how, note, self.note_path, self.exit_fn)

    def corrupter(self, specs: Sequence[FaultSpec], op: Op) -> Callable[[torch.Tensor], None]:
        """What flips seeded bits of `op`'s data, as the first of `specs` says."""
        f = specs[0]
        rng = inject.rng_for(self.seed, f, self.rank, op.index)

        def corrupt(t: torch.Tensor) -> None:
            if inject.flip_bits(t, rng, f.bit, f.count):
                self.fire(specs)
                self.note()

        return corrupt
