"""The property-based driver: finds, saves before shrinking, shrinks, respects budgets, is
reproducible under the ci profile; and, on real ranks, finds and shrinks a W >= 3 bug."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import case as case_mod
from harness.checks.progress import FuzzProgress
from harness.result import CaseResult, TensorCheck
from harness.search import engine, fuzz
from harness.search.outcome import ExitReason

PLANTED = "tests.helpers.planted_impls:late_diagonal"
ROOT = Path(__file__).resolve().parents[2]


def _result(c, bad: bool) -> CaseResult:
    check = TensorCheck(
        "out", 0, 5.0 if bad else 0.5, 1.0, 0, {"batch": 0, "token": 0, "head": 0}, not bad
    )
    return CaseResult(
        case=c, impl="fake", verdict="silent-corruption" if bad else "pass", checks=[check]
    )


def _needs_w3(c) -> bool:
    return c.world_size >= 3 and c.mask.is_causal


def test_finds_saves_before_shrinking_and_shrinks(tmp_path):
    seen_on_disk = []

    def run(c):
        r = _result(c, _needs_w3(c))
        if not r.passed:
            seen_on_disk.append(sorted(p.name for p in tmp_path.glob("*found.yaml")))
        return r

    out = fuzz.fuzz("fake", run=run, save_dir=tmp_path, max_examples=200)
    assert out.found is not None and out.stop == "shrunk" and out.exit_reason is ExitReason.SHRUNK
    # saved as soon as found, before any shrink step
    assert seen_on_disk[0] == [] and len(seen_on_disk[1]) == 1
    found, data = case_mod.load(out.found_path)
    assert found == out.found.case and data["result"]["verdict"] == "silent-corruption"
    shrunk, data = case_mod.load(out.shrunk_path)
    assert shrunk == out.shrunk.case
    assert (shrunk.world_size, shrunk.seq_lens, shrunk.heads_q, shrunk.mask.kind) == (
        3,
        (1, 1, 1),
        1,
        "causal",
    )
    assert data["result"]["localisation"]["worst"]["out"]["ratio"] == 5.0
    assert out.shrunk_path.name.replace("-shrunk", "-found") == out.found_path.name


def test_a_kill_while_shrinking_keeps_the_found_case(tmp_path):
    fails = []

    def run(c):
        if _needs_w3(c):
            fails.append(c)
            if len(fails) == 3:
                raise KeyboardInterrupt
        return _result(c, _needs_w3(c))

    from harness.search import strategies

    with pytest.raises(KeyboardInterrupt):  # toy sizes: each shrink step here is a smaller case
        fuzz.fuzz("fake", run=run, save_dir=tmp_path, strategy=strategies.cases(impl="fake"))
    found = list(tmp_path.glob("*-found.yaml"))
    shrunk = list(tmp_path.glob("*-shrunk.yaml"))
    assert len(found) == 1 and case_mod.load(found[0])[0] == fails[0]
    assert len(shrunk) == 1 and case_mod.load(shrunk[0])[0] == fails[1]  # the best so far


def test_ci_profile_is_reproducible_and_nightly_is_not(tmp_path):
    def drawn(profile, seed=None):
        cases = []
        fuzz.fuzz(
            "fake",
            run=lambda c: cases.append(c) or _result(c, False),
            save_dir=tmp_path,
            max_examples=25,
            profile=profile,
            seed=seed,
        )
        return cases

    assert drawn("ci") == drawn("ci")
    # --seed makes a nightly run repeatable
    assert drawn("nightly", seed=7) == drawn("nightly", seed=7)
    assert drawn("nightly") != drawn("nightly")


def test_max_examples_and_time_budget_stop_the_search(tmp_path):
    out = fuzz.fuzz("fake", run=lambda c: _result(c, False), save_dir=tmp_path, max_examples=30)
    assert out.examples == 30 and out.passed and out.stop.startswith("budget spent")
    assert out.exit_reason is ExitReason.MAX_EXAMPLES

    import time

    def slow(c):
        time.sleep(0.02)
        return _result(c, False)

    out = fuzz.fuzz("fake", run=slow, save_dir=tmp_path, max_examples=10_000, time_budget_s=0.5)
    assert out.stop == "time budget" and 5 < out.examples < 100 and out.seconds < 3
    assert out.exit_reason is ExitReason.TIME_BUDGET


def test_a_harness_error_is_raised_not_shrunk(tmp_path):
    def broken(c):
        raise RuntimeError("pool died")

    with pytest.raises(RuntimeError, match="pool died"):
        fuzz.fuzz("fake", run=broken, save_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_plain_progress_lines_when_not_a_terminal(tmp_path):
    buf = io.StringIO()
    bar = FuzzProgress(40, 10.0, stream=buf, every_s=0.0)
    with bar:
        fuzz.fuzz(
            "fake",
            run=lambda c: _result(c, _needs_w3(c)),
            save_dir=tmp_path,
            max_examples=40,
            progress=bar,
        )
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("property-based [search]: 1/40 examples, no failure")
    assert any("[shrink]" in ln and "failing" in ln and "cases/s" in ln for ln in lines)


# ~65 s alone (search, shrink each failure, confirm on fresh ranks, localise): the slow tier
@pytest.mark.slow
def test_finds_and_shrinks_a_bug_that_needs_three_ranks(tmp_path):
    """On real ranks: the planted late-diagonal ring is found, shrunk to W=3, and passes on the
    reference. Shrinking is the point, not sizes: toy sizes (the check at scale runs in the next
    test)."""
    from harness.ranks.pool import RankPool
    from harness.search import strategies

    toy = strategies.cases(impl=PLANTED, pool_size=4, max_world=4)
    with RankPool(4) as pool:  # rings of 1-4 ranks: enough for the bug, quick to start
        out = fuzz.fuzz(
            PLANTED, pool, allow_import=True, save_dir=tmp_path, max_examples=60, strategy=toy
        )
    assert out.found is not None, out.stop
    c = out.shrunk.case
    assert c.world_size == 3 and c.total_len == 3 and c.mask.kind == "causal", c.summary()
    assert out.reference_verdict == "pass"
    assert any("mask hides" in f for f in out.localisation.findings)
    data = case_mod.load(out.shrunk_path)[1]["result"]
    assert data["verdict"] == "silent-corruption" and data["reference_verdict"] == "pass"
    assert data["hashes"] and data["localisation"]["findings"]


# ~120 s alone (distinct failures, each confirmed on fresh ranks): the slow tier, run by CI
@pytest.mark.slow
def test_default_check_finds_shrinks_saves_and_replays(tmp_path):
    """`check` (growth, battery, property-based; the scale and fault stages have their own tests)
    on the planted bug, then `replay`. The headline is the failure that shrank smallest, with its
    plot."""
    cmd = [sys.executable, "-m", "harness"]
    chk = subprocess.run(
        [
            *cmd,
            "check",
            "--impl",
            PLANTED,
            "--save-dir",
            str(tmp_path),
            "--plot",
            str(tmp_path),
            "--no-scale",
            "--fault-stage",
            "none",
            "--no-repeat",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert chk.returncode == 1, chk.stdout[-3000:] + chk.stderr[-3000:]
    # the late diagonal fails different sets of tensors on different cases: each set is its own
    # failure, with its own found and shrunk file (shrinking never swaps one for another); the first
    # is reported
    files = sorted(tmp_path.glob("*-shrunk.yaml"))
    sigs = [case_mod.load(f)[1]["result"]["signature"] for f in files]
    assert files and len(set(sigs)) == len(files), sigs
    assert all(f.with_name(f.name.replace("-shrunk", "-found")).exists() for f in files)
    first = re.search(r"shrunk to: .*?saved (\S+-shrunk\.yaml)", chk.stdout, re.S)
    assert first, chk.stdout[-3000:]
    shrunk = [Path(first.group(1))]
    c = case_mod.load(shrunk[0])[0]
    assert c.world_size == 3 and c.total_len == 3
    assert len(list(tmp_path.glob("*-shrunk-out.png"))) == 1
    rep = subprocess.run(
        [*cmd, "replay", str(shrunk[0]), "--impl", PLANTED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rep.returncode == 1 and "reproduces the recorded verdict" in rep.stdout
    assert "match the record bit for bit" in rep.stdout
    ref = subprocess.run(
        [*cmd, "replay", str(shrunk[0]), "--impl", "reference"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stdout


def _two_bug_result(c) -> CaseResult:
    """Bug A: causal with W >= 3 fails `out`; bug B: head_dim 1 fails `dq`; a case with both fails
    both."""
    bad = ({"out"} if c.world_size >= 3 and c.mask.is_causal else set()) | (
        {"dq"} if c.head_dim == 1 else set()
    )
    checks = [
        TensorCheck(
            t,
            0,
            5.0 if t in bad else 0.5,
            1.0,
            0,
            {"batch": 0, "token": 0, "head": 0},
            t not in bad,
        )
        for t in ("out", "dq")
    ]
    return CaseResult(
        case=c, impl="fake", verdict="silent-corruption" if bad else "pass", checks=checks
    )


def test_each_signature_is_found_saved_and_shrunk_on_its_own(tmp_path):
    """Shrinking never slips from one cause to another: bug A stays a W >= 3 causal forward
    failure (at head_dim 1 it fails dq too: still its cause), bug B (dq alone, the backward) is
    found and shrunk separately."""
    out = fuzz.fuzz("fake", run=_two_bug_result, save_dir=tmp_path, max_examples=300)
    by_sig = {b.signature.what: b for b in out.bugs}
    # two causes: a wrong forward (out) and gradients alone (dq)
    assert {("forward",), ("backward",)} <= set(by_sig), [b.signature.label() for b in out.bugs]
    a, b = by_sig[("forward",)], by_sig[("backward",)]
    assert (a.shrunk.case.world_size, a.shrunk.case.mask.kind, a.shrunk.case.total_len) == (
        3,
        "causal",
        3,
    )
    assert a.shrunk.case.head_dim == 1 and "out" in {c.tensor for c in a.shrunk.failed_checks()}
    assert (b.shrunk.case.world_size, b.shrunk.case.head_dim) == (1, 1)
    assert {c.tensor for c in b.shrunk.failed_checks()} == {"dq"}
    for bug in out.bugs:  # each failure its own found and shrunk file, with its signature
        assert bug.found_path.exists() and bug.shrunk_path.exists()
        data = case_mod.load(bug.shrunk_path)[1]
        assert case_mod.load(bug.shrunk_path)[0] == bug.shrunk.case
        assert data["result"]["signature"] == bug.signature.label()
    assert len(list(tmp_path.glob("*-found.yaml"))) == len(out.bugs) >= 2
    first = out.bugs[0]  # the outcome's found/shrunk are the first failure's
    assert (out.found, out.shrunk, out.shrunk_path) == (
        first.found,
        first.shrunk,
        first.shrunk_path,
    )


PLANTED_TWO = "tests.helpers.planted_impls:two_bugs"


def test_a_planted_two_failure_ring_shrinks_to_both_failures(tmp_path):
    """On real ranks: a causality leak alone (masked cases) and dq alone (head_dim 1) shrink to two
    minimal cases, each with its own signature; both pass on the reference and on the second
    implementation."""
    from harness.ranks.pool import RankPool
    from harness.search import strategies

    # shrinking is the point here, not sizes
    toy = strategies.cases(impl=PLANTED_TWO, pool_size=4, max_world=4)
    with RankPool(4) as pool:
        out = fuzz.fuzz(
            PLANTED_TWO,
            pool,
            allow_import=True,
            save_dir=tmp_path,
            max_examples=100,
            time_budget_s=60,
            strategy=toy,
        )
    by_sig = {b.signature.what: b for b in out.bugs}
    # a leak is the forward's mask; dq alone, the backward
    assert {("forward",), ("backward",)} <= set(by_sig), [b.signature.label() for b in out.bugs]
    leak, dq = by_sig[("forward",)].shrunk, by_sig[("backward",)].shrunk
    assert leak.case.mask.kind != "none" and leak.leak is not None and not leak.leak.passed
    # the leak's cause may shrink onto head_dim 1, where dq fails too: still the leak's cause
    assert {c.tensor for c in leak.failed_checks()} <= {"dq"}
    assert leak.case.world_size == 1 and leak.case.total_len == 2, leak.case.summary()
    assert [c.tensor for c in dq.failed_checks()] == ["dq"] and dq.case.head_dim == 1
    assert (dq.case.world_size, dq.case.mask.kind) == (1, "none"), dq.case.summary()
    for bug in (by_sig[("forward",)], by_sig[("backward",)]):
        assert (bug.reference_verdict, bug.second_verdict, bug.disagreement) == (
            "pass",
            "pass",
            False,
        )
        data = case_mod.load(bug.shrunk_path)[1]["result"]
        assert data["signature"] == bug.signature.label() and data["second_verdict"] == "pass"


def test_a_shrunk_failure_that_the_second_implementation_shares_is_a_harness_disagreement(
    tmp_path, monkeypatch
):
    """A failure the independent flash-style ring has too points at the harness, not at the
    implementation."""
    from hypothesis import strategies as st

    from harness.judging import tolerance
    from harness.ranks.pool import RankPool

    real = tolerance.bound
    monkeypatch.setattr(
        tolerance, "bound", lambda t, *a, **k: 1e-30 if t == "dv" else real(t, *a, **k)
    )
    c = case_mod.make_case(world_size=2, total_len=6, heads_q=1, heads_kv=1, head_dim=4, seed=3)
    with RankPool(2) as pool:
        out = fuzz.fuzz("reference", pool, save_dir=tmp_path, strategy=st.just(c), max_examples=5)
    assert out.found is not None and out.bugs[0].signature.what == ("backward",)
    assert out.reference_verdict is None and out.second_verdict == "silent-corruption"
    assert out.disagreement
    data = case_mod.load(out.shrunk_path)[1]["result"]
    assert (
        data["harness_disagreement"] is True
        and "HARNESS DISAGREEMENT" in out.shrunk_path.read_text()
    )


def test_the_ci_profile_runs_the_same_cases_however_slow_the_machine(tmp_path, monkeypatch):
    """Issue #30: the default check's coverage must not depend on the machine's load. On a machine
    so slow that every run takes a minute, the ci profile still runs all its examples, the same
    ones: no time budget."""
    import itertools

    def drawn(clock_step: float):
        ticks = itertools.count()
        monkeypatch.setattr(engine.time, "monotonic", lambda: next(ticks) * clock_step)
        cases = []
        out = fuzz.fuzz(
            "fake", run=lambda c: cases.append(c) or _result(c, False), save_dir=tmp_path
        )
        return out, cases

    fast, fast_cases = drawn(0.001)
    slow, slow_cases = drawn(60.0)
    assert fuzz.PROFILES["ci"].time_budget_s == float("inf")
    assert (
        fast.examples == slow.examples == fuzz.PROFILES["ci"].max_examples
        and fast_cases == slow_cases
    )
