"""Corpus semantics (harness.case.EXPECT): a user's saved failure guards the fix (fails while the
bug is there, passes once it is fixed, the recorded verdict shown as history); a `reproduce` case
must reproduce. Case files replayed as test items: tests/test_pytest_plugin.py."""

from __future__ import annotations

import pytest

from harness import case as case_mod
from harness.case import make_case
from harness.checks.replay import replay_expectations
from harness.result import result_record
from harness.runner import run_case

BUGGY = "tests.helpers.impls:leaky"


POOL_SIZE = 2  # ranks of the module's `pool` (tests/conftest.py)


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
    # "fixed"
    path.write_text(text.replace(f"impl: {BUGGY}", "impl: tests.helpers.impls:reference"))
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
