"""Failures grouped by cause: one group per bug, its smallest case first, what its cases share.

A failure's cause is its signature (harness.judging.verdicts.failure_signature): the verdict and
the part of the ring it points at, not the tensors it happened to break. Three rules refine it:
- a faulted failure joins the group of the same cause without faults, when the ring fails that way
  without faults too. Only a failure no fault-free case shows stands as "under faults";
- a failure that does not reproduce bit for bit on fresh ranks is "racy", one group for all. One
  that a sequence of earlier cases reproduces there is "history-dependent", one group too;
- a growth-check failure is its own group: the error grows with W.
Then each group is explained by experiment (harness.checks.experiments): its smallest shrunk case,
one feature changed at a time. Groups whose experiments name the same trigger are one bug with
several causes: a crash on some splits and wrong numbers on the others, for instance. They merge,
and a line per cause says what tells it from the others. Without experiments (selftest stops at its
first failure), groups whose shared-feature lines agree merge instead.
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
from harness import outputs
from harness.checks import experiments
from harness.checks.experiments import Explanation, Lab, record_json
from harness.checks.headlines import headline
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
    explanation: Explanation | None = None  # its experiments (harness.checks.experiments)
    # (a plainer change, the group it then fails as): this group is that group's bug
    joins: tuple[str, FailureGroup] | None = field(default=None, repr=False, compare=False)
    # probes of undeclared features that fail as their declared case in this group does
    probes: list[str] = field(default_factory=list)

    @property
    def headline(self) -> RunRecord | None:
        """The experiments' shrunk case; without them, the smallest failing case (shrink.case_size
        order), one without faults if there is one."""
        if self.explanation is not None:
            return self.explanation.headline
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
            "experiments": _json_of(self.explanation),
            "shared_features": self.shared.to_json() if self.shared is not None else None,
            "causes": [
                {
                    "cause": list(g.key),
                    "label": g.cause_label(),
                    "failing_cases": len(g.members),
                    "when": apart.condition_text(),
                    "joins": None
                    if g.joins is None
                    else {"at": g.joins[0], "cause": g.joins[1].key},
                    "experiments": _json_of(g.explanation),
                }
                for g, apart in self.causes
            ],
            "probes_failing_as_this": self.probes,
            "cases": [record_json(r) for r in self.members],
        }


def _json_of(e: Explanation | None) -> dict | None:
    return None if e is None else e.to_json()


def all_records(res: CheckOutcome) -> list[RunRecord]:
    """Every judged run of the check: probes and not-applicable fault cases left out, a failing
    probe's declared base case in."""
    out: list[RunRecord] = []
    if res.growth is not None:
        for g in res.growth.cases:
            out += [record_of(r, "growth") for r in g.results.values()]
    out += [record_of(r, "battery") for r in res.results]
    out += [record_of(b.base, "probe base") for b in res.probe_bases.values()]
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


def build(res: CheckOutcome, lab: Lab | None = None) -> list[FailureGroup]:
    """The check's failure groups, the largest first, each with its shared-feature line.

    With a `lab`, each group is explained by experiment and groups merge by trigger.
    """
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
    out = sorted(groups.values(), key=lambda g: -len(g.members))
    out = _merged(out, passing) if lab is None else _explained(res, out, lab, records)
    if res.growth is not None and not res.growth.passed:
        g = FailureGroup(GROWTH, growth=res.growth.failures[0].detail)
        out.append(g)
    _attach_probes(res, out)
    return out


def _merged(groups: list[FailureGroup], passing: list[RunRecord], by=None) -> list[FailureGroup]:
    """Merge groups that `by` says alike: one bug, several causes.

    By default, groups with the same shared-feature conditions. `by(g)` None: stands alone.
    """
    by = by or (lambda g: g.shared.same_as() if g.shared is not None else None)
    alike: dict[tuple, list[FailureGroup]] = {}
    for g in groups:
        same = by(g)
        alike.setdefault((id(g),) if same is None else ("alike", same), []).append(g)
    out = []
    for parts in alike.values():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        host = FailureGroup(parts[0].key)
        for g in parts:
            host.members += g.members
            host.saved += g.saved
            host.probes += g.probes
        heads = [g for g in parts if g.explanation is not None]
        if heads:  # the experiments of a group that joined none first, then the smallest case
            first = min(heads, key=lambda g: (g.joins is not None, case_size(g.headline.case)))
            host.explanation = first.explanation
        host.shared = explain(host.members, passing, _ruled_out(host))
        for g in parts:
            rest = [r for p in parts if p is not g for r in p.members]
            host.causes.append((g, explain(g.members, rest)))
        out.append(host)
    return sorted(out, key=lambda g: -len(g.members))


def _no_experiments(g: FailureGroup) -> str:
    """Why a group gets no experiments, or '' when it does."""
    if not g.members:
        return "no failing case of its own"
    if g.key in (RACY, HISTORY, GROWTH):
        return "its failures do not reproduce on their own"
    if any(x.startswith("faults=") for x in g.key):
        return "it fails only under faults: the fault is the trigger"
    if g.key[0] == "hang":
        return "it hangs: each variant would wait out its deadline"
    return ""


