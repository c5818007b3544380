"""What the failing cases of one group share: the case features that separate them from the passes.

It reads every case the check ran: growth, battery, scale, fault stage, probes, property runs and
their shrinking. A greedy rule picks, one at a time, the feature condition that every failing case
meets and most remaining passing cases miss. It stops when no pass is left ("fails exactly when"),
or when no condition removes one ("fails only when ... ; N passing cases match too"). Hypothesis's
explain phase does this for one failure. Here it runs across the whole check. docs/check.md
("Failure groups") shows a real example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.case import Case
from harness.checks import serving_changes
from harness.judging.run_record import RunRecord

# one token a rank, then the kernel tiles the scale stage aims past (harness/search/scale.py)
TILES = (1, 64, 128, 256)
MAX_CONDITIONS = 3
MIN_FAILING = 3  # fewer failing cases tell too little to name a cause


def _tokens_per_rank(c: Case) -> int:
    """The longest shard's bucket, as its upper bound: 1, 64, 128, 256 or BEYOND."""
    n = max(c.seq_lens)
    return next((t for t in TILES if n <= t), BEYOND)


def _heads(c: Case) -> str:
    if c.heads_kv == c.heads_q:
        return "MHA"
    return "MQA" if c.heads_kv == 1 else f"GQA {c.heads_q // c.heads_kv}:1"


def _faults(c: Case) -> str:
    return "+".join(sorted({f["kind"] for f in c.faults})) or "none"


@dataclass(frozen=True)
class Feature:
    """A case feature: its name, how a condition on it reads, and how to read it off a case.

    `template` takes the values. A yes/no feature has `yes` and `no` sentences instead. An
    `ordered` one reads as a threshold when the failing values all lie above the passing ones.
    """

    name: str
    of: Callable[[Case], object]
    template: str = ""
    yes: str = ""
    no: str = ""
    ordered: bool = False
    unit: Callable[[object], str] = str
    above: str = ""  # an ordered feature's threshold sentence: "W >= {}"


def _tile_words(v: object) -> str:
    """A bucket in words: '1', '2-64', 'more than 256'."""
    if v == BEYOND:
        return f"more than {TILES[-1]}"
    i = TILES.index(v)
    return str(v) if i == 0 else f"{TILES[i - 1] + 1}-{v}"


BEYOND = 10**9
# in the order ties are broken
FEATURES: tuple[Feature, ...] = (
    Feature("world size", lambda c: c.world_size, "W is {}", ordered=True, above="W >= {}"),
    Feature(
        "power of two",
        lambda c: c.world_size & (c.world_size - 1) == 0,
        yes="W is a power of two",
        no="W is not a power of two",
    ),
    Feature(
        "uneven", lambda c: len(set(c.seq_lens)) > 1, yes="the split is uneven", no="it is even"
    ),
    Feature("idle ranks", lambda c: 0 in c.seq_lens, yes="a rank holds no token", no="none idle"),
    Feature("mask", lambda c: c.mask.kind, "the mask is {}"),
    Feature("layout", lambda c: c.layout, "the layout is {}"),
    Feature("dtype", lambda c: c.dtype, "the dtype is {}"),
    Feature(
        "tokens per rank",
        _tokens_per_rank,
        "a rank holds {} tokens",
        ordered=True,
        unit=_tile_words,
        above="a rank holds more than {1} token{s}",
    ),
    Feature(
        "head_dim", lambda c: c.head_dim, "head_dim is {}", ordered=True, above="head_dim >= {}"
    ),
    Feature("heads", _heads, "the heads are {}"),
    Feature("batch", lambda c: c.batch, "the batch is {}", ordered=True, above="the batch >= {}"),
    Feature("values", lambda c: c.values, "the values are {}"),
    Feature("faults", _faults, "the faults are {}"),
    Feature("call", lambda c: c.call, "the call is {}"),
    Feature("inputs", lambda c: c.inputs, "the inputs are {}"),
    Feature("subgroup", lambda c: c.group_offset > 0, yes="the ring is a subgroup", no="it is not"),
    Feature("sinks", lambda c: c.sinks is not None, yes="sinks are present", no="none"),
    Feature("softcap", lambda c: c.softcap is not None, yes="the scores are softcapped", no="none"),
    Feature("alibi", lambda c: c.alibi, yes="ALiBi biases the scores", no="none"),
    Feature(
        "value head dim",
        lambda c: c.head_dim_v is not None,
        yes="v has a head dim of its own",
        no="it has q's",
    ),
    Feature("shape", lambda c: c.shape, "the shape is {}"),
    Feature("KV distribution", serving_changes.kv_of, "the KV distribution is {}"),
    Feature("queries", serving_changes.queries_of, "the queries are {}"),
    Feature(
        "new tokens",
        serving_changes.new_of,
        "a request has {} new tokens",
        ordered=True,
        above="a request has more than {1} new token{s}",
    ),
    Feature(
        "interleave",
        serving_changes.interleave_of,
        "the KV is interleaved by {}",
        ordered=True,
        above="the KV is interleaved by more than {1} token{s}",
    ),
    Feature("pages", serving_changes.paged_of, yes="the KV cache is paged", no="not paged"),
)


