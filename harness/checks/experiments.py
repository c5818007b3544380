"""Explanations by experiment: a group's smallest failing case, one feature changed at a time.

A feature is named only when changing it alone turns the failure into a pass (issue #52). Each
variant stays inside what the implementation declares and fits the ranks started. A case the check
already ran is not run again. The headline is shrunk first (harness.checks.headlines).
docs/check.md ("Failure groups") shows the words.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.calls import CALLS, INPUT_FORMS, needs_backward
from harness.case import Case, to_dict
from harness.case_schema import VALUE_KINDS
from harness.checks import serving_changes
from harness.context import Capabilities
from harness.errors import HarnessError
from harness.impls.capabilities import unsupported
from harness.judging.run_record import RunRecord, record_of
from harness.result import CaseResult
from harness.search.strategies import DTYPE_ORDER
from ring_impl.layouts import LAYOUTS
from ring_impl.masks import SPEC_KINDS, MaskSpec, fit

if TYPE_CHECKING:
    from harness.checks.check import Check

STAGE = "experiment"
BUDGET_S = 20.0  # experiments and headline shrinking, every group together
DEADLINE_S = 15.0  # a variant's deadline at most: a hang costs this, not the case's 60 s
# few values: each other declared one is tried
EVERY_VALUE = ("layout", "dtype", *serving_changes.EVERY_VALUE)
MODEL_CALLS = ("call", "inputs")  # not varied under --no-model-calls

Changes = Iterator[tuple[str, dict]]


def _drop_one(lens: tuple[int, ...]) -> tuple[int, ...] | None:
    """`lens` less one shard, the split staying uneven or even, idle or not, as it was."""
    shape = (len(set(lens)) > 1, 0 in lens)
    for i in reversed(range(len(lens))):
        rest = lens[:i] + lens[i + 1 :]
        if (len(set(rest)) > 1, 0 in rest) == shape:
            return rest
    return None


def _world(c: Case) -> Changes:
    """W - 1 from W >= 3, else W + 1: one rank is no ring, so a W = 2 case goes up."""
    if c.serving is not None:
        yield from serving_changes.serving_world(c)
        return
    lens = c.seq_lens
    new = _drop_one(lens) if c.world_size >= 3 else (*lens, lens[-1])
    if new and all(f.get("rank") is None or f["rank"] < len(new) for f in c.faults):
        yield f"W = {len(new)}", {"world_size": len(new), "seq_lens": new}


def _uneven(c: Case) -> Changes:
    lens, w = c.seq_lens, c.world_size
    if 0 in lens:  # the idle rank's own variant
        return
    if len(set(lens)) > 1:  # rounded up: fewer tokens could hide the bug
        yield "an even split", {"seq_lens": (-(-c.total_len // w),) * w}
    elif w >= 2:
        yield "an uneven split", {"seq_lens": (lens[0] + 1, *lens[1:])}


def _idle(c: Case) -> Changes:
    if 0 in c.seq_lens:
        yield "no idle rank", {"seq_lens": tuple(max(x, 1) for x in c.seq_lens)}


def _mask(c: Case) -> Changes:
    if c.mask.kind != "none":
        yield "no mask", {"mask": MaskSpec("none")}
    if c.mask.kind != "causal":
        yield "mask causal", {"mask": MaskSpec("causal")}


def _layout(c: Case) -> Changes:
    yield from ((x, {"layout": x}) for x in LAYOUTS if x != c.layout)


def _dtype(c: Case) -> Changes:
    yield from ((x, {"dtype": x}) for x in DTYPE_ORDER if x != c.dtype)


def _tokens(c: Case) -> Changes:
    """Half the tokens of a long case, else three times as many: each rank keeps its share."""
    lens = c.seq_lens
    new = tuple((x + 1) // 2 for x in lens) if max(lens) > 8 else tuple(3 * x for x in lens)
    yield f"{max(new)} tokens a rank", {"seq_lens": new}


def _head_dim(c: Case) -> Changes:
    d = c.head_dim
    for new in (d // 2 if d > 32 else 56, 64, 16):
        yield f"head_dim {new}", {"head_dim": new}


def _heads(c: Case) -> Changes:
    if c.heads_q == c.heads_kv:
        yield "GQA 2:1", {"heads_q": 2 * c.heads_q}
    else:
        yield "MHA", {"heads_kv": c.heads_q}


def _batch(c: Case) -> Changes:
    b = 2 if c.batch == 1 else 1
    yield f"batch {b}", {"batch": b}


def _values(c: Case) -> Changes:
    """Normal values for a stress kind. Not the other way: large logits and near-ties hide bugs
    (one key takes all the weight, or every block weighs the same), which names them wrongly."""
    if c.values != "normal":
        yield "normal values", {"values": "normal"}


def _call(c: Case) -> Changes:
    calls = ("train", "no-grad", "inference-mode") if not needs_backward(c.call) else ("no-grad",)
    yield from ((f"call {x}", {"call": x}) for x in calls if x != c.call)


def _inputs(c: Case) -> Changes:
    forms = ("transposed", "fused-qkv") if c.inputs == "contiguous" else ("contiguous",)
    yield from ((f"inputs {x}", {"inputs": x}) for x in forms)


def _subgroup(c: Case) -> Changes:
    if c.group_offset:
        yield "not a subgroup", {"group_offset": 0}


def _variant_off(name: str, words: str, plain: object) -> Callable[[Case], Changes]:
    """An attention variant turned off: a failure that passes then is the variant's."""

    def change(c: Case) -> Changes:
        if getattr(c, name) != plain:
            yield words, {name: plain}

    return change


