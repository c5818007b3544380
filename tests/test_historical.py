"""ci/historical: the real-bug list and how a row is judged. The script itself installs releases
and is not run here (docs/third-party.md, "Real bugs at the versions they shipped in")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from harness import case as case_mod

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("historical_run", ROOT / "ci/historical/run.py")
hist = sys.modules["historical_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hist)


def test_every_bug_names_a_case_file_that_replays_it_at_its_release():
    bugs = hist.load_bugs()
    assert len(bugs) >= 5 and len({(b.package, b.buggy) for b in bugs}) >= 5
    for b in bugs:
        c, data = case_mod.load(ROOT / b.case)
        assert (c.impl, data.get("impl_version"), data.get("expect")) == (
            b.impl,
            b.buggy,
            "reproduce",
        ), b.id
        assert data["result"]["verdict"] != "pass" and data["result"]["versions"]["impl"] == b.buggy


def test_a_bug_list_entry_missing_a_field_is_one_line(tmp_path):
    bad = tmp_path / "bugs.yaml"
    bad.write_text("bugs:\n  - {id: x, title: t}\n")
    with pytest.raises(SystemExit, match=r"bug 0: needs \[.*'buggy'.*\]"):
        hist.load_bugs(bad)


def _run(version: str, exit: int, *labels: str) -> object:
    groups = [{"label": x, "stages": {"battery": 1}} for x in labels]
    return hist.CheckRun(version=version, exit=exit, groups=groups)


def test_a_row_is_found_by_its_cause_and_case_and_fixed_when_its_case_and_the_check_pass():
    b = next(x for x in hist.load_bugs() if x.at_fix)
    other = b.at_fix["cause"]
    row = hist.Row(b, _run(b.buggy, 1, b.cause), _run(b.fixed, 1, other), "fail-stop", "pass")
    assert row.found and row.fixed and "its case passes" in row.cells()[6]
    # only an unrelated failure, or a case that passes, at the buggy release
    assert not hist.Row(b, _run(b.buggy, 1, "fail-stop: Z"), _run(b.fixed, 0), "x", "pass").found
    assert not hist.Row(b, _run(b.buggy, 1, b.cause), _run(b.fixed, 0), "pass", "pass").found
    # at the fix: its case still fails, or a failure that is not the known one
    assert not hist.Row(b, _run(b.buggy, 1, b.cause), _run(b.fixed, 0), "x", "fail-stop").fixed
    assert not hist.Row(b, _run(b.buggy, 1, b.cause), _run(b.fixed, 1, "hang"), "x", "pass").fixed


def test_each_release_gets_its_own_environment_named_by_version_and_pins(tmp_path):
    b = hist.load_bugs()[0]
    a, c = hist.env_dir(b, b.buggy, tmp_path), hist.env_dir(b, b.fixed, tmp_path)
    assert a != c and a.parent == c.parent == tmp_path and b.buggy in a.name
