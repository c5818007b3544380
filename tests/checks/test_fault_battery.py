"""The fault battery: kind parsing, seeded case generation, the table, the leftover-process check,
and `ring-harness check --faults` end to end (the 200-case run is slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from harness.checks import fault_battery as runner
from harness.checks.options import parse_kinds
from harness.commands import cli
from harness.errors import HarnessError
from harness.faults.schema import KINDS, parse_faults
from harness.ranks.leftovers import leftover_workers
from harness.result import CaseResult
from harness.search import fault_battery as battery


def test_parse_kinds():
    assert parse_kinds("all", KINDS, "--faults", KINDS, allow_all=True) == KINDS
    assert parse_kinds("crash, delay", KINDS, "--faults", KINDS, allow_all=True) == (
        "delay",
        "crash",
    )
    with pytest.raises(HarnessError, match="unknown fault kind 'melt'"):
        parse_kinds("delay,melt", KINDS, "--faults", KINDS, allow_all=True)


def test_fault_cases_are_seeded_valid_and_rotate_kinds():
    a = battery.fault_cases(KINDS, 21, seed=4)
    assert a == battery.fault_cases(KINDS, 21, seed=4)
    assert a != battery.fault_cases(KINDS, 21, seed=5)
    assert [battery.kind_of(c) for c in a] == list(KINDS) * 3
    for c in a:
        (spec,) = parse_faults(c.faults, c.world_size)
        assert 2 <= c.world_size <= 4 and min(c.seq_lens) >= 2 and c.deadline_s == 8.0
        assert spec.index is None or spec.index <= c.world_size - 2
    assert {s["how"] for s in (c.faults[0] for c in a) if s["kind"] == "crash"} == {
        "exit0",
        "exit1",
        "sigkill",
    }


def test_table_counts_verdicts_per_kind():
    cases = battery.fault_cases(("drop", "delay"), 3)
    res = runner.BatteryOutcome()
    for c, verdict, ok in zip(
        cases, ("fail-stop", "pass", "silent-corruption"), (True, True, False), strict=True
    ):
        res.rows.append(
            (battery.kind_of(c), CaseResult(c, "reference", verdict, extra={"as_expected": ok}))
        )
    lines = runner.table_lines(res)
    assert re.match(r"delay\s+1\s+1\s+0\s+0", lines[2])
    assert re.match(r"drop\s+2\s+0\s+1\s+1\s+0\s+0\s+0\s+fail-stop\s+1/2", lines[3])
    assert lines[-1].split()[:2] == ["total", "3"] and "2/3" in lines[-1]


def test_leftover_check_sees_a_live_worker_and_not_a_dead_one():
    fake = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "harness.ranks.worker",
            "--parent",
            str(os.getpid()),
            "--x",
        ]
    )
    try:
        time.sleep(0.3)
        assert any(
            line.startswith(f"{fake.pid}:")
            for line in leftover_workers(set(), wait_s=0.2, scan=True)
        )
        assert leftover_workers({fake.pid}, wait_s=0.2, scan=False)
    finally:
        fake.kill()
        fake.wait()
    assert leftover_workers({fake.pid}, wait_s=0.2) == []


def test_check_rejects_an_unknown_fault_kind(capsys):
    assert cli.main(["check", "--faults", "delay,melt"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown fault kind 'melt'" in err and "\n" not in err


def test_check_faults_prints_the_table_and_leaves_no_worker(capsys):
    rc = cli.main(["check", "--faults", "early-read,send-reuse", "--fault-cases", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"early-read\s+1\s+1\s", out) and re.search(r"send-reuse\s+1\s+1\s", out)
    assert "worker processes left behind: 0" in out and "hangs: 0" in out


@pytest.mark.slow
def test_200_faulted_cases_no_hang_no_leftover():
    """The full battery (every kind, 200 cases) as a user runs it: exit 0 means every case ended as
    it must, none hung past its deadline, the pool healed every time, and no worker process was
    left."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "harness", "check", "--faults", "all", "--fault-cases", "200"],
            # the fault stage is what this guards: the growth, scale and property stages run
            # in their own tests
            *["--no-growth", "--no-scale", "--max-examples", "0"],
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=3600)
    assert proc.returncode == 0, out[-4000:] + err[-2000:]
    assert re.search(r"total\s+200\s+.*200/200", out)
    assert "hangs: 0; past the deadline: 0" in out
    assert "worker processes left behind: 0" in out
    assert re.search(r"straggler: .* slowdown x\d", out)
    # checked from outside too
    assert leftover_workers(set(), parent=proc.pid, wait_s=5.0, scan=True) == []