# in shared_features.FEATURES' order and names
CHANGES: tuple[tuple[str, Callable[[Case], Changes]], ...] = (
    ("world size", _world),
    ("uneven", _uneven),
    ("idle ranks", _idle),
    ("mask", _mask),
    ("layout", _layout),
    ("dtype", _dtype),
    ("tokens per rank", _tokens),
    ("head_dim", _head_dim),
    ("heads", _heads),
    ("batch", _batch),
    ("values", _values),
    ("call", _call),
    ("inputs", _inputs),
    ("subgroup", _subgroup),
    ("sinks", _variant_off("sinks", "without sinks", None)),
    ("softcap", _variant_off("softcap", "without softcap", None)),
    ("alibi", _variant_off("alibi", "without ALiBi", False)),
    ("value head dim", _variant_off("head_dim_v", "v of q's head dim", None)),
    *serving_changes.CHANGES,
)


# each feature's shrink order (harness.search.shrink): a variant lower in it is plainer
PLAIN: dict[str, Callable[[Case], object]] = {
    "world size": lambda c: c.world_size,
    "uneven": lambda c: len(set(c.seq_lens)) > 1,
    "idle ranks": lambda c: 0 in c.seq_lens,
    "mask": lambda c: SPEC_KINDS.index(c.mask.kind),
    "layout": lambda c: LAYOUTS.index(c.layout),
    "dtype": lambda c: DTYPE_ORDER.index(c.dtype),
    "tokens per rank": lambda c: c.total_len,
    "head_dim": lambda c: c.head_dim,
    "heads": lambda c: (c.heads_q, c.heads_kv),
    "batch": lambda c: c.batch,
    "values": lambda c: VALUE_KINDS.index(c.values),
    "call": lambda c: CALLS.index(c.call),
    "inputs": lambda c: INPUT_FORMS.index(c.inputs),
    "subgroup": lambda c: c.group_offset,
    "sinks": lambda c: c.sinks is not None,
    "softcap": lambda c: c.softcap is not None,
    "alibi": lambda c: c.alibi,
    "value head dim": lambda c: c.head_dim_v is not None,
    **serving_changes.PLAIN,
}


@dataclass(frozen=True)
class Variant:
    """The headline with one feature changed: the feature's name, the change in words, the case.

    `plainer`: the change goes the shrinker's way (fewer ranks, normal values, fp32, ...).
    """

    feature: str
    words: str  # "W = 2", "head_dim 56", "fp16"
    case: Case
    plainer: bool = False