@dataclass(frozen=True)
class Condition:
    """One feature restricted to the values every failing case has."""

    feature: Feature
    values: tuple
    passing_values: tuple  # the values of the passing cases it leaves out
    # those passing cases (given the other conditions), for the JSON: each claim can be checked
    ruled_out: tuple[RunRecord, ...] = field(default=(), compare=False)

    def text(self) -> str:
        f, vals, other = self.feature, self.values, self.passing_values
        if f.yes:
            return f.yes if vals == (True,) else f.no
        if f.ordered and other and min(vals) > max(other):
            said = f.above.format(min(vals), max(other), s="" if max(other) == 1 else "s")
        else:
            said = f.template.format(_words([f.unit(v) for v in vals]))
        if not other:
            return said
        return f"{said} (passes at {_words([f.unit(v) for v in other], 'and')})"


@dataclass
class SharedFeatures:
    """The explanation of one group: its conditions and the evidence behind them."""

    failing: int
    passing: int
    conditions: list[Condition] = field(default_factory=list)
    exact: bool = False  # no passing case meets every condition
    also_passing: int = 0  # passing cases that meet every condition
    ranks: str = ""  # which ranks are wrong, when that is one rank
    also: list[RunRecord] = field(default_factory=list)  # the passing cases that meet them all

    def line(self) -> str:
        """The sentence the report prints first."""
        evidence = f"{self.failing} failing, {self.passing} passing cases"
        if self.failing < MIN_FAILING:
            return f"too few failing cases to say what they share ({evidence})"
        if not self.conditions:
            return f"no case feature separates the failing cases from the passing ones ({evidence})"
        said = " and ".join(c.text() for c in self.conditions)
        if self.exact:
            return f"fails exactly when {said} ({evidence})"
        return (
            f"fails only when {said}; {self.also_passing} passing case(s) meet that too "
            f"({evidence})"
        )

    def condition_text(self) -> str:
        """'exactly when X', 'only when X', or '' when nothing is said."""
        if self.failing < MIN_FAILING or not self.conditions:
            return ""
        said = " and ".join(c.text() for c in self.conditions)
        return f"{'exactly' if self.exact else 'only'} when {said}"

    def same_as(self) -> tuple | None:
        """What two groups must share to be one bug: the same features, ruling out the same values
        of the passing cases (None when the line names nothing). The failing values are a sample:
        W 3, 4, 5 in one group and 3, 4, 6 in another both say "W >= 3"."""
        if self.failing < MIN_FAILING or not self.conditions:
            return None
        return tuple((c.feature.name, c.passing_values) for c in self.conditions)

    def to_json(self) -> dict:
        return {
            "line": self.line(),
            "exact": self.exact,
            "conditions": [
                {
                    "feature": c.feature.name,
                    "values": list(c.values),
                    "passes_at": list(c.passing_values),
                    "passing_cases": [_brief(r) for r in c.ruled_out],
                }
                for c in self.conditions
            ],
            "failing_cases": self.failing,
            "passing_cases": self.passing,
            "also_passing_cases": [_brief(r) for r in self.also],
            "ranks": self.ranks,
        }