def _explained(
    res: CheckOutcome, groups: list[FailureGroup], lab: Lab, records: list[RunRecord]
) -> list[FailureGroup]:
    """Each group explained by experiment, then merged with the groups of the same trigger.

    The experiments' failing runs join their group. Every run of the lab counts in the
    shared-feature lines, which are computed again.
    """
    lab.known.update({r.case.key(): r for r in reversed(records)})
    bugs = res.prop.bugs if res.prop is not None else []
    shrunk = {b.shrunk.case.key(): b.shrunk for b in bugs if b.shrunk is not None}
    for g in groups:
        why = _no_experiments(g) or ("the time budget was spent" if lab.spent() else "")
        if why:
            g.explanation = Explanation(g.headline, note=why) if g.headline else None
            continue
        start = len(lab.runs)
        head, source = headline(g.members, shrunk, lab)
        g.explanation = experiments.explain(head, lab, source)
        seen = {r.case.key() for r in g.members}
        g.members += [r for r in lab.runs[start:] if not r.passed and r.case.key() not in seen]
    res.lab_runs = list(lab.runs)
    passing = [r for r in _first_of_each_case(records + lab.runs) if r.passed]
    for g in groups:
        g.shared = explain(g.members, passing, _ruled_out(g))
    return _merged(groups, passing, by=_same_bug(groups))


def _same_bug(groups: list[FailureGroup]):
    """`by` for _merged: a group's bug is the trigger its experiments name.

    A group whose smallest case, one feature plainer, fails with another group's cause joins that
    group's bug: the shrinker kept its cause, and only the cause stopped it.
    """
    by_key = {g.key: g for g in groups}
    for g in groups:
        runs = g.explanation.experiments if g.explanation is not None else []
        plainer = [x for x in runs if x.variant.plainer and by_key.get(x.record.cause, g) is not g]
        if plainer:
            g.joins = (plainer[0].variant.words, by_key[plainer[0].record.cause])

    def root(g: FailureGroup) -> FailureGroup:
        seen = set()
        while g.joins is not None and id(g) not in seen:
            seen.add(id(g))
            g = g.joins[1]
        return g

    def by(g: FailureGroup) -> tuple:
        top = root(g)
        trigger = top.explanation.trigger() if top.explanation is not None else None
        return ("trigger", trigger) if trigger is not None else ("group", id(top))

    return by


def _ruled_out(g: FailureGroup) -> frozenset[str]:
    return g.explanation.ruled_out() if g.explanation is not None else frozenset()


def _attach_probes(res: CheckOutcome, groups: list[FailureGroup]) -> None:
    """Each probe that fails as its declared base case does: named under the base's group."""
    where = {r.case.key(): i for i, g in enumerate(groups) for r in g.members}
    for probe in res.probe_bases.values():
        if probe.base.passed:
            continue
        i = where.get(probe.base.case.key())
        probe.group = None if i is None else i + 1
        if i is not None:
            groups[i].probes.append("+".join(probe.features))


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
        f"{n} failure group{'s' if n > 1 else ''} (one per bug; docs/check.md 'Failure groups'):"
    ]
    for i, g in enumerate(groups, 1):
        out += _group_lines(i, g)
    return out


def _group_lines(i: int, g: FailureGroup) -> list[str]:
    """One group: the experiments' line (else the shared-feature line), then the evidence."""
    e, stats = g.explanation, g.shared.line() if g.shared is not None else ""
    tried = e is not None and bool(e.experiments)
    out = [f"  {i}. {e.line() if tried else stats or g.label()}"]
    if tried and stats:
        out.append(f"     statistics over every case run: {stats}")
    elif e is not None and e.note:
        out.append(f"     no experiments: {e.note}")
    if g.shared is not None and g.shared.ranks:
        out.append(f"     {g.shared.ranks}")
    if g.causes:
        why = "their smallest cases' experiments agree" if tried else "their cases share the line"
        out.append(f"     causes (one bug: {why}):")
        out += [
            f"       {c.cause_label()}: {len(c.members)} cases{_when(apart)}{_joins(c)}"
            for c, apart in g.causes
        ]
    else:
        out.append(f"     cause: {g.label()}")
    head = g.headline
    if head is not None:
        out.append(f"     {len(g.members)} failing cases ({g.stages()})")
        src = e.shrunk_from if e is not None else None
        how = f", shrunk from {src.case.summary()} ({src.stage})" if src is not None else ""
        out.append(f"     smallest: {head.case.summary()} ({head.stage}{how})")
    if g.probes:
        feats = list(dict.fromkeys(f for p in g.probes for f in p.split("+")))
        more = f" and {len(feats) - 8} more" if len(feats) > 8 else ""
        n = len(g.probes)
        out.append(
            f"     {n} probe{'s' if n > 1 else ''} of undeclared features fail"
            f"{'s' if n == 1 else ''} as its declared case does: {', '.join(feats[:8])}{more}"
        )
    out += [f"     saved: {p}" for p in g.saved]
    return out


def _joins(g: FailureGroup) -> str:
    if g.joins is None:
        return ""
    words, other = g.joins
    return f"; at {words} its smallest case fails as {other.cause_label()}"


def _when(apart: SharedFeatures) -> str:
    text = apart.condition_text()
    return f", {text}" if text else ""


def annotate_saved(groups: list[FailureGroup]) -> None:
    """Write each group's cause and shared-feature line into its saved case files' `result:`.

    A sequence file has no `result:`; its note already says what it reproduces.
    """
    for g in groups:
        info = {"group": g.label(), "shared_features": g.shared.line() if g.shared else None}
        if g.explanation is not None and g.explanation.experiments:
            info["experiments"] = g.explanation.line()
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
        outputs.write_atomic(path, case_mod.yaml_text(data, note or None))
    except OSError:
        pass  # the file stands as saved, without its group's words
