"""Failures grouped by cause: one group per bug, its smallest case first, what its cases share.

A failure's cause is its signature (harness.judging.verdicts.failure_signature): the verdict and
the part of the ring it points at, not the tensors it happened to break. Three rules refine it:
- a faulted failure joins the group of the same cause without faults, when the ring fails that way
  without faults too. Only a failure no fault-free case shows stands as "under faults";
- a failure that does not reproduce bit for bit on fresh ranks is "racy", one group for all. One
  that a sequence of earlier cases reproduces there is "history-dependent", one group too;
- a growth-check failure is its own group: the error grows with W.
Then groups whose failing cases share the same features (the same shared-feature conditions) are one
bug with several causes: a crash on some splits and wrong numbers on the others, for instance. They
merge, and a line per cause says what tells it from the others.
docs/check.md ("Failure groups") gives the rule and a real example.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from harness import case as case_mod
from harness.checks.shared_features import SharedFeatures, explain
from harness.judging.run_record import RunRecord, record_of
from harness.judging.verdicts import fault_ok
from harness.result import Verdict
from harness.search.shrink import case_size

if TYPE_CHECKING:
    from harness.checks.outcome import CheckOutcome

RACY = ("racy",)
HISTORY = ("history-dependent",)
GROWTH = ("growth",)

PARTS = {
    "forward": "wrong out or lse (the gradients follow)",
    "backward": "right out and lse, wrong gradients",
    "precision": "precision lost: values on a narrower dtype's grid",
    "send-buffer": "a send buffer overwritten while in flight",
    "repeat": "a second run of the same case differs",
}


@dataclass
class FailureGroup:
    """One bug: its cause, every failing run of it, the files saved for it, what its cases share."""

    key: tuple[str, ...]
    members: list[RunRecord] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)
    shared: SharedFeatures | None = None
    growth: str = ""  # a growth-check group: its figure
    # the causes merged into this one: (their group, what tells them from the rest)
    causes: list[tuple[FailureGroup, SharedFeatures]] = field(default_factory=list)

    @property
    def headline(self) -> RunRecord | None:
        """The smallest failing case (shrink.case_size order), one without faults if there is one."""
        clean = [r for r in self.members if not r.case.faults]
        return min(clean or self.members, key=lambda r: case_size(r.case), default=None)

    def label(self) -> str:
        """The cause in words: 'silent-corruption: wrong out or lse (the gradients follow)'."""
        if self.causes:
            return "; ".join(g.cause_label() for g, _ in self.causes)
        return self.cause_label()

    def cause_label(self) -> str:
        """This group's own cause, merged causes aside."""
        if self.key == RACY:
            return "racy: does not reproduce bit for bit on fresh ranks"
        if self.key == HISTORY:
            return "history-dependent: fails after earlier cases (its saved sequence reproduces it)"
        if self.key == GROWTH:
            return f"the error grows with W: {self.growth}"
        verdict, rest = self.key[0], self.key[1:]
        faults = [x.removeprefix("faults=") for x in rest if x.startswith("faults=")]
        what = [PARTS.get(x, x) for x in rest if not x.startswith("faults=")]
        text = f"{verdict}: {', '.join(what)}" if what else verdict
        return text + (f" (only under faults: {', '.join(faults)})" if faults else "")

    def stages(self) -> str:
        """'battery 4, faults 3, property 40'."""
        return ", ".join(f"{s} {n}" for s, n in Counter(r.stage for r in self.members).items())

    def to_json(self) -> dict:
        head = self.headline
        return {
            "cause": list(self.key),
            "label": self.label(),
            "failing_runs": len(self.members),
            "stages": dict(Counter(r.stage for r in self.members)),
            "smallest": head.case.summary() if head is not None else None,
            "saved": self.saved,
            "shared_features": self.shared.to_json() if self.shared is not None else None,
            "causes": [
                {
                    "cause": list(g.key),
                    "label": g.cause_label(),
                    "failing_cases": len(g.members),
                    "when": apart.condition_text(),
                }
                for g, apart in self.causes
            ],
        }


def all_records(res: CheckOutcome) -> list[RunRecord]:
    """Every judged run of the check, probes and not-applicable fault cases left out."""
    out: list[RunRecord] = []
    if res.growth is not None:
        for g in res.growth.cases:
            out += [record_of(r, "growth") for r in g.results.values()]
    out += [record_of(r, "battery") for r in res.results]
    out += [record_of(r, "scale") for r in res.scale_results]
    out += [record_of(r, "shape") for r in res.shape_results]
    for r in res.fault_results:
        if r.verdict != Verdict.INVALID:
            rec = record_of(r, "faults")
            out.append(RunRecord(r.case, "faults") if fault_ok(r) else rec)
    out += res.clean_reruns
    if res.prop is not None:
        out += res.prop.seen
    return _first_of_each_case(out)


def _first_of_each_case(records: list[RunRecord]) -> list[RunRecord]:
    """One record per case: shrinking runs a case many times, and one case is one piece of evidence."""
    seen: set[str] = set()
    out = []
    for r in records:
        key = r.case.key()
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def group_key(
    cause: tuple[str, ...], clean: set[tuple[str, ...]], racy: set, history: set = frozenset()
) -> tuple[str, ...]:
    """The group of a failure's cause: see the module docstring."""
    if "repeat" in cause or cause in racy:
        return RACY
    if cause in history:
        return HISTORY
    base = tuple(x for x in cause if not x.startswith("faults="))
    return base if base != cause and base in clean else cause