def _brief(r: RunRecord) -> dict:
    """A passing case behind a claim: its summary, key and stage."""
    return {"case": r.case.summary(), "key": r.case.key(), "stage": r.stage}


def _words(values: Sequence, last: str = "or") -> str:
    """'3, 5, 6 or 7'; booleans as yes / no."""
    shown = [("yes" if v else "no") if isinstance(v, bool) else str(v) for v in values]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + f" {last} " + shown[-1]


def _sorted(values: set) -> tuple:
    return tuple(sorted(values, key=lambda v: (str(type(v)), v)))


def _best(failing: list[Case], passing: list[Case], used: set[str]) -> Condition | None:
    """The condition every failing case meets that removes the most remaining passing cases."""
    best, removed_best = None, 0
    for f in FEATURES:
        if f.name in used:
            continue
        values = {f.of(c) for c in failing}
        removed = [f.of(c) for c in passing if f.of(c) not in values]
        if len(removed) > removed_best:
            best = Condition(f, _sorted(values), _sorted(set(removed)))
            removed_best = len(removed)
    return best


def _rank_line(failing: Sequence[RunRecord]) -> str:
    """'only the last rank is wrong' (or rank 0) when every failing case at W >= 2 says so."""
    multi = [r for r in failing if r.case.world_size >= 2 and r.ranks]
    if len(multi) < MIN_FAILING:
        return ""
    if all(r.ranks == {r.case.world_size - 1} for r in multi):
        return "only the last rank is wrong"
    if all(r.ranks == {0} for r in multi):
        return "only rank 0 is wrong"
    return ""


def _meets(c: Case, conds: Sequence[Condition]) -> bool:
    return all(k.feature.of(c) in k.values for k in conds)


def _pruned(conds: list[Condition], good: Sequence[RunRecord]) -> list[Condition]:
    """Drop a condition the others make redundant, then say each one's passing values as what the
    others leave: the greedy order can pick a condition whose removals a later one also makes."""
    left = sum(_meets(r.case, conds) for r in good)
    for cond in list(conds):
        rest = [k for k in conds if k is not cond]
        if rest and sum(_meets(r.case, rest) for r in good) == left:
            conds = rest
    out = []
    for cond in conds:
        rest = [k for k in conds if k is not cond]
        out_of = [r for r in good if _meets(r.case, rest) and not _meets(r.case, [cond])]
        passes = {cond.feature.of(r.case) for r in out_of}
        out.append(Condition(cond.feature, cond.values, _sorted(passes), tuple(out_of)))
    return out


def explain(
    failing: Sequence[RunRecord], passing: Sequence[RunRecord], skip: frozenset[str] = frozenset()
) -> SharedFeatures:
    """The conditions that separate `failing` from `passing`, greedily, at most MAX_CONDITIONS.

    `skip`: features not to name, e.g. those an experiment changed while the case still failed.
    """
    bad = [r.case for r in failing]
    out = SharedFeatures(len(bad), len(passing), ranks=_rank_line(failing))
    if len(bad) < MIN_FAILING:
        return out
    left, used, conds = list(passing), set(skip), []
    while left and len(conds) < MAX_CONDITIONS:
        cond = _best(bad, [r.case for r in left], used)
        if cond is None:
            break
        conds.append(cond)
        used.add(cond.feature.name)
        left = [r for r in left if cond.feature.of(r.case) in cond.values]
    out.conditions = _pruned(conds, passing)
    out.exact, out.also_passing, out.also = bool(conds) and not left, len(left), left
    return out