def _changed(c: Case, changes: dict) -> Case | None:
    """`c` with `changes` (a mask fitted to new lengths), or None when that is no valid case."""
    if "seq_lens" in changes:
        changes = {**changes, "mask": fit(changes.get("mask", c.mask), sum(changes["seq_lens"]))}
    if "heads_q" in changes and c.sinks is not None and "sinks" not in changes:
        n = changes["heads_q"]  # one sink per query head: the heads' sinks, repeated
        changes = {**changes, "sinks": tuple(c.sinks[i % len(c.sinks)] for i in range(n))}
    try:
        v = c.replace(**changes)
    except (HarnessError, ValueError, TypeError):
        return None
    return None if v == c else v


def variants(c: Case, caps: Capabilities, capacity: int, model_calls: bool = True) -> list[Variant]:
    """One declared variant per feature (each other value of EVERY_VALUE's), fitting `capacity`."""
    out = []
    for feature, changes in CHANGES:
        if feature in MODEL_CALLS and not model_calls:
            continue
        for words, change in changes(c):
            v = _changed(c, change)
            if v is None or v.pool_size > capacity or unsupported(caps, v):
                continue
            plainer = PLAIN[feature](v) < PLAIN[feature](c)
            out.append(Variant(feature, words, v, plainer))
            if feature not in EVERY_VALUE:
                break
    return out


def verdict_of(r: RunRecord) -> str:
    return r.cause[0] if r.cause else "pass"


def record_json(r: RunRecord, spec: bool = False) -> dict:
    """A run for the JSON: its case (with `spec`, the whole case, to replay), verdict, stage."""
    out = {
        "case": r.case.summary(),
        "key": r.case.key(),
        "verdict": verdict_of(r),
        "cause": list(r.cause),
        "stage": r.stage,
    }
    return {**out, "spec": to_dict(r.case)} if spec else out


@dataclass(frozen=True)
class Experiment:
    """One variant and how it ended. `reused`: the check had run that case already."""

    variant: Variant
    record: RunRecord
    reused: bool = False

    def words(self, head: RunRecord) -> str:
        """The change, and the variant's verdict when it fails otherwise than its headline."""
        other = not self.record.passed and verdict_of(self.record) != verdict_of(head)
        return self.variant.words + (f" (as {verdict_of(self.record)})" if other else "")

    def to_json(self) -> dict:
        v = self.variant
        more = {"feature": v.feature, "changed_to": v.words, "passed": self.record.passed}
        return {**more, "reused": self.reused, **record_json(self.record, spec=True)}


@dataclass
class Explanation:
    """A group's smallest case, its experiments, and the trigger they name."""

    headline: RunRecord
    experiments: list[Experiment] = field(default_factory=list)
    shrunk_from: RunRecord | None = None  # the case this check shrank the headline from
    note: str = ""  # why no experiment, or not every one, ran

    def passes(self) -> list[Experiment]:
        return [e for e in self.experiments if e.record.passed]

    def trigger(self) -> tuple[tuple[str, str], ...] | None:
        """The (feature, changed to) pairs that pass. None: too little ran to say."""
        if not self.experiments or self.note:
            return None
        return tuple(sorted((e.variant.feature, e.variant.words) for e in self.passes()))

    def ruled_out(self) -> frozenset[str]:
        """The features changed while the case still failed: no cause, whatever statistics say."""
        tried = {e.variant.feature for e in self.experiments}
        out = tried - {e.variant.feature for e in self.passes()}
        return frozenset(out | ({"power of two"} if "world size" in out else set()))

    def line(self) -> str:
        """'passes at W = 2; still fails at head_dim 56, fp16, striped (14 experiments on ...)'."""
        head = self.headline
        if not self.experiments:
            return f"no experiments on its smallest case ({head.case.summary()}): {self.note}"
        by: dict[str, list[str]] = {}
        for e in self.passes():
            by.setdefault(e.variant.feature, []).append(e.variant.words)
        passed = _listed([_at(" and ".join(words)) for words in by.values()], ", ", " and ")
        failed = [e.words(head) for e in self.experiments if not e.record.passed]
        said = f"passes {passed}" if passed else "no one change makes it pass"
        if failed:
            said += f"; still fails at {', '.join(failed)}"
        n = len(self.experiments)
        note = f"; {self.note}" if self.note else ""
        return f"{said} ({n} experiment{'s' if n > 1 else ''} on {head.case.summary()}{note})"

    def to_json(self) -> dict:
        trig = self.trigger() or ()
        return {
            "line": self.line(),
            "trigger": [{"feature": f, "changed_to": w} for f, w in trig],
            "headline": record_json(self.headline, spec=True),
            "shrunk_from": None if self.shrunk_from is None else record_json(self.shrunk_from),
            "experiments": [e.to_json() for e in self.experiments],
            "note": self.note,
        }