def _rules(res: CheckOutcome, failing: list[RunRecord]) -> tuple[set, set, set]:
    """(fault-free causes, racy causes, history-dependent causes) of the check's failures."""
    clean = {r.cause for r in failing if not r.case.faults}
    racy, history = set(res.racy), set(res.history)
    for bug in res.prop.bugs if res.prop is not None else ():
        if bug.history_dependent:
            (history if bug.history.sequence is not None else racy).add(bug.signature.parts)
    return clean, racy, history


def build(res: CheckOutcome) -> list[FailureGroup]:
    """The check's failure groups, the largest first, each with its shared-feature line."""
    records = all_records(res)
    failing = [r for r in records if not r.passed]
    rules = _rules(res, failing)
    groups: dict[tuple[str, ...], FailureGroup] = {}
    for r in failing:
        key = group_key(r.cause, *rules)
        groups.setdefault(key, FailureGroup(key)).members.append(r)
    _add_saved(res, groups, rules)
    passing = [r for r in records if r.passed]
    for g in groups.values():
        g.shared = explain(g.members, passing)
    out = _merged(sorted(groups.values(), key=lambda g: -len(g.members)), passing)
    if res.growth is not None and not res.growth.passed:
        g = FailureGroup(GROWTH, growth=res.growth.failures[0].detail)
        out.append(g)
    return out


def _merged(groups: list[FailureGroup], passing: list[RunRecord]) -> list[FailureGroup]:
    """Merge groups with the same shared-feature conditions: one bug, several causes."""
    alike: dict[tuple, list[FailureGroup]] = {}
    for g in groups:
        same = g.shared.same_as() if g.shared is not None else None
        alike.setdefault(same or (id(g),), []).append(g)
    out = []
    for parts in alike.values():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        host = FailureGroup(parts[0].key)
        for g in parts:
            host.members += g.members
            host.saved += g.saved
        host.shared = explain(host.members, passing)
        for g in parts:
            rest = [r for p in parts if p is not g for r in p.members]
            host.causes.append((g, explain(g.members, rest)))
        out.append(host)
    return sorted(out, key=lambda g: -len(g.members))


def _add_saved(res: CheckOutcome, groups: dict, rules: tuple[set, set, set]) -> None:
    """Each saved file under its group: the stages' files, then the property run's pairs."""
    for sig, (path, _count) in res.distinct.items():
        key = group_key(tuple(sig), *rules)
        if key in groups:
            groups[key].saved.append(str(path))
    for bug in res.prop.bugs if res.prop is not None else ():
        key = group_key(bug.signature.parts, *rules)
        g = groups.setdefault(key, FailureGroup(key))
        g.saved += [str(p) for p in _existing((bug.found_path, bug.shrunk_path))]


def _existing(paths: Iterable) -> list:
    return [p for p in paths if p is not None and p.exists()]


def lines(groups: list[FailureGroup]) -> list[str]:
    """The report's block: per group its shared-feature line first, then cause, runs, files."""
    if not groups:
        return []
    n = len(groups)
    out = [
        f"{n} failure group{'s' if n > 1 else ''} (one per cause; docs/check.md 'Failure groups'):"
    ]
    for i, g in enumerate(groups, 1):
        first = g.shared.line() if g.shared is not None else g.label()
        out.append(f"  {i}. {first}")
        if g.shared is not None and g.shared.ranks:
            out.append(f"     {g.shared.ranks}")
        if g.causes:
            out.append("     causes (one bug: their cases share the line above):")
            out += [
                f"       {c.cause_label()}: {len(c.members)} cases{_when(apart)}"
                for c, apart in g.causes
            ]
        else:
            out.append(f"     cause: {g.label()}")
        head = g.headline
        if head is not None:
            out.append(f"     {len(g.members)} failing cases ({g.stages()})")
            out.append(f"     smallest: {head.case.summary()} ({head.stage})")
        out += [f"     saved: {p}" for p in g.saved]
    return out


def _when(apart: SharedFeatures) -> str:
    text = apart.condition_text()
    return f", {text}" if text else ""


def annotate_saved(groups: list[FailureGroup]) -> None:
    """Write each group's cause and shared-feature line into its saved case files' `result:`.

    A sequence file has no `result:`; its note already says what it reproduces.
    """
    for g in groups:
        info = {"group": g.label(), "shared_features": g.shared.line() if g.shared else None}
        for path in g.saved:
            _annotate(Path(path), info)


def _annotate(path: Path, info: dict) -> None:
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    note = "\n".join(
        line[2:] if line.startswith("# ") else line[1:]
        for line in itertools.takewhile(lambda s: s.startswith("#"), text.splitlines())
    )
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not isinstance(data.get("result"), dict):
        return
    data["result"].update(info)
    try:
        case_mod.write_atomic(path, case_mod.yaml_text(data, note or None))
    except OSError:
        pass  # the file stands as saved, without its group's words
