"""The `where:` lines name where a known bug is, and nothing else (issue #42).

Each mutant's bug has a known place: the diagonal block of one rank, a block off the diagonal, one
ring step, the second zigzag chunk. Its where-lines must name that place and never another. The
leak column of the report row and the where-lines must agree on whether there is a leak.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch

from harness.case import make_case
from harness.checks import report
from harness.diagnose import localise
from harness.result import CaseResult, LeakCheck
from harness.runner import run_case

POOL_SIZE = 3  # ranks of the module's `pool` (tests/conftest.py)

SMALL = dict(world_size=3, seq_lens=(4, 4, 4), heads_q=2, heads_kv=2, head_dim=8)
CASES = {
    "causal": dict(SMALL, mask={"kind": "causal"}),
    "none": dict(SMALL, mask={"kind": "none"}),
    "striped": dict(SMALL, layout="striped", mask={"kind": "causal"}),
    "zigzag": dict(SMALL, layout="zigzag", mask={"kind": "causal"}),
    "window": dict(SMALL, mask={"kind": "window", "window": 3}),
}

STEP = re.compile(
    r"^(\w+): \d+% of the error is on (?:the causal-diagonal.*step (0)|ring step (\d+))"
)
BLOCK = re.compile(r"^(\w+): \d+% of the error is on (?:key|query) block (\d+) ")
RANKS = re.compile(r"^(\w+): fails only on rank\(s\) \[([\d, ]*)\] of")
CHUNKS = re.compile(r"^(\w+): fails only in zigzag chunk\(s\) \[([\d, ]*)\] of")


@dataclass
class Named:
    """What a localisation's lines name, by kind: (tensor, where) pairs."""

    steps: set = field(default_factory=set)
    blocks: set = field(default_factory=set)
    ranks: set = field(default_factory=set)
    chunks: set = field(default_factory=set)
    off_diagonal: set = field(default_factory=set)
    hidden: set = field(default_factory=set)
    edges: set = field(default_factory=set)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def named(findings: list[str]) -> Named:
    """Parse every where-line; one that matches no kind fails the test (a new kind needs a rule)."""
    n = Named()
    for f in findings:
        t = f.split(":", 1)[0]
        if m := STEP.match(f):
            n.steps.add((t, int(m.group(2) or m.group(3))))
        elif m := BLOCK.match(f):
            n.blocks.add((t, int(m.group(2))))
        elif m := RANKS.match(f):
            n.ranks.add((t, _ints(m.group(2))))
        elif m := CHUNKS.match(f):
            n.chunks.add((t, _ints(m.group(2))))
        elif "of the error is off the causal-diagonal" in f:
            n.off_diagonal.add(t)
        elif "blocks the mask hides entirely" in f:
            n.hidden.add(t)
        elif "failing tokens are at" in f:
            n.edges.add(t)
        else:
            raise AssertionError(f"a where-line of no known kind: {f}")
    return n


@pytest.fixture(scope="module")
def localised(pool):
    """(mutant, case name) -> (result, localisation), each run once per module."""
    done: dict[tuple[str, str], tuple[CaseResult, localise.Localisation]] = {}

    def get(impl: str, case: str):
        if (impl, case) not in done:
            r = run_case(make_case(**CASES[case]), pool, impl, allow_import=True)
            assert not r.passed, f"{impl} passes {case}: the test needs a failing case"
            done[impl, case] = (r, localise.localise(r, pool))
        return done[impl, case]

    return get


def test_diagonal_bug_of_the_last_rank_is_named_on_the_diagonal_of_that_rank(localised):
    """The last rank computes its own block unmasked: step 0, rank 2, and nothing else."""
    _, loc = localised("mutant:last-rank-own-block-unmasked", "causal")
    n = named(loc.findings)
    assert n.steps == {("out", 0), ("dk", 0), ("dv", 0)}, loc.findings
    assert ("out", (2,)) in n.ranks and all(r == (2,) for t, r in n.ranks if t != "dk"), n.ranks
    assert not (n.blocks | n.off_diagonal | n.hidden | n.edges | n.chunks), loc.findings


def test_a_block_dropped_off_the_diagonal_is_never_put_on_it(localised):
    """Ranks >= 1 drop owner 0's block. Its renormalised neighbours (the diagonal among them)
    carry no error of their own: the lines name key block 0 and late steps, never step 0."""
    _, loc = localised("mutant:causal-step-off-by-one", "causal")
    n = named(loc.findings)
    assert ("out", 0) in n.blocks and {b for _, b in n.blocks} == {0}, loc.findings
    assert n.steps and all(s >= 1 for _, s in n.steps), loc.findings
    assert {r for t, r in n.ranks if t == "out"} == {(1, 2)}, loc.findings
    assert not (n.hidden | n.edges | n.chunks), loc.findings


