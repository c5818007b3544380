"""Corpus semantics (harness.case.EXPECT): a user's saved failure guards the fix (fails while the
bug is there, passes once it is fixed, the recorded verdict shown as history); a `reproduce` case
must reproduce; a module-path case and a missing-extra case are skipped with one line."""

from __future__ import annotations

import pytest

from harness import case as case_mod
from harness.case import make_case
from harness.checks.replay import replay_expectations
from harness.result import result_record
from harness.runner import run_case

BUGGY = "tests.helpers.impls:leaky"


@pytest.fixture(scope="module")
def pool():
    from harness.ranks.pool import RankPool

    with RankPool(2) as p:
        yield p


def _saved(pool, tmp_path, impl, expect=None):
    c = make_case(world_size=2, total_len=8, mask={"kind": "causal"}, impl="reference")
    r = run_case(c, pool, impl, allow_import=True)
    return case_mod.save(c, tmp_path / "saved.yaml", result=result_record(r), expect=expect), r


def test_a_saved_failure_fails_while_the_bug_is_there_and_passes_once_fixed(pool, tmp_path):
    path, r = _saved(pool, tmp_path, BUGGY)
    assert r.verdict == "silent-corruption"
    text = path.read_text().replace("impl: reference", f"impl: {BUGGY}")
    path.write_text(text)
    problems = replay_expectations(path, pool, allow_import=True)  # the bug is still there
    assert len(problems) == 1 and "expected pass, got silent-corruption" in problems[0]
    assert "recorded: silent-corruption" in problems[0]
    path.write_text(text.replace(f"impl: {BUGGY}", "impl: tests.helpers.impls:reference"))  # "fixed"
    assert replay_expectations(path, pool, allow_import=True) == []


def test_a_reproduce_case_must_reproduce(pool, tmp_path):
    path, _ = _saved(pool, tmp_path, BUGGY, expect="reproduce")
    text = path.read_text()
    path.write_text(text.replace("impl: reference", f"impl: {BUGGY}"))
    assert replay_expectations(path, pool, allow_import=True) == []
    path.write_text(text.replace("impl: reference", "impl: tests.helpers.impls:reference"))
    problems = replay_expectations(path, pool, allow_import=True)
    assert problems and "recorded verdict silent-corruption, got pass" in problems[0]


def test_bad_expect_is_one_error_line(tmp_path):
    from harness.errors import HarnessError

    p = tmp_path / "c.yaml"
    case_mod.save(make_case(world_size=1, total_len=2), p)
    p.write_text(p.read_text() + "expect: maybe\n")
    with pytest.raises(HarnessError, match="case field 'expect'"):
        case_mod.load(p)


def test_a_case_that_cannot_run_fails_with_its_reason(pytester):
    pytester.makefile(".yaml", modpath=case_mod.dumps(make_case(world_size=1, total_len=2, impl="pkg.mod:ring")))
    res = pytester.runpytest("-p", "no:randomly", "--ring-cases", str(pytester.path), "-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    out = res.stdout.str()
    assert "a case file never imports code; pass --ring-impl pkg.mod:ring" in out and "Traceback" not in out


def test_a_case_whose_extra_is_missing_is_skipped_naming_it_unless_its_ring_is_given(pytester):
    """The project's corpus on the README's install: a case of a built-in whose library is an optional extra
    that is not installed is a skip naming the extra, and carries the `extra` marker (CI's extras step selects
    it with `-m extra`). Given explicitly with --ring-impl, the same case fails with the reason (#30)."""
    pytester.makefile(".yaml", extra=case_mod.dumps(make_case(world_size=2, total_len=4, impl="te-cp-p2p")))
    args = ["-p", "no:randomly", "--ring-cases", str(pytester.path), "-p", "no:cacheprovider"]
    skipped = pytester.runpytest(*args, "-rs")
    skipped.assert_outcomes(skipped=1)
    assert "pip install 'ring-harness[te]'" in skipped.stdout.str()
    pytester.runpytest(*args, "-m", "not extra").assert_outcomes(deselected=1)
    given = pytester.runpytest(*args, "--ring-impl", "te-cp-p2p")
    given.assert_outcomes(failed=1)
    assert "cannot run on te-cp-p2p" in given.stdout.str() and "Traceback" not in given.stdout.str()


def test_cases_saved_against_a_buggy_ring_run_on_the_fixed_one_given_by_ring_impl(pytester, pool):
    """`pytest --ring-cases DIR --ring-impl mypkg:fixed` runs (and passes) what was saved against mypkg:buggy; on
    the buggy ring the same cases fail; a case the given ring does not declare fails, naming the feature."""
    for i, layout in enumerate(("contiguous", "zigzag")):
        c = make_case(world_size=2, total_len=8, layout=layout, mask={"kind": "causal"}, impl=BUGGY, seed=i)
        r = run_case(c, pool, BUGGY, allow_import=True)
        assert r.verdict == "silent-corruption"
        case_mod.save(c, pytester.path / f"saved{i}.yaml", result=result_record(r))
    args = ["-p", "no:randomly", "--ring-cases", str(pytester.path), "-p", "no:cacheprovider", "--ring-impl"]
    pytester.runpytest(*args, "tests.helpers.impls:reference").assert_outcomes(passed=2)
    bad = pytester.runpytest(*args, BUGGY)
    bad.assert_outcomes(failed=2)
    assert "expected pass, got silent-corruption" in bad.stdout.str()
    striped = make_case(world_size=2, total_len=8, layout="striped", mask={"kind": "causal"}, impl=BUGGY)
    case_mod.save(striped, pytester.path / "striped.yaml")
    narrow = pytester.runpytest(*args, "torch-ring")  # declares contiguous and zigzag, not striped
    narrow.assert_outcomes(passed=2, failed=1)
    assert "striped.yaml: cannot run on torch-ring: it does not declare layout striped" in narrow.stdout.str()