def _listed(items: list[str], sep: str, last: str) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return sep.join(items[:-1]) + last + items[-1] if len(items) > 1 else "".join(items)


def _at(words: str) -> str:
    """'at W = 2', but 'without sinks': a variant switched off reads without 'at'."""
    return words if words.startswith(("with ", "without ")) else f"at {words}"


@dataclass
class Lab:
    """What the experiments need from a check: a way to run a case, the declared space, a budget.

    `known` holds every case the check ran (case key -> record); `runs` what the lab added.
    """

    execute: Callable[[Case], CaseResult]
    caps: Capabilities
    capacity: int
    until: float  # time.monotonic() when the budget ends
    model_calls: bool = True
    known: dict[str, RunRecord] = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)

    @classmethod
    def of(cls, check: Check, budget_s: float = BUDGET_S) -> Lab:
        """The lab of a check: its pool, implementation and declared space (--dtype included)."""
        opts, caps = check.opts, check.caps
        if opts.dtype is not None:
            caps = dataclasses.replace(caps, dtypes=frozenset({opts.dtype}))
        from harness.runner import run_case

        def execute(c: Case) -> CaseResult:
            return run_case(c, check.pool, opts.impl, allow_import=opts.allow_import)

        until = time.monotonic() + budget_s
        return cls(execute, caps, check.pool.capacity, until, model_calls=opts.model_calls)

    def spent(self) -> bool:
        return time.monotonic() > self.until

    def run(self, c: Case, stage: str = STAGE) -> tuple[RunRecord, bool]:
        """(the record of `c`, whether the check had run it already)."""
        key = c.key()
        if key in self.known:
            return self.known[key], True
        return self.note(self.result(c), stage, key), False

    def result(self, c: Case) -> CaseResult:
        """`c` run, its deadline DEADLINE_S at most."""
        return self.execute(c.replace(deadline_s=min(c.deadline_s, DEADLINE_S)))

    def note(self, r: CaseResult, stage: str, key: str | None = None) -> RunRecord:
        """Record a run of the lab, under its case's key and `key`, the key it was asked by."""
        rec = record_of(r, stage)
        for k in (r.case.key(), key or r.case.key()):
            self.known.setdefault(k, rec)
        self.runs.append(rec)
        return rec


def explain(head: RunRecord, lab: Lab, shrunk_from: RunRecord | None = None) -> Explanation:
    """Run each variant of `head`, within the lab's budget; a hang ends them."""
    out = Explanation(head, shrunk_from=shrunk_from)
    todo = variants(head.case, lab.caps, lab.capacity, lab.model_calls)
    for i, v in enumerate(todo):
        if lab.spent():
            out.note = f"the time budget ({BUDGET_S:.0f} s) ended {len(todo) - i} experiment(s)"
            break
        rec, reused = lab.run(v.case)
        out.experiments.append(Experiment(v, rec, reused))
        if verdict_of(rec) == "hang" and i + 1 < len(todo):
            out.note = f"a variant hung: {len(todo) - i - 1} experiment(s) not run"
            break
    return out