def test_a_backward_bug_off_the_diagonal_is_not_put_on_it_by_dq(localised):
    """The backward reads step 0's K/V on every step. dq's exact split put 84% of its error on the
    diagonal here (dq's D couples every block); dq names no block now, dk and dv name steps >= 1."""
    _, loc = localised("mutant:stale-kv-backward", "window")
    n = named(loc.findings)
    assert n.off_diagonal == {"dk", "dv"}, loc.findings
    assert not n.steps and not n.blocks, loc.findings
    assert not any(f.startswith(("out", "lse", "dq")) for f in loc.findings), loc.findings


def test_a_striped_offset_bug_is_off_the_diagonal(localised):
    """Later ranks' same-stripe keys are visible: every error is on steps >= 1."""
    _, loc = localised("mutant:striped-diagonal-offset", "striped")
    n = named(loc.findings)
    assert "out" in n.off_diagonal, loc.findings
    assert all(s >= 1 for _, s in n.steps), loc.findings
    assert not (n.edges | n.chunks), loc.findings


@pytest.mark.parametrize("mutant", ["skipped-ring-step", "steps-rounded-to-power-of-two"])
def test_a_missing_ring_step_is_named_as_that_step(localised, mutant):
    """At W = 3 both run two steps of three: every rank misses its step-2 block."""
    _, loc = localised(f"mutant:{mutant}", "none")
    n = named(loc.findings)
    assert n.steps == {("out", 2), ("dk", 2), ("dv", 2)}, loc.findings
    assert not (n.blocks | n.off_diagonal | n.hidden | n.ranks | n.edges), loc.findings


def test_zigzag_second_half_order_is_named_as_the_second_chunks(localised):
    """Positions of the second-half chunks are wrong: queries fail there only, never on a rank's
    own block (its two chunks keep their order) and not at chunk edges."""
    _, loc = localised("mutant:zigzag-second-half-order", "zigzag")
    n = named(loc.findings)
    assert ("out", (3, 4, 5)) in n.chunks, loc.findings
    assert any("the second chunk of rank(s) [0, 1, 2]" in f for f in loc.findings), loc.findings
    assert all(s >= 1 for _, s in n.steps), loc.findings
    assert not (n.ranks | n.edges), loc.findings


def test_without_lse_no_block_or_step_is_named(localised):
    """A ring that returns out alone cannot be renormalised: its hidden keys are still named."""
    _, loc = localised("tests.helpers.impls:leaky", "causal")
    n = named(loc.findings)
    assert "out" in n.hidden, loc.findings
    assert not (n.steps | n.blocks | n.off_diagonal), loc.findings


def _leak_column(r: CaseResult) -> str:
    cells = report.row(1, 1, r).split()
    return cells[-3]  # ... leak verdict secs


@pytest.mark.parametrize(
    "mutant, case, column",
    [
        ("striped-diagonal-offset", "striped", "ok"),  # the leak check's sample misses it
        ("zigzag-second-half-order", "zigzag", "ok"),
        ("window-off-by-one", "window", "LEAK"),
        ("last-rank-own-block-unmasked", "causal", "ok"),
    ],
)
def test_leak_column_and_where_lines_agree(localised, mutant, case, column):
    """A where-line says leak only when the row's leak column says LEAK, and then its hidden-block
    lines say so."""
    r, loc = localised(f"mutant:{mutant}", case)
    assert _leak_column(r) == column
    hidden = [f for f in loc.findings if "blocks the mask hides entirely" in f]
    said_leak = [f for f in loc.findings if "leak" in f.replace("leak check", "")]
    if column == "LEAK":
        assert hidden and said_leak == hidden, loc.findings
    else:
        assert not said_leak, loc.findings
        assert all("the leak check samples" in f for f in hidden), loc.findings
    if mutant in ("striped-diagonal-offset", "window-off-by-one"):
        assert hidden, loc.findings  # the case this test is about: hidden blocks hold error


def test_hidden_block_lines_follow_the_leak_check():
    c = make_case(world_size=3, seq_lens=(2, 2, 2), mask={"kind": "causal"})
    visible, _ = localise.block_visibility(c)
    grid = torch.full((6, 3), 0.1, dtype=torch.float64)
    grid[~visible] = 50.0
    found = {
        "none": localise.block_findings(c, {"out": grid}, {"out": visible})[1],
        "passed": localise.block_findings(
            c, {"out": grid}, {"out": visible}, leak=LeakCheck(queries=[0, 1], hidden_keys=4)
        )[1],
        "failed": localise.block_findings(
            c,
            {"out": grid},
            {"out": visible},
            leak=LeakCheck([0], 5, [{"rank": 1, "tensor": "dk", "token": 3, "count": 1}]),
        )[1],
    }
    assert "no leak check ran" in found["none"][0] and "leak" not in found["none"][0].replace(
        "leak check", ""
    )
    assert "samples 2 queries and passed" in found["passed"][0]
    assert "a mask/causality leak, as the leak check found" in found["failed"][0]
